"""Attention for the draft's training-time test (TTT), single-process or context-parallel.

The EAGLE-3 draft has one attention layer unrolled K TTT steps.  Step k's queries attend to the
*main* K/V — the step-0 keys and values, the same for every step — causally within their packed
sequence, plus their own branch keys K^1_i..K^k_i (docs/draft.md).  A :class:`TTTSession` holds the
main K/V once; each :meth:`TTTSession.attend` is one step::

    session = ttt_session(k0, v0, plan.local, cp=CPContext.from_group(group), mode="ring")
    out0 = session.attend(q0)                                   # step 0: no branch
    out1 = session.attend(q1, branch_k=k1[None], branch_v=v1[None])
    out2 = session.attend(q2, branch_k=[k1, k2], branch_v=[v1, v2])   # or stacked [2, T, Hkv, D]

Gradients flow to q, the main K/V (summed over all steps) and the branch K/V.  With context
parallelism the tensors are the rank's zigzag shard and ``layout`` is ``ZigzagPlan.local``.

Communication modes for the main K/V (docs/parallelism.md):

- ``"ring"``: every step runs the ring (:class:`~specrl.core.attention.ring.RingAttention`):
  O(S/cp) memory, k× the K/V traffic.
- ``"ring_once"``: the first step rings the K/V once and keeps all received blocks ([2, S, Hkv, D]
  per rank); every step attends locally against them.  The kept blocks are an autograd output, so
  the dK/dV of all steps accumulate before its single backward, which passes one accumulator
  round the ring.
- ``"gather"``: all-gather the main K/V once; backward is one reduce-scatter of the dK/dV
  accumulated over all steps.  O(S) memory, one collective each way.

Both kept-K/V modes attend with local q × the whole K/V in at most three kernel calls
(:meth:`RingGeometry.gathered_blocks`).  With cp = 1 every mode is local causal attention plus the
branch merge with linear memory (no S×S score matrix), which is also the single-process TTT path.

:func:`ring_attention` is the same ring without a branch, for the target model's own layers;
:func:`allgather_attention` is the baseline of prior frameworks (full K/V all-gathered on every
rank for every call), the baseline ``benchmarks/cp_attention.py`` measures against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from specrl.core.attention.blocks import BlockKernel, get_kernel
from specrl.core.attention.layout import PackedLayout
from specrl.core.attention.merge import acc_dtype
from specrl.core.attention.ring import (
    AccumulatorRing,
    PartialAttention,
    RingAttention,
    RingComm,
    RingGeometry,
    block_backward,
    branch_grads,
)

Mode = Literal["ring", "ring_once", "gather"]
MODES: tuple[str, ...] = ("ring", "ring_once", "gather")

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CPContext:
    """The context-parallel group of this rank (``group=None`` with ``size=1``: no CP)."""

    group: dist.ProcessGroup | None
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"need 0 ≤ rank < size, got rank={self.rank}, size={self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a CP context of size > 1 needs a process group")

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None) -> CPContext:
        """The context of this process in ``group`` (None: a single-rank context)."""
        if group is None:
            return cls(None)
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def comm(self) -> RingComm:
        return RingComm(self.group, self.rank, self.size)


class _RingCollectKV(torch.autograd.Function):
    """Ring the main K/V once; output [2, cp·T, Hkv, D]: K then V of every rank, rank-major.

    Backward passes one dK/dV accumulator round the ring (cp hops)."""

    @staticmethod
    def forward(ctx, k, v, comm):
        t = k.shape[0]
        kv_all = k.new_empty((2, comm.size * t, *k.shape[1:]))
        for src, k_src, v_src in comm.circulate(k, v):
            kv_all[0, src * t : (src + 1) * t] = k_src
            kv_all[1, src * t : (src + 1) * t] = v_src
        ctx.comm, ctx.t = comm, t
        return kv_all

    @staticmethod
    def backward(ctx, grad):  # grad [2, cp·T, Hkv, D]
        comm, t = ctx.comm, ctx.t
        grads = AccumulatorRing(comm, acc_dtype(grad.dtype))
        for s in range(comm.size):
            src = (comm.rank - s) % comm.size
            grads.add(grad[0, src * t : (src + 1) * t], grad[1, src * t : (src + 1) * t])
        dk, dv = grads.result()
        return dk.to(grad.dtype), dv.to(grad.dtype), None


class _AllGatherKV(torch.autograd.Function):
    """All-gather the main K/V: [2, cp·T, Hkv, D]; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, k, v, comm):
        kv_all = k.new_empty((2, comm.size * k.shape[0], *k.shape[1:]))
        _all_gather(kv_all[0], k.contiguous(), group=comm.group)
        _all_gather(kv_all[1], v.contiguous(), group=comm.group)
        ctx.comm = comm
        return kv_all

    @staticmethod
    def backward(ctx, grad):  # grad [2, cp·T, Hkv, D]
        comm = ctx.comm
        t = grad.shape[1] // comm.size
        dk = grad.new_empty((t, *grad.shape[2:]))
        dv = torch.empty_like(dk)
        _reduce_scatter(dk, grad[0].contiguous(), group=comm.group)
        _reduce_scatter(dv, grad[1].contiguous(), group=comm.group)
        return dk, dv, None


