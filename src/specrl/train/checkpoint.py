"""Run checkpoints: atomic, resumable, no pickle.

Layout (``<run>/checkpoints/``)::

    step-000040/
      policy/              HF-format policy (config.json, model.safetensors, tokenizer.json)
      draft/               specrl draft (absent when draft.mode is none)
      rank0.safetensors    optimizer tensors and RNG states of rank 0
      rank0.json           step, optimizer skeletons, RNG, data cursor, engine state of rank 0
      rank1.…              (one pair per data-parallel rank)
    latest                 name of the newest complete step directory

A step directory is built under a temporary name and renamed when every rank has written its
files; ``latest`` is replaced atomically afterwards.  A process killed at any moment leaves the
previous checkpoint intact, so ``--resume`` always finds a complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specrl.errors import CheckpointError

LATEST = "latest"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def begin(run_dir: str | Path, step: int) -> Path:
    """Rank 0: a fresh temporary directory for this step's checkpoint."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root, prefix=f".{step_name(step)}.tmp-"))


def write_rank(tmp: Path, rank: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / f"rank{rank}.safetensors"))
    (tmp / f"rank{rank}.json").write_text(json.dumps(meta) + "\n", encoding="utf-8")


def commit(run_dir: str | Path, tmp: Path, step: int, keep: int) -> Path:
    """Rank 0, after every rank wrote: rename into place, point ``latest`` at it, prune."""
    root = checkpoint_root(run_dir)
    final = root / step_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd, latest_tmp = tempfile.mkstemp(dir=root, prefix=".latest.")
    with os.fdopen(fd, "w") as fh:
        fh.write(final.name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(latest_tmp, root / LATEST)
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[: max(len(steps) - max(keep, 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step-*.tmp-*"):  # leftovers of killed saves
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest(run_dir: str | Path) -> Path | None:
    root = checkpoint_root(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text(encoding="utf-8").strip()
    if not path.is_dir():
        raise CheckpointError(
            f"{pointer} names '{path.name}', which is missing",
            hint="delete the pointer to start over, or restore the directory",
        )
    return path


def read_rank(path: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    st, js = path / f"rank{rank}.safetensors", path / f"rank{rank}.json"
    if not st.is_file() or not js.is_file():
        raise CheckpointError(
            f"checkpoint '{path}' has no state for rank {rank}",
            hint="resume with the same parallel layout the checkpoint was written with",
        )
    return load_file(str(st)), json.loads(js.read_text(encoding="utf-8"))
