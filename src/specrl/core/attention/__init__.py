"""One attention entry point for every caller (target layers, draft TTT, rollout decoding).

``attention(q, k, v, layout, ...)`` takes packed tokens ([T, H, D]) and a :class:`PackedLayout`;
optional parts select the path:

- ``cache``: cached decoding/verification against a slot KV cache;
- ``backend``: ``"sdpa"`` (default; torch SDPA on a right-padded batch), ``"flex"``
  (flex_attention), ``"reference"`` (dense, tests only).

GQA is handled here: q has ``Hq`` heads, k/v ``Hkv`` heads with ``Hq % Hkv == 0``.
"""

from __future__ import annotations

from typing import Literal

import torch

from specrl.core.attention.kernels import cached_attention, flex_packed, sdpa_packed
from specrl.core.attention.layout import CacheView, PackedLayout
from specrl.core.attention.reference import dense_attention

Backend = Literal["sdpa", "flex", "reference"]
BACKENDS: tuple[str, ...] = ("sdpa", "flex", "reference")

__all__ = ["BACKENDS", "CacheView", "PackedLayout", "attention", "dense_attention"]


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
) -> torch.Tensor:
    """Causal attention of packed sequences; returns [T, Hq, D]."""
    if cache is not None:
        return cached_attention(q, k, v, layout, cache, scale=scale, window=window)
    if backend == "sdpa":
        return sdpa_packed(q, k, v, layout, scale=scale, window=window)
    if backend == "flex":
        return flex_packed(q, k, v, layout, scale=scale, window=window)[0]
    if backend == "reference":
        return dense_attention(q, k, v, layout, scale=scale, window=window)[0]
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
