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
reported as the median and quartiles over repeats, with the speculative steps it took.

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
from pathlib import Path

import torch

from specrl.config.loader import atomic_write_text
from specrl.models.checkpoint import load_model, load_tokenizer
from specrl.models.tokenizer import TextCodec
from specrl.rl.tasks import AdditionTask
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig

MAX_K = 4


def configs(draft: Path) -> dict[str, SpecConfig | None]:
    eagle = {"eagle3": {"path": str(draft)}}
    held = {"probe": 0.0, "hysteresis": math.inf}
    return {
        "plain": None,
        "ngram (held off)": SpecConfig(("ngram",), max_k=MAX_K, **held),
        "eagle3 (held off)": SpecConfig(("eagle3",), max_k=MAX_K, proposer_options=eagle, **held),
        "best-of-N": SpecConfig(("eagle3", "ngram"), max_k=MAX_K, proposer_options=eagle),
    }


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
    codec = TextCodec(load_tokenizer(args.target), model.config.bos_token_id,
                      model.config.eos_token_id)  # fmt: skip
    engines = {}
    for name, spec in configs(args.draft).items():
        engines[name] = RolloutEngine(
            model, codec=codec, max_batch_size=args.batch, spec=spec, seed=0,
            compile=args.compile, clock=clock,
        )  # fmt: skip

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
    from rich.console import Console
    from rich.table import Table

    title = (
        f"gated-off cost, B={args.batch}, T={args.temperature}, "
        f"{'compiled' if args.compile else 'eager'}, median of {repeats}"
    )
    table = Table(title=title)
    cols = ("variant", "tok_s", "vs_plain", "vs_plain_q1", "vs_plain_q3", "spec_steps",
            "decode_steps")  # fmt: skip
    for c in cols:
        table.add_column(c, justify="left" if c == "variant" else "right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in cols))
    Console(width=160).print(table)
    print("| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
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
    atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
