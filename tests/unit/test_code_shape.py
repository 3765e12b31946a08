"""The rollout layer stays readable: no function over ``MAX_LINES`` lines, no class over
``MAX_METHODS`` methods in ``src/specrl/rollout`` (read with ``ast``, nothing imported).

``OVER`` lists what is over today, each with its size; it may only shrink: a new function or
class over the bound fails, a listed one that grew fails, and one that is no longer over fails
until it is taken off the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROLLOUT = Path(__file__).resolve().parents[2] / "src" / "specrl" / "rollout"
MAX_LINES = 60  # a function's lines, its ``def`` to its last line (docstring included)
MAX_METHODS = 20  # functions defined in a class body (properties included)

# "path:qualified name" → lines (functions) or methods (classes), as measured when listed
OVER: dict[str, int] = {}


def _sizes(path: Path, root: Path = ROLLOUT) -> dict[str, int]:
    """The functions' lines and the classes' method counts over the bounds in one module, by
    ``path`` (relative to ``root``) and qualified name."""
    rel = path.relative_to(root).as_posix()
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                if lines > MAX_LINES:
                    found[f"{rel}:{name}"] = lines
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                methods = [
                    c for c in child.body if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef))
                ]
                if len(methods) > MAX_METHODS:
                    found[f"{rel}:{name}"] = len(methods)
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def test_no_long_function_or_large_class_in_rollout():
    found: dict[str, int] = {}
    for path in sorted(ROLLOUT.rglob("*.py")):
        found.update(_sizes(path))
    new = {k: v for k, v in found.items() if k not in OVER}
    grown = {k: (OVER[k], v) for k, v in found.items() if k in OVER and v > OVER[k]}
    fixed = sorted(set(OVER) - set(found))
    assert not new, f"over {MAX_LINES} lines / {MAX_METHODS} methods: {new}"
    assert not grown, f"grew (listed → now): {grown}"
    assert not fixed, f"no longer over the bound, take them off OVER: {fixed}"


def test_the_walk_sees_what_it_measures(tmp_path):
    """The measure itself: nested functions and methods are found by qualified name."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    methods = "\n".join(f"    def m{i}(self):\n        pass" for i in range(MAX_METHODS + 1))
    short = "    def short(self):\n        pass"
    src = f"def long():\n{body}\n\n\nclass Big:\n{methods}\n{short}\n\n\nclass Small:\n{short}\n"
    (tmp_path / "mod.py").write_text(src)
    assert _sizes(tmp_path / "mod.py", tmp_path) == {
        "mod.py:long": MAX_LINES + 1,
        "mod.py:Big": MAX_METHODS + 2,
    }
