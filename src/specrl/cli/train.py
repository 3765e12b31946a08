"""``specrl train``: RL with speculative rollouts and online draft co-training (the main job)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from specrl.cli.common import load, progress_bar
from specrl.cli.ui import JsonOpt, SetOpt, emit_json, err, kv_table, out, want_json


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}"


def train_command(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML.")],
    overrides: SetOpt = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the run directory's latest checkpoint.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Warm-start/initialise what is missing, then RL with a co-trained draft."""
    from specrl.train.loop import build_trainer
    from specrl.train.metrics import summarize

    rec = load(recipe, overrides)
    with progress_bar("prepare", 1) as update:

        def prep(phase: str, done: int, total: int, info: str) -> None:
            update(done, total, f"{phase}: {info}")

        trainer = build_trainer(rec, source=str(recipe), resume=resume, progress=prep)
    rank0 = trainer.rank == 0
    for what, note in trainer.created.items():
        err.print(f"[dim]{what}:[/] {note}")
    steps = rec.train.steps
    with progress_bar("train", steps) as update:
        update(trainer.start_step, steps, "")

        def on_step(r: dict[str, Any]) -> None:
            if rank0:
                update(
                    r["step"],
                    steps,
                    f"reward {r['reward']:.2f}  τ {_fmt(r['tau'])}  "
                    f"tok/s {r['rollout_tokens_per_s']:.0f}",
                )

        trainer.run(on_step)
    if not rank0:
        return
    summary = {"run_dir": str(trainer.run_dir), **summarize(trainer.run_dir)}
    if want_json(json_out):
        emit_json(summary)
    else:
        flat = {k: v for k, v in summary.items() if k != "time_split"}
        flat.update({k: round(v, 1) for k, v in summary.get("time_split", {}).items()})
        out.print(kv_table("specrl train", flat))
        err.print(
            f"[dim]metrics:[/] {trainer.run_dir / 'metrics.jsonl'}   "
            f"[dim]plots:[/] {trainer.run_dir / 'curves.png'}"
        )
