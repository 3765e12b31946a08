"""Block attention kernels: one (query block × key block) piece of a ring, behind one interface.

A *block* is a packed query tensor and a packed key/value tensor with the same number ``B`` of
segments (``cu_q`` / ``cu_k``, [B+1]); query segment b attends only to key segment b.  With
``causal=True`` the segments have equal lengths and query offset i sees key offsets ≤ i (top-left
causal); otherwise every query of a segment sees every key of its segment.  A segment may have no
keys: its rows get ``lse = −inf`` and ``out = 0``.

    forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)          -> out, lse
    backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale) -> dq, dk, dv

``backward`` takes the **final** ``out`` and ``lse`` of the query rows — after every block of the
ring (and the branch) was merged — not the block's own.  Per row, with the block's scores s_j:

    p_j = exp(s_j − L),  D = ⟨dO, O⟩,  dv_j = p_j·dO,  ds_j = p_j·(⟨dO, v_j⟩ − D),
    dq = scale·Σ_j ds_j·k_j,  dk_j = scale·ds_j·q

which is the exact gradient of the merged attention restricted to this block's keys, so the
gradients of all blocks simply add.  GQA: ``Hq`` is a multiple of ``Hkv``; dk/dv are summed over the
query heads of each group.

Kernels:

- ``"torch"`` (:class:`TorchBlocks`): plain torch on any device.  Queries are processed in chunks of
  at most ``chunk`` rows (whole short segments, or slices of a long one) against the contiguous
  key window their segments can see, so temporaries are O(chunk × Tk) and a causal chunk stops at
  its last query's position.  Computes in float32 (float64 for float64 inputs).  A block larger
  than one chunk reads ``cu_q``/``cu_k`` to the host in a single transfer to plan its chunks.
- ``"flex"`` (:class:`FlexBlocks`): ``flex_attention`` with a segment(-causal) block mask, compiled
  on CUDA and eager on CPU (forward only there: torch has no CPU backward for flex).  The backward
  recomputes the block under autograd and feeds cotangents that reproduce the identity above
  (:func:`recompute_backward`).
- ``"flash"`` (:class:`FlashBlocks`): flash-attn 2 varlen kernels (CUDA, fp16/bf16), imported
  lazily; a missing package raises :func:`specrl.errors.missing_extra`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from functools import lru_cache
from typing import Protocol

import torch

from specrl.core.attention.merge import acc_dtype
from specrl.errors import missing_extra

KERNELS: tuple[str, ...] = ("torch", "flex", "flash")


class BlockKernel(Protocol):
    """Forward and final-(O, L) backward of one packed attention block."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [Tq, Hq, D]
        k: torch.Tensor,  # [Tk, Hkv, D]
        v: torch.Tensor,  # [Tk, Hkv, D]
        cu_q: torch.Tensor,  # [B+1] int64
        cu_k: torch.Tensor,  # [B+1] int64
        max_q: int,
        max_k: int,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # out [Tq, Hq, D], lse [Tq, Hq] (≥ fp32)
        ...

    def backward(
        self,
        dout: torch.Tensor,  # [Tq, Hq, D]
        q: torch.Tensor,  # [Tq, Hq, D]
        k: torch.Tensor,  # [Tk, Hkv, D]
        v: torch.Tensor,  # [Tk, Hkv, D]
        out: torch.Tensor,  # [Tq, Hq, D] final merged output of these rows
        lse: torch.Tensor,  # [Tq, Hq] final merged log-sum-exp of these rows
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # dq, dk, dv
        ...


def segments(cu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment id and offset inside the segment of each of ``n`` packed rows, on device."""
    t = torch.arange(n, device=cu.device)
    seg = torch.searchsorted(cu[1:], t, right=True)  # [n]
    return seg, t - cu[seg]


def _final_lse_for_backward(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows that saw no key anywhere (L = −inf) get L = +inf so that exp(s − L) = 0."""
    lse = lse.to(dtype)
    return torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)


class TorchBlocks:
    """Chunked plain-torch block kernel (CPU and GPU)."""

    name = "torch"

    def __init__(self, chunk: int = 64) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be ≥ 1, got {chunk}")
        self.chunk = chunk

    def _windows(
        self, cu_q: torch.Tensor, cu_k: torch.Tensor, tq: int, tk: int, causal: bool
    ) -> list[tuple[int, int, int, int]]:
        """(q_start, q_end, k_start, k_end) per query chunk: the keys its segments can see.

        A chunk is either a run of whole consecutive segments with at most ``chunk`` rows in
        total, or ``chunk`` rows of one longer segment (causal: its window ends at the last
        row's own position), so no chunk straddles into a long neighbour's keys.
        """
        if tq <= self.chunk:
            return [(0, tq, 0, tk)]
        bounds_q, bounds_k = torch.stack([cu_q, cu_k]).tolist()  # one host transfer
        windows: list[tuple[int, int, int, int]] = []
        run: list[int] | None = None  # [q_start, q_end, k_start, k_end] of short segments
        for qa, qb, ka, kb in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:], strict=False):
            if run is not None and (qb - run[0] > self.chunk or qb - qa > self.chunk):
                windows.append(tuple(run))
                run = None
            if qb - qa > self.chunk:
                for a in range(qa, qb, self.chunk):
                    b = min(a + self.chunk, qb)
                    windows.append((a, b, ka, min(kb, ka + b - qa) if causal else kb))
            elif run is None:
                run = [qa, qb, ka, kb]
            else:
                run[1], run[3] = qb, kb
        if run is not None:
            windows.append(tuple(run))
        return [w for w in windows if w[1] > w[0] and w[3] > w[2]]

    def _scores(
        self,
        qc: torch.Tensor,  # [n, Hkv, G, D]
        kc: torch.Tensor,  # [m, Hkv, D]
        seg_q: torch.Tensor,  # [n]
        off_q: torch.Tensor,  # [n]
        seg_k: torch.Tensor,  # [m]
        off_k: torch.Tensor,  # [m]
        causal: bool,
        scale: float,
    ) -> torch.Tensor:  # [n, Hkv, G, m], −inf where masked
        s = torch.einsum("qhgd,khd->qhgk", qc, kc).mul_(scale)
        allowed = seg_q[:, None] == seg_k[None, :]  # [n, m]
        if causal:
            allowed &= off_k[None, :] <= off_q[:, None]
        return s.masked_fill_(~allowed[:, None, None, :], -math.inf)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        tq, hq, d = q.shape
        tk, hkv = k.shape[0], k.shape[1]
        g = hq // hkv
        dt = acc_dtype(q.dtype)
        out = torch.zeros(tq, hkv, g, d, dtype=dt, device=q.device)
        lse = torch.full((tq, hkv, g), -math.inf, dtype=dt, device=q.device)
        if tq == 0 or tk == 0:
            return out.view(tq, hq, d), lse.view(tq, hq)
        seg_q, off_q = segments(cu_q, tq)
        seg_k, off_k = segments(cu_k, tk)
        for a, b, lo, hi in self._windows(cu_q, cu_k, tq, tk, causal):
            qc = q[a:b].to(dt).view(b - a, hkv, g, d)
            s = self._scores(
                qc,
                k[lo:hi].to(dt),
                seg_q[a:b],
                off_q[a:b],
                seg_k[lo:hi],
                off_k[lo:hi],
                causal,
                scale,
            )
            row_max = s.amax(-1, keepdim=True)  # [n, Hkv, G, 1]; −inf on rows without keys
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            p = s.sub_(row_max).exp_()  # unnormalized probabilities, 0 where masked
            denom = p.sum(-1)  # [n, Hkv, G]
            o = torch.einsum("qhgk,khd->qhgd", p, v[lo:hi].to(dt))
            out[a:b] = o / torch.where(denom > 0, denom, torch.ones_like(denom)).unsqueeze(-1)
            lse[a:b] = denom.log() + row_max.squeeze(-1)  # log 0 = −inf for rows without keys
        return out.view(tq, hq, d), lse.view(tq, hq)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        tq, hq, d = q.shape
        tk, hkv = k.shape[0], k.shape[1]
        g = hq // hkv
        dt = acc_dtype(q.dtype)
        dq = torch.zeros(tq, hkv, g, d, dtype=dt, device=q.device)
        dk = torch.zeros(tk, hkv, d, dtype=dt, device=q.device)
        dv = torch.zeros(tk, hkv, d, dtype=dt, device=q.device)
        if tq == 0 or tk == 0:
            return dq.view(tq, hq, d), dk, dv
        seg_q, off_q = segments(cu_q, tq)
        seg_k, off_k = segments(cu_k, tk)
        final_lse = _final_lse_for_backward(lse, dt).view(tq, hkv, g, 1)
        for a, b, lo, hi in self._windows(cu_q, cu_k, tq, tk, causal):
            n = b - a
            qc = q[a:b].to(dt).view(n, hkv, g, d)
            kc, vc = k[lo:hi].to(dt), v[lo:hi].to(dt)
            do = dout[a:b].to(dt).view(n, hkv, g, d)
            delta = (do * out[a:b].to(dt).view(n, hkv, g, d)).sum(-1, keepdim=True)  # D = ⟨dO, O⟩
            s = self._scores(
                qc, kc, seg_q[a:b], off_q[a:b], seg_k[lo:hi], off_k[lo:hi], causal, scale
            )
            p = s.sub_(final_lse[a:b]).exp_()  # [n, Hkv, G, m] = exp(s − L)
            dv[lo:hi] += torch.einsum("qhgk,qhgd->khd", p, do)
            ds = torch.einsum("qhgd,khd->qhgk", do, vc).sub_(delta).mul_(p)
            dq[a:b] = torch.einsum("qhgk,khd->qhgd", ds, kc).mul_(scale)
            dk[lo:hi] += torch.einsum("qhgk,qhgd->khd", ds, qc).mul_(scale)
        return dq.view(tq, hq, d), dk, dv


