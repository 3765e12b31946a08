"""The attention entry point: every backend equals the dense reference (packed, GQA, window),
including gradients, and cached attention equals the uncached one."""

from __future__ import annotations

import pytest
import torch

from specrl.core.attention import CacheView, PackedLayout, attention, dense_attention

LENS = [1, 5, 12, 3, 9]


def qkv(hq: int, hkv: int, d: int = 8, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    mk = lambda h: torch.randn(t, h, d, generator=gen, dtype=dtype, requires_grad=True)
    return mk(hq), mk(hkv), mk(hkv)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("window", [None, 4])
def test_backends_equal_reference(backend, hq, hkv, window):
    layout = PackedLayout.from_lengths(LENS)
    q, k, v = qkv(hq, hkv)
    ref, _ = dense_attention(q, k, v, layout, window=window)
    if backend == "flex":  # flex_attention has no CPU backward: forward only here (GPU tests)
        q, k, v = (x.detach() for x in (q, k, v))
    out = attention(q, k, v, layout, backend=backend, window=window)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    if backend == "flex":
        return
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    g_out = torch.autograd.grad((out * w).sum(), (q, k, v))
    for a, b in zip(g_ref, g_out, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_reference_rows_sum_to_one_and_stay_in_sequence():
    layout = PackedLayout.from_lengths([2, 3])
    t = 5
    q = torch.zeros(t, 1, 4, dtype=torch.float64)
    k = torch.zeros(t, 1, 4, dtype=torch.float64)
    v = torch.arange(t, dtype=torch.float64).view(t, 1, 1).expand(t, 1, 4).contiguous()
    out, lse = dense_attention(q, k, v, layout)
    # uniform scores: each query averages the values of its own sequence's prefix
    expected = torch.tensor([0.0, 0.5, 2.0, 2.5, 3.0], dtype=torch.float64)
    torch.testing.assert_close(out[:, 0, 0], expected)
    torch.testing.assert_close(lse[:, 0].exp(), torch.tensor([1, 2, 1, 2, 3.0],
                                                             dtype=torch.float64))


@pytest.mark.parametrize("window", [None, 3])
def test_cached_equals_uncached(window):
    layout = PackedLayout.from_lengths(LENS)
    q, k, v = (x.detach() for x in qkv(4, 2))
    ref = attention(q, k, v, layout, backend="reference", window=window)
    # feed each sequence in two chunks through a slot cache (slots in reverse order)
    b = len(LENS)
    kc = torch.zeros(b, 16, 2, 8, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    slots = torch.arange(b - 1, -1, -1)
    cu = layout.cu_seqlens.tolist()
    first = [n // 2 for n in LENS]
    for part in (0, 1):
        rows, lens, pre = [], [], []
        for i, n in enumerate(LENS):
            lo, hi = (0, first[i]) if part == 0 else (first[i], n)
            if hi > lo:
                rows.extend(range(cu[i] + lo, cu[i] + hi))
                lens.append(hi - lo)
                pre.append(lo)
        keep = [i for i, n in enumerate(LENS) if (first[i] if part == 0 else n - first[i]) > 0]
        idx = torch.tensor(rows)
        view = CacheView(kc, vc, slots[keep], torch.tensor(pre),
                         max(p + n for p, n in zip(pre, lens, strict=True)))
        out = attention(q[idx], k[idx], v[idx], PackedLayout.from_lengths(lens), cache=view,
                        window=window)
        torch.testing.assert_close(out, ref[idx], rtol=0, atol=1e-12)
