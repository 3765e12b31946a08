"""Block kernels, the log-sum-exp merge and the single-process (cp = 1) TTT path.

Every kernel is compared with a dense masked softmax written out here; backward with the final
merged (O, L) is compared with autograd of the unsplit attention.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from specrl.core.attention import blocks
from specrl.core.attention.blocks import TorchBlocks, get_kernel, recompute_backward, segments
from specrl.core.attention.layout import PackedLayout
from specrl.core.attention.merge import merge
from specrl.core.attention.reference import dense_attention, expand_kv
from specrl.core.attention.ttt import ttt_session
from specrl.errors import DependencyError

HEADS = [(2, 2), (4, 2), (3, 1)]
D = 4


def dense_block(q, k, v, cu_q, cu_k, causal: bool, scale: float):
    """Differentiable dense reference of one block: (out [Tq, Hq, D], lse [Tq, Hq])."""
    sq, oq = segments(cu_q, q.shape[0])
    sk, ok = segments(cu_k, k.shape[0])
    allowed = sq[:, None] == sk[None, :]
    if causal:
        allowed &= ok[None, :] <= oq[:, None]
    hq = q.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, expand_kv(k, hq)) * scale
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)  # [Hq, Tq]
    empty = torch.isinf(lse)
    p = torch.exp(s - lse.masked_fill(empty, 0.0)[..., None])
    out = torch.einsum("hqk,khd->qhd", p, expand_kv(v, hq))
    return out, lse.T


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0)


@st.composite
def block_case(draw):
    """Segment lengths of a block (causal: equal q/k lengths; else k may be empty), heads, chunk."""
    causal = draw(st.booleans())
    q_lens = draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
    if causal:
        k_lens = list(q_lens)
    else:
        k_lens = [draw(st.integers(0, 9)) for _ in q_lens]
    hq, hkv = draw(st.sampled_from(HEADS))
    chunk = draw(st.sampled_from([1, 2, 5, 256]))
    seed = draw(st.integers(0, 2**16))
    return causal, q_lens, k_lens, hq, hkv, chunk, seed


def _tensors(q_lens, k_lens, hq, hkv, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)
    tq, tk = sum(q_lens), sum(k_lens)
    return rand(tq, hq, D), rand(tk, hkv, D), rand(tk, hkv, D), rand(tq, hq, D)


@settings(max_examples=80, deadline=None)
@given(case=block_case())
def test_torch_kernel_matches_dense(case) -> None:
    causal, q_lens, k_lens, hq, hkv, chunk, seed = case
    q, k, v, dout = _tensors(q_lens, k_lens, hq, hkv, seed)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    kernel = TorchBlocks(chunk=chunk)
    args = (cu_q, cu_k, max(q_lens), max(k_lens), causal, 0.7)
    out, lse = kernel.forward(q, k, v, *args)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dense_block(*leaves, cu_q, cu_k, causal, 0.7)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, ref_lse.detach(), atol=1e-12, rtol=0)  # −inf rows too
    assert torch.all(out[torch.isinf(lse)] == 0)

    # backward with the block's own (out, lse) as the final ones = plain autograd
    ref_grads = torch.autograd.grad(ref_out, leaves, dout)
    grads = kernel.backward(dout, q, k, v, out, lse, *args)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    split=st.integers(0, 9),
    heads=st.sampled_from(HEADS),
    seed=st.integers(0, 2**16),
)
def test_blocks_with_final_out_and_lse_sum_to_the_full_gradient(lens, split, heads, seed) -> None:
    """Keys split into a causal diagonal block and an earlier unmasked block, like a ring step:
    the merged forward and the summed block backwards equal the unsplit attention."""
    hq, hkv = heads
    prefix = [min(split, n) for n in lens]  # per sequence: `prefix` earlier keys, then the diagonal
    q, _, _, dout = _tensors(lens, lens, hq, hkv, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    kp = torch.randn(sum(prefix), hkv, D, generator=gen, dtype=torch.float64)
    vp = torch.randn(sum(prefix), hkv, D, generator=gen, dtype=torch.float64)
    kd = torch.randn(sum(lens), hkv, D, generator=gen, dtype=torch.float64)
    vd = torch.randn(sum(lens), hkv, D, generator=gen, dtype=torch.float64)
    cu, cu_p = _cu(lens), _cu(prefix)
    kernel = TorchBlocks(chunk=3)
    diag = (cu, cu, max(lens), max(lens), True, 0.5)
    early = (cu, cu_p, max(lens), max(prefix), False, 0.5)
    out, lse = merge(*kernel.forward(q, kd, vd, *diag), *kernel.forward(q, kp, vp, *early))
    dq1, dkd, dvd = kernel.backward(dout, q, kd, vd, out, lse, *diag)
    dq2, dkp, dvp = kernel.backward(dout, q, kp, vp, out, lse, *early)

    # the same attention written as one packed causal problem: each sequence = prefix + own keys
    leaves = [x.clone().requires_grad_() for x in (q, kp, vp, kd, vd)]
    outs, lses = [], []
    for b in range(len(lens)):
        qb = leaves[0][cu[b] : cu[b + 1]]
        kb = torch.cat([leaves[1][cu_p[b] : cu_p[b + 1]], leaves[3][cu[b] : cu[b + 1]]])
        vb = torch.cat([leaves[2][cu_p[b] : cu_p[b + 1]], leaves[4][cu[b] : cu[b + 1]]])
        # bottom-right causal: query i sees all prefix keys and own keys ≤ i
        n, m = lens[b], prefix[b]
        allowed = torch.arange(m + n)[None, :] <= torch.arange(n)[:, None] + m
        s = torch.einsum("qhd,khd->hqk", qb, expand_kv(kb, hq)) * 0.5
        s = s.masked_fill(~allowed, -math.inf)
        lse_b = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), expand_kv(vb, hq)))
        lses.append(lse_b.T)
    ref_out = torch.cat(outs)
    torch.testing.assert_close(out, ref_out.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, torch.cat(lses).detach(), atol=1e-12, rtol=0)
    ref = torch.autograd.grad(ref_out, leaves, dout)
    for got, want in zip((dq1 + dq2, dkp, dvp, dkd, dvd), ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    t=st.integers(1, 6),
    n_a=st.integers(0, 5),
    n_b=st.integers(0, 5),
    empty_rows=st.lists(st.sampled_from(["a", "b", "both", "none"]), min_size=6, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_merge_equals_one_softmax_over_both_parts(t, n_a, n_b, empty_rows, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    h, d = 2, 3
    s = torch.randn(t, h, n_a + n_b, generator=gen, dtype=torch.float64)
    vals = torch.randn(n_a + n_b, d, generator=gen, dtype=torch.float64)
    for i, kind in enumerate(empty_rows[:t]):  # rows that see no key in a part
        if kind in ("a", "both"):
            s[i, :, :n_a] = -math.inf
        if kind in ("b", "both"):
            s[i, :, n_a:] = -math.inf

    def part(scores, v):
        lse = torch.logsumexp(scores, -1)
        p = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
        return torch.einsum("thk,kd->thd", p, v), lse

    out, lse = merge(*part(s[..., :n_a], vals[:n_a]), *part(s[..., n_a:], vals[n_a:]))
    ref_out, ref_lse = part(s, vals)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)


def test_merge_keeps_float32_for_low_precision_parts() -> None:
    o = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    lse = torch.zeros(3, 2)
    out, new = merge(o, lse, o, lse)
    assert out.dtype == torch.float32 and new.dtype == torch.float32
    torch.testing.assert_close(new, torch.full((3, 2), math.log(2)))


def test_recompute_backward_reproduces_the_final_lse_identity() -> None:
    """The cotangent formula the flex kernel uses, driven by a differentiable dense block."""
    lens, prefix = [5, 3], [2, 4]
    q, kd, vd, dout = _tensors(lens, lens, 4, 2, 3)
    _, kp, vp, _ = _tensors(lens, prefix, 4, 2, 4)
    cu, cu_p = _cu(lens), _cu(prefix)
    kernel = TorchBlocks()
    out, lse = merge(
        *kernel.forward(q, kd, vd, cu, cu, 5, 5, True, 0.5),
        *kernel.forward(q, kp, vp, cu, cu_p, 5, 4, False, 0.5),
    )
    for k, v, cu_k, causal in ((kd, vd, cu, True), (kp, vp, cu_p, False)):
        want = kernel.backward(dout, q, k, v, out, lse, cu, cu_k, 5, 5, causal, 0.5)
        got = recompute_backward(
            lambda q_, k_, v_, cu_k=cu_k, causal=causal: dense_block(
                q_, k_, v_, cu, cu_k, causal, 0.5
            ),
            dout,
            q,
            k,
            v,
            out,
            lse,
        )
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_flex_forward_matches_torch_kernel_on_cpu(hq: int, hkv: int, causal: bool) -> None:
    q_lens = [5, 1, 9]
    k_lens = q_lens if causal else [3, 0, 7]
    q, k, v, _ = _tensors(q_lens, k_lens, hq, hkv, 0, dtype=torch.float32)
    args = (_cu(q_lens), _cu(k_lens), 9, max(k_lens), causal, 0.5)
    out, lse = blocks.forward(q, k, v, *args, kernel="flex")
    ref_out, ref_lse = blocks.forward(q, k, v, *args, kernel="torch")
    torch.testing.assert_close(out.float(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


@pytest.mark.skipif(HAS_FLASH, reason="flash_attn is installed")
def test_missing_flash_attn_names_the_extra() -> None:
    with pytest.raises(DependencyError) as err:
        get_kernel("flash")
    assert err.value.hint == "pip install 'specrl[flash]'"


def test_unknown_kernel_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown block kernel"):
        get_kernel("cudnn")


@pytest.mark.parametrize("mode", ["ring", "ring_once", "gather"])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2)])
def test_cp1_session_equals_dense_reference(mode: str, hq: int, hkv: int) -> None:
    layout = PackedLayout.from_lengths([5, 1, 12, 3])  # not zigzag-padded: any layout at cp = 1
    t, j = layout.num_tokens, 3
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    qs = [rand(t, hq, D).requires_grad_() for _ in range(j + 1)]
    k, v = rand(t, hkv, D).requires_grad_(), rand(t, hkv, D).requires_grad_()
    bk, bv = rand(j, t, hkv, D).requires_grad_(), rand(j, t, hkv, D).requires_grad_()
    w = rand(j + 1, t, hq, D)
    leaves = [*qs, k, v, bk, bv]

    session = ttt_session(k, v, layout, mode=mode, kernel=TorchBlocks(chunk=4))
    outs = [session.attend(qs[s], bk[:s], bv[:s]) for s in range(j + 1)]
    refs = [
        dense_attention(qs[s], k, v, layout, branch_k=bk[:s], branch_v=bv[:s])[0]
        for s in range(j + 1)
    ]
    for o, r in zip(outs, refs, strict=True):
        torch.testing.assert_close(o, r, atol=1e-12, rtol=0)
    got = torch.autograd.grad(sum((o * w[s]).sum() for s, o in enumerate(outs)), leaves)
    want = torch.autograd.grad(sum((r * w[s]).sum() for s, r in enumerate(refs)), leaves)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_cp1_ttt_step_never_materializes_a_score_matrix() -> None:
    t, hq, hkv, j = 512, 2, 1, 3
    layout = PackedLayout.from_lengths([t])
    q = torch.randn(t, hq, D, requires_grad=True)
    k, v = torch.randn(t, hkv, D, requires_grad=True), torch.randn(t, hkv, D, requires_grad=True)
    bk, bv = torch.randn(j, t, hkv, D), torch.randn(j, t, hkv, D)
    session = ttt_session(k, v, layout, kernel=TorchBlocks(chunk=32))
    with _LargestTensor() as probe:
        session.attend(q, bk, bv).sum().backward()
    # scores live in [chunk, Hq, ≤ T] pieces; one step's S×S matrix would be Hq·T² elements
    assert probe.largest <= 32 * hq * t
    assert probe.largest < hq * t * t // 8


def test_branch_given_per_step_saves_no_stacked_copy() -> None:
    """Per-step branch tensors are saved as they are: an unroll keeps O(K), not O(K²), copies."""
    layout = PackedLayout.from_lengths([6, 3])
    t, hq, hkv, j = layout.num_tokens, 4, 2, 3
    gen = torch.Generator().manual_seed(5)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k, v = rand(t, hq, D), rand(t, hkv, D), rand(t, hkv, D)
    keys = [rand(t, hkv, D).requires_grad_() for _ in range(j)]
    vals = [rand(t, hkv, D).requires_grad_() for _ in range(j)]
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        out = ttt_session(k, v, layout).attend(q, keys, vals)
    saved_ptrs = {x.untyped_storage().data_ptr() for x in saved}
    assert {x.untyped_storage().data_ptr() for x in keys + vals} <= saved_ptrs
    assert all(x.dim() != 4 for x in saved)  # nothing stacked [J, T, Hkv, D]
    ref, _ = dense_attention(
        q, k, v, layout, branch_k=torch.stack(keys), branch_v=torch.stack(vals)
    )
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    w = rand(t, hq, D)
    got = torch.autograd.grad((out * w).sum(), keys + vals)
    want = torch.autograd.grad((ref * w).sum(), keys + vals)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)


def test_branch_shapes_are_checked() -> None:
    layout = PackedLayout.from_lengths([4])
    k = torch.zeros(4, 1, D)
    session = ttt_session(k, k, layout)
    with pytest.raises(ValueError, match="both"):
        session.attend(torch.zeros(4, 2, D), [k])
    with pytest.raises(ValueError, match="branch K/V"):
        session.attend(torch.zeros(4, 2, D), [k], [torch.zeros(3, 1, D)])
