"""``specrl warm-start``: supervised warm-start of a toy target into an HF-format checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specrl.cli.common import load, progress_bar, write_resolved
from specrl.cli.ui import (
    JsonOpt,
    OverwriteOpt,
    SetOpt,
    emit_json,
    err,
    kv_table,
    out,
    want_json,
)


def warmstart_command(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML (uses run, task, policy.warmstart).")],
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Checkpoint directory (default: policy.path).")
    ] = None,
    overrides: SetOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Train a tiny target from scratch on worked task solutions; write an HF checkpoint."""
    from specrl.core.fsio import check_output
    from specrl.errors import ConfigError
    from specrl.train.warmstart import run_warmstart, task_from_recipe

    rec = load(recipe, overrides)
    dest = out_dir or (Path(rec.policy.path) if rec.policy.path else None)
    if dest is None:
        raise ConfigError(
            f"{recipe}: policy.path is empty", hint="pass --out DIR or set policy.path"
        )
    check_output(
        dest, kind="dir", inputs=[recipe, rec.task.path, rec.run.directory], overwrite=overwrite
    )
    task = task_from_recipe(rec)  # validate data files before any output is written
    write_resolved(rec, rec.run.directory)
    steps = rec.policy.warmstart.steps if rec.policy.warmstart else 0
    with progress_bar("warm-start", steps) as update:

        def report(step: int, total: int, loss: float, acc: float | None) -> None:
            info = f"loss {loss:.3f}" + (f"  acc {acc:.1%}" if acc is not None else "")
            update(step, total, info)

        res = run_warmstart(rec, dest, task=task, progress=report, overwrite=overwrite)
    result = {
        "checkpoint": res.path,
        "params": res.num_params,
        "steps": res.steps,
        "final_loss": round(res.final_loss, 4),
        "heldout_accuracy": res.accuracy,
        "eval_problems": res.eval_size,
        "seconds": round(res.seconds, 1),
    }
    if want_json(json_out):
        emit_json(result)
    else:
        out.print(kv_table("warm-start", result))
        err.print(f"[dim]next:[/] specrl init-draft --target {res.path} --out <draft dir>")
