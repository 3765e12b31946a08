"""Crash injection for the crash tests: ``SPECRL_FAILPOINT=<point>:<step>[,…]``.

A test sets e.g. ``SPECRL_FAILPOINT=after_metrics:3`` and the process SIGKILLs itself at exactly
that point — no polling, no race with the machine's speed.  Points (all in ``specrl train``):

* ``after_metrics:N`` — step N's metrics record was appended, its checkpoint (if due) not begun;
* ``before_commit:N`` — step N's checkpoint files are written (and synced), not yet renamed in;
* ``after_commit:N`` — step N's checkpoint is in place and ``latest`` points at it.

Unset (the normal case) every :func:`hit` is a dictionary lookup.  Never set it outside tests.
"""

from __future__ import annotations

import os
import signal

ENV = "SPECRL_FAILPOINT"
POINTS = ("after_metrics", "before_commit", "after_commit")


def _armed() -> dict[str, int]:
    spec = os.environ.get(ENV, "")
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, value = item.partition(":")
        if name not in POINTS or not value.strip().isdigit():
            raise ValueError(f"{ENV}: '{item}' is not <point>:<step> with point in {POINTS}")
        out[name] = int(value)
    return out


def hit(point: str, step: int) -> None:
    """SIGKILL this process if ``point:step`` is armed in ``SPECRL_FAILPOINT``."""
    if ENV in os.environ and _armed().get(point) == step:
        os.kill(os.getpid(), signal.SIGKILL)
