"""Packed-attention kernels in plain torch (CPU and GPU) and flex_attention.

- :func:`sdpa_packed`: scatter the packed tokens into a right-padded [B, H, M, D] batch and run
  ``scaled_dot_product_attention`` with ``is_causal`` (right padding never leaks into real rows
  under a causal mask).  Autograd flows through SDPA.  Index maps are built on device from
  ``cu_seqlens``; the only host value used is ``layout.max_seqlen``.
- :func:`flex_packed`: ``flex_attention`` with a document-causal block mask; compiled on CUDA,
  eager (a materializing reference) on CPU.
- :func:`cached_attention`: decode/verify against a slot KV cache (writes the new K/V first).
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

import torch
import torch.nn.functional as F

from specrl.core.attention.layout import CacheView, PackedLayout


def _pad_index(layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    return layout.seq_ids, layout.token_offsets


def sdpa_packed(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    layout: PackedLayout,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    t, hq, d = q.shape
    hkv = k.shape[1]
    b, m = layout.num_seqs, layout.max_seqlen
    if t == 0:
        return q.new_zeros(q.shape)
    if b == 1:
        qp, kp, vp = (x.unsqueeze(0) for x in (q, k, v))
    else:
        seq, off = _pad_index(layout)
        qp = q.new_zeros(b, m, hq, d).index_put((seq, off), q)
        kp = k.new_zeros(b, m, hkv, d).index_put((seq, off), k)
        vp = v.new_zeros(b, m, hkv, d).index_put((seq, off), v)
    qp, kp, vp = (x.transpose(1, 2) for x in (qp, kp, vp))  # [B, H, M, D]
    if window is not None and window < m:
        pos = torch.arange(qp.shape[2], device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
        out = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=hq != hkv
        )
    else:
        out = F.scaled_dot_product_attention(
            qp, kp, vp, is_causal=True, scale=scale, enable_gqa=hq != hkv
        )
    out = out.transpose(1, 2)  # [B, M, Hq, D]
    if b == 1:
        return out[0]
    seq, off = _pad_index(layout)
    return out[seq, off]


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PackedLayout,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flex_attention with a packed document-causal mask. Returns (out [T,Hq,D], lse [T,Hq])."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    t, hq, _ = q.shape
    seq = layout.seq_ids
    off = layout.token_offsets

    def mask_mod(b, h, qi, ki):
        ok = (seq[qi] == seq[ki]) & (off[ki] <= off[qi])
        if window is not None:
            ok = ok & (off[qi] - off[ki] < window)
        return ok

    block = create_block_mask(mask_mod, None, None, t, t, device=q.device)
    args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    gqa = hq != k.shape[1]
    if q.is_cuda:
        out, lse = _compiled_flex()(
            *args, block_mask=block, scale=scale, enable_gqa=gqa, return_lse=True
        )
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, lse = flex_attention(
                *args, block_mask=block, scale=scale, enable_gqa=gqa, return_lse=True
            )
    return out[0].transpose(0, 1), lse[0].transpose(0, 1).float()


# (device) → offs[j, l] = l − j for j < _OFFSET_ROWS, l < its width (grown on demand up to
# _OFFSET_COLS: at most 4 MiB): cache_mask slices it instead of building two aranges and their
# difference every forward
_OFFSETS: dict[torch.device, torch.Tensor] = {}
_OFFSET_ROWS, _OFFSET_COLS = 64, 8192


def _offsets(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """[rows, cols] int64 l − j (a view of the table where it fits; computed afresh for long
    prefills and contexts, and inside a compiled graph, which must not read module state that
    changes)."""
    if rows > _OFFSET_ROWS or cols > _OFFSET_COLS or torch.compiler.is_compiling():
        return (
            torch.arange(cols, device=device)[None, :] - torch.arange(rows, device=device)[:, None]
        )
    table = _OFFSETS.get(device)
    if table is None or table.shape[1] < cols:
        width = min(max(cols, 2 * (table.shape[1] if table is not None else 256)), _OFFSET_COLS)
        ar = torch.arange(width, device=device)
        table = _OFFSETS[device] = ar[None, :] - ar[:_OFFSET_ROWS, None]
    return table[:rows, :cols]


def cache_mask(
    layout: PackedLayout,
    prefix_lens: torch.Tensor,
    max_kv_len: int,
    window: int | None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[B, 1, M, L]: new token j of sequence b (position prefix_b + j) sees keys ≤ itself.

    bool (True: attend), or with a float ``dtype`` the additive form (0 / −inf) that SDPA
    otherwise derives from a bool mask on every call: a forward builds it once for all its
    layers."""
    device = prefix_lens.device
    # key l against new token j of sequence b: rel = l − (prefix_b + j)
    rel = _offsets(layout.max_seqlen, max_kv_len, device)[None] - prefix_lens[:, None, None]
    mask = rel <= 0
    if window is not None:
        mask &= rel > -window  # (prefix_b + j) − l < window
    mask = mask[:, None]
    if dtype is None:
        return mask
    if torch.compiler.is_compiling():
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, -math.inf)
    zero, neg_inf = _mask_values(dtype, device)
    return torch.where(mask, zero, neg_inf)


