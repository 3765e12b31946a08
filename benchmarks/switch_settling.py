"""How long decode steps take to settle after the engine switches between plain and speculative.

The speculation gate (``specrl.rollout.gating``) times decode steps to fit its cost model, and
leaves out the first ``SETTLE_STEPS[kind]`` steps of a run of one kind after a switch.  This
script measures what those steps cost: a best-of-N engine runs a fixed schedule of cycles, each
``--spec`` speculative steps (one arm, ``--proposer``/``--k``) then ``--plain`` plain steps, and
reports the median step time at every position of the cycle next to a plain engine's median step
on the same prompts.  One torch thread, thread CPU time.

    python -m benchmarks.switch_settling --target runs/toy/target --draft runs/toy/draft --markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.rollout import prompt_set
from specrl.config.loader import atomic_write_text
from specrl.models.checkpoint import load_model
from specrl.models.tokenizer import TextCodec
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig
from specrl.rollout.gating import SETTLE_STEPS, Arm


def timed_steps(engine: RolloutEngine, planned: list[int | None], log: list) -> None:
    """Append (cycle position, thread seconds) of every decode step of ``engine`` to ``log``:
    the schedule puts the step's position in ``planned[0]`` (steps that only prefill plan
    nothing and are left out)."""
    step = engine.step

    def timed() -> list:
        planned[0] = None
        t0 = time.thread_time()
        out = step()
        seconds = time.thread_time() - t0
        if planned[0] is not None:
            log.append((planned[0], seconds))
        return out

    engine.step = timed  # type: ignore[method-assign]


def run(engine: RolloutEngine, prompts: list[list[int]], seed: int, greedy: bool) -> None:
    temperature = 0.0 if greedy else 1.0
    reqs = [
        Request(p, SamplingParams(64, temperature, seed=seed * 1000 + i))
        for i, p in enumerate(prompts)
    ]
    engine.generate(reqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("runs/toy/target"))
    ap.add_argument("--draft", type=Path, default=Path("runs/toy/draft"))
    ap.add_argument("--proposer", choices=("eagle3", "ngram"), default="eagle3")
    ap.add_argument("--k", type=int, default=2, help="draft length of the speculative steps")
    ap.add_argument("--spec", type=int, default=40, help="speculative steps per cycle")
    ap.add_argument("--plain", type=int, default=8, help="plain steps per cycle")
    ap.add_argument("--rounds", type=int, default=12, help="rounds of 8 prompts")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/switch_settling.json"))
    args = ap.parse_args()
    for p, what in ((args.target, "config.json"), (args.draft, "specrl_draft.json")):
        if not (p / what).is_file():
            ap.error(f"{p} has no {what}: make the toy pair first (docs/benchmarks.md)")
    if args.spec < 1 or args.plain < 1 or args.k < 1:
        ap.error("--spec, --plain and --k must be ≥ 1")
    torch.set_num_threads(1)
    model = load_model(args.target).eval()
    codec = TextCodec.from_checkpoint(args.target, model.config)
    spec = SpecConfig(
        ("eagle3", "ngram"), max_k=args.k, proposer_options={"eagle3": {"path": str(args.draft)}}
    )
    best = RolloutEngine(
        model, codec=codec, max_batch_size=1, spec=spec, seed=0, clock=time.thread_time
    )
    plain = RolloutEngine(model, codec=codec, max_batch_size=1, seed=0, clock=time.thread_time)
    cycle = args.spec + args.plain
    arm = Arm(args.proposer, args.k)
    counter = [0]
    planned: list[int | None] = [None]

    def schedule(batch_size: int, backlog=None, remaining=None) -> list[Arm] | None:
        pos = planned[0] = counter[0] % cycle
        counter[0] += 1
        return [arm] * batch_size if pos < args.spec else None

    best.controller.plan = schedule  # type: ignore[method-assign]
    best_steps: list[tuple[int, float]] = []
    timed_steps(best, planned, best_steps)
    plain_marked: list[int | None] = [None]

    def plain_schedule(batch_size: int, backlog=None, remaining=None) -> None:
        plain_marked[0] = 0  # a decode step (the plain engine plans every one plain)

    plain.controller.plan = plain_schedule  # type: ignore[method-assign]
    plain_log: list[tuple[int, float]] = []
    timed_steps(plain, plain_marked, plain_log)
    for w in range(2):  # warm-up
        prompts = prompt_set(codec, 8, 10_000 + w)
        run(best, prompts, w, args.greedy)
        run(plain, prompts, w, args.greedy)
    best_steps.clear()
    plain_log.clear()
    for r in range(args.rounds):
        prompts = prompt_set(codec, 8, 1 + r)
        run(best, prompts, r + 1, args.greedy)
        run(plain, prompts, r + 1, args.greedy)
    by_position: dict[int, list[float]] = {}
    for pos, seconds in best_steps:
        by_position.setdefault(pos, []).append(seconds)
    plain_steps = [seconds for _, seconds in plain_log]  # its decode steps, as the other's
    steady_plain = statistics.median(plain_steps)
    rows = []
    for pos in sorted(by_position):
        xs = by_position[pos]
        kind = "speculative" if pos < args.spec else "plain"
        run_pos = pos if pos < args.spec else pos - args.spec
        rows.append(
            {
                "kind": kind,
                "step_of_run": run_pos + 1,
                "median_us": round(statistics.median(xs) * 1e6, 1),
                "samples": len(xs),
                "vs_plain_engine": round(statistics.median(xs) / steady_plain, 3),
                "timed_by_gate": run_pos + 1 > SETTLE_STEPS[kind == "speculative"],
            }
        )
    print(f"plain engine: median step {steady_plain * 1e6:.1f} us over {len(plain_steps)} steps")
    for r in rows:
        print(json.dumps(r))
    if args.markdown:
        print("| kind | step of run | median µs | vs plain engine | timed by the gate |")
        print("| --- | ---: | ---: | ---: | --- |")
        spec_rows = [r for r in rows if r["kind"] == "speculative"]

        def line(r: dict) -> None:
            print(
                f"| {r['kind']} | {r['step_of_run']} | {r['median_us']} | "
                f"{r['vs_plain_engine']} | {'yes' if r['timed_by_gate'] else 'no'} |"
            )

        for r in spec_rows[:3]:
            line(r)
        if len(spec_rows) > 3:  # the steady speculative steps, one row
            med = statistics.median(r["median_us"] for r in spec_rows[3:])
            print(
                f"| speculative | 4–{len(spec_rows)} (median) | {med:.1f} | "
                f"{med / (steady_plain * 1e6):.3f} | yes |"
            )
        for r in rows[len(spec_rows) :]:
            line(r)
    meta = {
        "command": " ".join(["python", *sys.argv]),
        "target": str(args.target),
        "draft": str(args.draft),
        "arm": str(arm),
        "cycle": {"speculative": args.spec, "plain": args.plain},
        "plain_engine_median_us": round(steady_plain * 1e6, 1),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
