"""The attention entry point: every backend equals the dense reference (packed, GQA, window),
including gradients, and cached attention equals the uncached one."""

from __future__ import annotations

import math

import pytest
import torch

from specrl.core.attention import CacheView, PackedLayout, attention, dense_attention, kernels
from specrl.core.attention.kernels import grouped_decode_attention, verify_attention

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
    torch.testing.assert_close(
        lse[:, 0].exp(), torch.tensor([1, 2, 1, 2, 3.0], dtype=torch.float64)
    )


@pytest.mark.parametrize("window", [None, 3])
def test_cached_equals_uncached(window):
    layout = PackedLayout.from_lengths(LENS)
    q, k, v = (x.detach() for x in qkv(4, 2))
    ref = attention(q, k, v, layout, backend="reference", window=window)
    # feed each sequence in two chunks through a slot cache (slots in reverse order)
    b = len(LENS)
    kc = torch.zeros(b, 2, 16, 8, dtype=torch.float64)
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
        view = CacheView(
            kc,
            vc,
            slots[keep],
            torch.tensor(pre),
            max(p + n for p, n in zip(pre, lens, strict=True)),
        )
        out = attention(
            q[idx], k[idx], v[idx], PackedLayout.from_lengths(lens), cache=view, window=window
        )
        torch.testing.assert_close(out, ref[idx], rtol=0, atol=1e-12)


@pytest.mark.parametrize("lens", [[2, 5, 1], [3, 3, 3]], ids=["uneven", "uniform"])
@pytest.mark.parametrize("window", [None, 3])
def test_cached_attention_shared_rows_and_additive_mask(lens, window):
    """What a forward builds once for all its layers (``cache_rows``, the additive
    ``cache_mask``) gives the same cache writes and outputs as what each layer would derive on
    its own (a bool mask, rows from the layout)."""
    gen = torch.Generator().manual_seed(7)
    mk = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    layout = PackedLayout.from_lengths(lens)
    slots, prefix = torch.tensor([4, 0, 2]), torch.tensor([6, 0, 9])
    kv_len = int((prefix + torch.tensor(lens)).max())
    q, k, v = mk(sum(lens), 4, 8), mk(sum(lens), 2, 8), mk(sum(lens), 2, 8)
    caches = mk(5, 2, 16, 8), mk(5, 2, 16, 8)
    outs = []
    for shared in (False, True):
        kc, vc = (c.clone() for c in caches)
        mask = rows = None
        if shared:
            mask = kernels.cache_mask(layout, prefix, kv_len, window, torch.float64)
            rows = kernels.cache_rows(layout, slots, prefix)
            assert mask.dtype == torch.float64 and set(mask.unique().tolist()) == {0, -math.inf}
        view = CacheView(kc, vc, slots, prefix, kv_len, False, mask, False, rows)
        outs.append((attention(q, k, v, layout, cache=view, window=window), kc, vc))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("lens", "prefix", "kv_len"),
    [
        ([1] * 5, [0, 3, 7, 7, 12], 13),  # decoding: one new token each
        ([5, 2, 5], [9, 0, 30], 36),  # verification rows, ragged
        ([3], [1000], 1003),  # past the offset table's first width: it grows
        ([70, 4], [0, 10], 70),  # a prefill longer than the table's rows
        ([2], [8200], 8202),  # a context past the table's width cap
    ],
    ids=["decode", "verify", "wide", "long-prefill", "long-context"],
)
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64])
def test_cache_mask_matches_its_definition(lens, prefix, kv_len, window, dtype):
    """Key l is visible to new token j of sequence b iff l ≤ prefix_b + j (and, with a
    window, prefix_b + j − l < window); bool, or 0 / −inf in a float dtype; [B, 1, M, L]."""
    layout = PackedLayout.from_lengths(lens)
    m = max(lens)
    ref = torch.zeros(len(lens), 1, m, kv_len, dtype=torch.bool)
    for b, p in enumerate(prefix):
        for j in range(m):
            for key in range(kv_len):
                ref[b, 0, j, key] = key <= p + j and (window is None or p + j - key < window)
    for _ in range(2):  # a second call reuses the offset table
        mask = kernels.cache_mask(layout, torch.tensor(prefix), kv_len, window, dtype)
        if dtype is None:
            assert mask.dtype == torch.bool and torch.equal(mask, ref)
        else:
            additive = torch.zeros(ref.shape, dtype=dtype).masked_fill(~ref, -math.inf)
            assert mask.dtype == dtype and torch.equal(mask, additive)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("additive", [False, True])
