"""Turn YAML (plus ``--set a.b=c`` overrides) into typed, validated dataclasses.

The loader walks the dataclass annotations, so a schema is just dataclasses whose fields carry a
one-line ``help`` in their metadata (see :func:`doc`).  Errors name the file and the dotted field
path, suggest the closest known key for typos, and never show a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from specrl.core.fsio import atomic_write_text
from specrl.errors import ConfigError

T = TypeVar("T")
_MISSING = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid interval of a numeric field (``None``: unbounded on that side).  Every float
    must also be finite."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x: float) -> bool:
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return not (self.hi is not None and (x >= self.hi if self.hi_open else x > self.hi))

    def __str__(self) -> str:
        def num(v: float) -> str:
            return f"{v:g}" if isinstance(v, float) else str(v)

        lo = "-inf" if self.lo is None else num(self.lo)
        hi = "inf" if self.hi is None else num(self.hi)
        return f"{'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}" + (
            ")" if self.hi_open or self.hi is None else "]"
        )


def doc(
    default: Any = _MISSING,
    help: str = "",
    *,
    factory: Any = _MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field with a one-line docstring (``help``) the loader and docs can show, and
    for a number its valid range (``ge``/``gt`` lower, ``le``/``lt`` upper bound), checked at
    load naming the field and the range."""
    meta: dict[str, Any] = {"help": help}
    if any(b is not None for b in (ge, gt, le, lt)):
        meta["range"] = Range(
            lo=gt if gt is not None else ge,
            hi=lt if lt is not None else le,
            lo_open=gt is not None,
            hi_open=lt is not None,
        )
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error line never echoes a huge value."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _check_number(value: Any, f: dataclasses.Field, path: str, source: str | None) -> None:
    """A converted value against its field's range; floats must be finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    rng = f.metadata.get("range")
    hint = f"fix '{path}' in the recipe or pass --set {path}=<value>"
    if isinstance(value, float) and not math.isfinite(value):
        where = f" in {rng}" if rng else ""
        raise ConfigError(
            f"{_where(source)}field '{path}' must be a finite number{where}, got {value!r}",
            hint=hint,
        )
    if rng is not None and value not in rng:
        raise ConfigError(
            f"{_where(source)}field '{path}' must be in {rng}, got {_short(value)}", hint=hint
        )


def numeric_fields(cls: type, prefix: str = "") -> dict[str, tuple[type, Range | None]]:
    """Every int/float field's dotted path → (its number type, its range), nested sections
    included (for the docs and the recipe fuzz test)."""
    out: dict[str, tuple[type, Range | None]] = {}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, path = hints[f.name], f"{prefix}{f.name}"
        args = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) else [tp]
        for a in args:
            if dataclasses.is_dataclass(a):
                out.update(numeric_fields(a, prefix=path + "."))
            elif a in (int, float):
                out[path] = (a, f.metadata.get("range"))
    return out


def _where(source: str | None) -> str:
    return f"{source}: " if source else ""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str, source: str | None) -> Any:
    """Check/convert one YAML value against a type annotation."""
    origin = get_origin(tp)
    bad = ConfigError(
        f"{_where(source)}field '{path}' must be {_type_name(tp)}, got {_short(value)}",
        hint=f"fix '{path}' in the recipe or pass --set {path}=<value>",
    )
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad
        classes = [a for a in args if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and len(classes) == 1:  # a section: surface its own errors
            return _convert(value, classes[0], path, source)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path, source)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        if value in get_args(tp):
            return value
        choices = ", ".join(repr(a) for a in get_args(tp))
        close = difflib.get_close_matches(_short(value, 200), [str(a) for a in get_args(tp)], n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"choose one of {choices}"
        raise ConfigError(
            f"{_where(source)}field '{path}' must be one of {choices}, got {_short(value)}",
            hint=hint,
        )
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise bad
        return from_dict(tp, value, source=source, prefix=path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_convert(v, item_tp, f"{path}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {
            _convert(k, key_tp, f"{path}.{k}", source): _convert(v, val_tp, f"{path}.{k}", source)
            for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if isinstance(value, tp):
        return value
    raise bad


def from_dict(
    cls: type[T], data: dict[str, Any], *, source: str | None = None, prefix: str = ""
) -> T:
    """Build dataclass ``cls`` from a mapping, checking keys and types recursively."""
    if not isinstance(data, dict):
        where = prefix or "recipe"
        raise ConfigError(f"{_where(source)}'{where}' must be a mapping, got {_short(data)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = key if isinstance(key, str) else repr(key)
        name = name if len(name) <= 80 else f"{name[:80]}…"
        path = f"{prefix}.{name}" if prefix else name
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = (
                f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
                if close
                else ("known keys: " + ", ".join(sorted(fields)))
            )
            raise ConfigError(f"{_where(source)}unknown key '{path}'", hint=hint)
        kwargs[key] = _convert(value, hints[key], path, source)
        _check_number(kwargs[key], fields[key], path, source)
    for name, f in fields.items():
        if name not in kwargs and f.default is _MISSING and f.default_factory is _MISSING:
            path = f"{prefix}.{name}" if prefix else name
            raise ConfigError(
                f"{_where(source)}required field '{path}' is missing",
                hint=f"add '{path}' to the recipe or pass --set {path}=<value>",
            )
    try:
        obj = cls(**kwargs)
    except (ValueError, TypeError) as exc:  # __post_init__ validation
        raise ConfigError(f"{_where(source)}{prefix or 'recipe'}: {exc}") from None
    return obj


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain YAML-able Python values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` → (["a", "b", "c"], value parsed as YAML scalar/flow)."""
    if "=" not in text:
        raise ConfigError(
            f"override '{text}' is not of the form key.path=value",
            hint="example: --set rollout.temperature=0.7",
        )
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.load(raw, Loader=RecipeLoader) if raw.strip() else ""  # a SafeLoader
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set`` overrides to a raw recipe mapping (before typing: uniform errors)."""
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for part in parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{text}': '{part}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


class RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases: an anchor/alias chain (a "billion laughs" recipe)
    would expand into an object far larger than its file, so ``*alias`` is an error at its line
    (a recipe is short; ``--set`` covers repeated values)."""

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            name = event.anchor if len(event.anchor) <= 40 else f"{event.anchor[:40]}…"
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{name}) are not supported in recipes", event.start_mark
            )
        return super().compose_node(parent, index)


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read one YAML mapping with a safe loader (no aliases, :class:`RecipeLoader`); one-line
    errors for missing, non-UTF-8 or invalid files."""
    p = Path(path)
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "does not exist"
        raise ConfigError(f"recipe file '{p}' {what}", hint="ls recipes/ for examples")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read recipe file '{p}': {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{p}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line})",
            hint="save the recipe as UTF-8",
        ) from None
    try:
        data = yaml.load(text, Loader=RecipeLoader)  # RecipeLoader is a yaml.SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        problem = problem if len(problem) <= 200 else problem[:200] + "…"
        raise ConfigError(f"{p}: {problem}{where}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: a recipe must be a YAML mapping at top level")
    return data


def load_recipe(
    path: str | os.PathLike[str] | None, cls: type[T], overrides: list[str] | None = None
) -> T:
    """Load ``cls`` from YAML at ``path`` (or defaults when None) with ``--set`` overrides."""
    data = read_yaml(path) if path is not None else {}
    source = str(path) if path is not None else "--set"
    data = apply_overrides(data, list(overrides or []))
    return from_dict(cls, data, source=source)


def dump_recipe(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write the resolved recipe atomically (temp file + rename)."""
    atomic_write_text(path, yaml.safe_dump(to_dict(obj), sort_keys=False))


def field_docs(cls: type, prefix: str = "") -> dict[str, str]:
    """Every field's dotted path → its help text (nested dataclasses flattened)."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        out[path] = f.metadata.get("help", "")
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(field_docs(tp, prefix=path + "."))
    return out
