"""Decoupled drafting's mechanism, gate off: serial vs a drafter thread vs a drafter process.

Every decode step speculates with EAGLE-3 at a fixed draft length k (``gate: false``,
``draft_lengths: [k]``), so the figures are the mechanism's, not the gate's choice: plain,
serial (draft, then verify), decoupled with a drafter thread, decoupled with a drafter process
(:mod:`specrl.rollout.drafter_process`).  Wall clock; the engine thread has 1 torch thread,
the drafter (thread or process) 1 more.  On the ceiling pair
(:mod:`benchmarks.studies.ceiling_pair`: every draft and guess right) it measures what
decoupling can give at a preset's draft/target cost ratio.

    python -m benchmarks.studies.ceiling_pair --preset toy-small --out /tmp/ceil/toy-small
    python -m benchmarks.studies.decoupled_mechanism --target /tmp/ceil/toy-small/target \\
        --draft /tmp/ceil/toy-small/draft --ks 2,3,8 --markdown
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from benchmarks import harness
from specrl.models.checkpoint import load_model
from specrl.models.tokenizer import TextCodec
from specrl.rl.tasks import AdditionTask
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig

VARIANTS = {
    "plain": None,
    "serial": {},
    "decoupled thread": {"decoupled": True, "drafter": "thread"},
    "decoupled process": {"decoupled": True, "drafter": "process"},
}


def main() -> None:
    ap = harness.parser(__doc__, "decoupled_mechanism", repeats=3, threads=False, clock=False)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--ks", default="3", help="comma-separated draft lengths")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    clock = harness.configure(ap, args)
    torch.set_num_threads(1)
    model = load_model(args.target).eval()
    codec = TextCodec.from_checkpoint(args.target, model.config)
    problems = AdditionTask().sample(random.Random(0), max(8, args.batch))
    prompts = [codec.encode_prompt(p.prompt) for p in problems]
    eagle = {"eagle3": {"path": str(args.draft)}}
    rows = []
    for k in [int(x) for x in args.ks.split(",")]:

        def build(extra: dict | None, k: int = k) -> RolloutEngine:
            spec = None
            if extra is not None:
                spec = SpecConfig(
                    ("eagle3",), max_k=k, draft_lengths=(k,), gate=False,
                    proposer_options=eagle, **extra,
                )  # fmt: skip
            return RolloutEngine(
                model, codec=codec, max_batch_size=args.batch, seed=0, clock=clock, spec=spec
            )

        engines = {name: build(extra) for name, extra in VARIANTS.items()}

        def run(name: str, rep: int, engines=engines) -> dict:
            reqs = [Request(p, SamplingParams(args.max_tokens, 0.0)) for p in prompts]
            seconds, out = harness.timed(clock, lambda: engines[name].generate(reqs))
            return {"tok_s": out.stats["tokens"] / seconds, "tokens": [r.tokens for r in out]}

        runs = harness.interleave(list(VARIANTS), args.repeats, run)
        plain = [r["tok_s"] for r in runs["plain"]]
        serial = [r["tok_s"] for r in runs["serial"]]
        for name in VARIANTS:
            tok_s = [r["tok_s"] for r in runs[name]]
            la = engines[name].stats().get("decoupled") if name != "plain" else None
            rows.append(
                {
                    "k": k,
                    "variant": name,
                    "tok_s": round(harness.median(tok_s), 1),
                    "vs_plain": round(harness.paired_ratio(tok_s, plain), 3),
                    "vs_serial": round(harness.paired_ratio(tok_s, serial), 3),
                    "hit_rate": None if not la else la["hit_rate"],
                    "exact": all(
                        r["tokens"] == p["tokens"]
                        for r, p in zip(runs[name], runs["plain"], strict=True)
                    ),
                }
            )
    columns = ("k", "variant", "tok_s", "vs_plain", "vs_serial", "hit_rate", "exact")
    title = f"decoupled drafting, gate off, batch {args.batch}, ≤{args.max_tokens} tokens"
    harness.report(args, [(title, rows, columns)], {"rows": rows})


if __name__ == "__main__":
    main()
