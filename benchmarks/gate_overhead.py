"""What speculation costs a full batch where the gate keeps it off: engines vs plain decoding.

At a compute-bound batch (toy-small at 32 sequences) speculation loses, the batch-size gate
turns it off, and a speculative engine should then run as fast as a plain one.  What it still
pays is host work per step (planning, the proposers' bookkeeping, EAGLE-3's taps queued for a
later catch-up) and its probes.  This script measures each part against plain decoding on one
target, in one process:

- ``plain``: no speculation;
- ``ngram (held off)``, ``eagle3 (held off)``: one proposer, the gate held off (no probes,
  ``hysteresis`` = ∞: once the fits say speculation loses at a batch size it never turns on
  there): the bookkeeping alone;
- ``best-of-N``: eagle3 and ngram with the default gate and probes (what ``specrl rollout``
  runs).

Protocol as ``benchmarks/rollout.py``: engines warmed (``RolloutEngine.warmup()`` when compiled,
then two runs), each repeat a fresh set of B addition prompts decoded by every engine in a
rotated order, one torch thread, thread CPU time; per repeat each engine's tokens/s over plain's,
reported as the median and quartiles over repeats, with the speculative steps it took.  The
held-off engines start with the gate off at every batch size (a fresh gate starts on, and with
no plain step measured it may never turn off: EAGLE-3 alone at batch 1 would speculate).

Then where an engine's time goes, step by step (every ``step()`` of the measured repeats timed
and classed): prefill (no decode step in it), plain, plain right after a speculative step (it
pays the switch back: caches the drafting evicted), speculative with the gate off (a probe)
and speculative with the gate on; per class its steps, tokens, µs per step and µs per token
over the plain engine's plain steps, and the time it took beyond what the plain engine's
plain steps would have taken for its tokens ("excess", as a share of the engine's total).

    python benchmarks/gate_overhead.py --compile --repeats 21
    python benchmarks/gate_overhead.py --quick     # 3 repeats, eager

Writes ``benchmarks/results/gate_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specrl.config.loader import atomic_write_text
from specrl.models.checkpoint import load_model
from specrl.models.tokenizer import TextCodec
from specrl.rl.tasks import AdditionTask
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig

MAX_K = 4
HELD = {"probe": 0.0, "hysteresis": math.inf}  # once off at a batch size, never on again there
HELD_OFF = " (held off)"  # the names of the engines whose gate starts (and stays) off


def configs(draft: Path) -> dict[str, SpecConfig | None]:
    eagle = {"eagle3": {"path": str(draft)}}
    return {
        "plain": None,
        "ngram" + HELD_OFF: SpecConfig(("ngram",), max_k=MAX_K, **HELD),
        "eagle3" + HELD_OFF: SpecConfig(("eagle3",), max_k=MAX_K, proposer_options=eagle, **HELD),
        "best-of-N": SpecConfig(("eagle3", "ngram"), max_k=MAX_K, proposer_options=eagle),
    }


def hold_off(engine: RolloutEngine, max_batch: int) -> None:
    """Start ``engine``'s gate off at every batch size (held: no probe turns it on)."""
    gate = engine.controller.gate
    gate.states.update(dict.fromkeys(range(1, max_batch + 1), False))
    gate.on = False


STEP_CLASSES = ("prefill", "plain", "plain after speculative", "probe (gate off)", "gate on")


