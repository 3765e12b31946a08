"""The user-facing pages stay readable: README is a newcomer's page, docs/benchmarks.md holds the
current results per area (superseded measurements one line each), not a lab notebook.

The limits are issue 29's; a section that grows past them replaces what it supersedes.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO

LIMITS = {"README.md": 140, "docs/benchmarks.md": 400}


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_page_stays_within_its_line_budget(name):
    lines = (REPO / name).read_text(encoding="utf-8").splitlines()
    assert len(lines) <= LIMITS[name], (
        f"{name} has {len(lines)} lines (at most {LIMITS[name]}): shorten or replace what a "
        "newer result supersedes"
    )
