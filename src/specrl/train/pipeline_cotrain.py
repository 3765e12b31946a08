"""The pipelined policy step with EAGLE-3 draft co-training on the last stage.

The policy is split into pipeline stages (:mod:`specrl.core.pipeline`) and run by a
``torch.distributed.pipelining`` schedule (GPipe, 1F1B, Interleaved1F1B).  With a draft, every
stage that owns a tap layer sends it through a :class:`~specrl.core.transport.TapChannel` from
inside its forward (non-blocking).  The last stage's loss function computes the policy loss of
the microbatch and then, separately, collects that microbatch's taps and runs the draft's TTT
forward and backward with the microbatch's own final logits (detached) as the teacher.  The
draft's graph starts at detached taps and a detached teacher, so its gradients never enter the
policy's backward; the draft has its own optimizer.  The schedule, the tensors it moves and their
order are those of the draft-free run: with and without the draft the policy's loss and
gradients are bit-identical.

Packed microbatches through a schedule.  Pipelining moves fixed-shape tensors, so each
microbatch is padded to a fixed token budget ``microbatch_tokens`` by one filler sequence (its own
segment with loss mask 0: real tokens never attend to it).  Under context parallelism every
sequence is zigzag-padded to a multiple of 2·cp first and the budget splits into cp equal shards.
The layout (cu_seqlens, global position ids) has a different length per microbatch and cannot
ride the schedule as a tensor, so every rank of a pipeline builds the same per-step side table
from the same microbatches (the data loader hands the whole step to every rank of a pipeline),
keyed by microbatch index.  The index travels inside the schedule itself: a keyword input
``mb = arange(n)`` and the loss target ``arange(n)``, which the schedule chunks like any other
input.  Nothing extra passes between stages.

Losses and reductions (the single-process run over the same microbatches is reproduced exactly):

- policy: ``loss_fn(logits, tokens)`` returns the sum over this rank's rows; the step divides by
  the global count of loss tokens (every microbatch, every data-parallel replica), so the sum
  over microbatches and ranks is the global token mean.  Gradients: all-reduce (sum) over dp × cp.
- draft: per microbatch the TTT loss (its token counts reduced over cp), weighted 1/(n · dp):
  the mean over microbatches and replicas.  Gradients: all-reduce over dp × cp of the last stage.

Usage (every rank; the same microbatches on every rank of a pipeline)::

    groups = ParallelDims(world_size=8, dp=2, cp=2, pp=2).build_groups()
    draft = build_draft() if PipelineCotrainer.hosts_draft(groups) else None
    trainer = PipelineCotrainer(policy, groups, CotrainConfig(schedule="1f1b"),
                                num_microbatches=4, tap_layers=draft_cfg.tap_layers, draft=draft)
    policy_opt = torch.optim.AdamW(trainer.policy_parameters())
    draft_opt = torch.optim.AdamW(draft.parameters()) if draft is not None else None
    for step in ...:
        stats = trainer.step(microbatches, policy_optimizer=policy_opt, draft_optimizer=draft_opt)

Simplifications: the filler sequence costs attention over its own length (pack microbatches
close to the budget); under CP the TTT teacher shift gathers the microbatch's teacher rows over
the cp group once (O(T·V_draft) per rank) instead of a k-row halo exchange.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from specrl.core.attention import CPContext, PackedLayout
from specrl.core.attention.ttt import Mode
from specrl.core.attention.zigzag import ZigzagPlan, shift_within_sequences
from specrl.core.distributed import all_reduce_grads
from specrl.core.parallel import ParallelGroups
from specrl.core.pipeline import (
    ScheduleKind,
    StageLayout,
    StageModule,
    build_schedule,
    make_stage,
    split_model,
    tap_slot_depth,
)
from specrl.core.transport import TapChannel, TapPlan, TapSpec, TapStats
from specrl.errors import LayoutError
from specrl.models.decoder import Transformer
from specrl.models.draft import Eagle3Draft
from specrl.train.batch import PackedMicrobatch, Sample, microbatches
from specrl.train.layout import TrainLayout
from specrl.train.strategy import (
    DraftMode,
    DraftResult,
    MinibatchOutput,
    Objective,
    clip_on_last_stage,
    follow_embedding,
)
from specrl.train.ttt import (
    HaloShift,
    LossKind,
    TTTInputs,
    teacher_from_logits,
    ttt_inputs,
    ttt_loss,
)

# logits [T, V] and the microbatch's per-token tensors ([T] each: "labels", "loss_mask" and the
# microbatch's extra fields) → Σ of the per-token losses over this rank's rows (scalar)
TokenLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]


def masked_cross_entropy(logits: torch.Tensor, tokens: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Σ_t loss_mask[t] · CE(logits[t], labels[t]): next-token cross-entropy on learned rows."""
    ce = F.cross_entropy(logits, tokens["labels"], reduction="none")  # [T]
    return (ce * tokens["loss_mask"].to(ce.dtype)).sum()