def recompute_backward(
    block_forward: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
    ],
    dout: torch.Tensor,  # [Tq, Hq, D]
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,  # [Tq, Hq, D] final
    lse: torch.Tensor,  # [Tq, Hq] final
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Final-(O, L) block backward for a kernel that only offers autograd through (o_b, lse_b).

    Recompute the block's own (o_b, lse_b) and backpropagate the cotangents
    ``w·dO`` into o_b and ``w·(⟨dO, o_b⟩ − ⟨dO, O⟩)`` into lse_b with ``w = exp(lse_b − L)``:
    the block's softmax backward then yields exactly ds_j = exp(s_j − L)(⟨dO, v_j⟩ − ⟨dO, O⟩).
    """
    with torch.enable_grad():
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        o_b, lse_b = block_forward(qg, kg, vg)
        dt = acc_dtype(q.dtype)
        lse_b32 = lse_b.detach().to(dt)
        final = _final_lse_for_backward(lse, dt)
        w = torch.where(torch.isneginf(lse_b32), torch.zeros_like(lse_b32), (lse_b32 - final).exp())
        do = dout.to(dt)
        delta = (do * out.to(dt)).sum(-1)  # [Tq, Hq]
        delta_b = (do * o_b.detach().to(dt)).sum(-1)
        grad_o = (w.unsqueeze(-1) * do).to(o_b.dtype)
        grad_lse = (w * (delta_b - delta)).to(lse_b.dtype)
        torch.autograd.backward([o_b, lse_b], [grad_o, grad_lse])
    return qg.grad, kg.grad, vg.grad


@lru_cache(maxsize=1)
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class FlexBlocks:
    """flex_attention with a per-segment (causal) block mask."""

    name = "flex"

    def _run(self, q, k, v, cu_q, cu_k, causal, scale):
        from torch.nn.attention import flex_attention as fa

        tq, hq, _ = q.shape
        tk, hkv = k.shape[0], k.shape[1]
        seg_q, off_q = segments(cu_q, tq)
        seg_k, off_k = segments(cu_k, tk)

        def mask_mod(b, h, qi, ki):
            ok = seg_q[qi] == seg_k[ki]
            if causal:
                ok = ok & (off_k[ki] <= off_q[qi])
            return ok

        # compiled on CUDA so the mask is built block-sparse, never as a [Tq, Tk] tensor
        block = fa.create_block_mask(
            mask_mod, None, None, tq, tk, device=q.device, _compile=q.is_cuda
        )
        args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        kwargs = {"block_mask": block, "scale": scale, "enable_gqa": hq != hkv}
        if hasattr(fa, "AuxRequest"):
            kwargs["return_aux"] = fa.AuxRequest(lse=True)
        else:  # torch < 2.9
            kwargs["return_lse"] = True
        if q.is_cuda:
            out, aux = _compiled_flex()(*args, **kwargs)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # eager flex warns that it is unfused
                out, aux = fa.flex_attention(*args, **kwargs)
        lse = aux.lse if hasattr(aux, "lse") else aux  # [1, Hq, Tq]
        out, lse = out[0].transpose(0, 1), lse[0].transpose(0, 1)  # [Tq, Hq, D], [Tq, Hq]
        empty = torch.isneginf(lse)
        return out.masked_fill(empty.unsqueeze(-1), 0.0), lse

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        with torch.no_grad():
            out, lse = self._run(q, k, v, cu_q, cu_k, causal, scale)
        return out, lse.to(acc_dtype(q.dtype))

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        if not q.is_cuda:
            raise NotImplementedError(
                "flex_attention has no CPU backward in torch; use kernel='torch' on CPU"
            )
        return recompute_backward(
            lambda q_, k_, v_: self._run(q_, k_, v_, cu_q, cu_k, causal, scale),
            dout,
            q,
            k,
            v,
            out,
            lse,
        )


class FlashBlocks:
    """flash-attn 2 varlen forward/backward (CUDA, fp16/bf16, head dim a multiple of 8)."""

    name = "flash"

    def __init__(self) -> None:
        try:
            from flash_attn import flash_attn_interface
        except ImportError as e:
            raise missing_extra("flash_attn", "flash") from e
        self._fa = flash_attn_interface

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out, lse, _, _ = self._fa._flash_attn_varlen_forward(
            q,
            k,
            v,
            cu_q.to(torch.int32),
            cu_k.to(torch.int32),
            max_q,
            max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
        )
        lse = lse.transpose(0, 1)  # [Hq, Tq] → [Tq, Hq]; flash marks rows without keys +inf
        empty = torch.isinf(lse)
        lse = lse.masked_fill(empty, -math.inf)
        return out.masked_fill(empty.unsqueeze(-1), 0.0), lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_varlen_backward(
            dout.to(q.dtype).contiguous(),
            q,
            k,
            v,
            out.to(q.dtype).contiguous(),
            _final_lse_for_backward(lse, torch.float32).transpose(0, 1).contiguous(),  # [Hq, Tq]
            dq,
            dk,
            dv,
            cu_q.to(torch.int32),
            cu_k.to(torch.int32),
            max_q,
            max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
        )
        return dq, dk, dv


def get_kernel(kernel: str | BlockKernel) -> BlockKernel:
    """A block kernel by name (``"torch"``, ``"flex"``, ``"flash"``), or the instance given."""
    if not isinstance(kernel, str):
        return kernel
    if kernel == "torch":
        return TorchBlocks()
    if kernel == "flex":
        return FlexBlocks()
    if kernel == "flash":
        return FlashBlocks()
    raise ValueError(f"unknown block kernel {kernel!r}; choose one of {KERNELS}")


def forward(
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    cu_q: torch.Tensor,  # [B+1]
    cu_k: torch.Tensor,  # [B+1]
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
    *,
    kernel: str | BlockKernel = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block; returns ``out`` [Tq, Hq, D] and ``lse`` [Tq, Hq] (≥ float32)."""
    return get_kernel(kernel).forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)


def backward(
    dout: torch.Tensor,  # [Tq, Hq, D]
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    out: torch.Tensor,  # [Tq, Hq, D] final merged
    lse: torch.Tensor,  # [Tq, Hq] final merged
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
    *,
    kernel: str | BlockKernel = "torch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the final merged (out, lse) of its query rows."""
    return get_kernel(kernel).backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale
    )