@lru_cache(maxsize=16)
def _mask_values(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0 and −inf as 0-d tensors of ``dtype`` (the additive mask's two values)."""
    return (
        torch.zeros((), dtype=dtype, device=device),
        torch.full((), float("-inf"), dtype=dtype, device=device),
    )


def cache_rows(
    layout: PackedLayout, slots: torch.Tensor, prefix_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, position) [T] of each packed new token's cache row: the same for every layer of
    a forward, which computes them once (:attr:`CacheView.rows`)."""
    if layout.max_seqlen == 1 and layout.num_tokens == layout.num_seqs:  # one token each
        return slots, prefix_lens
    seq = layout.seq_ids
    return slots[seq], prefix_lens[seq] + layout.token_offsets


# The attention a compiled CPU decoding step (one new token each) traces: "grouped"
# (:func:`grouped_decode_attention`) or "sdpa".  Read while tracing: set it before a graph
# compiles (docs/benchmarks.md, "Decisions", has the measurement that chose "grouped").
COMPILED_CPU_ATTENTION = "grouped"


def grouped_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]: one new query per sequence
    k: torch.Tensor,  # [B, Hkv, L, D]
    v: torch.Tensor,  # [B, Hkv, L, D]
    mask: torch.Tensor | None,  # [B, 1, 1, L] bool (True: attend), additive, or None
    scale: float | None = None,
) -> torch.Tensor:
    """Decoding attention against a head-major cache block, written for inductor; [B, Hq, D].

    Same math as ``scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask,
    enable_gqa=True)``.  The query heads are grouped by the KV head they share: the scores are
    one small matmul per (sequence, KV head), and the weighted sum of the values is a plain
    reduction that inductor fuses with the masked softmax into one loop nest.  Inside a compiled
    CPU decoding step this beats SDPA's CPU flash kernel, which pays a fixed cost per (sequence,
    head) block (docs/benchmarks.md, "Decisions"); verification (several new tokens per
    sequence) keeps SDPA, which a grouped form did not beat there.  The scores stay a matmul on
    purpose: written as a reduction, inductor inlines the query's RoPE into the loop over the
    keys and recomputes it for every key (slower than SDPA in the engine).  Eagerly the
    reduction materializes a [B, Hkv, G, L, D] product: call it under ``torch.compile`` only.
    """
    b, hq, d = q.shape
    hkv, kv_len = k.shape[1], k.shape[2]
    qg = q.view(b, hkv, hq // hkv, d)
    s = torch.matmul(qg, k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
    if mask is not None and mask.dtype == torch.bool:  # [B, Hkv, G, L] scores
        s = s.masked_fill(~mask.view(b, 1, 1, kv_len), float("-inf"))
    elif mask is not None:  # additive (0 / −inf)
        s = s + mask.view(b, 1, 1, kv_len)
    p = torch.softmax(s, dim=-1)
    return (p[..., None] * v[:, :, None]).sum(-2).reshape(b, hq, d)


def verify_in_matmuls(batch: int, heads: int, rows: int, kv_len: int) -> bool:
    """Whether eager CPU attention of ``rows`` new queries per sequence runs as
    :func:`verify_attention` rather than SDPA (``benchmarks/studies/verify_attention.py``).

    Above one query per sequence SDPA's CPU flash kernel pays a fixed cost per (sequence, query
    head) block; the two matmuls pay theirs per call and materialize the scores.  So: 2–5 rows
    (verifying up to 4 drafts; at 8 the matmuls lost on some toy shapes), enough blocks — or
    blocks × keys — to outweigh a call, and scores of at most 1 M elements (above, the matmuls
    lost on some shapes in some runs).
    """
    blocks = batch * heads
    return (
        1 < rows <= 5
        and (blocks >= 32 or blocks * kv_len >= 16384)
        and blocks * rows * kv_len <= 1 << 20
    )


def verify_attention(
    q: torch.Tensor,  # [B, M, Hq, D]: a few new queries per sequence
    k: torch.Tensor,  # [B, Hkv, L, D]
    v: torch.Tensor,  # [B, Hkv, L, D]
    mask: torch.Tensor | None,  # [B, 1, M, L] bool (True: attend), additive, or None
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of a few queries per sequence against its cached keys; [B, M, Hq, D].

    Same math as ``scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
    enable_gqa=True).transpose(1, 2)``: the query heads sharing a KV head are stacked with their
    rows so that scores and the weighted sum are one batched matmul each, and the [B, Hq, M, L]
    scores are materialized (bounded by :func:`verify_in_matmuls`).
    """
    b, m, hq, d = q.shape
    hkv, kv_len = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.permute(0, 2, 1, 3).reshape(b, hkv, g * m, d)  # head h = kv head h // g
    s = torch.matmul(qg, k.transpose(-1, -2)).view(b, hkv, g, m, kv_len)
    s = s * (d**-0.5 if scale is None else scale)
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(~mask.view(b, 1, 1, m, kv_len), float("-inf"))
    elif mask is not None:
        s = s + mask.view(b, 1, 1, m, kv_len)
    p = torch.softmax(s, dim=-1).view(b, hkv, g * m, kv_len)
    return torch.matmul(p, v).view(b, hq, m, d).transpose(1, 2)