@dataclass(frozen=True)
class CotrainConfig:
    """How the pipelined step runs."""

    schedule: ScheduleKind = "1f1b"
    """pipeline schedule: gpipe, 1f1b or interleaved (needs virtual_stages ≥ 2)"""
    microbatch_tokens: int = 4096
    """fixed token budget of every microbatch before CP sharding (a multiple of 2·cp)"""
    ttt_steps: int = 3
    """unrolled TTT steps of the draft"""
    ttt_loss: LossKind = "ce"
    """draft loss: soft cross-entropy (ce) or total variation (tv)"""
    ttt_decay: float = 0.8
    """weight of TTT step k is decay**k"""
    draft_loss_weight: float = 1.0
    """multiplier of the draft's loss (and so of its gradients)"""
    ttt_mode: Mode = "ring"
    """how the draft's main K/V travel under CP: ring, ring_once or gather"""
    tap_timeout: float = 300.0
    """seconds a TapChannel wait may take before the step fails naming the silent peer"""
    policy_grad_clip: float = 0.0
    """global gradient-norm clip of the policy across all stages (0: off)"""
    draft_grad_clip: float = 0.0
    """gradient-norm clip of the draft (0: off)"""
    pad_id: int = 0
    """token id of filler rows"""


@dataclass
class CotrainStats:
    """One step, identical on every rank of a pipeline."""

    policy_loss: float  # global token-mean policy loss
    tokens: int  # global loss tokens (the policy loss normalizer)
    draft_loss: float | None  # mean TTT loss over microbatches and replicas (None: no draft)
    draft_acc: list[float]  # top-1 agreement with the teacher per TTT step
    policy_grad_norm: float | None  # before clipping (None without a policy optimizer)
    draft_grad_norm: float | None
    seconds: float  # wall time of the whole step on this rank
    draft_seconds: float  # this rank's draft TTT compute (forward + backward; 0 off the last stage)
    tap: TapStats | None  # this rank's TapChannel traffic (None: no draft)

    @property
    def draft_tau(self) -> float:
        """Simulated acceptance length 1 + Σ_k Π_{j≤k} acc_j."""
        tau, run = 1.0, 1.0
        for a in self.draft_acc:
            run *= a
            tau += run
        return tau


@dataclass
class _Row:
    """This rank's view of one microbatch: the side-table entry keyed by its index."""

    ids: torch.Tensor  # [T_loc] ids incl. filler (zigzag shard under CP)
    layout: PackedLayout  # [T_loc] tokens: real sequences then the filler
    tokens: dict[str, torch.Tensor]  # [T_loc] labels, loss_mask, fields
    rows: int  # leading rows of T_loc that are real tokens (what the draft sees)
    draft_layout: PackedLayout  # layout of those rows
    ttt: TTTInputs | None  # [K, rows] step ids / masks (draft ranks)
    real_plan: ZigzagPlan | None  # zigzag plan of the real tokens (CP teacher shift)
    real_layout: PackedLayout  # global layout of the real tokens


