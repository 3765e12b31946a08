"""Fused projection weights for inference forwards (the rollout engine's decode steps).

At decode batch sizes a projection is a small GEMM whose cost is mostly the call around it, so
the inference path runs q|k|v as one ``linear`` and gate|up as another (vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear``), with RoPE applied to q and k in one
pass.  The parameters keep their Hugging Face names and shapes (training, checkpoints and
optimizers see nothing); :class:`FusedWeight` holds a row-concatenated copy, built on first use
and rebuilt when any source weight changes.

A change is seen through each weight's identity, storage and autograd **version counter**, which
every in-place tensor op bumps: ``copy_`` (``RolloutEngine.update_weights``,
``load_state_dict``), optimizer steps, ``fill_``.  Writes through ``.data`` bypass the counter;
call :func:`invalidate` on the model after such a write.  Memory: the copy costs as much as the
weights it concatenates (q, k, v, gate and up), only where the inference path runs.
"""

from __future__ import annotations

import torch
from torch import nn


class FusedWeight:
    """A no-grad row concatenation of weights, refreshed when one of them changes."""

    __slots__ = ("_key", "_value")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: torch.Tensor | None = None

    def get(self, *weights: torch.Tensor) -> torch.Tensor:
        key = tuple((id(w), w.data_ptr(), w._version) for w in weights)
        if key != self._key or self._value is None:
            with torch.no_grad():
                self._value = torch.cat([w.detach() for w in weights])
            self._key = key
        return self._value

    def clear(self) -> None:
        self._key = self._value = None


def invalidate(module: nn.Module) -> None:
    """Drop every fused copy under ``module`` (after writes through ``.data``)."""
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, FusedWeight):
                value.clear()
