"""PNG plots of RL runs from their ``metrics.jsonl`` (matplotlib, headless).

- :func:`plot_run`: reward (with held-out accuracy) and τ over steps for one run;
- :func:`compare_runs`: the same curves for several runs on shared axes (e.g. co-trained vs
  frozen vs no draft), plus the draft's simulated τ and rollout time per step;
- :func:`compare_siblings`: that comparison for a run and its A/B siblings (run directories
  next to it that started from the same policy on the same task with another ``draft.mode``);
- :func:`plot_waves`: the rollout waves — the live batch over the engine steps of a few RL
  steps' rollouts (where they speculated marked), and the response-length p50 / p90 / max per
  RL step.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from specrl.core.fsio import atomic_save
from specrl.train.metrics import read_metrics


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(recs: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _smooth(ys: list[float], w: int = 5) -> list[float]:
    out = []
    for i in range(len(ys)):
        window = ys[max(0, i - w + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    plt = _plt()
    run_dir = Path(run_dir)
    recs = read_metrics(run_dir / "metrics.jsonl")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x, y = _series(recs, "reward")
    ax1.plot(x, y, alpha=0.3, color="C0")
    ax1.plot(x, _smooth(y), color="C0", label="reward (rollouts)")
    x, y = _series(recs, "heldout_accuracy")
    if x:
        ax1.plot(x, y, "o-", color="C2", label="held-out greedy accuracy")
    ax1.set_xlabel("RL step")
    ax1.set_ylabel("reward / accuracy")
    ax1.legend()
    ax1.grid(alpha=0.3)
    x, y = _series(recs, "tau")
    ax2.plot(x, y, alpha=0.3, color="C1")
    ax2.plot(x, _smooth(y), color="C1", label="τ (rollout engine)")
    x, y = _series(recs, "draft_sim_tau")
    if x:
        ax2.plot(x, _smooth(y), "--", color="C3", label="simulated τ (draft TTT)")
    ax2.set_xlabel("RL step")
    ax2.set_ylabel("tokens per target forward")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    path = Path(out) if out else run_dir / "curves.png"
    try:  # through a temporary file: a reader (or a kill) never sees half a PNG
        atomic_save(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), suffix=".png")
    finally:
        plt.close(fig)
    return path


def compare_runs(runs: dict[str, str | Path], out: str | Path) -> Path:
    plt = _plt()
    panels = {
        "reward": "reward",
        "tau": "rollout τ (tokens per verification)",
        "draft_sim_tau": "draft τ vs the current policy (simulated)",
        "time_rollout": "rollout seconds per step",
    }
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for i, (label, run_dir) in enumerate(runs.items()):
        recs = read_metrics(Path(run_dir) / "metrics.jsonl")
        for ax, key in zip(axes, panels, strict=True):
            x, y = _series(recs, key)
            if x:
                ax.plot(x, _smooth(y), color=f"C{i}", label=label)
    for ax, title in zip(axes, panels.values(), strict=True):
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_save(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), suffix=".png")
    finally:
        plt.close(fig)
    return path


def _ab_key(recipe: dict) -> tuple[str, str]:
    """What A/B runs of draft modes share: the starting policy and the task."""
    policy, task = recipe.get("policy") or {}, recipe.get("task") or {}
    return str(policy.get("path")), yaml.safe_dump(task, sort_keys=True)


def compare_siblings(run_dir: str | Path) -> Path | None:
    """``compare.png`` in ``run_dir`` when sibling runs (same parent directory, same policy path
    and task, another ``draft.mode``) exist: co-trained vs frozen vs none on shared axes.
    None when there is nothing to compare with."""
    run_dir = Path(run_dir).resolve()

    def load(d: Path) -> dict | None:
        f = d / "recipe.resolved.yaml"
        if not f.is_file() or not (d / "metrics.jsonl").is_file():
            return None
        try:
            data = yaml.safe_load(f.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return None
        return data if isinstance(data, dict) else None

    mine = load(run_dir)
    if mine is None:
        return None
    key, mode = _ab_key(mine), (mine.get("draft") or {}).get("mode")
    runs = {f"{mode} ({run_dir.name})": run_dir}
    for d in sorted(run_dir.parent.iterdir()):
        other = load(d) if d.is_dir() and d != run_dir else None
        if other is None or _ab_key(other) != key:
            continue
        other_mode = (other.get("draft") or {}).get("mode")
        if other_mode != mode:
            runs[f"{other_mode} ({d.name})"] = d
    if len(runs) < 2:
        return None
    return compare_runs(runs, run_dir / "compare.png")


def _unfold(runs: list[list[int]]) -> tuple[list[int], list[int]]:
    """Per engine step (live batch, drafting) from ``live_batch``'s run-length encoding."""
    live, drafting = [], []
    for size, spec, repeats in runs:
        live += [size] * repeats
        drafting += [spec] * repeats
    return live, drafting


def plot_waves(run_dir: str | Path, out: str | Path | None = None, waves: int = 4) -> Path | None:
    """``rollout_wave.png``: left, the live batch per engine step of ``waves`` RL steps'
    rollouts spread over the run (solid: sequences decoding, dots: those that carried drafts);
    right, response length p50 / p90 / max per RL step.  None when the metrics have no waves
    (an engine that does not report them)."""
    recs = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r.get("live_batch")]
    if not recs:
        return None
    plt = _plt()
    run_dir = Path(run_dir)
    picks = sorted({round(i * (len(recs) - 1) / max(waves - 1, 1)) for i in range(waves)})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for c, i in enumerate(picks):
        live, drafting = _unfold(recs[i]["live_batch"])
        steps = list(range(len(live)))
        ax1.plot(steps, live, color=f"C{c}", label=f"RL step {recs[i]['step']}: live batch")
        spec = [(x, d) for x, d in zip(steps, drafting, strict=True) if d]
        if spec:
            ax1.plot(*zip(*spec, strict=True), ".", color=f"C{c}", markersize=3)
    ax1.set_xlabel("engine step within the rollout (dots: sequences drafting)")
    ax1.set_ylabel("sequences")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    styles = (("response_len_max", ":"), ("response_len_p90", "--"), ("response_len_p50", "-"))
    for key, style in styles:
        x, y = _series(recs, key)
        ax2.plot(x, y, style, color="C0", label=key.removeprefix("response_len_"))
    ax2.set_xlabel("RL step")
    ax2.set_ylabel("response length (tokens)")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle(f"{run_dir.name}: rollout waves")
    fig.tight_layout()
    path = Path(out) if out else run_dir / "rollout_wave.png"
    try:
        atomic_save(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), suffix=".png")
    finally:
        plt.close(fig)
    return path
