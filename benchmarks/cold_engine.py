"""A cold engine is not a slow engine: best-of-N on a fresh engine vs plain, as a new user runs it.

Issue 29's check.  The toy pair (``toy-small`` target, its EAGLE-3 draft), 64 greedy addition
prompts, at most 64 tokens each, batch sizes 1 / 8 / 64.  Every measured run builds **fresh**
engines — plain, best-of-N (``eagle3`` + ``ngram``, the recipe's default ``max_k``, the learned
gate), and a second plain one whose ratio to the first is the noise floor of the run — gives each
one short warm-up call (2 other prompts, 8 tokens), then times the 64 prompts.  Variants are
interleaved in a rotated order per repeat; ratios are medians of per-repeat ratios.

The gate starts off on a fresh engine and speculates only once its own measurements say it pays
(:mod:`specrl.rollout.gating`), so the target is best-of-N ≥ 0.95× plain at every batch size.

    python benchmarks/cold_engine.py --target runs/toy/target --draft runs/toy/draft
    python benchmarks/cold_engine.py --threads 2 --clock wall   # the issue's setting

Writes ``benchmarks/results/cold_engine.json``.
"""

from __future__ import annotations

import random
from pathlib import Path

from specrl.models.checkpoint import load_model
from specrl.models.tokenizer import TextCodec
from specrl.rl.tasks import AdditionTask
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig

try:
    from benchmarks import harness
except ModuleNotFoundError:  # run as a file (python benchmarks/cold_engine.py)
    import harness

VARIANTS = ("plain", "best-of-N", "plain again")
COLUMNS = ("batch", "variant", "tok_s", "vs_plain", "ratio_runs", "spec_step_share", "exact")


def prompts(codec: TextCodec, count: int, seed: int) -> list[list[int]]:
    problems = AdditionTask().sample(random.Random(seed), count)
    return [codec.encode_prompt(p.prompt) for p in problems]


def main() -> None:
    ap = harness.parser(__doc__, "cold_engine", repeats=3)
    ap.add_argument("--target", type=Path, default=Path("runs/toy/target"))
    ap.add_argument("--draft", type=Path, default=Path("runs/toy/draft"))
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    clock = harness.configure(ap, args)
    for path, what in ((args.target, "config.json"), (args.draft, "specrl_draft.json")):
        if not (path / what).exists():
            ap.error(f"{path} has no {what}: make the toy pair first (see docs/benchmarks.md)")
    model = load_model(args.target)
    codec = TextCodec.from_checkpoint(args.target, model.config)
    spec = SpecConfig(
        ["eagle3", "ngram"], proposer_options={"eagle3": {"path": str(args.draft)}}
    )  # the recipe's defaults otherwise: max_k 4, the learned gate
    batches = [1, 8] if args.quick else [int(b) for b in args.batches.split(",")]
    repeats = 1 if args.quick else args.repeats
    work = prompts(codec, args.prompts, seed=1)
    warm = [Request(p, SamplingParams(8, 0.0)) for p in prompts(codec, 2, seed=2)]
    rows, records = [], {}
    for batch in batches:

        def run(name: str, rep: int, batch: int = batch) -> dict:
            engine = RolloutEngine(
                model, codec=codec, max_batch_size=batch, clock=clock, seed=rep,
                spec=spec if name == "best-of-N" else None,
            )  # fmt: skip
            engine.generate(warm)  # one short warm-up call, as a user's first request
            reqs = [Request(p, SamplingParams(args.max_tokens, 0.0)) for p in work]
            seconds, out = harness.timed(clock, lambda: engine.generate(reqs))
            steps = engine.stats()["gating"]
            return {
                "tok_s": out.stats["tokens"] / seconds,
                "tokens": [r.tokens for r in out],
                "spec_steps": steps["spec_steps"],
                "plain_steps": steps["plain_steps"],
                "decode_forwards": out.stats["decode_forwards"],
            }

        runs = harness.interleave(VARIANTS, repeats, run, warmup=0)
        records[batch] = runs
        plain = [r["tok_s"] for r in runs["plain"]]
        for name in VARIANTS:
            tok_s = [r["tok_s"] for r in runs[name]]
            steps = [r["spec_steps"] + r["plain_steps"] for r in runs[name]]
            rows.append(
                {
                    "batch": batch,
                    "variant": name,
                    "tok_s": round(harness.median(tok_s), 1),
                    "vs_plain": round(harness.paired_ratio(tok_s, plain), 3),
                    "ratio_runs": [round(a / b, 3) for a, b in zip(tok_s, plain, strict=True)],
                    "spec_step_share": round(
                        sum(r["spec_steps"] for r in runs[name]) / max(sum(steps), 1), 3
                    ),
                    "exact": all(
                        r["tokens"] == p["tokens"]
                        for r, p in zip(runs[name], runs["plain"], strict=True)
                    ),
                }
            )
    payload = {"rows": rows, "prompts": args.prompts, "max_tokens": args.max_tokens}
    harness.report(args, [("cold engine: best-of-N vs plain", rows, COLUMNS)], payload)


if __name__ == "__main__":
    main()
