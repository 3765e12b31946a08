"""Training-time-test (TTT) targets and loss for the EAGLE-3 draft (docs/draft.md).

Alignment, for a packed sequence x_0..x_{S−1} with taps f_t and target logits z_t (z_t predicts
x_{t+1}): the draft at index t, step k, reads token x_{t+k+1} and (k = 0) feature f_t, sits at
RoPE position t + k, and is taught by the teacher z_{t+k+1}.  ``loss_mask[j]`` marks positions j
whose prediction z_j is learned (response tokens); step k at index t uses ``loss_mask[t+k+1]``.
No shift crosses a sequence boundary; shifted-out rows have mask 0.

Loss per step: soft cross-entropy (forward KL up to a constant) against the teacher restricted
to the draft vocabulary and renormalized, or total variation 1 − Σ min(p, q) (optimises
acceptance directly); rows whose teacher argmax lies outside the draft vocabulary are masked.
Steps are weighted ``decay**k``.  Metrics: top-1 agreement acc_k and simulated
τ = 1 + Σ_k Π_{j≤k} acc_j (comparable to the serving τ = 1 + accepted/drafts).

Sums and counts are kept apart so data/context-parallel ranks can all-reduce them and reproduce
the single-process loss exactly (``reduce`` hook).  Under context parallelism the teacher shift
crosses zigzag shards: :class:`HaloShift` is the ``shift`` hook for that case — a K-row halo
exchange with the two ring neighbours, O(T_local·V_draft) per rank — and falls back to
:class:`GatheredShift` (all-gather the whole teacher, O(T·V_draft)) when a chunk is shorter than K.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from specrl.core.attention import CPContext, PackedLayout
from specrl.core.attention.zigzag import ZigzagPlan, shift_within_sequences
from specrl.models.draft import Eagle3Draft, TTTOutput

LossKind = Literal["ce", "tv"]
Shift = Callable[[torch.Tensor, int], torch.Tensor]
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class TTTInputs:
    step_ids: torch.Tensor  # [K, T] x_{t+k+1} (0 where shifted out)
    step_mask: torch.Tensor  # [K, T] loss_mask[t+k+1] (0 where shifted out)


def ttt_inputs(
    ids: torch.Tensor,  # [T] packed token ids
    loss_mask: torch.Tensor,  # [T] 1 where the prediction at this position is learned
    layout: PackedLayout,
    steps: int,
) -> TTTInputs:
    """Global TTT shifts (compute before any CP sharding)."""
    step_ids = torch.stack([shift_within_sequences(ids, layout, k + 1, 0) for k in range(steps)])
    m = loss_mask.to(torch.float32)
    step_mask = torch.stack([shift_within_sequences(m, layout, k + 1, 0.0) for k in range(steps)])
    return TTTInputs(step_ids, step_mask)


class GatheredShift:
    """``shift(x, n)`` for :func:`ttt_loss` under context parallelism: each teacher tensor (a
    rank's zigzag shard) is gathered over the cp group once, shifted within its global sequences
    and sharded back.  O(T·V_draft) per rank whatever cp: :class:`HaloShift`'s fallback."""

    def __init__(self, plan: ZigzagPlan, layout: PackedLayout, cp: CPContext) -> None:
        """``plan``: this rank's zigzag plan of the global ``layout`` over the ring ``cp``."""
        self.plan, self.layout, self.cp = plan, layout, cp
        self._full: list[tuple[torch.Tensor, torch.Tensor]] = []  # (shard, global) pairs

    def __call__(self, x: torch.Tensor, n: int) -> torch.Tensor:  # x: [T_local, ...]
        full = next((g for local, g in self._full if local is x), None)
        if full is None:
            gathered = x.new_empty((self.cp.size * x.shape[0], *x.shape[1:]))
            _all_gather(gathered, x.contiguous(), group=self.cp.group)
            full = self.plan.unshard(gathered)  # [T, ...] in global order
            self._full.append((x, full))
        return self.plan.shard(shift_within_sequences(full, self.layout, n, 0))


class HaloShift:
    """``shift(x, n)`` for :func:`ttt_loss` under context parallelism by a K-row halo exchange.

    Rank r holds chunk r (front) and chunk 2cp−1−r (back) of every sequence (zigzag,
    :mod:`specrl.core.attention.zigzag`).  A row at offset w of a chunk of c rows shifted by
    n ≤ c reads offset w + n of the same chunk, or — when w + n ≥ c — offset w + n − c < n of the
    chunk's successor in global order:

    - front chunk r → chunk r+1: rank r+1's front chunk, or for r = cp−1 this rank's own back
      chunk (local: the back chunk follows the front one in the local layout);
    - back chunk 2cp−1−r → chunk 2cp−r: rank r−1's back chunk; none for r = 0 (past the end).

    So every rank sends the first K = ``max_shift`` rows of each sequence's front chunk to rank
    r−1 and of its back chunk to rank r+1, and receives the same from r+1 and r−1: one
    ``batch_isend_irecv`` of four ops per tensor on every rank (cyclic neighbours, so ranks 0 and
    cp−1 post the same ops as the others; the rows that wrap around are never read).  cp = 1
    communicates nothing.  Each tensor is exchanged once and memoized (the K steps of
    :func:`ttt_loss` shift the same teacher).  The shifted view is built from indices precomputed
    here for every n: ``x[local_index]`` with the rows that cross a chunk border overwritten from
    the halo (2·B·n rows at most) and rows shifted past the real end of their sequence, or into
    its padding, set to 0 — exactly ``plan.shard(shift_within_sequences(global, layout, n, 0))``.
    The halo is not concatenated to ``x``: that would copy the whole shard per teacher tensor.

    Per rank: the output [T_local, ...] plus 2·B·K halo rows kept per tensor, against the
    gathered [T, ...] teacher (and its shifted copies) of :class:`GatheredShift`.

    Fallback: when some sequence's chunk c_b = padded_b / 2cp is shorter than K (short sequences
    or large cp) a shift can span several chunks; every call then goes through
    :class:`GatheredShift`.  That is decided once per plan (one host sync, ``gathered``), from
    global lengths, so all ranks take the same path.
    """

    _FRONT_TAG, _BACK_TAG = 2, 3  # distinct from RingComm's K/V and gradient tags

    def __init__(
        self, plan: ZigzagPlan, layout: PackedLayout, cp: CPContext, max_shift: int
    ) -> None:
        """``plan``: this rank's zigzag plan of the global ``layout`` over the ring ``cp``;
        ``max_shift``: the largest n asked for (the number of TTT steps; 0 allows none)."""
        if max_shift < 0:
            raise ValueError(f"max_shift must be ≥ 0, got {max_shift}")
        self.cp, self.max_shift = cp, max_shift
        shortest = int(plan.chunk.min()) if plan.chunk.numel() else max_shift  # host sync
        self.gathered = cp.size > 1 and shortest < max_shift
        self._fallback = GatheredShift(plan, layout, cp) if self.gathered else None
        self._halos: list[tuple[torch.Tensor, torch.Tensor]] = []  # (shard, [2·B·K, ...] halo)
        self._index: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if self.gathered:
            return
        r, size, k = cp.rank, cp.size, max_shift
        cu = plan.local.cu_seqlens[:-1]  # [B] start of each local sequence (front chunk)
        chunk = plan.chunk  # [B] c_b
        nseq, n_local = chunk.numel(), plan.num_local
        steps = torch.arange(k, device=cu.device)
        self._send_front = (cu[:, None] + steps).flatten()  # [B·K] → rank r−1
        self._send_back = (cu[:, None] + chunk[:, None] + steps).flatten()  # [B·K] → rank r+1
        if size > 1:
            self._next = dist.get_global_rank(cp.group, (r + 1) % size)
            self._prev = dist.get_global_rank(cp.group, (r - 1) % size)

        # Every local row: its chunk offset w, chunk length c and room left in its real sequence.
        t = torch.arange(n_local, device=cu.device)
        seq = plan.local.seq_ids  # [T_local]
        o = t - cu[seq]
        c = chunk[seq]
        back = o >= c
        pos = torch.where(back, (2 * size - 1 - r) * c + o - c, r * c + o)  # global offset
        room = plan.lengths[seq] - pos  # [T_local] row t + n is real iff n < room
        seq_base = torch.arange(nseq, device=cu.device)[:, None] * k  # [B, 1] halo row of (b, 0)
        for n in range(1, k + 1):
            # rows w ≥ c − n of a chunk read row w + n − c of the successor chunk
            tail = torch.arange(n, device=cu.device)  # [n]
            dst, src = [], []
            if r < size - 1:  # front successor on rank r+1: halo rows [0, B·K)
                dst.append(cu[:, None] + chunk[:, None] - n + tail)
                src.append(seq_base + tail)
            if r > 0:  # back successor on rank r−1: halo rows [B·K, 2·B·K)
                dst.append(cu[:, None] + 2 * chunk[:, None] - n + tail)
                src.append(nseq * k + seq_base + tail)
            empty = t.new_empty(0)
            self._index.append(
                (
                    (t + n).clamp(max=max(n_local - 1, 0)),  # [T_local] same chunk, or r = cp−1
                    torch.cat([d.flatten() for d in dst]) if dst else empty,  # [≤ 2·B·n]
                    torch.cat([s.flatten() for s in src]) if src else empty,  # [≤ 2·B·n]
                    room > n,  # [T_local] bool
                )
            )

    def __call__(self, x: torch.Tensor, n: int) -> torch.Tensor:  # x: [T_local, ...]
        if not 1 <= n <= self.max_shift:
            raise ValueError(f"shift must be in 1..{self.max_shift}, got {n}")
        if self._fallback is not None:
            return self._fallback(x, n)
        local_index, dst, src, valid = self._index[n - 1]
        y = x.index_select(0, local_index)  # [T_local, ...]
        if self.cp.size > 1:  # every rank exchanges (the same four ops), or none does
            y.index_copy_(0, dst, self._halo(x).index_select(0, src))
        return y.masked_fill_(~valid.view(-1, *([1] * (y.dim() - 1))), 0)

    def _halo(self, x: torch.Tensor) -> torch.Tensor:
        """[2·B·K, ...]: the first K rows of every sequence's front chunk on rank r+1, then of
        every back chunk on rank r−1 (exchanged once per tensor)."""
        halo = next((h for local, h in self._halos if local is x), None)
        if halo is None:
            front = x.index_select(0, self._send_front)  # [B·K, ...]
            back = x.index_select(0, self._send_back)  # [B·K, ...]
            halo = x.new_empty((2 * front.shape[0], *x.shape[1:]))
            from_next, from_prev = halo.split(front.shape[0])
            g = self.cp.group
            ops = [
                dist.P2POp(dist.isend, front, self._prev, g, self._FRONT_TAG),
                dist.P2POp(dist.isend, back, self._next, g, self._BACK_TAG),
                dist.P2POp(dist.irecv, from_next, self._next, g, self._FRONT_TAG),
                dist.P2POp(dist.irecv, from_prev, self._prev, g, self._BACK_TAG),
            ]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            self._halos.append((x, halo))
        return halo


@dataclass
class Teacher:
    logits: torch.Tensor  # [T, Vd] target logits at the draft vocabulary's target ids
    in_vocab: torch.Tensor  # [T] float: target argmax lies in the draft vocabulary


def teacher_from_logits(target_logits: torch.Tensor, draft: Eagle3Draft) -> Teacher:
    """Restrict target logits [T, V] to the draft vocabulary (no gradient)."""
    z = target_logits.detach()
    sel = z.index_select(-1, draft.draft_to_target)
    in_vocab = draft.t2d[z.argmax(-1)].to(torch.float32)
    return Teacher(sel, in_vocab)


@dataclass
class TTTLoss:
    loss: torch.Tensor  # scalar, Σ_k decay^k · mean loss of step k
    step_loss: list[float]
    acc: list[float]  # top-1 agreement with the teacher per step
    count: list[float]  # valid rows per step (after reduction)

    @property
    def tau(self) -> float:
        """Simulated acceptance length 1 + Σ_k Π_{j≤k} acc_j."""
        tau, run = 1.0, 1.0
        for a in self.acc:
            run *= a
            tau += run
        return tau


def ttt_loss(
    out: TTTOutput,
    teacher: Teacher,
    inputs: TTTInputs,
    layout: PackedLayout,
    *,
    kind: LossKind = "ce",
    decay: float = 0.8,
    shift: Shift | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> TTTLoss:
    """The TTT loss; ``shift(x, n)`` moves teacher rows by n within sequences (CP: a halo
    exchange) and ``reduce`` sums [sums, counts] across ranks (identity single-process)."""
    shift = shift or (lambda x, n: shift_within_sequences(x, layout, n, 0))
    steps = len(out.logits)
    sums, hits, counts = [], [], []
    for k in range(steps):
        z = shift(teacher.logits, k + 1)  # [T, Vd] teacher z_{t+k+1}
        valid = inputs.step_mask[k] * shift(teacher.in_vocab, k + 1)  # [T]
        logits = out.logits[k]
        p = torch.softmax(z.to(logits.dtype), dim=-1)
        if kind == "ce":
            per_row = -(p * F.log_softmax(logits, dim=-1)).sum(-1)
        elif kind == "tv":
            per_row = 1.0 - torch.minimum(p, torch.softmax(logits, dim=-1)).sum(-1)
        else:
            raise ValueError(f"unknown TTT loss {kind!r}; choose ce or tv")
        v = valid.to(logits.dtype)
        sums.append((per_row * v).sum())
        with torch.no_grad():
            hits.append(((logits.argmax(-1) == z.argmax(-1)).to(logits.dtype) * v).sum())
            counts.append(v.sum())
    stats = torch.stack([torch.stack(hits), torch.stack(counts)]).detach()
    loss_sums = torch.stack(sums)
    if reduce is not None:
        stats = reduce(stats)
    hits_t, counts_t = stats[0], stats[1]
    denom = counts_t.clamp(min=1.0)
    weights = torch.tensor(
        [decay**k for k in range(steps)], dtype=loss_sums.dtype, device=loss_sums.device
    )
    # the local loss is exact after an all-reduce SUM of gradients (DDP/CP): Σ_ranks local = global
    loss = (weights * loss_sums / denom).sum()
    step_loss_t = loss_sums.detach()
    if reduce is not None:
        step_loss_t = reduce(step_loss_t)
    return TTTLoss(
        loss=loss,
        step_loss=(step_loss_t / denom).tolist(),
        acc=(hits_t / denom).tolist(),
        count=counts_t.tolist(),
    )
