"""Fused projection weights for inference forwards (the rollout engine's decode steps).

At decode batch sizes a projection is a small GEMM whose cost is mostly the call around it, so
the inference path runs q|k|v as one projection and gate|up as another (vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear``), with RoPE applied to q and k in one
pass, and adds each residual inside the GEMM that feeds it (``addmm``: o_proj, down_proj).  The
parameters keep their Hugging Face names and shapes (training, checkpoints and optimizers see
nothing); :class:`FusedWeight` holds the inference copy, built on first use and rebuilt when any
source weight changes:

- on CPU, the **transposed** row concatenation, [in, out] contiguous, for every projection
  (single ones included): MKL runs ``x @ W`` on it faster at decode sizes than ``x @ Wᵀ`` on
  the parameter's [out, in] layout, and ``mm``/``addmm`` skip ``linear``'s dispatch layers
  (``benchmarks/fused_projections.py``);
- elsewhere, the row concatenation (none for a single weight: the parameter itself) for
  ``F.linear``, whose transposed operand the GPU GEMMs take as it is.

A change is seen through each weight's identity, storage and autograd **version counter**, which
every in-place tensor op bumps: ``copy_`` (``RolloutEngine.update_weights``,
``load_state_dict``), optimizer steps, ``fill_``.  Writes through ``.data`` bypass the counter;
call :func:`invalidate` on the model after such a write.  Memory: on CPU the copies cost as much
as the projection weights of the modules whose inference path runs (on GPU: q, k, v, gate and
up only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The inference copies' layout on CPU: "transposed" ([in, out], for mm/addmm) or "rows" (the
# [out, in] row concatenation for F.linear, as on GPU).  ``benchmarks/fused_projections.py``
# switches it to measure both; a copy built under the other layout is rebuilt on next use.
CPU_LAYOUT = "transposed"


def _transposed(device: torch.device) -> bool:
    return device.type == "cpu" and CPU_LAYOUT == "transposed"


class FusedWeight:
    """A no-grad inference copy of one or more weights [out_i, in], refreshed when one of them
    changes; :meth:`project` applies it."""

    __slots__ = ("_key", "_value")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: torch.Tensor | None = None

    def get(self, *weights: torch.Tensor) -> torch.Tensor:
        """The row concatenation [Σ out_i, in], or on CPU its transpose [in, Σ out_i]
        (contiguous; :data:`CPU_LAYOUT`)."""
        transposed = _transposed(weights[0].device)
        key = (transposed, *((id(w), w.data_ptr(), w._version) for w in weights))
        if key != self._key or self._value is None:
            with torch.no_grad():
                cat = weights[0] if len(weights) == 1 else torch.cat(weights)
                self._value = cat.detach().t().contiguous() if transposed else cat.detach()
            self._key = key
        return self._value

    def project(
        self,
        x: torch.Tensor,  # [T, in]
        *weights: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,  # [T, Σ out_i], added to the projection
    ) -> torch.Tensor:
        """``residual + x @ cat(weights)ᵀ + bias`` (each term optional), one GEMM call."""
        w = self.get(*weights)
        if not self._key[0]:  # the layout get() just built (or found) the copy in
            y = F.linear(x, w, bias)
            return y if residual is None else residual + y
        if residual is not None:
            y = torch.addmm(residual, x, w)
            return y if bias is None else y.add_(bias)
        return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)

    def clear(self) -> None:
        self._key = self._value = None


def invalidate(module: nn.Module) -> None:
    """Drop every fused copy under ``module`` (after writes through ``.data``)."""
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, FusedWeight):
                value.clear()