class _GatheredAttention(torch.autograd.Function):
    """Local q × the whole main K/V ([2, cp·T, Hkv, D]) with the zigzag mask, plus the branch.

    ``apply(q, kv_all, geometry, kernel, scale, *branch_k, *branch_v) -> (out, lse)``.
    """

    @staticmethod
    def forward(ctx, q, kv_all, geometry, kernel, scale, *branch):
        acc = PartialAttention()
        for spec in geometry.gathered_blocks():
            acc.add_block(kernel, spec, q, kv_all[0], kv_all[1], scale)
        acc.add_branch(q, branch[: len(branch) // 2], branch[len(branch) // 2 :], scale)
        out, lse = acc.out.to(q.dtype), acc.lse
        ctx.save_for_backward(q, kv_all, out, lse, *branch)
        ctx.geometry, ctx.kernel, ctx.scale = geometry, kernel, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv_all, out, lse, *branch = ctx.saved_tensors
        dt = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        dkv = torch.zeros(kv_all.shape, dtype=dt, device=q.device)
        for spec in ctx.geometry.gathered_blocks():
            dk_b, dv_b = block_backward(
                ctx.kernel, spec, dout, q, kv_all[0], kv_all[1], out, lse, dq, ctx.scale
            )
            dkv[0].index_add_(0, spec.kv_rows, dk_b.to(dt))
            dkv[1].index_add_(0, spec.kv_rows, dv_b.to(dt))
        d_branch = branch_grads(dout, q, branch, out, lse, dq, ctx.scale)
        return dq.to(q.dtype), dkv.to(kv_all.dtype), None, None, None, *d_branch


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"need q [T, Hq, D], k/v [T, Hkv, D]; got {q.shape}, {k.shape}, {v.shape}")
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not match k/v {tuple(k.shape)}")
    if layout.num_tokens != t:
        raise ValueError(f"layout has {layout.num_tokens} tokens, q has {t}")


Branch = torch.Tensor | Sequence[torch.Tensor] | None


def _branch(k: torch.Tensor, branch_k: Branch, branch_v: Branch) -> tuple[torch.Tensor, ...]:
    """Branch K/V as one flat tuple (J keys, then J values) of [T, Hkv, D] tensors.

    Accepts a stacked [J, T, Hkv, D] tensor (unbound into views) or a sequence of J tensors;
    passing the per-step tensors themselves avoids saving a stacked copy at every step.
    """
    if (branch_k is None) != (branch_v is None):
        raise ValueError("pass both branch_k and branch_v, or neither")
    if branch_k is None:
        return ()
    keys = branch_k.unbind(0) if isinstance(branch_k, torch.Tensor) else tuple(branch_k)
    vals = branch_v.unbind(0) if isinstance(branch_v, torch.Tensor) else tuple(branch_v)
    if len(keys) != len(vals) or any(x.shape != k.shape for x in (*keys, *vals)):
        raise ValueError(
            f"branch K/V must be J × [{', '.join(map(str, k.shape))}] (or stacked [J, …]); "
            f"got {[tuple(x.shape) for x in keys]} and {[tuple(x.shape) for x in vals]}"
        )
    return (*keys, *vals)


class TTTSession:
    """The main K/V of one draft attention layer, attended by every TTT step (see module doc).

    One session per forward pass: the kept-K/V modes reuse the K/V collected by the first
    :meth:`attend` (and its autograd node) for every later step.
    """

    def __init__(
        self,
        k: torch.Tensor,  # [T, Hkv, D] step-0 keys (this rank's zigzag shard under CP)
        v: torch.Tensor,  # [T, Hkv, D]
        layout: PackedLayout,  # local layout (ZigzagPlan.local under CP)
        cp: CPContext,
        mode: Mode,
        kernel: BlockKernel,
        scale: float | None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown TTT mode {mode!r}; choose one of {MODES}")
        self.k, self.v, self.layout, self.cp, self.mode = k, v, layout, cp, mode
        self.kernel = kernel
        self.scale = scale
        self._comm = cp.comm()
        self._geometry = RingGeometry(layout, cp.size, cp.rank)
        self._kv_all: torch.Tensor | None = None  # [2, cp·T, Hkv, D] for the kept-K/V modes

    def attend(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        branch_k: Branch = None,  # [J, T, Hkv, D] or J × [T, Hkv, D]
        branch_v: Branch = None,  # [J, T, Hkv, D] or J × [T, Hkv, D]
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One TTT step: ``out`` [T, Hq, D] (and ``lse`` [T, Hq] without gradient)."""
        _check(q, self.k, self.v, self.layout)
        branch = _branch(self.k, branch_k, branch_v)
        scale = 1.0 / math.sqrt(q.shape[-1]) if self.scale is None else self.scale
        if self.cp.size == 1 or self.mode == "ring":
            args = (self._geometry, self._comm, self.kernel, scale)
            out, lse = RingAttention.apply(q, self.k, self.v, *args, *branch)
        else:
            if self._kv_all is None:
                collect = _RingCollectKV if self.mode == "ring_once" else _AllGatherKV
                self._kv_all = collect.apply(self.k, self.v, self._comm)
            args = (self._geometry, self.kernel, scale)
            out, lse = _GatheredAttention.apply(q, self._kv_all, *args, *branch)
        return (out, lse) if return_lse else out


def ttt_session(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    layout: PackedLayout,
    *,
    cp: CPContext | None = None,
    mode: Mode = "ring",
    kernel: str | BlockKernel = "torch",
    scale: float | None = None,
) -> TTTSession:
    """A TTT session over the main K/V (see module doc); ``scale`` defaults to 1/√D."""
    return TTTSession(k, v, layout, cp or CPContext(None), mode, get_kernel(kernel), scale)


def ring_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    layout: PackedLayout,
    cp: CPContext | None = None,
    *,
    kernel: str | BlockKernel = "torch",
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Packed causal attention over a zigzag-sharded batch by the ring (no branch)."""
    return ttt_session(k, v, layout, cp=cp, mode="ring", kernel=kernel, scale=scale).attend(
        q, return_lse=return_lse
    )


def allgather_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    layout: PackedLayout,
    cp: CPContext | None = None,
    *,
    branch_k: Branch = None,  # [J, T, Hkv, D] or J × [T, Hkv, D]
    branch_v: Branch = None,
    kernel: str | BlockKernel = "torch",
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Baseline: all-gather the full K/V on every call (per layer and per TTT step), then local
    q × full K/V.  Exact, but every call keeps a full-length K/V copy for backward."""
    cp = cp or CPContext(None)
    _check(q, k, v, layout)
    branch = _branch(k, branch_k, branch_v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    comm, geometry, kern = cp.comm(), RingGeometry(layout, cp.size, cp.rank), get_kernel(kernel)
    if cp.size == 1:
        out, lse = RingAttention.apply(q, k, v, geometry, comm, kern, scale, *branch)
    else:
        kv_all = _AllGatherKV.apply(k, v, comm)
        out, lse = _GatheredAttention.apply(q, kv_all, geometry, kern, scale, *branch)
    return (out, lse) if return_lse else out
