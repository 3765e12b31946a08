"""The run directory: one writer at a time, and never truncated by accident.

* **One writer.**  The trainer (rank 0) holds an advisory lock on ``<run>/.specrl-run.lock``
  (``fcntl.flock`` through the :mod:`filelock` library) from the moment it prepares the run
  directory until its steps end, fail or are abandoned (``RLTrainer.close``).  A second
  ``specrl train`` on the same directory stops at once with a one-line error naming the
  holder's pid and host (recorded in ``.specrl-run.owner.json``).  The kernel drops the lock
  when the holder dies, however it dies, so a killed run never leaves a stale lock behind.
* **No silent truncation.**  A run directory that already holds a run (metric records or
  checkpoints) is only continued with ``--resume`` or started over with ``--overwrite``, which
  deletes exactly what a run writes (``metrics.jsonl``, ``checkpoints/``, the plots) and nothing
  else — a policy or draft kept inside the run directory stays.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from specrl.core.fsio import atomic_write_text, fsync_dir
from specrl.errors import ConfigError, SpecrlError

LOCK_NAME = ".specrl-run.lock"
OWNER_NAME = ".specrl-run.owner.json"
METRICS_NAME = "metrics.jsonl"
RUN_OUTPUTS = ("metrics.jsonl", "curves.png", "compare.png")  # what --overwrite deletes
RUN_DIRS = ("checkpoints",)


class RunDirBusy(SpecrlError):
    """Another process is training into the same run directory."""


class RunDirLock:
    """The advisory one-writer lock of a run directory (module docstring)."""

    def __init__(self, run_dir: str | Path) -> None:
        from filelock import FileLock

        self.run_dir = Path(run_dir)
        self._lock = FileLock(str(self.run_dir / LOCK_NAME), timeout=0)

    def acquire(self) -> RunDirLock:
        from filelock import Timeout

        try:
            self._lock.acquire()
        except Timeout:
            raise RunDirBusy(
                f"run directory '{self.run_dir}' is in use by {self._holder()}",
                hint="wait for that run to finish, stop it, or choose another run.out_dir",
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"cannot lock run directory '{self.run_dir}': {exc.strerror or exc}"
            ) from None
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        atomic_write_text(self.run_dir / OWNER_NAME, json.dumps(owner) + "\n")
        return self

    def _holder(self) -> str:
        try:
            o = json.loads((self.run_dir / OWNER_NAME).read_text(encoding="utf-8"))
            return f"pid {o['pid']} on host {o['host']} (since {o['started']})"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process (its owner record is unreadable)"

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def release(self) -> None:
        if self._lock.is_locked:
            (self.run_dir / OWNER_NAME).unlink(missing_ok=True)
            self._lock.release()


def existing_run(run_dir: str | Path) -> str | None:
    """What a previous run left in ``run_dir`` (for the refusal message), or None."""
    from specrl.train.metrics import read_metrics

    d = Path(run_dir)
    parts = []
    if (d / METRICS_NAME).is_file():
        n = len(read_metrics(d / METRICS_NAME))
        if n:
            parts.append(f"{n} metric records")
    steps = sorted((d / "checkpoints").glob("step-*")) if (d / "checkpoints").is_dir() else []
    if steps:
        parts.append(f"checkpoints up to {steps[-1].name}")
    return ", ".join(parts) or None


def open_run_dir(
    run_dir: str | Path, *, resume: bool, overwrite: bool, source: str = "recipe"
) -> RunDirLock:
    """Rank 0: create and lock the run directory; refuse to start a fresh run over an existing
    one unless ``overwrite`` (which then deletes the previous run's outputs).  Returns the held
    lock (the caller releases it when the run ends)."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other", hint="pass one of them")
    d = Path(run_dir)
    if os.path.lexists(d) and not d.is_dir():
        raise ConfigError(
            f"{source}: run directory '{d}' is not a directory",
            hint="set run.out_dir (or run.name) to a directory path",
        )
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{source}: cannot create run directory '{d}': {exc.strerror or exc}",
            hint="set run.out_dir to a writable location",
        ) from None
    lock = RunDirLock(d).acquire()
    try:
        previous = None if resume else existing_run(d)
        if previous is not None:
            if not overwrite:
                raise ConfigError(
                    f"run directory '{d}' already holds a run ({previous})",
                    hint="continue it with --resume, or start over with --overwrite "
                    "(deletes its metrics and checkpoints)",
                )
            for name in RUN_OUTPUTS:
                (d / name).unlink(missing_ok=True)
            for name in RUN_DIRS:
                shutil.rmtree(d / name, ignore_errors=True)
            fsync_dir(d)
    except BaseException:
        lock.release()
        raise
    return lock
