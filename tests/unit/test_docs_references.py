"""Docs and code point only at files that are in the repository.

Every repository path named in README, ``docs/``, the code, the benchmarks and the scripts
(``src/…``, ``docs/…``, ``benchmarks/…``, …) exists, every relative Markdown link resolves, and
nothing cites design notes that users do not have.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

TOPS = ("src", "benchmarks", "docs", "tests", "recipes", "scripts", "examples", "completions")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOPS) + r"|\.ci)/[\w./*-]*[\w*])")
LINK = re.compile(r"\]\(([^)#\s]+)")
# the names are assembled so that this file does not match itself
NOTES = [n + ".md" for n in ("DESIGN", "REFERENCE", "STYLE")] + ["REFERENCE " + "§"]


def _texts() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for top in ("src", "benchmarks", "scripts", "tests"):
        files += sorted((REPO / top).rglob("*.py"))
    return [f for f in files if ".venv" not in f.parts]


def missing_paths(path: Path, text: str) -> list[str]:
    """Repository paths and relative links in ``text`` that do not exist."""
    out = []
    for m in PATH.finditer(text):
        p = m.group(1)
        if path.suffix == ".py" and p.startswith("benchmarks/results/"):
            continue  # a script names the results it writes; docs must cite existing ones
        if not (list(REPO.glob(p)) if "*" in p else (REPO / p).exists()):
            out.append(p)
    if path.suffix == ".md":
        for m in LINK.finditer(text):
            target = m.group(1)
            if "://" not in target and not (path.parent / target).exists():
                out.append(f"link {target}")
    return out


def test_the_checker_finds_a_missing_path_and_a_broken_link():
    gone = "/".join(("docs", "nope.md"))  # not spelled out: this file is checked too
    text = f"see `{gone}` and [x](nope.md), but `docs/benchmarks.md` exists"
    assert missing_paths(REPO / "docs" / "x.md", text) == [gone, "link nope.md"]
    out = "/".join(("benchmarks", "results", "new.json"))
    assert missing_paths(REPO / "docs" / "x.md", f"`{out}`") == [out]
    assert missing_paths(REPO / "benchmarks" / "x.py", f"`{out}`") == []


def test_every_path_named_in_docs_and_code_exists():
    bad = {}
    for f in _texts():
        if miss := missing_paths(f, f.read_text(encoding="utf-8")):
            bad[str(f.relative_to(REPO))] = miss
    assert not bad, bad


def test_nothing_cites_design_notes_users_do_not_have():
    bad = [
        (str(f.relative_to(REPO)), n)
        for f in [*_texts(), REPO / "CHANGELOG.md"]
        for n in NOTES
        if n in f.read_text(encoding="utf-8")
    ]
    assert not bad, bad
