"""Process-level runtime helpers: device choice, seeding, determinism, thread count, and the
deterministic clock."""

from __future__ import annotations

import os
import random

import torch


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from specrl.errors import ConfigError

        raise ConfigError(
            "run.device is 'cuda' but CUDA is not available", hint="--set run.device=cpu"
        )
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def set_determinism(enabled: bool, threads: int = 0) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


class UnitClock:
    """Deterministic engine clock (``run.deterministic``): every reading advances one unit (one
    forward = one unit), so timing-driven decisions such as the speculation gate's repeat
    exactly when a killed run is resumed."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        self.t += 1.0
        return self.t

    def state(self) -> float:
        return self.t
