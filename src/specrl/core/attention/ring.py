"""Packed zigzag ring attention with the draft's branch attention merged (docs/parallelism.md).

Each of the ``cp`` ranks holds a zigzag shard (see :mod:`specrl.core.attention.zigzag`): for every
packed sequence, chunk r then chunk 2cp−1−r, c tokens each.  The main K/V blocks travel round the
ring: at step s rank r holds the K/V of ``src = (r − s) mod cp`` and computes one block:

- ``src == r`` (s = 0), *diagonal*: local q × local K/V, causal per local sequence (the local
  concatenation [chunk r, chunk 2cp−1−r] is in global order, so top-left causal is exact);
- ``src < r``, *front*: all local q × the front half (chunk src) of the incoming K/V, unmasked
  within a sequence — chunk src precedes both local chunks, chunk 2cp−1−src follows both;
- ``src > r``, *back*: the back half (chunk 2cp−1−r) of the local q × all incoming K/V — both
  incoming chunks precede it, and both follow chunk r.

Every step costs every rank 2c² query–key pairs per sequence.  The next K/V block is posted
(isend to r+1, irecv from r−1) before the current one is computed.  Partial (out, lse) are merged
in float32 (float64 for float64 inputs) by log-sum-exp.

Branch (TTT steps 1..J, rank-local): query i also attends to ``K^j_i`` for every j — its own
speculative chain at the same index — in the same softmax; GQA maps each query head to its kv
head.  The branch keys/values come as J separate [T, Hkv, D] tensors (the activations each TTT
step produced) and are never stacked into a saved copy, so an unroll of K steps keeps O(K), not
O(K²), branch tensors.  Branch scores are [T, Hq, J], merged like any other block.

Backward runs every block with the **final** merged O and L (see :mod:`blocks`): the K/V blocks
circulate again, dq accumulates locally in float32, and a float32 dK/dV accumulator follows the
blocks round the ring, each rank adding its contribution for the block it holds, so it arrives
home after cp hops.  Branch gradients are closed-form.  With cp = 1 nothing is sent (gloo cannot
send to itself); with cp > 1 every rank issues the same point-to-point operations in the same
order: per forward (cp−1) exchanges, per backward (cp−1) K/V exchanges and cp accumulator hops.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from specrl.core.attention.blocks import BlockKernel, segments
from specrl.core.attention.layout import PackedLayout
from specrl.core.attention.merge import acc_dtype, merge_rows_

StepCase = Literal["diagonal", "front", "back"]


def step_case(rank: int, src: int) -> StepCase:
    """Which block rank ``rank`` computes against the main K/V of rank ``src``."""
    if src == rank:
        return "diagonal"
    return "front" if src < rank else "back"


@dataclass(frozen=True)
class BlockSpec:
    """One kernel call: local query rows, rows of a K/V tensor, and their segments."""

    q_rows: torch.Tensor | None  # [Tq_block] rows of the local q (None: all)
    kv_rows: torch.Tensor | None  # [Tk_block] rows of the K/V tensor (None: all)
    cu_q: torch.Tensor  # [B+1]
    cu_k: torch.Tensor  # [B+1]
    max_q: int
    max_k: int
    causal: bool


class RingGeometry:
    """Index tensors of one rank's zigzag shard, derived from its local layout on device.

    ``layout`` is the rank's local layout (``ZigzagPlan.local``): B sequences of 2·c_b tokens,
    chunk r then chunk 2cp−1−r.  With cp = 1 any packed layout is accepted.
    """

    def __init__(self, layout: PackedLayout, cp: int, rank: int) -> None:
        self.cp, self.rank = cp, rank
        self.cu = layout.cu_seqlens  # [B+1]
        self.max_len = layout.max_seqlen
        self.num_tokens = layout.num_tokens
        if cp == 1:
            return
        if self.num_tokens % 2 or self.max_len % 2:
            raise ValueError(
                "a zigzag shard has even sequence lengths; pass ZigzagPlan.local as the layout"
            )
        self.cu_half = self.cu // 2  # [B+1] one chunk per sequence
        self.max_half = self.max_len // 2
        seq, w = segments(self.cu_half, self.num_tokens // 2)
        chunk = (self.cu_half[1:] - self.cu_half[:-1])[seq]
        self.front_rows = self.cu[seq] + w  # [T/2] local rows of chunk r
        self.back_rows = self.front_rows + chunk  # [T/2] local rows of chunk 2cp−1−r

    def ring_block(self, src: int) -> BlockSpec:
        """The block of ring step with source rank ``src`` (its K/V indexed like local rows)."""
        case = step_case(self.rank, src)
        if case == "diagonal":
            return BlockSpec(None, None, self.cu, self.cu, self.max_len, self.max_len, True)
        if case == "front":
            return BlockSpec(
                None, self.front_rows, self.cu, self.cu_half, self.max_len, self.max_half, False
            )
        return BlockSpec(
            self.back_rows, None, self.cu_half, self.cu, self.max_half, self.max_len, False
        )

    def chunk_rows(self, first: int, last: int) -> torch.Tensor:
        """Rows, in the rank-major concatenation of all shards, of global chunks
        ``first..last−1`` of every sequence (sequence-major, in global order)."""
        n = last - first
        seq, o = segments(n * self.cu_half, n * (self.num_tokens // 2))
        c = (self.cu_half[1:] - self.cu_half[:-1])[seq]
        j, w = first + o // c, o % c
        front = j < self.cp
        owner = torch.where(front, j, 2 * self.cp - 1 - j)
        return owner * self.num_tokens + self.cu[seq] + torch.where(front, w, c + w)

    def gathered_blocks(self) -> list[BlockSpec]:
        """Kernel calls of local q against the *whole* K/V (rank-major concatenation of all
        shards): the ring's step cases fused into at most three calls.

        diagonal: own shard, causal; prefix: every local q × chunks 0..r−1 (all precede both local
        chunks); middle: back-half q × chunks r+1..2cp−2−r (all lie between the two local chunks).
        """
        r, cp = self.rank, self.cp
        own = torch.arange(self.num_tokens, device=self.cu.device) + r * self.num_tokens
        blocks = [BlockSpec(None, own, self.cu, self.cu, self.max_len, self.max_len, True)]
        if cp == 1:
            return blocks
        if r > 0:
            blocks.append(
                BlockSpec(
                    None,
                    self.chunk_rows(0, r),
                    self.cu,
                    r * self.cu_half,
                    self.max_len,
                    r * self.max_half,
                    False,
                )
            )
        n_mid = 2 * cp - 2 - 2 * r
        if n_mid > 0:
            blocks.append(
                BlockSpec(
                    self.back_rows,
                    self.chunk_rows(r + 1, r + 1 + n_mid),
                    self.cu_half,
                    n_mid * self.cu_half,
                    self.max_half,
                    n_mid * self.max_half,
                    False,
                )
            )
        return blocks


Tensors = tuple[torch.Tensor, ...]


class _Pending:
    """An in-flight ring exchange; ``wait()`` returns the received tensors."""

    def __init__(self, reqs: list, received: Tensors, sent: Tensors) -> None:
        self._reqs, self._received, self._sent = reqs, received, sent

    def wait(self) -> Tensors:
        for req in self._reqs:
            req.wait()
        self._sent = ()  # the send buffers may be freed now
        return self._received


class RingComm:
    """Point-to-point neighbours of one rank in a CP group (``size == 1``: no communication)."""

    KV_TAG, GRAD_TAG = 0, 1

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        if size > 1 and group is None:
            raise ValueError("a CP group of size > 1 needs a process group")
        self.group, self.rank, self.size = group, rank, size
        if size > 1:
            self._next = dist.get_global_rank(group, (rank + 1) % size)
            self._prev = dist.get_global_rank(group, (rank - 1) % size)

    def exchange(self, tensors: Tensors, tag: int) -> _Pending:
        """Post isend(tensors → rank+1) and irecv(same shapes ← rank−1) as one batch."""
        sent = tuple(t.contiguous() for t in tensors)
        received = tuple(torch.empty_like(t) for t in sent)
        ops = [dist.P2POp(dist.isend, t, self._next, self.group, tag) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self.group, tag) for t in received]
        return _Pending(dist.batch_isend_irecv(ops), received, sent)

    def circulate(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(src, k_src, v_src)`` for s = 0..cp−1; block s+1 is in flight while the caller
        computes with block s.  At most two blocks are alive: the current and the incoming."""
        cur = (k, v)
        for s in range(self.size):
            pending = self.exchange(cur, self.KV_TAG) if s + 1 < self.size else None
            yield (self.rank - s) % self.size, cur[0], cur[1]
            if pending is not None:
                cur = pending.wait()


