"""Megatron-core on a machine without CUDA: its few CUDA calls routed to the CPU, in one scope.

Megatron-core's local (non-Transformer-Engine) layers run on CPU once a handful of calls that
assume a GPU are answered there:

- ``torch.cuda.current_device()`` — where the rotary tables and the global memory buffer go and
  where p2p shape tensors are made → the CPU device;
- the CUDA RNG tracker (``tensor_parallel.random``: ``_get_cuda_rng_state`` /
  ``_set_cuda_rng_state``, ``torch.cuda.get_rng_state`` / ``manual_seed`` in
  ``CudaRNGStatesTracker.add`` and ``model_parallel_cuda_manual_seed``) → the CPU generator;
- ``torch.zeros(..., device="cuda")`` (the schedules' token counters) → the CPU;
- ``torch.cuda.synchronize()`` after batched p2p → nothing to wait for.

:func:`cpu_compat` is the one place that does this.  Rather than patching ``torch`` itself,
which every other part of the process shares (the embedded engine, other modules' tests), it
swaps the ``torch`` name inside Megatron's own modules for a thin proxy that answers those calls
on the CPU and forwards everything else to the real ``torch``.  The swap is made on entry, only
when CUDA is absent, and undone on exit (re-entrant: the outermost exit restores).  Where CUDA
exists the context manager does nothing at all.

Use it around every call into Megatron code — building the model, ``forward_backward_func``,
checkpoint conversion of a live model::

    with cpu_compat():
        model = GPTModel(config, spec, ...)
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

_CPU = torch.device("cpu")
_lock = threading.RLock()
_depth = 0
_swapped: list[tuple[types.ModuleType, str, Any]] = []  # (module, name, original)
# tensor factories whose ``device=`` keyword Megatron sets to "cuda"
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand")
# modules whose RNG helpers are replaced (imported before the swap)
_RNG_MODULE = "megatron.core.tensor_parallel.random"


def _cpu_device(device: Any) -> Any:
    """``device`` with any CUDA device replaced by the CPU."""
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if torch.device(device).type == "cuda":
        return _CPU
    return device


class _CudaOnCpu:
    """``torch.cuda`` as Megatron sees it inside :func:`cpu_compat` (everything not named here
    is the real ``torch.cuda``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """CPU collectives complete before they return: nothing to wait for."""

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def is_available() -> bool:
        return False


class _TorchOnCpu:
    """``torch`` as Megatron sees it inside :func:`cpu_compat`: ``cuda`` is :class:`_CudaOnCpu`
    and the tensor factories map ``device="cuda"`` to the CPU; the rest is the real ``torch``."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _factory(fn: Any) -> Any:
    def make(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    make.__name__ = fn.__name__
    return make


for _name in _FACTORIES:
    setattr(_TorchOnCpu, _name, staticmethod(_factory(getattr(torch, _name))))

_TORCH_ON_CPU = _TorchOnCpu()


def _get_rng_state_cpu(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_rng_state_cpu(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def active() -> bool:
    """Whether the CPU routing is in force right now (inside :func:`cpu_compat`, no CUDA)."""
    return _depth > 0 and bool(_swapped)


def needed() -> bool:
    """Whether this process needs the routing: Megatron code on a machine without CUDA."""
    return not torch.cuda.is_available()


def _swap() -> None:
    __import__(_RNG_MODULE)  # Megatron's modules that matter are loaded before the swap
    for name, module in list(sys.modules.items()):
        if not (name == "megatron" or name.startswith("megatron.")) or module is None:
            continue
        namespace = vars(module)
        if namespace.get("torch") is torch:
            _swapped.append((module, "torch", torch))
            module.torch = _TORCH_ON_CPU
    rng = sys.modules[_RNG_MODULE]
    for attr, replacement in (
        ("_get_cuda_rng_state", _get_rng_state_cpu),
        ("_set_cuda_rng_state", _set_rng_state_cpu),
    ):
        _swapped.append((rng, attr, getattr(rng, attr)))
        setattr(rng, attr, replacement)


def _restore() -> None:
    while _swapped:
        module, attr, original = _swapped.pop()
        setattr(module, attr, original)


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Megatron's CUDA calls answered on the CPU for the duration (module docstring); a no-op
    where CUDA is available.  Re-entrant and restored on exit, also when the body raises."""
    global _depth
    with _lock:
        if _depth == 0 and needed():
            _swap()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _restore()