class StepLog:
    """Times and classes every ``step()`` of an engine (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, clock: Callable[[], float]) -> None:
        self.engine, self.clock = engine, clock
        self.recording = False
        self.times: dict[str, list[float]] = {c: [] for c in STEP_CLASSES}  # seconds per step
        self.tokens = dict.fromkeys(STEP_CLASSES, 0)  # tokens emitted, per class
        self._last_speculative = False
        self._step = engine.step
        engine.step = self  # type: ignore[method-assign]

    def __call__(self) -> list:
        ctrl = self.engine.controller  # a plain engine's too (it counts plain steps)
        before = ctrl.spec_steps, ctrl.plain_steps
        tokens = self.engine._total.tokens  # the engine's running count (stats() builds much more)
        t0 = self.clock()
        out = self._step()
        seconds = self.clock() - t0
        if not self.recording:
            return out
        speculative = ctrl.spec_steps > before[0]
        decoded = speculative or ctrl.plain_steps > before[1]
        if not decoded:
            cls = "prefill"
        elif speculative:
            cls = "gate on" if ctrl.gate.on else "probe (gate off)"
        else:
            cls = "plain after speculative" if self._last_speculative else "plain"
        if decoded:
            self._last_speculative = speculative
        self.times[cls].append(seconds)
        self.tokens[cls] += self.engine._total.tokens - tokens
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("runs/toy/target"))
    ap.add_argument("--draft", type=Path, default=Path("runs/toy/draft"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--compile", action="store_true", help="compiled engines (torch.compile)")
    ap.add_argument("--quick", action="store_true", help="3 repeats")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gate_overhead.json"))
    args = ap.parse_args()
    for p, what in ((args.target, "config.json"), (args.draft, "specrl_draft.json")):
        if not (p / what).is_file():
            ap.error(f"{p} has no {what}: make the toy pair first (docs/benchmarks.md, issue 6)")
    repeats = 3 if args.quick else args.repeats
    torch.set_num_threads(1)
    clock = time.thread_time
    model = load_model(args.target)
    codec = TextCodec.from_checkpoint(args.target, model.config)
    engines = {}
    logs = {}
    for name, spec in configs(args.draft).items():
        engines[name] = RolloutEngine(
            model, codec=codec, max_batch_size=args.batch, spec=spec, seed=0,
            compile=args.compile, clock=clock,
        )  # fmt: skip
        if name.endswith(HELD_OFF):
            hold_off(engines[name], args.batch)
        logs[name] = StepLog(engines[name], clock)

    def run(engine: RolloutEngine, seed: int) -> int:
        problems = AdditionTask().sample(random.Random(seed), args.batch)
        params = [SamplingParams(args.max_tokens, args.temperature, seed=seed * 1000 + i)
                  for i in range(args.batch)]  # fmt: skip
        pairs = zip(problems, params, strict=True)
        out = engine.generate([Request(codec.encode_prompt(p.prompt), s) for p, s in pairs])
        return sum(len(r.tokens) for r in out)

    for engine in engines.values():
        if args.compile:
            engine.warmup()
        for w in range(2):
            run(engine, 10_000 + w)
    names = list(engines)
    for log in logs.values():
        log.recording = True
    rates: dict[str, list[float]] = {n: [] for n in names}
    spec_steps = dict.fromkeys(names, 0)
    steps = dict.fromkeys(names, 0)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            engine = engines[name]
            before = engine.controller.spec_steps, engine.controller.plain_steps
            t0 = clock()
            tokens = run(engine, r + 1)
            rates[name].append(tokens / (clock() - t0))
            after = engine.controller.spec_steps, engine.controller.plain_steps
            spec_steps[name] += after[0] - before[0]
            steps[name] += sum(after) - sum(before)
    for name in names:
        if name.endswith(HELD_OFF) and spec_steps[name]:
            raise SystemExit(f"{name} speculated in {spec_steps[name]} steps: not held off")
    rows = []
    for name in names:
        ratios = [a / b for a, b in zip(rates[name], rates["plain"], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        rows.append(
            {
                "variant": name,
                "tok_s": round(statistics.median(rates[name]), 1),
                "vs_plain": round(statistics.median(ratios), 3),
                "vs_plain_q1": round(q1, 3),
                "vs_plain_q3": round(q3, 3),
                "spec_steps": spec_steps[name],
                "decode_steps": steps[name],
                "tok_s_runs": [round(x, 1) for x in rates[name]],
            }
        )
    title = (
        f"gated-off cost, B={args.batch}, T={args.temperature}, "
        f"{'compiled' if args.compile else 'eager'}, median of {repeats}"
    )
    cols = ("variant", "tok_s", "vs_plain", "vs_plain_q1", "vs_plain_q3", "spec_steps",
            "decode_steps")  # fmt: skip
    show(title, cols, rows)
    step_rows = step_classes(logs)
    step_cols = ("variant", "class", "steps", "tokens", "us_step", "us_token", "vs_plain_step",
                 "median_us_step", "median_vs_plain", "excess_share")  # fmt: skip
    show("where the time goes: steps by class (measured repeats)", step_cols, step_rows)
    meta = {
        "command": " ".join(["python", *sys.argv]),
        "target": str(args.target),
        "draft": str(args.draft),
        "batch": args.batch,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "repeats": repeats,
        "compile": args.compile,
        "clock": "thread cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    payload = {"meta": meta, "rows": rows, "steps": step_rows}
    atomic_write_text(args.out, json.dumps(payload, indent=2) + "\n")


def show(title: str, cols: tuple[str, ...], rows: list[dict]) -> None:
    """A Rich table of ``rows``, then the same as Markdown."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in cols:
        table.add_column(c, justify="left" if c in ("variant", "class") else "right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in cols))
    Console(width=160).print(table)
    print("| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")


def step_classes(logs: dict[str, StepLog]) -> list[dict]:
    """Per engine and step class: steps, tokens, µs per step (mean and median) and per token;
    against the plain engine (its prefill steps for prefill, its plain steps otherwise): the
    mean time per token (prefill: per step), the median step (robust to this machine's slow
    spells, which the means are not), and the excess over its rates as a share of the engine's
    measured time."""
    ref = logs["plain"]

    def rate(cls: str) -> tuple[float, float]:  # (mean seconds per unit, median step)
        times = ref.times[cls]
        units = len(times) if cls == "prefill" else ref.tokens[cls]
        return sum(times) / max(units, 1), statistics.median(times)

    base = {"prefill": rate("prefill"), "decode": rate("plain")}
    out = []
    for name, log in logs.items():
        total = sum(sum(times) for times in log.times.values())
        for cls, times in log.times.items():
            if not times:
                continue
            per_unit, median = base["prefill" if cls == "prefill" else "decode"]
            steps, tokens, seconds = len(times), log.tokens[cls], sum(times)
            units = steps if cls == "prefill" else tokens
            out.append(
                {
                    "variant": name,
                    "class": cls,
                    "steps": steps,
                    "tokens": tokens,
                    "us_step": round(seconds / steps * 1e6, 1),
                    "us_token": round(seconds / tokens * 1e6, 1) if tokens else None,
                    "vs_plain_step": round(seconds / units / per_unit, 3) if units else None,
                    "median_us_step": round(statistics.median(times) * 1e6, 1),
                    "median_vs_plain": round(statistics.median(times) / median, 3),
                    "excess_share": round((seconds - per_unit * units) / total, 4),
                }
            )
    return out


if __name__ == "__main__":
    main()
