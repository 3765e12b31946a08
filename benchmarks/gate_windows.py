"""The gate's cost fits: windows of the last 256 samples against windows bounded by age alone.

The speculation gate compares a plain step time t_p with speculative step times t_s, each from
its own window of timing samples (``specrl.rollout.gating.CostModel``, ``split``).  The kind of
step the gate plays fills its window in a few hundred steps; the other kind is measured only by
probes, so a window of the last 256 samples of it spans the whole ``COST_MAX_AGE``.  On a
machine whose speed drifts, t_p and t_s then come from different stretches of time.  With
windows larger than ``COST_MAX_AGE`` steps can fill (``COST_WINDOW``), age alone bounds both
and both kinds average over the same steps.

Where the gate's decision is close (toy-small at batch 1: speculation loses by 10–20 %), a
drift can keep a gate on for many requests, so one engine's run says little: this script runs
``--trials`` independent trials, each with fresh engines — plain, best-of-N (``eagle3`` and
``ngram``, k ≤ 8) with 256-sample windows, best-of-N with the default windows; eager, or compiled
with ``--compile`` (``RolloutEngine.warmup()`` first) — warmed up with two runs,
then ``--repeats`` runs on the same prompts, interleaved in a rotated order (P = max(B, 8)
addition prompts, ≤ 64 tokens, one torch thread, thread CPU time).  Per trial and variant: the
median tok/s ratio to plain over its repeats and the speculative share of its decode steps;
then, over trials, the median of those ratios and the trials in which a variant speculated in
more than 10 % and 50 % of its steps, and the two best-of-N engines head to head (per repeat).
The JSON keeps per trial the gate's final estimate (best arm, its speedup, the plain step time)
and the arms played.

    python -m benchmarks.gate_windows --target runs/toy/target --draft runs/toy/draft \\
        --batch 1 --mode greedy --trials 8 --repeats 12 --markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.draft_lengths import decode
from benchmarks.rollout import MAX_K, paired_ratio, prompt_set
from specrl.config.loader import atomic_write_text
from specrl.models.checkpoint import load_model
from specrl.models.decoder import Transformer
from specrl.models.tokenizer import TextCodec
from specrl.rollout import RolloutEngine, SpecConfig
from specrl.rollout.gating import COST_WINDOW, PLAIN_PROBE_STEPS, SETTLE_STEPS

SHORT_WINDOW = 256  # the fits' window before COST_WINDOW
VARIANTS = ("plain", f"best-of-N, last {SHORT_WINDOW} samples", "best-of-N, age-bounded")


def variant_names(settle: int | None) -> tuple[str, str, str]:
    """The engines compared: the windows (default), or plain probes' settling (``--settle``)."""
    if settle is None:
        return VARIANTS
    return ("plain", "best-of-N, defaults", f"best-of-N, plain probes settle {settle}")


def engines(
    model: Transformer, codec: TextCodec, draft: Path, batch: int, max_k: int, seed: int,
    compile: bool = False, settle: int | None = None,
) -> dict[str, RolloutEngine]:  # fmt: skip
    def spec(window: int) -> SpecConfig:
        return SpecConfig(
            ("eagle3", "ngram"),
            max_k=max_k,
            proposer_options={"eagle3": {"path": str(draft)}},
            cost_window=window,
        )

    names = variant_names(settle)
    # the windows: 256 samples against age-bounded; or, with settle, the defaults against plain
    # probes that settle `settle` steps
    second = spec(SHORT_WINDOW if settle is None else COST_WINDOW)
    specs = {names[0]: None, names[1]: second, names[2]: spec(COST_WINDOW)}
    built = {
        name: RolloutEngine(
            model,
            codec=codec,
            max_batch_size=batch,
            spec=s,
            seed=seed,
            clock=time.thread_time,
            compile=compile,
        )
        for name, s in specs.items()
    }
    if settle is not None:
        ctrl = built[names[2]].controller
        ctrl.settle_steps[False] = settle
        ctrl.plain_probe_steps = settle + PLAIN_PROBE_STEPS - SETTLE_STEPS[False]
    for engine in built.values():
        engine.warmup()  # compiled: every decode graph now (eager: nothing)
    return built


