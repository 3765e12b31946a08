"""Verification attention on CPU: SDPA's flash kernel vs two batched matmuls, by shape.

A speculative decode step verifies k drafts: each sequence brings m = k + 1 new queries (a
batch that mixes drafting and plain sequences pads every one to the longest).  PyTorch's CPU
flash kernel for ``scaled_dot_product_attention`` takes a fast path for one query per sequence,
and above that pays a fixed cost per (sequence, head) block; the two-matmul form
(:func:`specrl.core.attention.kernels.verify_attention`) pays a fixed cost per call and
materializes the [B, Hq, m, L] scores.  This study times both over head layouts (the toy
presets' 4/2 × 32 up to an 8B-like 32/8 × 128), batch sizes, context lengths and rows per
sequence, and shows which one :func:`~specrl.core.attention.kernels.cached_attention` runs
eagerly on CPU for that shape (``picked``).

    python -m benchmarks.studies.verify_attention --threads 2 --clock wall
    python -m benchmarks.studies.verify_attention --quick

Writes ``benchmarks/results/studies/verify_attention.json``.
"""

from __future__ import annotations

import itertools
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks import harness
from specrl.core.attention import kernels

HEADS = ((4, 2, 32), (16, 4, 64), (32, 8, 128))  # (query heads, KV heads, head dim)
COLUMNS = ("heads", "batch", "context", "rows", "sdpa_us", "matmul_us", "speedup", "picked")
BUDGET = 1 << 26  # largest K cache block timed (elements): keeps the study to minutes


def shapes(quick: bool) -> list[tuple[tuple[int, int, int], int, int, int]]:
    batches, contexts, rows = ((1, 8, 64), (64, 512), (2, 5)) if quick else (
        (1, 2, 4, 8, 64), (64, 512, 2048), (2, 3, 5, 8, 9)
    )  # fmt: skip
    return [
        (h, b, ctx, m)
        for h, b, ctx, m in itertools.product(HEADS, batches, contexts, rows)
        if b * h[1] * ctx * h[2] <= BUDGET
    ]


def picked(hq: int, b: int, ctx: int, m: int) -> str:
    """The form ``cached_attention`` runs eagerly on CPU for this shape."""
    return "matmul" if kernels.verify_in_matmuls(b, hq, m, ctx) else "sdpa"


def inputs(hq: int, hkv: int, d: int, b: int, ctx: int, m: int) -> tuple[torch.Tensor, ...]:
    """Queries [B, m, Hq, D] at the cache's last m positions of each sequence (sequences of
    different lengths, as in a batch), keys and values [B, Hkv, L, D], the additive mask."""
    gen = torch.Generator().manual_seed(b * ctx + m)
    q = torch.randn(b, m, hq, d, generator=gen)
    k, v = (torch.randn(b, hkv, ctx, d, generator=gen) for _ in "kv")
    last = torch.randint(ctx // 2, ctx - m + 1, (b, 1, 1), generator=gen)  # first new position
    visible = torch.arange(ctx)[None, None] <= last + torch.arange(m)[None, :, None]
    mask = torch.zeros(b, 1, m, ctx).masked_fill(~visible[:, None], float("-inf"))
    return q, k, v, mask


def per_call(clock, fn, calls: int) -> float:
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls * 1e6


def main() -> None:
    ap = harness.parser(__doc__, "studies/verify_attention", repeats=5)
    args = ap.parse_args()
    clock = harness.configure(ap, args)
    repeats = 2 if args.quick else args.repeats
    rows = []
    for (hq, hkv, d), b, ctx, m in shapes(args.quick):
        q, k, v, mask = inputs(hq, hkv, d, b, ctx, m)
        forms = {
            "sdpa": partial(
                F.scaled_dot_product_attention,
                q.transpose(1, 2),
                k,
                v,
                attn_mask=mask,
                enable_gqa=hq != hkv,
            ),
            "matmul": partial(kernels.verify_attention, q, k, v, mask),
        }
        torch.testing.assert_close(
            forms["sdpa"]().transpose(1, 2), forms["matmul"](), rtol=1e-4, atol=1e-5
        )
        calls = max(2, int(2e6 / (b * hq * ctx * d)))  # ≈ 10–30 ms per timing
        times = harness.interleave(
            list(forms), repeats, lambda name, rep, f=forms, n=calls: per_call(clock, f[name], n)
        )
        sdpa, matmul = (harness.median(times[name]) for name in forms)
        rows.append(
            {
                "heads": f"{hq}/{hkv}×{d}",
                "batch": b,
                "context": ctx,
                "rows": m,
                "sdpa_us": round(sdpa, 1),
                "matmul_us": round(matmul, 1),
                "speedup": round(harness.paired_ratio(times["sdpa"], times["matmul"]), 2),
                "picked": picked(hq, b, ctx, m),
            }
        )
    harness.report(args, [("verification attention, CPU", rows, COLUMNS)], {"rows": rows})


if __name__ == "__main__":
    main()
