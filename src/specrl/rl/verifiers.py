"""Reward verifiers: ``verify(completion, answer) → 1.0 | 0.0``.

Named verifiers for user tasks (JSONL prompt/answer files):

- ``exact``: the stripped completion equals the stripped answer;
- ``numeric``: the last number in the completion equals the answer as a number (rel. tol 1e-6);
- ``regex``: ``pattern`` is searched in the completion (last match); group 1 (or the whole match)
  must equal the answer — e.g. ``####\\s*(.+)`` for GSM8K-style answers;
- ``boxed``: the content of the last ``\\boxed{…}`` (balanced braces) equals the answer after
  light LaTeX normalization, numerically when both sides are numbers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import partial

from specrl.errors import ConfigError

Verifier = Callable[[str, str], float]
_NUMBER = re.compile(r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _to_number(text: str) -> float | None:
    t = text.strip().replace(",", "").rstrip(".")
    if t.startswith("$"):
        t = t[1:]
    try:
        if "/" in t and t.count("/") == 1:
            a, b = t.split("/")
            return float(a) / float(b)
        return float(t)
    except (ValueError, ZeroDivisionError):
        return None


def _same_number(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def exact(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def numeric(completion: str, answer: str) -> float:
    found = _NUMBER.findall(completion)
    want = _to_number(answer)
    if not found or want is None:
        return 0.0
    got = _to_number(found[-1])
    return float(got is not None and _same_number(got, want))


def regex(completion: str, answer: str, *, pattern: str) -> float:
    matches = list(re.finditer(pattern, completion))
    if not matches:
        return 0.0
    m = matches[-1]
    got = m.group(1) if m.groups() else m.group(0)
    got, want = got.strip(), answer.strip()
    if got == want:
        return 1.0
    a, b = _to_number(got), _to_number(want)
    return float(a is not None and b is not None and _same_number(a, b))


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` with balanced braces, or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _normalize_tex(s: str) -> str:
    s = s.strip().strip("$")
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\displaystyle", " "):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    m = re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    return s.rstrip(".")


def boxed(completion: str, answer: str) -> float:
    got = last_boxed(completion)
    if got is None:
        return 0.0
    inner = last_boxed(answer)
    a, b = _normalize_tex(got), _normalize_tex(inner if inner is not None else answer)
    if a == b:
        return 1.0
    x, y = _to_number(a), _to_number(b)
    return float(x is not None and y is not None and _same_number(x, y))


VERIFIERS = ("exact", "numeric", "regex", "boxed")


def get_verifier(name: str, pattern: str | None = None) -> Verifier:
    """The verifier called ``name``; ``regex`` needs ``pattern``."""
    if name == "exact":
        return exact
    if name == "numeric":
        return numeric
    if name == "boxed":
        return boxed
    if name == "regex":
        if not pattern:
            raise ConfigError(
                "verifier 'regex' needs task.pattern", hint="e.g. --set task.pattern='####\\s*(.+)'"
            )
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"task.pattern {pattern!r} is not a valid regex: {exc}") from None
        return partial(regex, pattern=pattern)
    raise ConfigError(f"unknown verifier {name!r}", hint="choose one of " + ", ".join(VERIFIERS))
