"""PNG plots of RL runs from their ``metrics.jsonl`` (matplotlib, headless).

- :func:`plot_run`: reward (with held-out accuracy) and τ over steps for one run;
- :func:`compare_runs`: the same curves for several runs on shared axes (e.g. co-trained vs
  frozen vs no draft), plus rollout time per step.
"""

from __future__ import annotations

from pathlib import Path

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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare_runs(runs: dict[str, str | Path], out: str | Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i, (label, run_dir) in enumerate(runs.items()):
        recs = read_metrics(Path(run_dir) / "metrics.jsonl")
        for ax, key in zip(axes, ("reward", "tau", "time_rollout"), strict=True):
            x, y = _series(recs, key)
            if x:
                ax.plot(x, _smooth(y), color=f"C{i}", label=label)
    for ax, title in zip(
        axes, ("reward", "τ (tokens per target forward)", "rollout seconds per step"), strict=True
    ):
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
