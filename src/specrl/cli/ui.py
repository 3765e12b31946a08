"""Shared CLI plumbing: consoles, global flags, shared options, result rendering.

Results go to stdout (a Rich table, or JSON with ``--json``); logs, progress bars and hints go
to stderr, so ``specrl … --json | jq`` always works.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

out = Console(soft_wrap=True)
err = Console(stderr=True)


@dataclass
class GlobalState:
    json: bool = False
    debug: bool = bool(os.environ.get("SPECRL_DEBUG"))


STATE = GlobalState()

JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print the result as JSON on stdout (same as the global flag)."),
]


def finite(value: float | None) -> float | None:
    """Typer callback: a float option must be a finite number (click's ranges let NaN pass)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"must be a finite number, got {value}")
    return value


def positive(value: float | None) -> float | None:
    """Typer callback: a float option must be a finite number > 0."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"must be a finite number > 0, got {value}")
    return value


OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace an existing output that specrl did not write (never an input of the "
        "command, '.', or a directory above it).",
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override a recipe field, e.g. --set rollout.temperature=0.7 (repeatable).",
    ),
]


def want_json(local: bool = False) -> bool:
    return local or STATE.json


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def kv_table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("key", style="bold")
    table.add_column("value")
    for k, v in rows.items():
        table.add_row(str(k), _fmt(v))
    return table


def _fmt(v: Any) -> str:
    """A cell value as text (markup escaped: hints like ``specrl[vllm]`` must survive)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v)
    return escape(str(v))


def records_table(title: str, records: list[dict[str, Any]], columns: list[str] | None = None):
    cols = columns or (list(records[0]) if records else [])
    table = Table(title=title, title_justify="left")
    for c in cols:
        table.add_column(
            c,
            justify="right" if records and isinstance(records[0].get(c), (int, float)) else "left",
        )
    for r in records:
        table.add_row(*(_fmt(r.get(c, "")) for c in cols))
    return table
