"""README's quickstart and .ci/run stay in sync."""

from __future__ import annotations

import re

from tests.conftest import REPO


def _commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", quick, flags=re.S)


def test_quickstart_has_exactly_two_commands():
    cmds = _commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds), cmds
    assert all("torch==2.13.0" in c for c in cmds)  # never a multi-GB CUDA resolve


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci/run").read_text().splitlines()
    assert _commands()[1] in ci
