"""Probe: the rollout engine with its target forward under ``torch.compile`` vs eager.

The baseline of ``RolloutEngine(compile=True)`` (:mod:`specrl.rollout.compiled`): it compiles
the forward as the eager engine calls it, whose steps change shape and host flags, so dynamo
keeps compiling new graphs; the engine's compiled mode pads its steps to shape-stable blocks
instead (``benchmarks/rollout.py --compile`` measures it).  For each batch size B, one
plain-decoding engine per mode decodes max(B, 8) addition prompts (sampled, T = 1, ≤ 64
tokens) after ``--warmup`` runs (default 2) on other prompts; the compiled engine's target is
``torch.compile(model, dynamic=True)``.  Reported per B: warm-up wall seconds (compilation
included), tokens/s over three measured runs (thread CPU time, one torch thread), how many
graphs dynamo compiled in all and during the measured runs (``graphs_after_warmup``: their
compilation is in the measured time, the steps are not shape-stable), and whether both engines
produced the same tokens.

    python -m benchmarks.compile_probe --target runs/toy/target

Writes ``benchmarks/results/compile_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmarks.rollout import prompt_set
from specrl.models.checkpoint import load_model
from specrl.models.tokenizer import TextCodec
from specrl.rollout import Request, RolloutEngine, SamplingParams


def measure(
    model, codec: TextCodec, batch: int, compiled: bool, max_tokens: int, warmup: int
) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    engine = RolloutEngine(model, codec=codec, max_batch_size=batch, seed=0, clock=time.thread_time)
    if compiled:
        engine.model = torch.compile(model, dynamic=True)

    def run(seed: int) -> list[list[int]]:
        prompts = prompt_set(codec, max(batch, 8), seed)
        reqs = [
            Request(p, SamplingParams(max_tokens, 1.0, seed=seed * 1000 + i))
            for i, p in enumerate(prompts)
        ]
        return [r.tokens for r in engine.generate(reqs)]

    t0 = time.perf_counter()
    for w in range(warmup):
        run(10_000 + w)
    warm = time.perf_counter() - t0
    warm_graphs = int(counters["stats"]["unique_graphs"])
    t0, outs = time.thread_time(), []
    for rep in range(1, 4):
        outs.append(run(rep))
    seconds = time.thread_time() - t0
    tokens = sum(len(t) for out in outs for t in out)
    return {
        "batch": batch,
        "mode": "compiled" if compiled else "eager",
        "warmup_s": round(warm, 1),
        "tok_s": round(tokens / seconds, 1),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graphs_after_warmup": int(counters["stats"]["unique_graphs"]) - warm_graphs,
        "recompile_limit_hit": bool(counters["stats"].get("recompile_limit_hit", 0))
        or any("recompile_limit" in k for k in counters["frames"]),
        "outputs": outs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("runs/toy/target"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up runs before measuring")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compile_probe.json"))
    args = ap.parse_args()
    if not (args.target / "config.json").is_file():
        ap.error(f"{args.target} has no config.json: run the README main job first")
    torch.set_num_threads(1)
    model = load_model(args.target).eval()
    cfg = model.config
    codec = TextCodec.from_checkpoint(args.target, cfg)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        eager = measure(model, codec, batch, False, args.max_tokens, args.warmup)
        comp = measure(model, codec, batch, True, args.max_tokens, args.warmup)
        same = eager.pop("outputs") == comp.pop("outputs")
        for r in (eager, comp):
            rows.append({**r, "same_tokens": same})
        rows[-1]["vs_eager"] = round(comp["tok_s"] / eager["tok_s"], 2)
        print(json.dumps(rows[-2]), json.dumps(rows[-1]), file=sys.stderr, flush=True)

    from rich.console import Console
    from rich.table import Table

    table = Table(title="rollout engine, plain decoding: torch.compile(target) vs eager")
    cols = ("batch", "mode", "warmup_s", "tok_s", "vs_eager", "graphs", "graphs_after_warmup")
    for c in (*cols, "same_tokens"):
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*(str(r.get(c, "-")) for c in (*cols, "same_tokens")))
    Console(width=140).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cmd = shlex.join(["python", "-m", "benchmarks.compile_probe", *sys.argv[1:]])
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"command": cmd, "torch": torch.__version__, "rows": rows}, indent=2))
    tmp.replace(args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
