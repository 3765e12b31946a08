"""Training-time-test (TTT) targets and loss for the EAGLE-3 draft (REFERENCE §3).

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
crosses zigzag shards: :class:`GatheredShift` is the ``shift`` hook for that case.
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
    and sharded back.  O(T·V_draft) per rank; a k-row halo exchange would move less."""

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
