"""Merge partial attention results by log-sum-exp.

Attention of one query over a key set split into parts A and B can be computed part by part:
each part gives ``(out, lse)`` — its own softmax-weighted values and the log-sum-exp of its scores —
and the full result is

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a − lse) · out_a + exp(lse_b − lse) · out_b

A row that saw no key in a part has ``lse = −inf`` and ``out = 0``; the weights are guarded so such
rows never produce NaN (the popular ``sigmoid(lse_b − lse_a)`` form returns NaN when both sides are
−inf).  Merges run in at least float32 (float64 stays float64): the accumulators of a ring are kept
in this precision and only the final output is cast back to the input dtype.
"""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for attention partials: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def merge(
    out_a: torch.Tensor,  # [T, H, D]
    lse_a: torch.Tensor,  # [T, H]
    out_b: torch.Tensor,  # [T, H, D]
    lse_b: torch.Tensor,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial results over disjoint key sets; returns ``(out, lse)`` in acc dtype."""
    dtype = acc_dtype(torch.promote_types(out_a.dtype, out_b.dtype))
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    lse = torch.logaddexp(lse_a, lse_b)  # −inf only where both sides are −inf
    # Shift by a finite reference so exp never sees (−inf) − (−inf).
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - ref).unsqueeze(-1)  # [T, H, 1]; 0 where lse_a = −inf
    w_b = torch.exp(lse_b - ref).unsqueeze(-1)
    out = w_a * out_a.to(dtype) + w_b * out_b.to(dtype)
    return out, lse


def merge_rows_(
    out: torch.Tensor,  # [T, H, D] accumulator, acc dtype
    lse: torch.Tensor,  # [T, H] accumulator, acc dtype
    rows: torch.Tensor | None,  # [R] int64 rows of the accumulator the partial belongs to, or None
    part_out: torch.Tensor,  # [R, H, D]
    part_lse: torch.Tensor,  # [R, H]
) -> None:
    """Merge a partial result into (a subset of the rows of) running accumulators, in place."""
    if rows is not None:
        sub_out, sub_lse = out.index_select(0, rows), lse.index_select(0, rows)
        merge_rows_(sub_out, sub_lse, None, part_out, part_lse)
        out.index_copy_(0, rows, sub_out)
        lse.index_copy_(0, rows, sub_lse)
        return
    part_lse = part_lse.to(lse.dtype)
    new = torch.logaddexp(lse, part_lse)
    ref = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1))
    out.add_(torch.exp(part_lse - ref).unsqueeze(-1) * part_out)
    lse.copy_(new)