def cached_attention(
    q: torch.Tensor,  # [T, Hq, D] new tokens, packed by sequence
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    layout: PackedLayout,
    cache: CacheView,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Append the new K/V to their cache slots, then attend over prefix + new tokens.

    The cache is head-major ([slot, Hkv, position, D]): a sequence's keys for one head are one
    contiguous run, the layout attention reads (SDPA's CPU kernel runs faster on it than on a
    position-major cache at batch 8 and more; docs/benchmarks.md, "Decisions").  Inside a
    compiled CPU graph the attention of a decoding step is :func:`grouped_decode_attention`.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    b, m, kv_len = layout.num_seqs, layout.max_seqlen, cache.max_kv_len
    uniform = t == b * m  # every sequence brings m tokens: packed == padded, no scatter
    if cache.rows is not None:  # computed once by the forward for all its layers
        slot_t, pos_t = cache.rows
    else:
        slot_t, pos_t = cache_rows(layout, cache.slots, cache.prefix_lens)
    if not uniform:
        seq, off = _pad_index(layout)
    same = cache.k.dtype == k.dtype  # skip no-op casts: each is a dispatch per layer and step
    # [slot, position, Hkv, D] views of the head-major cache take the [T, Hkv, D] rows as they are
    cache.k.transpose(1, 2).index_put_((slot_t, pos_t), k if same else k.to(cache.k.dtype))
    cache.v.transpose(1, 2).index_put_((slot_t, pos_t), v if same else v.to(cache.v.dtype))
    if cache.slots_are_prefix:
        kp, vp = cache.k[:b, :, :kv_len], cache.v[:b, :, :kv_len]  # views, no copy
    else:
        # index_select copies whole rows (4× faster on CPU than advanced indexing, same values)
        kp = cache.k[:, :, :kv_len].index_select(0, cache.slots)
        vp = cache.v[:, :, :kv_len].index_select(0, cache.slots)
    if kp.dtype != q.dtype:
        kp, vp = kp.to(q.dtype), vp.to(q.dtype)  # [B, Hkv, L, D]
    if uniform:
        qp = q.view(b, m, hq, d)
    else:
        qp = q.new_zeros(b, m, hq, d).index_put((seq, off), q)
    if cache.full_rows and (window is None or window >= kv_len):
        mask = None  # every query sees every cached key: no mask, fastest SDPA path
    else:
        mask = cache.mask
        if mask is None:
            mask = cache_mask(layout, cache.prefix_lens, kv_len, window)
    on_cpu = q.device.type == "cpu"
    compiling = on_cpu and torch.compiler.is_compiling()
    if m == 1 and compiling and COMPILED_CPU_ATTENTION == "grouped":
        out = grouped_decode_attention(qp.view(b, hq, d), kp, vp, mask, scale).view(b, 1, hq, d)
    elif on_cpu and not compiling and verify_in_matmuls(b, hq, m, kv_len):
        out = verify_attention(qp, kp, vp, mask, scale)
    else:
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), kp, vp, attn_mask=mask, scale=scale, enable_gqa=hq != hkv
        ).transpose(1, 2)  # [B, M, Hq, D]
    if uniform:
        return out.reshape(t, hq, d)
    return out[seq, off]
