"""Co-trained vs frozen vs no draft: three RL runs of the toy task, interleaved step by step.

All three start from the same warm-started target and the same initial draft, with the same
seed (same prompts, same per-sample seeds).  Runs advance one step each in turn inside one
process, so machine noise hits them alike; torch uses one thread (on shared 2-core machines two
OpenMP threads make small ops erratic).

- ``cotrain``: eagle3 + ngram drafters; the draft trains on every policy forward;
- ``frozen``: the same drafters; the draft keeps its initial weights (its embedding, shared with
  the policy, still follows the policy);
- ``none``: no draft, plain decoding (the non-speculative baseline).

Reported (start = mean of the first 10 steps, end = mean of the last 10): reward; τ of the
rollouts (tokens per verification over every drafter the bandit picked, n-gram included); the
draft's own τ (``draft_sim_tau``: simulated τ of the draft against the current policy on the
step's rollouts, from the policy's training forward — the same measurement for cotrain and
frozen, and the one co-training acts on; the τ targets use it); rollout
seconds per step, step seconds, policy-update and draft-update seconds; targets of issue 7:
reward rises; co-trained τ ≥ 95 % of its start and above frozen at the end; rollout time with
cotrain ≤ 0.6× none; step time ≤ 0.75× none; draft update ≤ 10 % of the policy update; and of
issue 31, on the long-tailed task: rollout time with cotrain ≤ 0.85× none (median of the per-step
ratios: both runs decode the same step's prompts back to back).  The tail table says where
speculation ran: the share of RL steps whose rollouts drafted at all, of engine steps with
drafts, and of the wave's tail (engine steps with at most a quarter of the wave's peak batch
live) that drafted.

    python benchmarks/rl_cotrain.py                 # 60 steps each, table + JSON + PNG
    # the long-tailed task, speculation against plain decoding only
    python benchmarks/rl_cotrain.py --recipe recipes/toy/longtail.yaml --modes cotrain,none \
        --runs runs/bench-rl-longtail --out benchmarks/results/rl_cotrain_longtail.json
    python benchmarks/rl_cotrain.py --steps 20      # quicker look
    # a lightly initialised draft (20 offline steps) that co-training has room to improve
    python benchmarks/rl_cotrain.py --out benchmarks/results/rl_cotrain_light.json \
        --set draft.path=runs/toy/draft-light \
        --set draft.init.steps=20 --set draft.lr=1e-3
"""

from __future__ import annotations

from pathlib import Path

from specrl.config import Recipe, load_recipe
from specrl.train.artifacts import ensure_artifacts
from specrl.train.loop import build_trainer
from specrl.train.plots import compare_runs

try:
    from benchmarks import harness
except ModuleNotFoundError:  # run as a file (python benchmarks/rl_cotrain.py)
    import harness

MODES = ("cotrain", "frozen", "none")


def mode_overrides(mode: str, out: Path, steps: int) -> list[str]:
    sets = [
        f"run.out_dir={out / mode}",
        f"train.steps={steps}",
        "checkpoint.every=0",
        "train.eval_every=20",
        f"draft.mode={mode}",
    ]
    if mode == "none":
        sets.append("rollout.speculation=null")
    return sets


