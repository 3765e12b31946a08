"""What every benchmark script shares: its command line, clocks, interleaved paired repeats,
medians and paired ratios, peak memory, the JSON it writes and the tables it prints.

A script builds its parser with :func:`parser` (``--repeats``, ``--quick``, ``--threads``,
``--clock``, ``--markdown``, ``--out``), adds its own options, calls :func:`configure` (threads,
clock), runs its variants with :func:`interleave`, reduces them with :func:`median` and
:func:`paired_ratio`, and ends with :func:`report` (a Rich table, optionally the same table as
Markdown for ``docs/benchmarks.md``, and ``benchmarks/results/<name>.json`` with the command line
and the versions that produced it)::

    ap = harness.parser(__doc__, "decode", repeats=5)
    args = ap.parse_args()
    clock = harness.configure(ap, args)
    runs = harness.interleave(["ours", "theirs"], args.repeats, lambda v, rep: ..., warmup=1)
    harness.report(args, "decode", rows, ["variant", "tok_s"], {"rows": rows})

Why interleave: this machine is shared and noisy.  Every repeat runs each variant once, back to
back and in an order that changes per repeat (:func:`ordered`), so a slow stretch hits all
variants of that repeat and none always runs first or right after the same one;
ratios are then medians of per-repeat ratios (:func:`paired_ratio`), not ratios of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")

RESULTS = Path("benchmarks/results")
CLOCKS: dict[str, Callable[[], float]] = {
    # the thread's CPU time: on a shared machine it counts the work done, not the wait for a core
    "cpu": time.thread_time,
    "wall": time.perf_counter,
}


def parser(
    doc: str | None, name: str, *, repeats: int | None, threads: bool = True, clock: bool = True
) -> argparse.ArgumentParser:
    """The common options: ``--quick``, ``--markdown``, ``--out`` (default
    ``benchmarks/results/<name>.json``), and unless turned off ``--repeats`` (``repeats`` None),
    ``--threads`` and ``--clock``: a script that does not repeat, sets its own threads or times
    in processes of its own leaves them out rather than offer options it would ignore."""
    first = (doc or name).strip().split("\n\n")[0]
    ap = argparse.ArgumentParser(description=" ".join(first.split()))
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats, help="measured rounds (median)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer sizes and repeats")
    if threads:
        ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    if clock:
        ap.add_argument(
            "--clock", choices=sorted(CLOCKS), default="cpu",
            help="cpu: the thread's CPU time (shared machines; one thread); wall: dedicated ones",
        )  # fmt: skip
    ap.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    ap.add_argument("--out", type=Path, default=RESULTS / f"{name}.json", help="results JSON")
    return ap


def configure(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Callable[[], float]:
    """Checks the common options, applies ``--threads`` and returns the ``--clock`` (wall time
    without one; a CPU clock measures one thread, so it needs ``--threads 1``)."""
    if getattr(args, "repeats", 1) < 1:
        ap.error(f"--repeats must be ≥ 1, got {args.repeats}")
    if hasattr(args, "threads"):
        if args.threads < 1:
            ap.error(f"--threads must be ≥ 1, got {args.threads}")
        if getattr(args, "clock", "wall") == "cpu" and args.threads != 1:
            ap.error("--clock cpu measures one thread: use --threads 1 (or --clock wall)")
        torch.set_num_threads(args.threads)
    return CLOCKS[getattr(args, "clock", "wall")]


def timed(clock: Callable[[], float], fn: Callable[[], T]) -> tuple[float, T]:
    """``(seconds, fn())`` on ``clock``."""
    t0 = clock()
    out = fn()
    return clock() - t0, out


def ordered(items: Sequence[T], index: int) -> list[T]:
    """Row ``index`` of a Williams design over ``items`` (n rows, 2n for an odd n, cycling).

    Over one cycle each variant runs in each place, and right after each other one, equally
    often; the first n rows are n rotations.  A rotation alone has the same variant always
    follow the same one, and what one engine leaves in the caches then always falls on the same
    next one.
    """
    n = len(items)
    if n == 0:
        return []
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    r = index % (n if n % 2 == 0 else 2 * n)
    row = [items[(x + r) % n] for x in first]
    return row[::-1] if r >= n else row


def interleave(
    variants: Sequence[str],
    repeats: int,
    run: Callable[[str, int], T | None],
    *,
    warmup: int = 1,
    rotate: bool = True,
) -> dict[str, list[T]]:
    """Calls ``run(variant, rep)`` for every variant in every round and keeps what it returns.

    ``warmup`` rounds come first with ``rep`` = -warmup … -1 (in the given order; their results
    are dropped), then ``repeats`` measured rounds with ``rep`` = 0 … repeats-1, each in the
    order :func:`ordered` gives ``rep`` (``rotate``), so that no variant always runs first.  A
    ``None`` result (the variant does not apply) is not kept.
    """
    for rep in range(-warmup, 0):
        for v in variants:
            run(v, rep)
    out: dict[str, list[T]] = {v: [] for v in variants}
    for rep in range(repeats):
        for v in ordered(variants, rep) if rotate else variants:
            result = run(v, rep)
            if result is not None:
                out[v].append(result)
    return out


def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over repeats of ``num[i] / den[i]``: both ran in the same round, back to back, so
    a slow stretch of the machine cancels out of their ratio."""
    if len(num) != len(den) or not num:
        raise ValueError(
            f"paired_ratio needs two equal non-empty series, got {len(num)}, {len(den)}"
        )
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CPU bytes allocated (and not yet freed) during ``fn()`` beyond what existed before.

    With ``profile_memory=True`` the CPU allocator reports every allocation and free to
    ``torch.profiler``; summing the ``[memory]`` events in time order gives the live-bytes curve
    of the call.  Unlike RSS this is exact, repeatable and unaffected by other processes.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def metadata(args: argparse.Namespace | None = None) -> dict[str, Any]:
    """The command line, versions and machine a result came from."""
    meta: dict[str, Any] = {
        "command": shlex.join(["python", *sys.argv]),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if args is not None:
        for key in ("repeats", "quick", "clock"):
            if hasattr(args, key):
                meta[key] = getattr(args, key)
    return meta


def write_json(
    path: Path | str, payload: Mapping[str, Any], args: argparse.Namespace | None = None
) -> Path:
    """Writes ``{"meta": metadata(args), **payload}`` atomically (a temporary file renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"meta": metadata(args), **payload}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(body, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def cell(value: Any) -> str:
    """A table cell: ``-`` for missing values, floats without trailing noise."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _numeric(rows: Sequence[Mapping[str, Any]], column: str) -> bool:
    """Whether every value of ``column`` is a number or missing (a right-aligned column)."""
    values = [r.get(column) for r in rows]
    return all(
        v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in values
    )


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` as a Markdown table of ``columns`` (text left aligned, numbers right)."""
    numeric = {c: _numeric(rows, c) for c in columns}
    lines = ["| " + " | ".join(columns) + " |"]
    lines.append("|" + "".join(" ---: |" if numeric[c] else " --- |" for c in columns))
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def print_table(title: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """``rows`` as a Rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if _numeric(rows, c) else "left")
    for r in rows:
        table.add_row(*(cell(r.get(c)) for c in columns))
    Console(width=200).print(table)


def report(
    args: argparse.Namespace,
    tables: Sequence[tuple[str, Sequence[Mapping[str, Any]], Sequence[str]]],
    payload: Mapping[str, Any],
) -> Path:
    """Prints every ``(title, rows, columns)`` table (and its Markdown with ``--markdown``),
    then writes ``payload`` to ``--out``; returns that path."""
    for title, rows, columns in tables:
        print_table(title, rows, columns)
        if args.markdown:
            print(f"\n**{title}**\n\n{markdown_table(rows, columns)}\n")
    path = write_json(args.out, payload, args)
    print(f"wrote {path}")
    return path
