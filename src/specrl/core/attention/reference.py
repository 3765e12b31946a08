"""Dense reference attention: the definition every fast path is tested against.

Materializes the full [H, T, T(+K·T)] score matrix, so it is for tests and tiny inputs only.
Works in any dtype (float64 for exactness tests) and returns the log-sum-exp of every row.

Mask (the draft's TTT attention, docs/draft.md): a query at packed index i attends to
- main keys p of the same sequence with offset(p) ≤ offset(i) (causal; optionally within a
  sliding window of ``window`` positions), and
- branch keys ``branch_k[j, i]`` for every branch step j (its own speculative chain: the same index
  i only),
with one softmax over both parts.
"""

from __future__ import annotations

import math

import torch

from specrl.core.attention.layout import PackedLayout


def expand_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[..., Hkv, D] → [..., Hq, D] by repeating each kv head for its query-head group (GQA)."""
    hkv = x.shape[-2]
    if hkv == num_q_heads:
        return x
    return x.repeat_interleave(num_q_heads // hkv, dim=-2)


def main_mask(layout: PackedLayout, window: int | None = None) -> torch.Tensor:
    """[T, T] bool: packed causal mask (same sequence, key not after query)."""
    seq = layout.seq_ids
    off = layout.token_offsets
    mask = (seq[:, None] == seq[None, :]) & (off[None, :] <= off[:, None])
    if window is not None:
        mask &= (off[:, None] - off[None, :]) < window
    return mask


def dense_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    layout: PackedLayout,
    *,
    branch_k: torch.Tensor | None = None,  # [J, T, Hkv, D]
    branch_v: torch.Tensor | None = None,  # [J, T, Hkv, D]
    scale: float | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out`` [T, Hq, D] and ``lse`` [T, Hq] (natural log)."""
    t, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    keys = expand_kv(k, hq)
    vals = expand_kv(v, hq)
    scores = torch.einsum("thd,shd->hts", q, keys) * scale  # [Hq, T, T]
    mask = main_mask(layout, window)
    scores = scores.masked_fill(~mask, float("-inf"))
    if branch_k is not None and branch_k.shape[0] > 0:
        assert branch_v is not None
        bk = expand_kv(branch_k, hq)  # [J, T, Hq, D]
        bv = expand_kv(branch_v, hq)
        b_scores = torch.einsum("thd,jthd->htj", q, bk) * scale  # [Hq, T, J]
        scores = torch.cat([scores, b_scores], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, T]
    probs = torch.exp(scores - lse[..., None].masked_fill(torch.isinf(lse)[..., None], 0.0))
    probs = probs.masked_fill(torch.isinf(lse)[..., None], 0.0)
    out = torch.einsum("hts,shd->thd", probs[..., :t], vals)
    if branch_k is not None and branch_k.shape[0] > 0:
        out = out + torch.einsum("htj,jthd->thd", probs[..., t:], bv)
    return out, lse.transpose(0, 1)
