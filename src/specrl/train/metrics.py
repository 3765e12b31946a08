"""Append-only metrics JSONL (one object per line, flushed per record, ``fsync``-ed before each
checkpoint so a checkpoint never counts records a power loss could take back)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from specrl.core.fsio import atomic_write_text


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class MetricsWriter:
    def __init__(self, path: str | Path, *, truncate_after_step: int | None = None) -> None:
        """Open ``path`` for appending; on resume drop records beyond ``truncate_after_step``."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_after_step is not None and self.path.exists():
            keep = [r for r in read_metrics(self.path) if r.get("step", -1) <= truncate_after_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep))
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(_clean(record), sort_keys=False) + "\n")
        self._fh.flush()

    def sync(self) -> None:
        """Make every record written so far durable (before a checkpoint that counts them)."""
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def merge_minibatches(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One update's metrics from its minibatches' (``algo.minibatches`` optimizer steps): times
    summed, ``draft_acc`` averaged per draft position, the rest averaged over the minibatches
    that report them."""
    merged: dict[str, Any] = {}
    for key in recs[0]:
        vals = [r[key] for r in recs if r.get(key) is not None]
        if key.startswith("time_"):
            merged[key] = sum(vals)
        elif key == "draft_acc":
            merged[key] = [sum(c) / len(c) for c in zip(*vals, strict=True)]
        elif vals:
            merged[key] = sum(vals) / len(vals)
    return merged


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete records (a torn last line from a kill is skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """Start/end figures of a run from its metrics.jsonl (for the CLI summary)."""
    recs = read_metrics(Path(run_dir) / "metrics.jsonl")
    if not recs:
        return {}
    head, tail = recs[: max(1, len(recs) // 10)], recs[-max(1, len(recs) // 10) :]

    def mean(rs, k):
        vals = [r[k] for r in rs if r.get(k) is not None]
        return sum(vals) / len(vals) if vals else None

    out = {"steps": recs[-1]["step"]}
    for k in ("reward", "tau", "rollout_tokens_per_s", "draft_sim_tau"):
        out[f"{k}_start"] = mean(head, k)
        out[f"{k}_end"] = mean(tail, k)
    gaps = [r["logp_gap_max"] for r in recs if r.get("logp_gap_max") is not None]
    if gaps:  # the worst train/inference mismatch of the run
        out["logp_gap_max"] = max(gaps)
    evals = [r["heldout_accuracy"] for r in recs if "heldout_accuracy" in r]
    if evals:
        out["heldout_accuracy_last"] = evals[-1]
    out["spec_alarms"] = sum(r.get("spec_alarms", 0) for r in recs)
    out["time_split"] = {
        k: sum(r.get(k, 0.0) for r in recs)
        for k in ("time_rollout", "time_policy_update", "time_draft_update", "time_sync")
    }
    return out
