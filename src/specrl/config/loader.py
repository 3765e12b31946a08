"""Turn YAML (plus ``--set a.b=c`` overrides) into typed, validated dataclasses.

The loader walks the dataclass annotations, so a schema is just dataclasses whose fields carry a
one-line ``help`` in their metadata (see :func:`doc`).  Errors name the file and the dotted field
path, suggest the closest known key for typos, and never show a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
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


def doc(default: Any = _MISSING, help: str = "", *, factory: Any = _MISSING) -> Any:
    """A dataclass field with a one-line docstring (``help``) the loader and docs can show."""
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


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
        f"{_where(source)}field '{path}' must be {_type_name(tp)}, got {value!r}",
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
        close = difflib.get_close_matches(str(value), [str(a) for a in get_args(tp)], n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"choose one of {choices}"
        raise ConfigError(
            f"{_where(source)}field '{path}' must be one of {choices}, got {value!r}", hint=hint
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
        raise ConfigError(f"{_where(source)}'{where}' must be a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = (
                f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
                if close
                else ("known keys: " + ", ".join(sorted(fields)))
            )
            raise ConfigError(f"{_where(source)}unknown key '{path}'", hint=hint)
        kwargs[key] = _convert(value, hints[key], path, source)
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
        value = yaml.safe_load(raw) if raw.strip() else ""
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


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read one YAML mapping with ``yaml.safe_load``; one-line errors for missing/invalid files."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe file '{p}' does not exist", hint="ls recipes/ for examples")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
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
