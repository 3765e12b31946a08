"""Helpers shared by commands: recipe loading with overrides, run directory, progress bars."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from specrl.cli.ui import err


def load(recipe: Path | None, overrides: list[str] | None):
    """Typed recipe from YAML + ``--set`` overrides (CLI > recipe > defaults)."""
    from specrl.config import Recipe, load_recipe

    return load_recipe(recipe, Recipe, overrides or [])


def write_resolved(recipe_obj, run_dir: str | Path, name: str = "recipe.resolved.yaml") -> Path:
    from specrl.config import dump_recipe

    path = Path(run_dir) / name
    dump_recipe(recipe_obj, path)
    return path


@contextmanager
def progress_bar(description: str, total: int):
    """A Rich progress bar on stderr; yields ``update(done, total, info)``.

    The bar appears at the first update, so input errors raised before any work starts print
    as a clean one-line error with no half-drawn bar.
    """
    prog = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,
    )
    state: dict[str, int] = {}

    def update(done: int, total_: int | None = None, info: str = "") -> None:
        if "task" not in state:
            prog.start()
            state["task"] = prog.add_task(description, total=total, info="")
        prog.update(state["task"], completed=done, total=total_ or total, info=info)

    try:
        yield update
    finally:
        if "task" in state:
            prog.stop()