def window(recs: list[dict], key: str, head: bool, n: int = 10) -> float | None:
    part = recs[:n] if head else recs[-n:]
    vals = [r[key] for r in part if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def wave_shares(recs: list[dict]) -> dict[str, float | None]:
    """Where a run's rollouts speculated: the share of RL steps with drafts (τ not null), of
    engine steps in their waves that carried drafts, and of the tail's engine steps (at most a
    quarter of the wave's peak live batch) that did; plus the tail's share of engine steps."""
    steps = tail = spec = tail_spec = 0
    for r in recs:
        runs = r.get("live_batch") or []
        peak = max((size for size, _, _ in runs), default=0)
        for size, drafting, repeats in runs:
            steps += repeats
            spec += repeats * (drafting > 0)
            if 4 * size <= peak:
                tail += repeats
                tail_spec += repeats * (drafting > 0)
    return {
        "rl_steps_drafting": sum(r.get("tau") is not None for r in recs) / max(len(recs), 1),
        "engine_steps_drafting": spec / steps if steps else None,
        "tail_share": tail / steps if steps else None,
        "tail_steps_drafting": tail_spec / tail if tail else None,
    }


def draft_flop_share(cfg, ttt_steps: int, draft_vocab: int) -> float:
    """Matmul FLOPs per token of the draft's TTT update over the policy's (forward and backward
    scale alike; attention scores left out — short sequences): fc over the three taps once, then
    K unrolled passes of the draft layer and its lm_head, against L target layers + lm_head."""
    from specrl.profiling.model import Shapes

    s = Shapes.of(cfg)
    draft = 3 * s.H * s.H + ttt_steps * (s.draft_layer_matmul() + s.H * draft_vocab)
    return draft / (s.L * s.matmul_params() + s.H * s.V)


def summary_row(mode: str, r: list[dict]) -> dict:
    return {
        "mode": mode,
        "reward_start": window(r, "reward", True),
        "reward_end": window(r, "reward", False),
        "tau_start": window(r, "tau", True),
        "tau_end": window(r, "tau", False),
        "draft_tau_start": window(r, "draft_sim_tau", True),
        "draft_tau_end": window(r, "draft_sim_tau", False),
        "heldout_acc_end": next(
            (x["heldout_accuracy"] for x in reversed(r) if "heldout_accuracy" in x), None
        ),
        "rollout_s": sum(x["time_rollout"] for x in r) / len(r),
        "step_s": sum(x["time_step"] for x in r) / len(r),
        "policy_update_s": sum(x["time_policy_update"] for x in r) / len(r),
        "draft_update_s": sum(x["time_draft_update"] for x in r) / len(r),
        "rollout_tok_s": sum(x["rollout_tokens"] for x in r) / sum(x["time_rollout"] for x in r),
    }


def targets_met(by: dict[str, dict], recs: dict[str, list[dict]]) -> dict[str, tuple[bool, str]]:
    """Each target that the modes run can decide: ``{target: (met, measured)}``."""
    c, f, n = by["cotrain"], by.get("frozen"), by.get("none")
    out = {
        "reward rises (cotrain)": (
            c["reward_end"] > c["reward_start"],
            f"{c['reward_start']:.3f} → {c['reward_end']:.3f}",
        ),
        "cotrain draft τ end ≥ 0.95 × start": (
            c["draft_tau_end"] >= 0.95 * c["draft_tau_start"],
            f"{c['draft_tau_end']:.3f} vs {0.95 * c['draft_tau_start']:.3f}",
        ),
    }
    if f is not None:
        out["cotrain draft τ end > frozen draft τ end"] = (
            c["draft_tau_end"] > f["draft_tau_end"],
            f"{c['draft_tau_end']:.3f} vs {f['draft_tau_end']:.3f}",
        )
    if n is not None:
        paired = harness.paired_ratio(
            [x["time_rollout"] for x in recs["cotrain"]], [x["time_rollout"] for x in recs["none"]]
        )
        ratio = c["rollout_s"] / n["rollout_s"]
        measured = f"{ratio:.2f}× (per-step median {paired:.2f}×)"
        out["rollout time cotrain ≤ 0.6 × none (issue 7)"] = (ratio <= 0.6, measured)
        out["rollout time cotrain ≤ 0.85 × none (issue 31, long tail)"] = (ratio <= 0.85, measured)
        out["step time cotrain ≤ 0.75 × none"] = (
            c["step_s"] <= 0.75 * n["step_s"],
            f"{c['step_s'] / n['step_s']:.2f}×",
        )
    out["draft update ≤ 10 % of policy update"] = (
        c["draft_update_s"] <= 0.1 * c["policy_update_s"],
        f"{c['draft_update_s'] / c['policy_update_s']:.0%}",
    )
    return out


def _rounded(row: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def main() -> None:
    ap = harness.parser(__doc__, "rl_cotrain", repeats=None, clock=False)
    ap.add_argument("--recipe", default="recipes/toy/cotrain.yaml")
    ap.add_argument("--steps", type=int, default=60, help="RL steps per run (--quick: 10)")
    ap.add_argument("--runs", type=Path, default=Path("runs/bench-rl"), help="run directories")
    ap.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}"
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="key=value")
    args = ap.parse_args()
    harness.configure(ap, args)
    modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
    if "cotrain" not in modes or len(modes) < 2 or any(m not in MODES for m in modes):
        ap.error(f"--modes: cotrain and one or both of frozen, none; got {args.modes!r}")
    if args.quick:
        args.steps = 10
    out = args.runs
    base = load_recipe(args.recipe, Recipe, args.overrides)
    ensure_artifacts(base)
    trainers = {
        m: build_trainer(
            load_recipe(args.recipe, Recipe, [*args.overrides, *mode_overrides(m, out, args.steps)])
        )
        for m in modes
    }
    gens = {m: t.steps() for m, t in trainers.items()}
    recs: dict[str, list[dict]] = {m: [] for m in modes}
    for step in range(args.steps):
        for m in modes:
            recs[m].append(next(gens[m]))
        line = "  ".join(
            f"{m}: r={recs[m][-1]['reward']:.2f} τ={recs[m][-1]['tau'] or 1:.2f} "
            f"{recs[m][-1]['time_rollout']:.1f}s"
            for m in modes
        )
        print(f"step {step + 1:3d}  {line}", flush=True)
    for g in gens.values():  # finish the generators (final checkpoint, plots)
        for _ in g:
            pass
    rows = [summary_row(m, recs[m]) for m in modes]
    by = {row["mode"]: row for row in rows}
    from specrl.models.presets import preset_config

    d = base.draft
    k, vd = d.ttt_steps, trainers["cotrain"].draft.config.draft_vocab_size
    shares = {"toy (this run)": draft_flop_share(trainers["cotrain"].policy.config, k, vd)}
    for name in ("llama-8b", "llama-70b"):
        shares[f"{name}, V_d 32000"] = draft_flop_share(preset_config(name), k, 32000)
    targets = targets_met(by, recs)
    listed = ", ".join(f"{n} {v:.0%}" for n, v in shares.items())
    print(f"draft/policy matmul FLOPs per token (analytic, K = {k}): {listed}")
    png = compare_runs({m: out / m for m in modes}, args.out.with_suffix(".png"))
    checks = [{"target": k, "met": ok, "measured": d} for k, (ok, d) in targets.items()]
    title = (
        f"RL on {base.task.name}, {args.steps} steps each, interleaved, {args.threads} thread(s)"
    )
    tail = [{"mode": m, **wave_shares(recs[m])} for m in modes if m != "none"]
    payload = {
        "steps": args.steps,
        "rows": rows,
        "tail": tail,
        "targets": {c["target"]: {"met": c["met"], "measured": c["measured"]} for c in checks},
        "draft_flop_share": shares,
        "plot": str(png),
    }
    rounded = [_rounded(r) for r in rows]
    harness.report(
        args,
        [
            (title, rounded, list(rows[0])),
            ("where speculation ran", [_rounded(r) for r in tail], list(tail[0])),
            ("targets", checks, ["target", "met", "measured"]),
        ],
        payload,
    )


if __name__ == "__main__":
    main()
