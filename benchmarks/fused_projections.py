"""The eager engine's inference projections on CPU: the weight copies' layout.

The fused inference path (:mod:`specrl.models.fused`) runs every projection of a decode or
verification forward from a copy of its weights.  Two layouts, switched with
``specrl.models.fused.CPU_LAYOUT``:

- ``rows``: the [out, in] row concatenation (q|k|v, gate|up; o_proj and down_proj as they are)
  through ``F.linear``, residuals added after;
- ``transposed``: the [in, out] contiguous transpose of every projection through ``mm``, and
  ``addmm`` for o_proj and down_proj with the residual added in the GEMM (the default).

Measured on each target: its whole cached forward (all layers, the logits) for B sequences
bringing M new tokens each (M = 1: a decoding step; M = 5: verifying 4 drafted tokens) at a
context of 40 positions, and one EAGLE-3 chain step of its draft (``Eagle3Draft.decode`` on one
token per sequence, then the draft logits).  The two layouts take turns within each round, in
alternating order (the machine's drift hits both); per case the median over rounds of each
round's median µs, one torch thread, thread CPU time.

Then the whole eager plain engine (``RolloutEngine``, no proposers) under each layout: the
rollout benchmark's workload (P = max(B, 8) addition prompts, one sample each at temperature 1,
≤ 64 tokens), the layouts alternating run by run in alternating order, ``--engine-repeats``
pairs; tok/s per thread-CPU second (medians) and the median of the per-pair ratios.

    python -m benchmarks.fused_projections --targets runs/toy/target runs/toy-deep/target \\
        --drafts runs/toy/draft runs/toy-deep/draft

Writes ``benchmarks/results/fused_projections.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.engine_paths import markdown, render
from benchmarks.rollout import prompt_set
from specrl.core.attention import PackedLayout
from specrl.models import fused
from specrl.models.checkpoint import load_model
from specrl.models.decoder import CacheBatch, Transformer
from specrl.models.draft_io import load_draft
from specrl.models.tokenizer import TextCodec
from specrl.rollout import Request, RolloutEngine, SamplingParams

LAYOUTS = ("rows", "transposed")
CONTEXT = 40


def target_call(model: Transformer, b: int, m: int) -> Callable[[], object]:
    """The cached forward of ``b`` sequences × ``m`` new tokens in slots 0..b−1."""
    cache = model.new_cache(b, CONTEXT + m)
    gen = torch.Generator().manual_seed(0)
    for kv in (cache.k, cache.v):
        for t in kv.values():
            t.copy_(torch.randn(t.shape, generator=gen))
    ids = torch.randint(0, model.config.vocab_size, (b * m,), generator=gen)
    layout = PackedLayout.from_lengths([m] * b)
    slots, prefix = torch.arange(b), torch.full((b,), CONTEXT)

    def call() -> object:
        batch = CacheBatch(
            cache, slots, prefix, CONTEXT + m, slots_are_prefix=True, full_rows=m == 1
        )
        return model(ids, layout, cache=batch, fused=True).logits

    return call


def draft_call(draft, b: int) -> Callable[[], object]:
    """One chain step: the draft layer on (h, d_j) for ``b`` sequences, then its logits."""
    cache = draft.new_cache(b, CONTEXT + 1)
    gen = torch.Generator().manual_seed(1)
    for kv in (cache.k, cache.v):
        for t in kv.values():
            t.copy_(torch.randn(t.shape, generator=gen))
    h = torch.randn(b, draft.config.hidden_size, generator=gen)
    ids = torch.randint(0, draft.config.vocab_size, (b,), generator=gen)
    layout = PackedLayout.from_lengths([1] * b)
    slots, prefix = torch.arange(b), torch.full((b,), CONTEXT)

    def call() -> object:
        batch = CacheBatch(cache, slots, prefix, CONTEXT + 1, slots_are_prefix=True, full_rows=True)
        return draft.logits(draft.decode(h, ids, layout, batch, fused=True), fused=True)

    return call


def compare(call: Callable[[], object], rounds: int, calls: int) -> dict[str, float]:
    """Median over rounds of each layout's median µs; the layouts take turns within each
    round (switching rebuilds the copies: one untimed call first)."""
    per_round: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    saved = fused.CPU_LAYOUT
    try:
        with torch.no_grad():
            outs = {}
            for layout in LAYOUTS:  # build both layouts' copies; check they agree
                fused.CPU_LAYOUT = layout
                outs[layout] = call()
            torch.testing.assert_close(outs["rows"], outs["transposed"], rtol=1e-4, atol=1e-4)
            for r in range(rounds):
                for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
                    fused.CPU_LAYOUT = layout
                    call()  # rebuilds this layout's copies
                    samples = []
                    for _ in range(calls):
                        t0 = time.thread_time()
                        call()
                        samples.append(time.thread_time() - t0)
                    per_round[layout].append(statistics.median(samples) * 1e6)
    finally:
        fused.CPU_LAYOUT = saved
    return {k: statistics.median(v) for k, v in per_round.items()}


def engine_run(engine: RolloutEngine, codec: TextCodec, layout: str, seed: int) -> float:
    """One run of the workload under ``layout``; tok/s per thread-CPU second."""
    fused.CPU_LAYOUT = layout
    engine.generate([Request([1, 5], SamplingParams(2, 1.0, seed=0))])  # rebuilds the copies
    prompts = prompt_set(codec, max(engine.max_batch_size, 8), seed)
    reqs = [
        Request(q, SamplingParams(64, 1.0, seed=seed * 1000 + i)) for i, q in enumerate(prompts)
    ]
    t0 = time.thread_time()
    out = engine.generate(reqs)
    return sum(len(r.tokens) for r in out) / (time.thread_time() - t0)


def engine_rows(target: Path, batches: list[int], repeats: int) -> list[dict]:
    """The eager plain engine's tok/s under each layout, alternating run by run."""
    model = load_model(target).eval()
    cfg = model.config
    codec = TextCodec.from_checkpoint(target, cfg)
    rows = []
    saved = fused.CPU_LAYOUT
    try:
        for b in batches:
            engine = RolloutEngine(model, codec=codec, max_batch_size=b, seed=0)
            for layout in LAYOUTS:  # warm-up
                engine_run(engine, codec, layout, 1)
            tok_s: dict[str, list[float]] = {k: [] for k in LAYOUTS}
            for r in range(repeats):
                for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
                    tok_s[layout].append(engine_run(engine, codec, layout, 100 + r))
            ratios = [t / r for t, r in zip(tok_s["transposed"], tok_s["rows"], strict=True)]
            rows.append(
                {
                    "target": target.parent.name,
                    "batch": b,
                    "rows tok/s": round(statistics.median(tok_s["rows"]), 1),
                    "transposed tok/s": round(statistics.median(tok_s["transposed"]), 1),
                    "transposed / rows": round(statistics.median(ratios), 3),
                    "pairs": repeats,
                }
            )
            print(rows[-1], flush=True)
    finally:
        fused.CPU_LAYOUT = saved
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", type=Path, nargs="+", default=[Path("runs/toy-deep/target")])
    ap.add_argument("--drafts", type=Path, nargs="*", default=[])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--engine-batches", default="1", help="'' skips the engine measurement")
    ap.add_argument("--engine-repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/fused_projections.json"))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    if args.drafts and len(args.drafts) != len(args.targets):
        ap.error("--drafts needs one draft per target")
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for i, target in enumerate(args.targets):
        model = load_model(target).eval()
        cases = [(f"target forward, M={m}", b, target_call(model, b, m)) for m in (1, 5)
                 for b in batches]  # fmt: skip
        if args.drafts:
            draft, _ = load_draft(args.drafts[i], model, dtype=model.dtype, share_embedding=True)
            cases += [("draft chain step", b, draft_call(draft.eval(), b)) for b in batches]
        for what, b, call in cases:
            us = compare(call, args.rounds, args.calls)
            rows.append(
                {
                    "target": target.parent.name,
                    "call": what,
                    "batch": b,
                    "rows us": round(us["rows"], 1),
                    "transposed us": round(us["transposed"], 1),
                    "rows / transposed": round(us["rows"] / us["transposed"], 3),
                }
            )
            print(rows[-1], flush=True)
    engine = []
    if args.engine_batches:
        eb = [int(b) for b in args.engine_batches.split(",")]
        for target in args.targets:
            engine += engine_rows(target, eb, args.engine_repeats)
    render(rows, "eager inference projections: weight-copy layout on CPU (µs per call)")
    if engine:
        render(engine, "eager plain engine: weight-copy layout on CPU (tok/s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    meta = {
        "command": "python -m benchmarks.fused_projections --targets "
        + " ".join(map(str, args.targets))
        + (" --drafts " + " ".join(map(str, args.drafts)) if args.drafts else "")
        + f" --batches {args.batches} --rounds {args.rounds} --calls {args.calls}"
        + f" --engine-batches '{args.engine_batches}' --engine-repeats {args.engine_repeats}",
        "torch": torch.__version__,
        "threads": 1,
        "clock": "thread cpu",
        "context": CONTEXT,
    }
    tmp.write_text(json.dumps({"meta": meta, "rows": rows, "engine": engine}, indent=1))
    tmp.replace(args.out)
    if args.markdown:
        print(markdown(rows))
        if engine:
            print()
            print(markdown(engine))


if __name__ == "__main__":
    main()
