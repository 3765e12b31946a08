"""Run checkpoints: atomic, durable, resumable, no pickle.

Layout (``<run>/checkpoints/``)::

    step-000040/
      policy/              HF-format policy (config.json, model.safetensors, tokenizer.json)
      draft/               specrl draft (absent when draft.mode is none)
      rank0.safetensors    optimizer tensors and RNG states of rank 0
      rank0.json           step, optimizer skeletons, RNG, data cursor, engine state of rank 0
      rank1.…              (one pair per data-parallel rank)
    latest                 name of the newest complete step directory

A step directory is built under a temporary name; when every rank has written its files they
are ``fsync``-ed, the directory is renamed into place and ``latest`` replaced atomically (both
renames ``fsync``-ed), so a process killed — or a machine losing power — at any moment leaves
the previous checkpoint intact.  Pruning keeps the ``keep`` highest *step numbers* and never the
one just written.  :func:`resume_point` picks the newest checkpoint that reads back completely
and falls back to an older kept one, with a warning, when the newest is truncated or corrupt;
the first checkpoint the resumed run writes then deletes the unusable newer ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specrl.core import failpoint
from specrl.core.fsio import atomic_write_text, fsync_dir, fsync_tree
from specrl.errors import CheckpointError

LATEST = "latest"
_STEP = re.compile(r"^step-(\d+)$")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(path: Path) -> int | None:
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else None


def step_dirs(run_dir: str | Path) -> list[Path]:
    """The committed step directories, by step number (not by name: ``step-1000000`` sorts
    after ``step-999999``)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0)


def begin(run_dir: str | Path, step: int) -> Path:
    """Rank 0: a fresh temporary directory for this step's checkpoint."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix=f".{step_name(step)}.tmp-"))


def write_rank(tmp: Path, rank: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / f"rank{rank}.safetensors"))
    (tmp / f"rank{rank}.json").write_text(json.dumps(meta) + "\n", encoding="utf-8")


def commit(run_dir: str | Path, tmp: Path, step: int, keep: int) -> Path:
    """Rank 0, after every rank wrote: sync, rename into place, point ``latest`` at it, prune."""
    root = checkpoint_root(run_dir)
    final = root / step_name(step)
    fsync_tree(tmp)
    failpoint.hit("before_commit", step)
    if final.exists():  # a re-save of the same step (a resumed run reaching it again)
        aside = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_text(root / LATEST, final.name + "\n")
    failpoint.hit("after_commit", step)
    prune(run_dir, keep, newest=final)
    return final


def prune(run_dir: str | Path, keep: int, *, newest: Path) -> None:
    """Keep ``newest`` and the ``keep - 1`` highest-numbered step directories below it; delete
    the rest, steps above ``newest`` (abandoned, see below) and leftovers of killed saves."""
    root = checkpoint_root(run_dir)
    mine = step_of(newest) or 0
    # a step above the one just written belongs to a timeline abandoned by resuming from an
    # older checkpoint (the newer one was unusable): it can never be resumed from again
    abandoned = [p for p in step_dirs(run_dir) if (step_of(p) or 0) > mine]
    steps = [p for p in step_dirs(run_dir) if (step_of(p) or 0) < mine]
    for old in [*abandoned, *steps[: max(len(steps) - (max(keep, 1) - 1), 0)]]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in [*root.glob(".step-*.tmp-*"), *root.glob(".step-*.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{LATEST}.*"):
        stale.unlink(missing_ok=True)


def latest(run_dir: str | Path) -> Path | None:
    """The step directory ``latest`` names (None when there is no pointer)."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text(encoding="utf-8", errors="replace").strip()
    if not path.is_dir():
        raise CheckpointError(
            f"{pointer} names '{path.name}', which is missing",
            hint="delete the pointer to start over, or restore the directory",
        )
    return path


def _check_safetensors(f: Path) -> None:
    with safe_open(str(f), framework="pt") as fh:
        for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
            fh.get_slice(name)  # the header's offsets lie inside the file


def validate(path: Path, world: int) -> None:
    """Raise CheckpointError unless every file of checkpoint ``path`` reads back: each rank's
    JSON and safetensors, the policy and draft weights and their configs."""
    files = []
    for rank in range(world):
        st, js = path / f"rank{rank}.safetensors", path / f"rank{rank}.json"
        if not st.is_file() or not js.is_file():
            raise CheckpointError(
                f"checkpoint '{path}' has no state for rank {rank}",
                hint="resume with the same parallel layout the checkpoint was written with",
            )
        try:
            meta = json.loads(js.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"'{js}' is not readable JSON ({exc})") from None
        if not isinstance(meta, dict) or meta.get("step") != step_of(path):
            raise CheckpointError(f"'{js}' does not describe step {step_of(path)}")
        files.append(st)
    for sub, config in (("policy", "config.json"), ("draft", "specrl_draft.json")):
        d = path / sub
        if sub == "draft" and not d.exists():
            continue
        try:
            json.loads((d / config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"'{d / config}' is not readable ({exc})") from None
        files.extend(sorted(d.glob("*.safetensors")))
    for f in files:
        try:
            _check_safetensors(f)
        except Exception as exc:  # safetensors raises its own error types and OSError
            raise CheckpointError(
                f"'{f}' is not a readable safetensors file ({str(exc).splitlines()[0][:120]})"
            ) from None


def resume_point(run_dir: str | Path, world: int) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from and the warnings about newer ones that could not be used.

    Candidates: the step ``latest`` names, then every other kept step directory from the
    highest step down.  The first that :func:`validate` accepts wins; None when there is no
    checkpoint at all.  Every checkpoint unreadable → CheckpointError naming the newest."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST
    named = None
    if pointer.is_file():
        named = pointer.read_text(encoding="utf-8", errors="replace").strip()
    dirs = step_dirs(run_dir)
    ordered = sorted(dirs, key=lambda p: (p.name != named, -(step_of(p) or 0)))
    warnings: list[str] = []
    if named and not (root / named).is_dir():
        warnings.append(f"{pointer} names '{named}', which is missing")
    if not ordered:
        if warnings:
            raise CheckpointError(warnings[0], hint="restore the directory, or start over")
        return None, warnings
    first_error = None
    for cand in ordered:
        try:
            validate(cand, world)
        except CheckpointError as exc:
            first_error = first_error or exc
            warnings.append(f"checkpoint {cand.name} is unusable: {exc.message}")
            continue
        if warnings:
            warnings.append(f"resuming from {cand.name} instead")
        return cand, warnings
    assert first_error is not None
    raise CheckpointError(
        f"no usable checkpoint in '{root}': {first_error.message}",
        hint="start over with --overwrite, or restore the checkpoint files",
    )


def read_rank(path: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    st, js = path / f"rank{rank}.safetensors", path / f"rank{rank}.json"
    if not st.is_file() or not js.is_file():
        raise CheckpointError(
            f"checkpoint '{path}' has no state for rank {rank}",
            hint="resume with the same parallel layout the checkpoint was written with",
        )
    return load_file(str(st)), json.loads(js.read_text(encoding="utf-8"))
