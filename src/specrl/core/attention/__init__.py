"""One attention entry point for every caller (target layers, draft TTT, rollout decoding).

``attention(q, k, v, layout, ...)`` takes packed tokens ([T, H, D]) and a :class:`PackedLayout`;
optional parts select the path:

- ``cache``: cached decoding/verification against a slot KV cache;
- ``backend``: ``"sdpa"`` (default; torch SDPA on a right-padded batch), ``"flex"``
  (flex_attention), ``"reference"`` (dense, tests only);
- ``cp``: a :class:`CPContext` of size > 1 routes to zigzag ring attention over the group
  (``layout`` is then the rank's ``ZigzagPlan.local``).

GQA is handled here: q has ``Hq`` heads, k/v ``Hkv`` heads with ``Hq % Hkv == 0``.

Context parallelism and the draft's TTT branch attention live in :mod:`.zigzag` (sharding),
:mod:`.blocks` (block kernels), :mod:`.merge`, :mod:`.ring` and :mod:`.ttt` (sessions).
"""

from __future__ import annotations

from typing import Literal

import torch

from specrl.core.attention.blocks import KERNELS, BlockKernel, get_kernel
from specrl.core.attention.kernels import cached_attention, flex_packed, sdpa_packed
from specrl.core.attention.layout import CacheView, PackedLayout
from specrl.core.attention.merge import merge
from specrl.core.attention.reference import dense_attention
from specrl.core.attention.ttt import (
    MODES,
    CPContext,
    TTTSession,
    allgather_attention,
    ring_attention,
    ttt_session,
)
from specrl.core.attention.zigzag import ZigzagPlan, shift_within_sequences, shifted_steps

Backend = Literal["sdpa", "flex", "reference"]
BACKENDS: tuple[str, ...] = ("sdpa", "flex", "reference")

__all__ = [
    "BACKENDS",
    "KERNELS",
    "MODES",
    "BlockKernel",
    "CPContext",
    "CacheView",
    "PackedLayout",
    "TTTSession",
    "ZigzagPlan",
    "allgather_attention",
    "attention",
    "dense_attention",
    "get_kernel",
    "merge",
    "ring_attention",
    "shift_within_sequences",
    "shifted_steps",
    "ttt_session",
]


def attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    layout: PackedLayout,
    *,
    cache: CacheView | None = None,
    backend: Backend = "sdpa",
    scale: float | None = None,
    window: int | None = None,
    cp: CPContext | None = None,
) -> torch.Tensor:
    """Causal attention of packed sequences; returns [T, Hq, D]."""
    if cp is not None and cp.size > 1:
        if cache is not None or window is not None:
            raise ValueError("context-parallel attention supports neither a KV cache nor a window")
        return ring_attention(
            q, k, v, layout, cp, kernel="flex" if backend == "flex" else "torch", scale=scale
        )
    if cache is not None:
        return cached_attention(q, k, v, layout, cache, scale=scale, window=window)
    if backend == "sdpa":
        return sdpa_packed(q, k, v, layout, scale=scale, window=window)
    if backend == "flex":
        return flex_packed(q, k, v, layout, scale=scale, window=window)[0]
    if backend == "reference":
        return dense_attention(q, k, v, layout, scale=scale, window=window)[0]
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