class AccumulatorRing:
    """Gradient accumulators that follow the K/V blocks round the ring.

    At step s the rank holds block ``src = r − s``: :meth:`add` adds its contribution (dK, dV of
    that block) into the accumulators of the block received from r−1 and sends them on to r+1.
    After cp steps the accumulators of the rank's own block have visited every rank and
    :meth:`result` returns them.  Contributions are read, never modified.
    """

    def __init__(self, comm: RingComm, dtype: torch.dtype) -> None:
        self._comm, self._dtype = comm, dtype
        self._pending: _Pending | None = None
        self._held: Tensors = ()

    def add(self, *contribution: torch.Tensor) -> None:
        if self._pending is None:  # first step: the accumulators start as this contribution
            acc = tuple(c.to(self._dtype) for c in contribution)
        else:
            acc = self._pending.wait()  # received buffers: ours to update in place
            for a, c in zip(acc, contribution, strict=True):
                a.add_(c)
        if self._comm.size == 1:
            self._held = acc
        else:
            self._pending = self._comm.exchange(acc, RingComm.GRAD_TAG)

    def result(self) -> Tensors:
        if self._comm.size == 1:
            return self._held
        assert self._pending is not None
        return self._pending.wait()


def branch_forward(
    q: torch.Tensor,  # [T, Hq, D]
    branch_k: Tensors,  # J × [T, Hkv, D]
    branch_v: Tensors,  # J × [T, Hkv, D]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, Hq, D], lse [T, Hq] (acc dtype)
    """Attention of each query over its own J branch keys (same index, one per TTT step)."""
    t, hq, d = q.shape
    hkv = branch_k[0].shape[1]
    dt = acc_dtype(q.dtype)
    qg = q.to(dt).view(t, hkv, hq // hkv, d)
    s = torch.stack([torch.einsum("thgd,thd->thg", qg, k_j.to(dt)) for k_j in branch_k], -1)
    lse = torch.logsumexp(s.mul_(scale), dim=-1)  # [T, Hkv, G]
    p = s.sub_(lse.unsqueeze(-1)).exp_()  # [T, Hkv, G, J]
    out = torch.zeros_like(qg)  # [T, Hkv, G, D]
    for j, v_j in enumerate(branch_v):
        out.addcmul_(p[..., j, None], v_j.to(dt).unsqueeze(2))
    return out.reshape(t, hq, d), lse.reshape(t, hq)


def branch_backward(
    dout: torch.Tensor,  # [T, Hq, D]
    q: torch.Tensor,  # [T, Hq, D]
    branch_k: Tensors,  # J × [T, Hkv, D]
    branch_v: Tensors,  # J × [T, Hkv, D]
    out: torch.Tensor,  # [T, Hq, D] final merged
    lse: torch.Tensor,  # [T, Hq] final merged
    dq: torch.Tensor,  # [T, Hq, D] accumulator (acc dtype), updated in place
    scale: float,
) -> tuple[Tensors, Tensors]:  # d branch_k, d branch_v (J × [T, Hkv, D] each)
    """Closed-form branch gradients with the final (O, L): p = exp(s − L), D = ⟨dO, O⟩."""
    t, hq, d = q.shape
    hkv = branch_k[0].shape[1]
    g = hq // hkv
    dt = acc_dtype(q.dtype)
    qg = q.to(dt).view(t, hkv, g, d)
    do = dout.to(dt).view(t, hkv, g, d)
    delta = (do * out.to(dt).view(t, hkv, g, d)).sum(-1)  # [T, Hkv, G]
    final = lse.to(dt).view(t, hkv, g)  # every row sees its own main key: L finite
    dqg = dq.view(t, hkv, g, d)
    d_bk, d_bv = [], []
    for k_j, v_j in zip(branch_k, branch_v, strict=True):
        k_j, v_j = k_j.to(dt), v_j.to(dt)
        p = (torch.einsum("thgd,thd->thg", qg, k_j).mul_(scale) - final).exp_()  # [T, Hkv, G]
        d_bv.append(torch.einsum("thg,thgd->thd", p, do).to(v_j.dtype))
        ds = (torch.einsum("thgd,thd->thg", do, v_j) - delta).mul_(p).mul_(scale)
        dqg.addcmul_(ds.unsqueeze(-1), k_j.unsqueeze(2))
        d_bk.append(torch.einsum("thg,thgd->thd", ds, qg))
    return (
        tuple(x.to(k.dtype) for x, k in zip(d_bk, branch_k, strict=True)),
        tuple(x.to(v.dtype) for x, v in zip(d_bv, branch_v, strict=True)),
    )


def _take(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


class PartialAttention:
    """Running (out, lse) of the local query rows in acc dtype, merged block by block.

    The first block must cover every row (the diagonal block does): it becomes the accumulator
    as is, so no −inf initial state is ever merged.
    """

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None  # [T, Hq, D]
        self.lse: torch.Tensor | None = None  # [T, Hq]

    def add(self, rows: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge a partial result of the given rows (None: all rows)."""
        if self.out is None:
            if rows is not None:
                raise ValueError("the first block must cover every query row")
            dt = acc_dtype(out.dtype)
            self.out, self.lse = out.to(dt), lse.to(dt)
        else:
            merge_rows_(self.out, self.lse, rows, out, lse)

    def add_block(
        self,
        kernel: BlockKernel,
        spec: BlockSpec,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [N, Hkv, D]
        v: torch.Tensor,  # [N, Hkv, D]
        scale: float,
    ) -> None:
        """Run one block and merge it."""
        out, lse = kernel.forward(
            _take(q, spec.q_rows),
            _take(k, spec.kv_rows),
            _take(v, spec.kv_rows),
            spec.cu_q,
            spec.cu_k,
            spec.max_q,
            spec.max_k,
            spec.causal,
            scale,
        )
        self.add(spec.q_rows, out, lse)

    def add_branch(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        branch_k: Tensors,  # J × [T, Hkv, D]
        branch_v: Tensors,
        scale: float,
    ) -> None:
        """Merge the branch part, if any (J = 0: nothing)."""
        if branch_k:
            self.add(None, *branch_forward(q, branch_k, branch_v, scale))


def block_backward(
    kernel: BlockKernel,
    spec: BlockSpec,
    dout: torch.Tensor,  # [T, Hq, D]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    out: torch.Tensor,  # [T, Hq, D] final
    lse: torch.Tensor,  # [T, Hq] final
    dq: torch.Tensor,  # [T, Hq, D] accumulator, updated in place
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # dk, dv of the block's K/V rows [Tk_block, Hkv, D]
    """Gradients of one block with the final (O, L); dq is accumulated, dk/dv returned."""
    rows = spec.q_rows
    dq_b, dk_b, dv_b = kernel.backward(
        _take(dout, rows),
        _take(q, rows),
        _take(k, spec.kv_rows),
        _take(v, spec.kv_rows),
        _take(out, rows),
        _take(lse, rows),
        spec.cu_q,
        spec.cu_k,
        spec.max_q,
        spec.max_k,
        spec.causal,
        scale,
    )
    if rows is None:
        dq += dq_b
    else:
        dq.index_add_(0, rows, dq_b.to(dq.dtype))
    return dk_b, dv_b


def branch_grads(
    dout: torch.Tensor,  # [T, Hq, D]
    q: torch.Tensor,  # [T, Hq, D]
    branch: list[torch.Tensor],  # J branch keys then J branch values
    out: torch.Tensor,  # [T, Hq, D] final
    lse: torch.Tensor,  # [T, Hq] final
    dq: torch.Tensor,  # [T, Hq, D] accumulator, updated in place
    scale: float,
) -> Tensors:
    """Gradients of the flattened branch inputs of an attention Function (dq accumulated)."""
    if not branch:
        return ()
    j = len(branch) // 2
    d_bk, d_bv = branch_backward(dout, q, branch[:j], branch[j:], out, lse, dq, scale)
    return (*d_bk, *d_bv)


class RingAttention(torch.autograd.Function):
    """Zigzag ring attention over the main K/V with the rank-local branch merged.

    ``apply(q, k, v, geometry, comm, kernel, scale, *branch_k, *branch_v) -> (out, lse)`` with
    J branch keys then J branch values ([T, Hkv, D] each); ``out`` [T, Hq, D] in q's dtype,
    ``lse`` [T, Hq] (float32/float64, no gradient).
    """

    @staticmethod
    def forward(ctx, q, k, v, geometry, comm, kernel, scale, *branch):
        branch_k, branch_v = branch[: len(branch) // 2], branch[len(branch) // 2 :]
        acc = PartialAttention()
        for src, k_src, v_src in comm.circulate(k, v):
            acc.add_block(kernel, geometry.ring_block(src), q, k_src, v_src, scale)
        acc.add_branch(q, branch_k, branch_v, scale)
        out, lse = acc.out.to(q.dtype), acc.lse
        ctx.save_for_backward(q, k, v, out, lse, *branch)
        ctx.geometry, ctx.comm, ctx.kernel, ctx.scale = geometry, comm, kernel, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *branch = ctx.saved_tensors
        geometry, comm, kernel, scale = ctx.geometry, ctx.comm, ctx.kernel, ctx.scale
        dt = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        grads = AccumulatorRing(comm, dt)
        for src, k_src, v_src in comm.circulate(k, v):
            spec = geometry.ring_block(src)
            dk_b, dv_b = block_backward(kernel, spec, dout, q, k_src, v_src, out, lse, dq, scale)
            if spec.kv_rows is not None:  # front half only: scatter into full-block gradients
                dk_b = dk_b.new_zeros(k.shape, dtype=dt).index_copy_(0, spec.kv_rows, dk_b.to(dt))
                dv_b = dv_b.new_zeros(v.shape, dtype=dt).index_copy_(0, spec.kv_rows, dv_b.to(dt))
            grads.add(dk_b, dv_b)  # [T, Hkv, D] each
            del dk_b, dv_b  # sent or added: not kept alive through the next block
        dk, dv = grads.result()
        d_branch = branch_grads(dout, q, branch, out, lse, dq, scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, *d_branch
