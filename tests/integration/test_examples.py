"""``examples/prompts.jsonl`` is valid toy-task input and README's ``specrl rollout`` command on
it runs as written (with this test's tiny target and draft in place of the main job's)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from specrl.cli.app import main

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "examples" / "prompts.jsonl"


def readme_rollout_command() -> list[str]:
    """README's one ``specrl rollout`` command line on the example prompts."""
    lines = [
        line.strip()
        for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
        if line.strip().startswith("specrl rollout ") and "examples/prompts.jsonl" in line
    ]
    assert len(lines) == 1, f"README should show one rollout command on the examples: {lines}"
    return shlex.split(lines[0])


def test_example_prompts_are_addition_problems_with_their_answers():
    records = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert len(records) >= 8
    assert len({r["id"] for r in records}) == len(records)
    for r in records:
        a, b = r["prompt"].removesuffix("=").split("+")
        assert r["prompt"].endswith("=") and int(r["answer"]) == int(a) + int(b), r


def test_readme_rollout_command_runs_on_the_example_prompts(
    tiny_pair, tmp_path, monkeypatch, capsys
):
    argv = readme_rollout_command()
    assert argv[:2] == ["specrl", "rollout"]
    target, draft = tiny_pair
    swap = {"--target": str(target), "--draft": str(draft), "--out": str(tmp_path / "o.jsonl")}
    for flag, value in swap.items():
        assert flag in argv, f"README's rollout command has no {flag}"
        argv[argv.index(flag) + 1] = value
    assert argv[argv.index("--prompts") + 1] == "examples/prompts.jsonl"
    argv[argv.index("--prompts") + 1] = str(PROMPTS)
    monkeypatch.setattr(sys, "argv", [*argv[:1], "--json", *argv[1:], "--max-tokens", "8"])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    assert (exc.value.code or 0) == 0, out.err
    summary = json.loads(out.out)
    records = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert summary["prompts"] == len(records)
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert {r["id"] for r in rows} == {r["id"] for r in records}
    answers = {r["id"]: r["answer"] for r in records}
    assert all(r["answer"] == answers[r["id"]] for r in rows)
