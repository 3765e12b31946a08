"""How a compiled call is dispatched: fully guarded, dynamo's guard-free stance, or direct.

The compiled engine calls a handful of graphs per decode step (the target's forward, the
verification, EAGLE-3's catch-up and chain passes).  Entering dynamo costs each call time
outside the graph: the frame interception, the cache lookup and its guards.
``specrl.rollout.compiled.Compiled`` runs a graph class it has served either under dynamo's
``skip_guard_eval_unsafe`` stance or, where torch exposes dynamo's cache entries, directly (the
entry's rewritten bytecode called as a plain function, vLLM's custom dispatcher).  Two parts:

1. **per call**: the target's compiled decode forward (one new token per sequence), the same
   graph called three ways in rotation (fully guarded, stance, direct); median per-call time
   over rounds of calls;
2. **per engine**: ``RolloutEngine(compile=True)`` plain and best-of-N (eagle3 + ngram), built
   with direct calls off (stance only) and on, decoding the same addition prompts in a rotated
   order; tokens/s, and per repeat each engine's over its direct-off twin.

One torch thread, thread CPU time.

    python benchmarks/compiled_dispatch.py
    python benchmarks/compiled_dispatch.py --quick    # fewer rounds and repeats

Writes ``benchmarks/results/compiled_dispatch.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import specrl.rollout.compiled as compiled_module
from specrl.config.loader import atomic_write_text
from specrl.core.attention import PackedLayout
from specrl.models.checkpoint import load_model
from specrl.models.decoder import CacheBatch
from specrl.models.tokenizer import TextCodec
from specrl.rl.tasks import AdditionTask
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig
from specrl.rollout.compiled import CompiledDecode

MAX_K = 4


def per_call(target: Path, batches: list[int], rounds: int, calls: int) -> list[dict]:
    model = load_model(target)
    return [{"target": str(target), **_per_call(model, b, rounds, calls)} for b in batches]


def _per_call(model: torch.nn.Module, batch: int, rounds: int, calls: int) -> dict:
    cache = model.new_cache(batch, 256)
    layout = PackedLayout.from_lengths([1] * batch)
    ids = torch.full((batch,), 5)
    slots = torch.arange(batch)
    compiled_module.DIRECT_CALLS = False
    stance = CompiledDecode(model)
    compiled_module.DIRECT_CALLS = True
    direct = CompiledDecode(model)

    def guarded(ids, layout, cache, taps):  # no key: every call fully guarded
        return super(CompiledDecode, direct).__call__(ids, layout, taps=taps, cache=cache)

    modes = {"guarded": guarded, "stance": stance, "direct": direct}

    def call(fn, kv: int) -> torch.Tensor:
        prefix = torch.full((batch,), kv - 1)
        batch_cache = CacheBatch(
            cache, slots, prefix, kv, slots_are_prefix=True, full_rows=batch == 1
        )
        return fn(ids, layout, batch_cache, ()).logits

    with torch.no_grad():
        for fn in modes.values():  # compile (once: the graphs are shared), then serve
            for i in range(4):
                call(fn, 40 + i)
        ref = call(guarded, 60)
        for name, fn in modes.items():  # every mode runs the same graph
            torch.testing.assert_close(call(fn, 60), ref, rtol=0, atol=0, msg=name)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(rounds):
            names = list(modes)
            for name in names[r % 3 :] + names[: r % 3]:
                t0 = time.thread_time()
                for _ in range(calls):
                    call(modes[name], 60)
                times[name].append((time.thread_time() - t0) / calls * 1e6)
    assert direct.direct > 0 and stance.direct == 0
    med = {m: statistics.median(v) for m, v in times.items()}
    return {
        "batch": batch,
        **{f"{m}_us": round(v, 1) for m, v in med.items()},
        "stance_minus_direct_us": round(med["stance"] - med["direct"], 1),
        "guarded_over_direct": round(med["guarded"] / med["direct"], 3),
        "stance_over_direct": round(med["stance"] / med["direct"], 3),
    }


def per_engine(
    target: Path, draft: Path, batches: list[int], repeats: int, temperature: float
) -> list[dict]:
    model = load_model(target)
    codec = TextCodec.from_checkpoint(target, model.config)
    eagle = {"eagle3": {"path": str(draft)}}
    specs = {
        "plain": None,
        "best-of-N": SpecConfig(("eagle3", "ngram"), max_k=MAX_K, proposer_options=eagle),
    }
    rows = []
    for batch in batches:
        rows += [
            {"target": str(target), **row}
            for row in _per_engine(model, codec, specs, batch, repeats, temperature)
        ]
    return rows


def _per_engine(
    model: torch.nn.Module,
    codec: TextCodec,
    specs: dict,
    batch: int,
    repeats: int,
    temperature: float,
) -> list[dict]:
    rows = []
    engines = {}
    for direct in (False, True):
        compiled_module.DIRECT_CALLS = direct
        for name, spec in specs.items():
            engines[(name, direct)] = RolloutEngine(
                model, codec=codec, max_batch_size=batch, spec=spec, seed=0, compile=True,
                clock=time.thread_time,
            )  # fmt: skip
    compiled_module.DIRECT_CALLS = True

    def run(engine: RolloutEngine, seed: int) -> int:
        problems = AdditionTask().sample(random.Random(seed), max(batch, 8))
        reqs = [
            Request(codec.encode_prompt(p.prompt),
                    SamplingParams(64, temperature, seed=seed * 1000 + i))
            for i, p in enumerate(problems)
        ]  # fmt: skip
        return sum(len(r.tokens) for r in engine.generate(reqs))

    for engine in engines.values():
        engine.warmup()
        for w in range(2):
            run(engine, 10_000 + w)
    keys = list(engines)
    rates: dict = {k: [] for k in keys}
    for r in range(repeats):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            t0 = time.thread_time()
            tokens = run(engines[key], r + 1)
            rates[key].append(tokens / (time.thread_time() - t0))
    for name in specs:
        off, on = rates[(name, False)], rates[(name, True)]
        ratios = [b / a for a, b in zip(off, on, strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        calls = _compiled_parts(engines[(name, True)])
        rows.append(
            {
                "batch": batch,
                "engine": f"{name} compiled",
                "stance_tok_s": round(statistics.median(off), 1),
                "direct_tok_s": round(statistics.median(on), 1),
                "direct_over_stance": round(statistics.median(ratios), 3),
                "q1": round(q1, 3),
                "q3": round(q3, 3),
                "direct_calls": sum(c.direct for c in calls),
                "compiled_calls_unguarded": sum(c.unguarded for c in calls),
            }
        )
    # best-of-N over plain, both ways: does direct dispatch move the speculative ratio?
    for direct in (False, True):
        ratios = [
            b / a
            for a, b in zip(rates[("plain", direct)], rates[("best-of-N", direct)], strict=True)
        ]
        rows.append(
            {
                "batch": batch,
                "engine": f"best-of-N / plain ({'direct' if direct else 'stance'})",
                "ratio": round(statistics.median(ratios), 3),
            }
        )
    return rows


def _compiled_parts(engine: RolloutEngine) -> list:
    parts = [engine._compiled, engine._compiled_decide]
    for proposer in engine.proposers.values():
        parts += [getattr(proposer, "_compiled", None), getattr(proposer, "_compiled_start", None)]
    return [p for p in parts if p is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="+", type=Path,
                    default=[Path("runs/toy/target"), Path("runs/toy-deep/target")])  # fmt: skip
    ap.add_argument("--drafts", nargs="+", type=Path,
                    default=[Path("runs/toy/draft"), Path("runs/toy-deep/draft")])  # fmt: skip
    ap.add_argument("--call-batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--engine-batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 20 calls, 3 repeats")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compiled_dispatch.json"))
    args = ap.parse_args()
    if len(args.targets) != len(args.drafts):
        ap.error("--targets and --drafts pair up: give as many of each")
    for t, d in zip(args.targets, args.drafts, strict=True):
        for p, what in ((t, "config.json"), (d, "specrl_draft.json")):
            if not (p / what).is_file():
                ap.error(f"{p} has no {what}: make the toy pairs (docs/benchmarks.md, issue 6)")
    if args.quick:
        args.rounds, args.calls, args.repeats = 3, 20, 3
    compiled_module.check_toolchain(torch.device("cpu"))
    torch.set_num_threads(1)
    calls, engines = [], []
    for target, draft in zip(args.targets, args.drafts, strict=True):
        calls += per_call(target, args.call_batches, args.rounds, args.calls)
        engines += per_engine(target, draft, args.engine_batches, args.repeats, args.temperature)
    _print("per call: the target's compiled decode forward", calls)
    _print("per engine: direct calls on over off", engines)
    meta = {
        "command": " ".join(["python", *sys.argv]),
        "rounds": args.rounds,
        "calls": args.calls,
        "repeats": args.repeats,
        "temperature": args.temperature,
        "clock": "thread cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    payload = {"meta": meta, "per_call": calls, "per_engine": engines}
    atomic_write_text(args.out, json.dumps(payload, indent=2) + "\n")


def _print(title: str, rows: list[dict]) -> None:
    cols: list[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]
    print(f"\n{title}\n")
    print("| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "-")) for c in cols) + " |")


if __name__ == "__main__":
    main()
