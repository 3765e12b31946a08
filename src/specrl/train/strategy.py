"""How one rank runs a minibatch's forward and backward: the strategy interface and the native one.

The trainer (:mod:`specrl.train.loop`) has one minibatch path whatever the layout::

    out = strategy.forward_backward(samples, draft=mode)  # gradients in .grad, reduced
    strategy.clip_policy_(max_norm); policy_optimizer.step()
    strategy.clip_draft_(draft_params, max_norm); draft_optimizer.step()   # co-training
    strategy.after_step()                                   # the draft's embedding follows

and between RL steps ``strategy.gather_weights()`` before the engine sync and the checkpoint.
:func:`specrl.train.parallelize.parallelize_policy` picks the strategy from the recipe:

- :class:`NativeStrategy` (this module): one packed forward over the minibatch — this rank's
  zigzag shard under context parallelism, DDP over dp × cp — whose taps and logits also train
  the draft (no second target forward);
- :class:`~specrl.train.pipeline_cotrain.PipelineStrategy`: ``torch.distributed.pipelining``
  stages, the draft trained on the last one from TapChannel taps;
- another backend (Megatron-core) implements :class:`PolicyStrategy` and plugs in the same way.

Every strategy optimises the same :class:`Objective` and reports the same
:class:`MinibatchOutput`, identical on every rank, so the metrics do not depend on the layout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from specrl.config.schema import Recipe
from specrl.core.attention import ZigzagPlan
from specrl.core.attention.ttt import Mode
from specrl.core.distributed import all_reduce_grads
from specrl.models.decoder import Transformer
from specrl.models.draft import Eagle3Draft
from specrl.train.batch import PackedBatch, Sample, pack
from specrl.train.layout import TrainLayout
from specrl.train.policy_loss import PolicyLoss, clipped_policy_loss, token_logprobs
from specrl.train.ttt import (
    HaloShift,
    LossKind,
    TTTInputs,
    TTTLoss,
    teacher_from_logits,
    ttt_inputs,
    ttt_loss,
)

# what a minibatch does with the draft: co-train it, only measure it (a frozen draft), nothing
DraftMode = Literal["train", "measure"] | None


@dataclass(frozen=True)
class Objective:
    """What a minibatch optimises, whatever the layout: the clipped policy loss and the draft's
    TTT loss (settings from the recipe's ``algo``, ``draft`` and ``parallel`` sections)."""

    temperature: float  # the rollouts' sampling temperature, applied to training logits
    clip_low: float
    clip_high: float
    kl_coef: float
    ttt_steps: int
    ttt_loss: LossKind
    ttt_decay: float
    draft_loss_weight: float
    ttt_cp_mode: Mode

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> Objective:
        a, d = recipe.algo, recipe.draft
        return cls(
            recipe.rollout.temperature,
            a.clip_low,
            a.clip_high,
            a.kl_coef,
            d.ttt_steps,
            d.loss,
            d.decay,
            d.loss_weight,
            recipe.parallel.ttt_cp_mode,
        )

    def policy_loss(
        self,
        logits: torch.Tensor,  # [T, V]
        labels: torch.Tensor,  # [T]
        old_logp: torch.Tensor,  # [T]
        advantages: torch.Tensor,  # [T]
        mask: torch.Tensor,  # [T]
        normalizer: float,
        ref_logits: torch.Tensor | None = None,  # [T, V] of the reference policy (KL)
    ) -> PolicyLoss:
        """Σ over the rows of the clipped surrogate (+ KL), divided by ``normalizer``."""
        logp = token_logprobs(logits, labels, self.temperature)
        ref = None if ref_logits is None else token_logprobs(ref_logits, labels, self.temperature)
        return clipped_policy_loss(
            logp,
            old_logp,
            advantages,
            mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            normalizer=normalizer,
            ref_logp=ref,
            kl_coef=self.kl_coef,
        )


@dataclass
class DraftResult:
    """The draft's TTT loss on a minibatch (global: every rank reports the same)."""

    loss: float
    acc: list[float]  # top-1 agreement with the policy per TTT step
    tau: float  # simulated acceptance length 1 + Σ_k Π_{j≤k} acc_j


@dataclass
class MinibatchOutput:
    """One minibatch's forward and backward, identical on every rank."""

    policy_loss: float  # global token-mean policy loss
    sums: torch.Tensor  # [5] float64 global [clipped, kl, ratio, nll, tokens]
    draft: DraftResult | None  # None: the draft did not take part
    policy_seconds: float  # this rank's policy forward and backward
    draft_seconds: float  # this rank's draft TTT forward and backward

    def policy_metrics(self) -> dict[str, float]:
        """The global policy loss and its per-token means."""
        clipped, kl, ratio, nll, tokens = self.sums.tolist()
        n = max(tokens, 1.0)
        return {
            "policy_loss": self.policy_loss,
            "clip_frac": clipped / n,
            "kl": kl / n,
            "ratio": ratio / n,
            "nll": nll / n,
        }


class PolicyStrategy(Protocol):
    """How this rank runs the policy (and the draft) over a minibatch (module docstring).

    Checkpoints: the trainer saves the optimizers built over :meth:`parameters` (and the draft's)
    and, after :meth:`gather_weights`, the whole policy and draft from the rollout rank."""

    def parameters(self) -> list[nn.Parameter]:
        """This rank's policy parameters: what its policy optimizer steps."""
        ...

    def forward_backward(self, samples: Sequence[Sample], *, draft: DraftMode) -> MinibatchOutput:
        """Policy loss (and the draft's TTT loss on the same forward's taps) backward over this
        replica's ``samples``; gradients reduced over the ranks that share parameters.
        Collective: every rank of the replica passes the same samples."""
        ...

    def clip_policy_(self, max_norm: float) -> float:
        """The policy's global gradient norm (identical on every rank), clipped to
        ``max_norm`` (0: not clipped)."""
        ...

    def clip_draft_(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        """The draft's gradient norm (identical on every rank; ``params`` empty off the draft's
        ranks), clipped to ``max_norm`` (0: not clipped)."""
        ...

    def after_step(self) -> None:
        """After the policy optimizer stepped: the draft's frozen embedding follows it."""
        ...

    def gather_weights(self) -> None:
        """The rollout rank's policy (and draft) modules hold the whole current weights."""
        ...


def follow_embedding(draft: Eagle3Draft | None, policy: Transformer) -> None:
    """The draft's frozen embedding refreshed from the policy's (a draft of another dtype holds
    a copy; one of the same dtype shares the table and needs nothing)."""
    if draft is None:
        return
    table = policy.model.embed_tokens.weight
    if draft.embed_tokens.weight.data_ptr() != table.data_ptr():
        draft.refresh_embedding(table.to(draft.embed_tokens.weight.dtype))


def _clip(params: Sequence[nn.Parameter], max_norm: float) -> float:
    return float(torch.nn.utils.clip_grad_norm_(list(params), max_norm or torch.inf))


def clip_on_last_stage(
    layout: TrainLayout, params: Sequence[nn.Parameter], max_norm: float
) -> float:
    """Clip the draft's gradients where the draft lives (the last pipeline stage) and broadcast
    the norm along the pipeline, so every stage logs the same figure."""
    norm = torch.full((), float("nan"), dtype=torch.float64, device=layout.device)
    if params:
        norm.fill_(_clip(params, max_norm))
    groups = layout.groups
    assert groups is not None
    dist.broadcast(norm, src=groups.ranks("pp")[-1], group=groups["pp"])
    return float(norm)


class NativeStrategy:
    """One packed forward per minibatch: one process, or DDP over dp × cp with zigzag CP shards
    (the model's attention runs the ring, :meth:`Transformer.use_context_parallel`)."""

    def __init__(
        self,
        policy: Transformer,
        layout: TrainLayout,
        objective: Objective,
        *,
        draft: Eagle3Draft | None = None,
        reference: Transformer | None = None,
        pad_id: int = 0,
    ) -> None:
        self.policy, self.layout, self.objective = policy, layout, objective
        self.draft, self.reference, self.pad_id = draft, reference, pad_id
        self.cp = layout.cp_context()
        self.ddp = None
        if layout.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(policy, process_group=layout.group("dp_cp"))

    def parameters(self) -> list[nn.Parameter]:
        return list(self.policy.parameters())

    def forward_backward(self, samples: Sequence[Sample], *, draft: DraftMode) -> MinibatchOutput:
        obj, lay, device = self.objective, self.layout, self.policy.device
        t0 = time.perf_counter()
        draft = draft if self.draft is not None else None
        full = pack(samples, device, self.pad_id)  # [T]
        ttt = ttt_inputs(full.ids, full.mask, full.layout, obj.ttt_steps) if draft else None
        plan, local = None, full
        if self.cp is not None:
            plan = ZigzagPlan.build(full.layout, self.cp.size, self.cp.rank)
            local = full.shard(plan)  # [T_local]
            if ttt is not None:
                ttt = TTTInputs(
                    torch.stack([plan.shard(x) for x in ttt.step_ids]),  # [K, T_local]
                    torch.stack([plan.shard(x) for x in ttt.step_mask]),
                )
        total = float(lay.sum_(local.mask.sum(dtype=torch.float64), "dp_cp"))
        taps = tuple(self.draft.config.tap_layers) if draft else ()
        out = (self.ddp or self.policy)(local.ids, local.layout, taps=taps)
        ref_logits = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = self.reference(local.ids, local.layout).logits
        rows = (local.labels, local.old_logp, local.advantages, local.mask)
        pl = obj.policy_loss(out.logits, *rows, total, ref_logits)
        for p in self.policy.parameters():
            p.grad = None
        # DDP averages over its dp × cp ranks: × their count → the gradient of the global sum
        (pl.loss * lay.dims.dp * lay.dims.cp).backward()
        t_policy = time.perf_counter() - t0

        t0 = time.perf_counter()
        tl = None
        if draft == "train":
            self.draft.zero_grad(set_to_none=True)
            tl = self._ttt_loss(out, ttt, full, local, plan)
            (tl.loss * obj.draft_loss_weight).backward()
            if lay.world > 1:
                trainable = [p for p in self.draft.parameters() if p.requires_grad]
                all_reduce_grads(trainable, lay.group("dp_cp"))
        elif draft == "measure":  # a frozen draft: how well it still matches the policy
            with torch.no_grad():
                tl = self._ttt_loss(out, ttt, full, local, plan)
        t_draft = time.perf_counter() - t0

        draft_loss = tl.loss.detach().double().reshape(1) if tl is not None else torch.zeros(1)
        sums = torch.tensor([float(pl.loss.detach()), *pl.sums()], dtype=torch.float64)
        sums = lay.sum_(torch.cat([sums, draft_loss.to(sums)]), "dp_cp")
        result = None if tl is None else DraftResult(float(sums[6]), tl.acc, tl.tau)
        return MinibatchOutput(float(sums[0]), sums[1:6], result, t_policy, t_draft)

    def _ttt_loss(
        self, out, ttt: TTTInputs, full: PackedBatch, local: PackedBatch, plan: ZigzagPlan | None
    ) -> TTTLoss:
        """The draft's TTT loss on this rank's rows of the policy forward ``out`` (counts
        all-reduced over dp × cp; under CP the teacher shift crosses shards)."""
        obj, draft = self.objective, self.draft
        assert draft is not None
        feats = Eagle3Draft.concat_taps(out.taps, draft.config.tap_layers)  # [T_local, 3H]
        res = draft.ttt_forward(feats, ttt.step_ids, local.layout, cp=self.cp, mode=obj.ttt_cp_mode)
        shift = None
        if plan is not None:
            shift = HaloShift(plan, full.layout, self.cp, max_shift=obj.ttt_steps)
        return ttt_loss(
            res,
            teacher_from_logits(out.logits, draft),
            ttt,
            local.layout,
            kind=obj.ttt_loss,
            decay=obj.ttt_decay,
            shift=shift,
            reduce=lambda t: self.layout.sum_(t, "dp_cp"),
        )

    def clip_policy_(self, max_norm: float) -> float:
        return _clip(self.policy.parameters(), max_norm)

    def clip_draft_(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        return _clip(params, max_norm)

    def after_step(self) -> None:
        follow_embedding(self.draft, self.policy)

    def gather_weights(self) -> None:
        """Nothing to gather: every rank holds the whole policy."""
