"""``specrl train``: RL with speculative rollouts and online draft co-training (the main job)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from specrl.cli.common import load, progress_bar
from specrl.cli.ui import JsonOpt, SetOpt, emit_json, err, kv_table, out, want_json


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def train_command(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML.")],
    overrides: SetOpt = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue from the run directory's newest usable checkpoint (an unreadable "
            "newest one is skipped with a warning).",
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Start over in a run directory that holds a previous run: deletes its "
            "metrics.jsonl, checkpoints and plots (nothing else).",
        ),
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Warm-start/initialise what is missing, then RL with a co-trained draft.

    Relative paths in the recipe (policy.path, draft.path, run.out_dir, task.path) resolve
    against the current directory, not the recipe's; the resolved run directory (and where a
    warm-started policy or a new draft was written) is printed before training starts.  A run
    directory has one writer at a time (a second train on it stops at once), and one that
    holds a run is only continued with --resume or started over with --overwrite.
    """
    from specrl.train.loop import build_trainer
    from specrl.train.metrics import summarize

    rec = load(recipe, overrides)
    with progress_bar("prepare", 1) as update:

        def prep(phase: str, done: int, total: int, info: str) -> None:
            update(done, total, f"{phase}: {info}")

        trainer = build_trainer(
            rec, source=str(recipe), resume=resume, overwrite=overwrite, progress=prep
        )
    rank0 = trainer.rank == 0
    if rank0:
        err.print(f"[dim]run directory:[/] {trainer.run_dir.resolve()}", soft_wrap=True)
    for what, note in trainer.created.items():
        err.print(f"[dim]{what}:[/] {note}")
    for warning in trainer.warnings if rank0 else ():
        err.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    steps = rec.train.steps
    with progress_bar("train", steps) as update:
        update(trainer.start_step, steps, "")

        def on_step(r: dict[str, Any]) -> None:
            if rank0:
                update(
                    r["step"],
                    steps,
                    f"reward {r['reward']:.2f}  τ {_fmt(r['tau'])}  "
                    f"|Δlogp| {_fmt(r.get('logp_gap_mean'), '.1e')}  "
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
