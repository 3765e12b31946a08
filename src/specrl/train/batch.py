"""Rollout samples as training batches: packed, zigzag-sharded, or cut into pipeline microbatches.

A :class:`Sample` is one scored response.  :func:`pack` lays a minibatch of samples end to end
(``cu_seqlens`` layout, global position ids) with per-token labels, loss mask, behaviour
log-probs and advantages; row t of a sequence predicts its token t + 1, so a response of r
tokens after a prompt of p is learned on rows p − 1 … p + r − 2.  Under context parallelism
:meth:`PackedBatch.shard` keeps a rank's zigzag rows of every per-token tensor with one index
(pads: loss mask 0).  :func:`microbatches` cuts a minibatch into the pipeline's fixed number of
microbatches (:class:`PackedMicrobatch`, what ``PipelineCotrainer`` takes).

An empty minibatch or microbatch (possible with DAPO dynamic sampling) becomes one dummy token
with loss mask 0, so every rank still runs the same collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specrl.core.attention import PackedLayout, ZigzagPlan


@dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    old_logp: list[float]  # behaviour log-probs of the response tokens
    advantage: float


@dataclass
class PackedMicrobatch:
    """One packed microbatch as the data loader hands it over (global, unsharded)."""

    ids: torch.Tensor  # [T] int64 token ids of the sequences laid end to end
    lengths: list[int]  # sequence lengths (Σ = T)
    loss_mask: torch.Tensor  # [T] 1 where the prediction made at row t (of token t + 1) is learned
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # [T] extras for loss_fn


@dataclass
class PackedBatch:
    """Per-token training tensors of packed samples (or a rank's zigzag shard of them)."""

    ids: torch.Tensor  # [T] int64 token ids
    layout: PackedLayout  # [T] tokens in B sequences (global positions)
    labels: torch.Tensor  # [T] int64 token t + 1 of the same sequence (0 on its last row)
    mask: torch.Tensor  # [T] float32, 1 on rows that predict a response token
    old_logp: torch.Tensor  # [T] float32 behaviour log-prob of the label (0 off the mask)
    advantages: torch.Tensor  # [T] float32 advantage of the row's sample

    def shard(self, plan: ZigzagPlan) -> PackedBatch:
        """This rank's zigzag shard ([T_local] rows, local layout with global positions)."""
        return PackedBatch(
            plan.shard(self.ids),
            plan.local,
            plan.shard(self.labels),
            plan.shard(self.mask),
            plan.shard(self.old_logp),
            plan.shard(self.advantages),
        )


def _rows(samples: Sequence[Sample], pad_id: int):
    """Python lists of the packed rows; one dummy masked token when ``samples`` is empty."""
    if not samples:
        return [pad_id], [1], [0], [0.0], [0.0], [0.0]
    ids, lens, labels, mask, old, adv = [], [], [], [], [], []
    for s in samples:
        seq = s.prompt + s.response
        p, r = len(s.prompt), len(s.response)
        ids.extend(seq)
        lens.append(len(seq))
        labels.extend([*seq[1:], 0])
        mask.extend([0.0] * (p - 1) + [1.0] * r + [0.0])
        old.extend([0.0] * (p - 1) + s.old_logp + [0.0])
        adv.extend([s.advantage] * len(seq))
    return ids, lens, labels, mask, old, adv


def pack(samples: Sequence[Sample], device: torch.device, pad_id: int = 0) -> PackedBatch:
    """Samples laid end to end (the whole minibatch; unsharded)."""
    ids, lens, labels, mask, old, adv = _rows(samples, pad_id)
    f = lambda x: torch.tensor(x, dtype=torch.float32, device=device)
    return PackedBatch(
        torch.tensor(ids, device=device),
        PackedLayout.from_lengths(lens, device=device),
        torch.tensor(labels, device=device),
        f(mask),
        f(old),
        f(adv),
    )


def microbatches(
    samples: Sequence[Sample], n: int, device: torch.device, pad_id: int = 0
) -> list[PackedMicrobatch]:
    """``n`` pipeline microbatches of a minibatch: sample i goes to microbatch i mod n."""
    out = []
    for j in range(n):
        ids, lens, _, mask, old, adv = _rows(samples[j::n], pad_id)
        f = lambda x: torch.tensor(x, dtype=torch.float32, device=device)
        out.append(
            PackedMicrobatch(
                torch.tensor(ids, device=device),
                lens,
                f(mask),
                fields={"old_logp": f(old), "advantages": f(adv)},
            )
        )
    return out


def microbatch_budget(samples_per_minibatch: int, n: int, max_seq_len: int, cp: int) -> int:
    """Token budget that fits any microbatch: its most sequences, each at most ``max_seq_len``
    tokens, zigzag-padded to a multiple of 2·cp."""
    per_mb = max(1, -(-samples_per_minibatch // n))
    step = 2 * cp
    return per_mb * -(-max_seq_len // step) * step