def trial(
    model: Transformer, codec: TextCodec, draft: Path, batch: int, greedy: bool, repeats: int,
    max_k: int, seed: int, compile: bool = False, settle: int | None = None,
) -> dict[str, dict]:  # fmt: skip
    """One trial: fresh engines (their bandits seeded with ``seed``), warm-up, measured runs."""
    built = engines(model, codec, draft, batch, max_k, seed, compile, settle)
    count, names = max(batch, 8), list(built)
    for w in range(2):
        prompts = prompt_set(codec, count, 10_000 + 100 * seed + w)
        for name in names:
            decode(built[name], prompts, w, greedy)
    steps = {
        name: (e.controller.spec_steps, e.controller.plain_steps)
        for name, e in built.items()
        if e.controller is not None
    }
    tok_s: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        prompts = prompt_set(codec, count, 1000 * seed + rep)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.thread_time()
            tokens = decode(built[name], prompts, rep + 1, greedy)
            tok_s[name].append(tokens / (time.thread_time() - t0))
    out = {}
    for name in names[1:]:
        c = built[name].controller
        spec0, plain0 = steps[name]
        spec, plain = c.spec_steps - spec0, c.plain_steps - plain0
        # the gate's view at the end: its best arm's steady-state speedup over plain decoding
        t_plain = c.plain_seconds(batch)
        best = max(c.arms, key=lambda arm: c.expected_rate(batch, arm))
        speedup = c.expected_rate(batch, best) * t_plain / batch
        out[name] = {
            "vs_plain": round(paired_ratio(tok_s[name], tok_s[names[0]]), 3),
            "spec_share": round(spec / max(1, spec + plain), 3),
            "tok_s_runs": [round(x, 1) for x in tok_s[name]],
            "final_speedup_estimate": round(speedup, 3),
            "final_best_arm": str(best),
            "final_plain_step_us": round(t_plain * 1e6, 1),
            "selections": {a: n for a, n in c.selections.items() if n},
        }
    out[names[0]] = {"tok_s_runs": [round(x, 1) for x in tok_s[names[0]]]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("runs/toy/target"))
    ap.add_argument("--draft", type=Path, default=Path("runs/toy/draft"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--mode", choices=("sampled", "greedy"), default="greedy")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--max-k", type=int, default=MAX_K)
    ap.add_argument("--compile", action="store_true", help="compiled engines (torch.compile)")
    ap.add_argument(
        "--settle",
        type=int,
        help="compare settling instead: both engines age-bounded, the second's plain probes "
        "settle this many steps (default SETTLE_STEPS[plain]) before their two timed ones",
    )
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gate_windows.json"))
    args = ap.parse_args()
    for p, what in ((args.target, "config.json"), (args.draft, "specrl_draft.json")):
        if not (p / what).is_file():
            ap.error(f"{p} has no {what}: make the toy pair first (docs/benchmarks.md)")
    if args.trials < 1 or args.repeats < 1 or args.batch < 1 or args.max_k < 1:
        ap.error("--trials, --repeats, --batch and --max-k must be ≥ 1")
    if args.settle is not None and args.settle < 0:
        ap.error(f"--settle must be ≥ 0 steps, got {args.settle}")
    torch.set_num_threads(1)
    model = load_model(args.target).eval()
    codec = TextCodec.from_checkpoint(args.target, model.config)
    greedy = args.mode == "greedy"
    trials = []
    for t in range(args.trials):
        res = trial(
            model, codec, args.draft, args.batch, greedy, args.repeats, args.max_k, t,
            args.compile, args.settle,
        )  # fmt: skip
        trials.append(res)
        print(
            json.dumps(
                {"trial": t}
                | {
                    n: {k: v for k, v in r.items() if k not in ("tok_s_runs", "selections")}
                    for n, r in res.items()
                }
            )
        )
    summary = []
    names = variant_names(args.settle)
    for name in names[1:]:
        ratios = [tr[name]["vs_plain"] for tr in trials]
        shares = [tr[name]["spec_share"] for tr in trials]
        quart = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        summary.append(
            {
                "variant": name,
                "vs_plain": round(statistics.median(ratios), 3),
                "vs_plain_iqr": [round(quart[0], 3), round(quart[-1], 3)],
                "vs_plain_trials": ratios,
                "spec_share_trials": shares,
                "trials_over_10_percent": sum(s > 0.1 for s in shares),
                "trials_mostly_speculating": sum(s > 0.5 for s in shares),
            }
        )
    # the two best-of-N engines against each other, per repeat (they ran back to back)
    paired = [
        a / b
        for tr in trials
        for a, b in zip(tr[names[2]]["tok_s_runs"], tr[names[1]]["tok_s_runs"], strict=True)
    ]
    quart = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
    head_to_head = {
        "variant": names[2],
        "over": names[1],
        "ratio": round(statistics.median(paired), 3),
        "iqr": [round(quart[0], 3), round(quart[-1], 3)],
        "repeats": len(paired),
    }
    if args.markdown:
        print(f"{args.mode}, batch {args.batch}, {args.trials} trials × {args.repeats} repeats:\n")
        print(
            "| variant | vs plain, median of trials (IQR) | speculative share per trial "
            "| trials speculating > 10 % | > 50 % |"
        )
        print("| --- | --- | --- | ---: | ---: |")
        for s in summary:
            lo, hi = s["vs_plain_iqr"]
            shares = ", ".join(f"{x:.2f}" for x in s["spec_share_trials"])
            print(
                f"| {s['variant']} | {s['vs_plain']} ({lo}–{hi}) | {shares} | "
                f"{s['trials_over_10_percent']} | {s['trials_mostly_speculating']} |"
            )
        print(
            f"\n{names[2]} ÷ {names[1]}, per repeat: {head_to_head['ratio']} "
            f"({head_to_head['iqr'][0]}–{head_to_head['iqr'][1]}, {len(paired)} repeats)"
        )
    meta = {
        "command": " ".join(["python", "-m", "benchmarks.gate_windows", *sys.argv[1:]]),
        "target": str(args.target),
        "draft": str(args.draft),
        "batch": args.batch,
        "mode": args.mode,
        "max_k": args.max_k,
        "compile": args.compile,
        "settle": args.settle,
        "variants": list(names),
        "trials": args.trials,
        "repeats": args.repeats,
        "cost_window": COST_WINDOW,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    payload = {"meta": meta, "summary": summary, "head_to_head": head_to_head, "trials": trials}
    atomic_write_text(args.out, json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