def _sum_over(group: dist.ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    return reduce


class PipelineCotrainer:
    """One pipeline-parallel policy update per :meth:`step`, the draft co-trained on the side."""

    def __init__(
        self,
        model: Transformer,
        groups: ParallelGroups,
        config: CotrainConfig,
        *,
        num_microbatches: int,
        tap_layers: Sequence[int] = (),
        draft: Eagle3Draft | None = None,
        loss_fn: TokenLoss = masked_cross_entropy,
    ) -> None:
        """``model``: the whole policy on every rank (this rank keeps its chunks' modules);
        ``tap_layers``: the draft's tap layers on every rank (empty: no co-training);
        ``draft``: the draft on the ranks of the last stage (:meth:`hosts_draft`), else None."""
        dims = self.dims = groups.dims
        self.groups, self.config, self.loss_fn = groups, config, loss_fn
        self.n_microbatches = num_microbatches
        if draft is not None and not tap_layers:
            tap_layers = draft.config.tap_layers
        self.tap_layers = tuple(tap_layers)  # the draft's order, repeats allowed (small targets)
        distinct = tuple(sorted(set(self.tap_layers)))  # what the stages send, once each
        budget, cp = config.microbatch_tokens, dims.cp
        if budget < 1 or (cp > 1 and budget % (2 * cp)):
            raise LayoutError(
                f"microbatch_tokens = {budget} must be a positive multiple of 2·cp = {2 * cp}"
            )
        self.local_tokens = budget // cp
        dims.check_layers(model.config.num_hidden_layers)
        self.layout = StageLayout.balanced(
            model.config.num_hidden_layers, dims.pp, dims.virtual_stages
        )
        pp_rank = groups.coords.pp
        self.cp = CPContext.from_group(groups["cp"]) if cp > 1 else CPContext(None)
        self.modules: list[StageModule] = []
        for s, chunk in zip(
            self.layout.rank_stages(pp_rank), split_model(model, self.layout, pp_rank), strict=True
        ):
            if cp > 1:
                chunk.use_context_parallel(self.cp)
            self.modules.append(StageModule(chunk, s, self.layout.num_stages, distinct))
        self.device = model.device
        self.stages = [
            make_stage(m, self.local_tokens, groups["pp"], self.device) for m in self.modules
        ]
        self.schedule = build_schedule(
            config.schedule, self.stages, num_microbatches, self._microbatch_loss
        )
        self.is_last = any(m.is_last for m in self.modules)
        self.is_first = any(m.is_first for m in self.modules)
        self.draft = draft if self.is_last else None
        if self.is_last and self.tap_layers and draft is None:
            raise ValueError("this rank runs the last stage: pass the draft to co-train")
        if draft is not None and tuple(draft.config.tap_layers) != self.tap_layers:
            raise ValueError(
                f"tap_layers {self.tap_layers} differ from the draft's {draft.config.tap_layers}"
            )
        self.channel: TapChannel | None = None
        if self.tap_layers:
            plan = TapPlan.build(distinct, self.layout.stage_layers, self.layout.stage_ranks)
            order = self.schedule.pipeline_order
            depth = {
                s: tap_slot_depth(order, s, plan.stage_ranks[s], num_microbatches)
                for s in plan.remote_stages
            }
            spec = TapSpec(model.config.hidden_size, model.dtype, self.local_tokens, self.device)
            self.channel = TapChannel.create(
                plan, spec, dims.group_ranks("pp"), depth=depth, timeout=config.tap_timeout
            )
            for m in self.modules:
                m.channel = self.channel
        self._table: list[_Row] = []
        self._normalizer = 1.0
        self._policy_sums: list[torch.Tensor] = []
        self._draft_sums: list[torch.Tensor] = []  # [1 + 2K]: scaled loss, hits, counts
        self._draft_seconds = 0.0

    @staticmethod
    def hosts_draft(groups: ParallelGroups) -> bool:
        """Whether this rank runs the last stage (where the draft trains)."""
        return groups.coords.pp == groups.dims.pp - 1

    def policy_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's policy parameters (its chunks), for its optimizer."""
        seen: dict[int, torch.nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    # ---------------------------------------------------------------------- the step
    def step(
        self,
        microbatches: Sequence[PackedMicrobatch],
        *,
        policy_optimizer: torch.optim.Optimizer | None = None,
        draft_optimizer: torch.optim.Optimizer | None = None,
    ) -> CotrainStats:
        """Forward and backward of this replica's microbatches through the pipeline (the draft
        trained on the last stage), gradients reduced over dp × cp, then — when given — the
        policy optimizer (over :meth:`policy_parameters`) and the draft optimizer (draft ranks)
        step after their gradient clips.  Gradients stay in ``.grad`` until the next step.
        Collective: pass a policy optimizer on every rank or on none (its clip norm spans every
        stage); the draft optimizer matters on the draft's ranks only."""
        t0 = time.perf_counter()
        if len(microbatches) != self.n_microbatches:
            raise ValueError(
                f"the schedule runs {self.n_microbatches} microbatches, got {len(microbatches)}"
            )
        params = self.policy_parameters()
        for p in params:
            p.grad = None
        if self.draft is not None:
            self.draft.zero_grad(set_to_none=True)
        self._table = [self._prepare(mb) for mb in microbatches]
        count = torch.tensor(
            [float(mb.loss_mask.sum()) for mb in microbatches],
            dtype=torch.float64,
            device=self.device,  # NCCL reduces device tensors only
        ).sum()
        if self.dims.dp > 1:
            dist.all_reduce(count, group=self.groups["dp"])
        self._normalizer = max(float(count), 1.0)
        self._policy_sums, self._draft_sums, self._draft_seconds = [], [], 0.0
        for m in self.modules:
            m.set_microbatches([r.layout for r in self._table], [r.rows for r in self._table])
        if self.channel is not None:
            self.channel.begin_step([r.rows for r in self._table])

        index = torch.arange(self.n_microbatches)  # [n] microbatch ids, chunked by the schedule
        args = (torch.cat([r.ids for r in self._table]),) if self.is_first else ()
        self.schedule.step(
            *args, target=index if self.is_last else None, mb=index, return_outputs=False
        )
        tap_stats = self.channel.end_step() if self.channel is not None else None

        same_params = self.groups["dp_cp"]
        if self.dims.dp * self.dims.cp > 1:
            all_reduce_grads(params, same_params)
            if self.draft is not None:
                all_reduce_grads(list(self.draft.parameters()), same_params)
        policy_norm = draft_norm = None
        if policy_optimizer is not None:
            policy_norm = self.clip_policy_grads(self.config.policy_grad_clip)
            policy_optimizer.step()
        if draft_optimizer is not None and self.draft is not None:
            trainable = [p for p in self.draft.parameters() if p.requires_grad]
            clip = self.config.draft_grad_clip or float("inf")
            draft_norm = float(torch.nn.utils.clip_grad_norm_(trainable, clip))
            draft_optimizer.step()
        stats = self._gather_stats(policy_norm, draft_norm)
        optional = lambda x: None if math.isnan(x) else x
        return CotrainStats(
            policy_loss=stats[0],
            tokens=int(count),
            draft_loss=stats[1] if self.tap_layers else None,
            draft_acc=stats[4:] if self.tap_layers else [],
            policy_grad_norm=optional(stats[2]),
            draft_grad_norm=optional(stats[3]),
            seconds=time.perf_counter() - t0,
            draft_seconds=self._draft_seconds,
            tap=tap_stats,
        )

    # --------------------------------------------------------------- the last stage
    def _microbatch_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: policy loss of one microbatch; trains the draft on it.

        logits: [T_loc, V] of the microbatch; target: [1] its index (see the module doc)."""
        m = int(target[0])
        row = self._table[m]
        policy_sum = self.loss_fn(logits, row.tokens)
        self._policy_sums.append(policy_sum.detach())
        if self.channel is not None:
            self._train_draft(m, row, logits)
        return policy_sum / self._normalizer

    def _train_draft(self, m: int, row: _Row, logits: torch.Tensor) -> None:
        draft, cfg = self.draft, self.config
        taps = self.channel.collect(m)  # {layer: [rows, H]}, waits only for what has not landed
        t0 = time.perf_counter()
        feats = Eagle3Draft.concat_taps(taps, self.tap_layers)  # [rows, 3H]
        cp = self.cp if self.cp.size > 1 else None
        out = draft.ttt_forward(feats, row.ttt.step_ids, row.draft_layout, cp=cp, mode=cfg.ttt_mode)
        teacher = teacher_from_logits(logits[: row.rows], draft)  # detached [rows, V_draft]
        shift = reduce = None
        if cp is not None:
            shift = HaloShift(row.real_plan, row.real_layout, cp, max_shift=cfg.ttt_steps)
            reduce = _sum_over(cp.group)
        loss = ttt_loss(
            out,
            teacher,
            row.ttt,
            row.draft_layout,
            kind=cfg.ttt_loss,
            decay=cfg.ttt_decay,
            shift=shift,
            reduce=reduce,
        )
        scale = 1.0 / (self.n_microbatches * self.dims.dp)
        (loss.loss * (scale * cfg.draft_loss_weight)).backward()
        counts = torch.tensor(loss.count, dtype=torch.float64)
        hits = torch.tensor(loss.acc, dtype=torch.float64) * counts.clamp(min=1.0)
        scaled = loss.loss.detach().to(torch.float64).reshape(1) * scale
        self._draft_sums.append(torch.cat([scaled, hits, counts]))
        self._draft_seconds += time.perf_counter() - t0

    # --------------------------------------------------------------------- helpers
    def _prepare(self, mb: PackedMicrobatch) -> _Row:
        """Pad the microbatch to the budget with one filler sequence, shard it under CP, and
        precompute the draft's TTT inputs (global shifts before sharding)."""
        dev, cp, budget = self.device, self.dims.cp, self.config.microbatch_tokens
        ids = mb.ids.to(dev)
        t = ids.numel()
        if sum(mb.lengths) != t or mb.loss_mask.numel() != t:
            raise ValueError(
                f"microbatch of {t} ids has lengths summing to {sum(mb.lengths)} and a loss "
                f"mask of {mb.loss_mask.numel()}"
            )
        real = PackedLayout.from_lengths(mb.lengths, device=dev)
        mask = mb.loss_mask.to(dev)
        per_token = {
            "labels": shift_within_sequences(ids, real, 1, 0),  # x_{t+1} within the sequence
            "loss_mask": mask,
            **{k: v.to(dev) for k, v in mb.fields.items()},
        }
        step = 2 * cp if cp > 1 else 1
        padded = sum(-(-n // step) * step for n in mb.lengths)
        filler = budget - padded
        if filler < 0:
            raise LayoutError(
                f"a microbatch of {t} tokens ({padded} after CP padding) exceeds "
                f"microbatch_tokens = {budget}",
                hint="raise microbatch_tokens or pack fewer sequences per microbatch",
            )
        full = PackedLayout.from_lengths([*mb.lengths, *([filler] if filler else [])], device=dev)
        pad = lambda x, fill: torch.cat([x, x.new_full((filler,), fill)])
        ids_full = pad(ids, self.config.pad_id)
        tokens_full = {k: pad(v, 0) for k, v in per_token.items()}
        ttt = ttt_inputs(ids, mask, real, self.config.ttt_steps) if self.draft else None
        if cp == 1:
            return _Row(ids_full, full, tokens_full, t, real, ttt, None, real)
        plan = ZigzagPlan.build(full, cp, self.cp.rank)
        real_plan = ZigzagPlan.build(real, cp, self.cp.rank)
        if ttt is not None:
            ttt = TTTInputs(
                torch.stack([real_plan.shard(x) for x in ttt.step_ids]),
                torch.stack([real_plan.shard(x) for x in ttt.step_mask]),
            )
        return _Row(
            plan.shard(ids_full, self.config.pad_id),
            plan.local,
            {k: plan.shard(v) for k, v in tokens_full.items()},
            real_plan.num_local,
            real_plan.local,
            ttt,
            real_plan,
            real,
        )

    def clip_policy_grads(self, max_norm: float) -> float:
        """The policy's global gradient norm over every stage (identical on all ranks), its
        gradients clipped to ``max_norm`` (0 or inf: not clipped)."""
        params = self.policy_parameters()
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            if p.grad is not None:
                sq += p.grad.detach().to(torch.float64).pow(2).sum()
        if self.dims.pp > 1:
            dist.all_reduce(sq, group=self.groups["pp"])
        norm = float(sq.sqrt())
        clip = max_norm
        if clip > 0 and norm > clip:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(clip / (norm + 1e-6))
        return norm

    def _gather_stats(self, policy_norm: float | None, draft_norm: float | None) -> list[float]:
        """[policy loss, draft loss, policy norm, draft norm, acc_0..acc_K−1] on every rank:
        reduced over dp × cp on the last stage, then broadcast along the pipeline (a norm that
        was not computed is NaN)."""
        k = self.config.ttt_steps
        out = torch.zeros(4 + k, dtype=torch.float64, device=self.device)
        out[2:4] = float("nan")
        if self.is_last:
            sums = torch.zeros(1 + 2 * k, dtype=torch.float64, device=self.device)
            for d in self._draft_sums:
                sums += d.to(self.device)
            # every cp rank holds the same counts (reduced inside ttt_loss): count them once
            sums[1:] /= self.dims.cp
            policy = torch.stack(self._policy_sums).sum().to(torch.float64) / self._normalizer
            local = torch.cat([policy.reshape(1), sums])
            if self.dims.dp * self.dims.cp > 1:
                dist.all_reduce(local, group=self.groups["dp_cp"])
            hits, counts = local[2 : 2 + k], local[2 + k :]
            out[0], out[1] = local[0], local[1]
            out[4:] = hits / counts.clamp(min=1.0)
            if draft_norm is not None:
                out[3] = draft_norm
        if policy_norm is not None:
            out[2] = policy_norm
        if self.dims.pp > 1:
            last = self.groups.ranks("pp")[-1]
            dist.broadcast(out, src=last, group=self.groups["pp"])
        return out.tolist()


def stage_parameters(model: Transformer, stages: StageLayout, pp_rank: int) -> list[nn.Parameter]:
    """The parameters of ``pp_rank``'s chunks of ``model``, in a rank-independent order."""
    seen: dict[int, nn.Parameter] = {}
    for chunk in split_model(model, stages, pp_rank):
        for p in chunk.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflat_(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class StageSync:
    """Parameter traffic of a pipelined policy between steps.

    - after every policy optimizer step the embedding table goes from stage 0 to the last stage
      over a dedicated two-rank group per pipeline, so the draft (whose frozen token embedding
      *is* the policy's) never trains against a stale table;
    - once per RL step every stage of the cp-rank-0 pipeline sends its parameters (the last
      stage also the draft's) to the rollout rank, point to point.  Only that rank needs the
      whole model, so this moves (pp − 1)/pp of the policy to one rank instead of to all.

    Collective construction (every rank): creates the two-rank embedding links."""

    def __init__(
        self,
        layout: TrainLayout,
        stages: StageLayout,
        policy: Transformer,
        draft: nn.Module | None,
    ) -> None:
        assert layout.groups is not None and layout.dims.pp > 1
        self.layout, self.stages, self.policy, self.draft = layout, stages, policy, draft
        self.pipeline = layout.groups.ranks("pp")  # global ranks in stage order
        pipelines = layout.dims.group_ranks("pp")
        self.link, _ = dist.new_subgroups_by_enumeration([[p[0], p[-1]] for p in pipelines])

    def _draft_params(self) -> list[nn.Parameter]:
        if self.draft is None:
            return []
        return [p for p in self.draft.parameters() if p.requires_grad]

    def broadcast_embedding(self) -> None:
        """Stage 0's embedding table into the last stage's copy (which the draft reads)."""
        if self.layout.pp_rank not in (0, self.layout.dims.pp - 1):
            return
        weight = self.policy.model.embed_tokens.weight.detach()  # [V, H]
        dist.broadcast(weight, src=self.pipeline[0], group=self.link)

    def gather(self) -> None:
        """Every stage's parameters (and the draft's) into the rollout rank's model, in place."""
        if self.layout.cp_rank != 0:
            return
        pp, me, group = self.layout.dims.pp, self.layout.pp_rank, self.layout.groups["pp"]
        if me == 0:
            for r in range(1, pp):
                params = stage_parameters(self.policy, self.stages, r)
                if r == pp - 1:
                    params = [*params, *self._draft_params()]
                for tensors in _by_dtype(params):
                    flat = torch.empty(
                        sum(t.numel() for t in tensors),
                        dtype=tensors[0].dtype,
                        device=tensors[0].device,
                    )
                    dist.recv(flat, src=self.pipeline[r], group=group)
                    _unflat_(flat, tensors)
            return
        params = stage_parameters(self.policy, self.stages, me)
        if me == pp - 1:
            params = [*params, *self._draft_params()]
        for tensors in _by_dtype(params):
            dist.send(_flat(tensors), dst=self.pipeline[0], group=group)


def _by_dtype(params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` grouped by dtype (first-seen order), each group in its given order."""
    groups: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.dtype, []).append(p)
    return list(groups.values())


class PipelineStrategy:
    """:class:`~specrl.train.strategy.PolicyStrategy` over pipeline stages: each minibatch cut
    into ``num_microbatches`` microbatches through :class:`PipelineCotrainer` (the draft, when
    co-trained, on the last stage from TapChannel taps).  The policy loss of a microbatch is the
    clipped loss summed over its rows, divided by the global token count as everywhere; the
    draft's objective is the mean over microbatches (and replicas) of per-microbatch token means
    — the one-process objective when ``num_microbatches`` = 1 and dp = 1.  A frozen draft is
    not measured here."""

    def __init__(
        self,
        policy: Transformer,
        layout: TrainLayout,
        objective: Objective,
        *,
        schedule: ScheduleKind,
        num_microbatches: int,
        microbatch_tokens: int,
        draft: Eagle3Draft | None = None,
        pad_id: int = 0,
    ) -> None:
        """``draft``: the co-trained draft (None: the policy alone)."""
        assert layout.groups is not None and layout.dims.pp > 1
        obj = self.objective = objective
        self.policy, self.layout, self.pad_id = policy, layout, pad_id
        self.num_microbatches = num_microbatches
        self.draft = draft if layout.hosts_draft else None
        config = CotrainConfig(
            schedule=schedule,
            microbatch_tokens=microbatch_tokens,
            ttt_steps=obj.ttt_steps,
            ttt_loss=obj.ttt_loss,
            ttt_decay=obj.ttt_decay,
            draft_loss_weight=obj.draft_loss_weight,
            ttt_mode=obj.ttt_cp_mode,
            pad_id=pad_id,
        )
        self.pipeline = PipelineCotrainer(
            policy,
            layout.groups,
            config,
            num_microbatches=num_microbatches,
            tap_layers=draft.config.tap_layers if draft is not None else (),
            draft=self.draft,
            loss_fn=self._microbatch_loss,
        )
        self.stage_sync = StageSync(layout, self.pipeline.layout, policy, draft)
        self._sums: list[torch.Tensor] = []  # per microbatch [clipped, kl, ratio, nll, tokens]

    def parameters(self) -> list[nn.Parameter]:
        return self.pipeline.policy_parameters()

    def forward_backward(self, samples: Sequence[Sample], *, draft: DraftMode) -> MinibatchOutput:
        mbs = microbatches(samples, self.num_microbatches, self.policy.device, self.pad_id)
        self._sums = []
        stats = self.pipeline.step(mbs)  # gradients only: the trainer clips and steps
        sums = torch.zeros(5, dtype=torch.float64)
        for s in self._sums:
            sums += s
        self.layout.sum_(sums)  # the last stage's dp × cp ranks hold every row once
        result = None
        if stats.draft_loss is not None:
            result = DraftResult(stats.draft_loss, stats.draft_acc, stats.draft_tau)
        seconds = stats.seconds - stats.draft_seconds
        return MinibatchOutput(stats.policy_loss, sums, result, seconds, stats.draft_seconds)

    def _microbatch_loss(
        self, logits: torch.Tensor, tokens: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """Σ of the clipped policy loss over this rank's rows of a microbatch (logits
        [T_local, V], tokens [T_local] each); the pipeline divides by the global count."""
        pl = self.objective.policy_loss(
            logits,
            tokens["labels"],
            tokens["old_logp"],
            tokens["advantages"],
            tokens["loss_mask"],
            normalizer=1.0,
        )
        self._sums.append(torch.tensor(pl.sums(), dtype=torch.float64))
        return pl.loss

    def clip_policy_(self, max_norm: float) -> float:
        return self.pipeline.clip_policy_grads(max_norm)

    def clip_draft_(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        """The norm on the last stage (which holds the draft), sent along the pipeline."""
        return clip_on_last_stage(self.layout, params, max_norm)

    def after_step(self) -> None:
        self.stage_sync.broadcast_embedding()
        follow_embedding(self.draft, self.policy)

    def gather_weights(self) -> None:
        self.stage_sync.gather()
