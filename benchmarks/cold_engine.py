"""A cold engine is not a slow engine: best-of-N on a fresh engine vs plain, as a new user runs it.

Issue 29's check.  The toy pair (``toy-small`` target, its EAGLE-3 draft), 64 greedy addition
prompts, at most 64 tokens each, batch sizes 1 / 8 / 64.  Every measured run builds **fresh**
engines — plain, best-of-N (``eagle3`` + ``ngram``, the recipe's default ``max_k``, the learned
gate), and a second plain one whose ratio to the first is the noise floor of the run — gives each
one short warm-up call (2 other prompts, 8 tokens), then runs the 64 prompts in batches of
``--chunk`` prompts (default: the batch size, at least 8), each batch run to completion by every
engine before the next.  This machine's speed drifts by tens of percent within a second, more
than the margin at stake, so the engines take turns, in an order that changes per turn
(``harness.ordered``), and each turn is timed on its own:

- ``--interleave step`` (default): a turn is one engine step (``RolloutEngine.step``, what
  ``generate`` loops over), so a slow stretch of the machine falls on all three engines within
  a few milliseconds;
- ``--interleave call``: a turn is one ``generate`` call per batch of prompts (per-repeat
  ratios spread about 5× wider: a call at batch 64 lasts a quarter of a second).

Ratios are medians of per-repeat ratios.  The gate starts off on a fresh engine and speculates
only once its own measurements say it pays (:mod:`specrl.rollout.gating`), so the target is
best-of-N ≥ 0.95× plain at every batch size.

    python benchmarks/cold_engine.py --target runs/toy/target --draft runs/toy/draft
    python benchmarks/cold_engine.py --threads 2 --clock wall   # the issue's setting

Writes ``benchmarks/results/cold_engine.json``.
"""

from __future__ import annotations

import random
from functools import partial
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


def fresh_engines_interleaved(
    model, codec, spec, batch, rep, clock, warm, work, chunk, max_tokens, by_step
) -> dict[str, dict]:
    """One repeat: a fresh engine per variant, each warmed by one short call, then the prompts
    in batches of ``chunk``, every batch run by each engine in turns of one step (``by_step``)
    or one call, the order changing per turn, so that the machine's slow and fast stretches
    fall on all variants alike."""

    def fresh(name: str) -> RolloutEngine:
        best_of_n = spec if name == "best-of-N" else None
        return RolloutEngine(
            model, codec=codec, max_batch_size=batch, clock=clock, seed=rep, spec=best_of_n
        )

    engines = {name: fresh(name) for name in VARIANTS}
    for engine in engines.values():
        engine.generate(warm)  # one short warm-up call, as a user's first request
    seconds, tokens = dict.fromkeys(VARIANTS, 0.0), {name: [] for name in VARIANTS}
    turn = rep  # each repeat starts one place further in the turn order
    for i in range(0, len(work), chunk):
        prompts = work[i : i + chunk]
        reqs = {
            name: [Request(p, SamplingParams(max_tokens, 0.0)) for p in prompts]
            for name in VARIANTS
        }
        if not by_step:
            for name in harness.ordered(VARIANTS, turn):
                spent, out = harness.timed(clock, partial(engines[name].generate, reqs[name]))
                seconds[name] += spent
                tokens[name] += [r.tokens for r in out]
            turn += 1
            continue
        done: dict[str, dict[str, list[int]]] = {name: {} for name in VARIANTS}
        ids = {name: e.add_requests(reqs[name]) for name, e in engines.items()}
        while busy := [name for name in VARIANTS if engines[name].has_unfinished()]:
            for name in harness.ordered(busy, turn):
                spent, finished = harness.timed(clock, engines[name].step)
                seconds[name] += spent
                done[name].update((r.request_id, r.tokens) for r in finished)
            turn += 1
        for name in VARIANTS:
            tokens[name] += [done[name][rid] for rid in ids[name]]
    out = {}
    for name, engine in engines.items():
        steps = engine.stats()["gating"]
        out[name] = {
            "tok_s": sum(map(len, tokens[name])) / seconds[name],
            "tokens": tokens[name],
            "spec_steps": steps["spec_steps"],
            "plain_steps": steps["plain_steps"],
        }
    return out


def main() -> None:
    ap = harness.parser(__doc__, "cold_engine", repeats=3)
    ap.add_argument("--target", type=Path, default=Path("runs/toy/target"))
    ap.add_argument("--draft", type=Path, default=Path("runs/toy/draft"))
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--chunk", type=int, default=0, help="prompts per batch (default: the batch size, ≥ 8)"
    )
    ap.add_argument(
        "--interleave",
        choices=("step", "call"),
        default="step",
        help="the engines take turns by step (default) or by generate call",
    )
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
    rows = []
    for batch in batches:
        chunk = args.chunk or max(batch, 8)
        runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        for rep in range(repeats):
            for name, record in fresh_engines_interleaved(
                model,
                codec,
                spec,
                batch,
                rep,
                clock,
                warm,
                work,
                chunk,
                args.max_tokens,
                args.interleave == "step",
            ).items():
                runs[name].append(record)
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
    payload = {
        "rows": rows,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "interleave": args.interleave,
    }
    harness.report(args, [("cold engine: best-of-N vs plain", rows, COLUMNS)], payload)


if __name__ == "__main__":
    main()
