"""Small process-group helpers: free ports, spawned CPU (gloo) worlds, rank-aware printing,
flat gradient all-reduce.

``spawn(fn, world_size, *args)`` starts ``world_size`` fresh processes, initializes a process group
in each (TCP store on 127.0.0.1, gloo by default, collectives time out after ``timeout`` seconds),
runs ``fn(rank, world_size, *args)`` and returns the per-rank results in rank order.  A rank that
raises, dies or runs past ``timeout`` fails the whole call with its traceback; the surviving
processes are terminated, so a deadlocked collective fails a test instead of hanging it.  ``fn``
must be importable by name (a module-level function) because the children are spawned, not forked.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_print(*args: Any, all_ranks: bool = False, **kwargs: Any) -> None:
    """``print`` on rank 0 only (or on every rank, prefixed with ``[rank r]``)."""
    if not (dist.is_available() and dist.is_initialized()):
        print(*args, **kwargs)
        return
    rank = dist.get_rank()
    if all_ranks:
        print(f"[rank {rank}]", *args, **kwargs)
    elif rank == 0:
        print(*args, **kwargs)


def all_reduce_grads(params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    threads: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    threads: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; per-rank results.

    ``threads`` is each rank's torch thread count (default: the CPUs shared evenly, at least 1).
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, timeout, threads, fn, args, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    done = False
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                if dead:
                    raise RuntimeError(
                        f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
        done = True
    finally:
        for p in procs:  # on failure, do not wait for ranks stuck in a collective
            p.join(timeout=10 if done else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
