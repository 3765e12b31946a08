"""Helpers of the Megatron-core backend tests."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch.distributed as dist

from specrl.core.distributed import free_port


@contextlib.contextmanager
def one_process_group(seed: int = 0):
    """A one-rank gloo world with Megatron's parallel state (pp = 1), torn down on exit."""
    from specrl.integrations.megatron import runtime

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        runtime.initialize(1, seed=seed)
        try:
            yield
        finally:
            runtime.destroy()
    finally:
        dist.destroy_process_group()