def test_grouped_decode_attention_equals_sdpa(hq, hkv, masked, additive):
    """The compiled CPU form of decoding attention is SDPA's math, head groups and mask
    included."""
    gen = torch.Generator().manual_seed(hq)
    b, length, d = 3, 11, 8
    q = torch.randn(b, hq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, length, d, generator=gen, dtype=torch.float64) for _ in "kv")
    mask = None
    if masked:  # the new token of sequence i sits at position prefix_i; a window of 4
        q_pos = torch.tensor([5, 7, length - 1])[:, None, None]
        k_pos = torch.arange(length)
        mask = ((k_pos <= q_pos) & (q_pos - k_pos < 4))[:, None]  # [B, 1, 1, L]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=mask, scale=0.3, enable_gqa=hq != hkv
    )[:, :, 0]
    if masked and additive:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, -math.inf)
    out = grouped_decode_attention(q, k, v, mask, 0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_verify_attention_equals_sdpa(hq, hkv, mask):
    """The two-matmul form of a few queries per sequence is SDPA's math, head groups (query
    head h reads KV head h // (Hq / Hkv)) and mask included."""
    gen = torch.Generator().manual_seed(hq)
    b, m, length, d = 3, 4, 11, 8
    q = torch.randn(b, m, hq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, length, d, generator=gen, dtype=torch.float64) for _ in "kv")
    visible = (
        torch.arange(length) <= torch.tensor([3, 6, 7])[:, None, None] + torch.arange(m)[:, None]
    )  # [B, M, L]: new token j of sequence b at position prefix_b + j
    attn_mask = None if mask == "none" else visible[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=attn_mask, scale=0.3, enable_gqa=hq != hkv
    ).transpose(1, 2)
    if mask == "additive":
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill(~attn_mask, -math.inf)
    torch.testing.assert_close(verify_attention(q, k, v, attn_mask, 0.3), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("lens", [[3, 1, 5, 1, 1, 2, 1, 4], [3] * 8], ids=["ragged", "uniform"])
@pytest.mark.parametrize("window", [None, 4])
def test_cached_verification_rows_take_the_matmul_form_and_equal_the_reference(
    monkeypatch, lens, window
):
    """Verification (a few new tokens per sequence, 8 sequences × 4 heads: the matmul form on
    CPU) against a slot cache whose prefixes were written by an earlier call equals attention
    over the whole sequences; decoding (one token each) and a prefill stay on SDPA."""
    hq, hkv, d, num_slots, max_len = 4, 2, 8, 10, 32
    taken = []
    matmuls = kernels.verify_attention
    monkeypatch.setattr(
        kernels, "verify_attention", lambda *a: taken.append(a[0].shape[1]) or matmuls(*a)
    )
    gen = torch.Generator().manual_seed(3)
    prefix = [5, 9, 0, 12, 3, 7, 20, 1]
    full = [p + n for p, n in zip(prefix, lens, strict=True)]
    mk = lambda t, h: torch.randn(t, h, d, generator=gen, dtype=torch.float64)
    q, k, v = mk(sum(full), hq), mk(sum(full), hkv), mk(sum(full), hkv)
    whole = PackedLayout.from_lengths(full)
    ref = attention(q, k, v, whole, backend="reference", window=window)
    kc = torch.zeros(num_slots, hkv, max_len, d, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([9, 0, 4, 2, 7, 1, 5, 3])
    cu = whole.cu_seqlens.tolist()
    outs = {}
    for part, (lo, hi) in {
        "prefix": (lambda i: 0, lambda i: prefix[i]),
        "new": (lambda i: prefix[i], lambda i: full[i]),
    }.items():
        keep = [i for i in range(len(full)) if hi(i) > lo(i)]
        rows = torch.tensor([r for i in keep for r in range(cu[i] + lo(i), cu[i] + hi(i))])
        view = CacheView(
            kc, vc, slots[keep], torch.tensor([lo(i) for i in keep]), max(hi(i) for i in keep)
        )
        layout = PackedLayout.from_lengths([hi(i) - lo(i) for i in keep])
        outs[part] = (rows, attention(q[rows], k[rows], v[rows], layout, cache=view, window=window))
    assert taken == [max(lens)]  # the new rows only: the prefill (up to 20 rows) took SDPA
    for rows, out in outs.values():
        torch.testing.assert_close(out, ref[rows], rtol=0, atol=1e-12)


def test_compiled_cached_attention_equals_eager(monkeypatch):
    """Under torch.compile on CPU, cached attention writes the same cache and returns the same
    outputs as eagerly: decoding (one token each; all at one position, compact slots; or at
    different positions, scattered slots) takes the grouped form, verification (uneven new
    tokens) stays on SDPA."""
    hq, hkv, d, num_slots, max_len = 4, 2, 8, 6, 24
    traced = []
    grouped = kernels.grouped_decode_attention
    monkeypatch.setattr(
        kernels, "grouped_decode_attention", lambda *a: traced.append(len(a[0])) or grouped(*a)
    )

    def run(fn, lens, slots, prefix):
        gen = torch.Generator().manual_seed(1)
        mk = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
        kc, vc = mk(num_slots, hkv, max_len, d), mk(num_slots, hkv, max_len, d)
        q, k, v = mk(sum(lens), hq, d), mk(sum(lens), hkv, d), mk(sum(lens), hkv, d)
        kv_len = max(p + n for p, n in zip(prefix, lens, strict=True))
        compact = slots == list(range(len(slots)))
        full_rows = set(lens) == {1} and {p + 1 for p in prefix} == {kv_len}
        view = CacheView(
            kc, vc, torch.tensor(slots), torch.tensor(prefix), kv_len, compact, None, full_rows
        )
        return fn(q, k, v, PackedLayout.from_lengths(lens), view), kc, vc

    def eager(q, k, v, layout, view):
        return attention(q, k, v, layout, cache=view)

    compiled = torch.compile(eager, dynamic=False, fullgraph=True)
    for lens, slots, prefix in [
        ([1, 1, 1], [0, 1, 2], [9, 9, 9]),
        ([1, 1, 1], [4, 0, 2], [5, 12, 7]),
        ([3, 1, 2], [4, 0, 2], [5, 12, 7]),
    ]:
        want, k_want, v_want = run(eager, lens, slots, prefix)
        assert not traced  # eager: SDPA
        got, k_got, v_got = run(compiled, lens, slots, prefix)
        assert traced == ([3] if set(lens) == {1} else []), "wrong form traced"
        traced.clear()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
