"""The policy's RL update through Megatron-core's own pipeline schedules: :class:`MegatronStrategy`.

A :class:`~specrl.train.strategy.PolicyStrategy` like the native ones: the trainer's one
minibatch path calls it the same way.  The policy is built as Megatron ``GPTModel`` chunks (one
per virtual stage) from the HF-named weights of specrl's native policy
(:mod:`~specrl.integrations.megatron.convert`), and a minibatch runs through
``get_forward_backward_func()`` — 1F1B, or interleaved 1F1B with virtual stages — unchanged.

Batches.  Megatron's local attention takes ``[b, s]`` rows with a causal mask (packed THD
sequences need Transformer Engine), so a microbatch is ``micro_batch_size`` rows of
``seq_length`` tokens: one sample per row, right-padded (pads are never attended to by real
tokens under the causal mask and carry loss mask 0).  Sample i goes to microbatch i mod n, as on
the native pipeline.  Every rank of a pipeline builds the same microbatches (the trainer hands
the whole minibatch to every rank), so the loss function on the last stage and the data
iterators of every stage agree without any extra traffic.

Losses.  The loss function returns ``(Σ over the microbatch's rows of the clipped loss / N,
tokens, {...})`` with ``calculate_per_token_loss=True``, so Megatron does not rescale it; N is the
global count of loss tokens (every microbatch, every data-parallel replica): the sum over
microbatches and replicas is the global token mean — the one-process objective.  Gradients are
summed over the data-parallel replicas after the schedule (torch's optimizer steps them; the
model is not wrapped in Megatron's ``DistributedDataParallel``, whose grad buffers are a GPU
memory optimisation).

The draft (co-training).  Forward hooks on the ``TransformerLayer`` s of the draft's tap layers
(``layer_number - 1``: Megatron numbers layers globally from 1) send each microbatch's tap —
``output[0]``, ``[s, b, h]``, its real rows in packing order — through specrl's
:class:`~specrl.core.transport.TapChannel` (the native pipeline's transport: a link per producer
stage → last stage, beside Megatron's p2p) to the last stage.  There, Megatron's loss function
of each microbatch computes the policy loss and then, separately, collects the microbatch's taps
and runs the draft's TTT forward and backward with the microbatch's own logits (detached) as the
teacher, weighted 1/(n · dp) as on the native pipeline.  The draft's graph starts at detached
taps and teacher, so Megatron's schedule, its tensors and the policy's gradients are those of the
draft-free run.  Stage s of Megatron's layout is chunk s // pp of pipeline rank s mod pp (read off
the built chunks' layer numbers, all-gathered over the pipeline), so :class:`TapPlan` gets it
directly.  Every landing ring holds all microbatches of a step (depth = n): Megatron's schedules
run a producer up to a whole warm-up ahead of the last stage.

Two settings Megatron does not check, which fail silently (:func:`check_stage_layers`,
:func:`check_schedule_config`):

- ``TransformerConfig.pipeline_model_parallel_size`` (and the virtual size) must be passed:
  without them every stage builds every layer, with no error;
- interleaved schedules over gloo need ``batch_p2p_comm=False``: the batched isend/irecv of the
  interleaved schedule runs but pairs the wrong messages on gloo (wrong losses and gradients).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from specrl.core.distributed import all_reduce_grads
from specrl.core.transport import TapChannel, TapPlan, TapSpec, TapStats
from specrl.errors import LayoutError
from specrl.models.decoder import Transformer
from specrl.models.draft import Eagle3Draft
from specrl.train.batch import PackedBatch, Sample, pack
from specrl.train.layout import TrainLayout
from specrl.train.strategy import (
    DraftMode,
    DraftResult,
    MinibatchOutput,
    Objective,
    clip_on_last_stage,
)
from specrl.train.ttt import TTTInputs, teacher_from_logits, ttt_inputs, ttt_loss

MegatronSchedule = Literal["1f1b", "interleaved"]


def check_stage_layers(chunks: Sequence[nn.Module], num_layers: int, pp: int, vp: int) -> None:
    """Each chunk holds exactly its ``num_layers / (pp · vp)`` layers (Megatron builds every
    layer on every stage, silently, when the config lacks the pipeline sizes)."""
    want = num_layers // (pp * vp)
    for i, chunk in enumerate(chunks):
        got = len(chunk.decoder.layers)
        if got != want:
            raise LayoutError(
                f"Megatron chunk {i} built {got} decoder layers, the layout gives it {want} "
                f"({num_layers} layers / (pp={pp} · virtual_stages={vp})): its TransformerConfig "
                "lacks pipeline_model_parallel_size / virtual_pipeline_model_parallel_size",
                hint="build the config with specrl.integrations.megatron.convert."
                "transformer_config(..., pp=, vp=)",
            )


def check_schedule_config(config: Any, backend: str) -> None:
    """Refuse settings under which Megatron's schedules run but compute the wrong thing."""
    vp = config.virtual_pipeline_model_parallel_size or 1
    if vp > 1 and backend == "gloo" and config.batch_p2p_comm:
        raise LayoutError(
            "Megatron's interleaved schedule with batch_p2p_comm=True pairs the wrong "
            "point-to-point messages on gloo (wrong losses and gradients, no error)",
            hint="set batch_p2p_comm=False (specrl's transformer_config does)",
        )
    if config.pipeline_model_parallel_size > 1 and config.pipeline_model_parallel_size != (
        _pp_size()
    ):
        raise LayoutError(
            f"TransformerConfig.pipeline_model_parallel_size="
            f"{config.pipeline_model_parallel_size} but Megatron's parallel state has pp="
            f"{_pp_size()}"
        )


def _pp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


@dataclass
class _Microbatch:
    """One microbatch as every stage's data iterator hands it to ``forward_step``."""

    index: int
    tokens: torch.Tensor  # [b, s] ids, right-padded
    position_ids: torch.Tensor  # [b, s]
    valid: torch.Tensor  # [b, s] bool: real tokens, in packing order row by row
    packed: PackedBatch  # [T] the microbatch's samples packed (labels, mask, old_logp, adv)


class MegatronStrategy:
    """:class:`~specrl.train.strategy.PolicyStrategy` over Megatron-core ``GPTModel`` chunks
    (module docstring).  ``policy``: the whole native policy on every rank (its weights
    initialise the chunks; the rollout rank's copy receives the trained weights in
    :meth:`gather_weights`).  Collective construction: every rank."""

    def __init__(
        self,
        policy: Transformer,
        layout: TrainLayout,
        objective: Objective,
        *,
        schedule: MegatronSchedule = "1f1b",
        num_microbatches: int,
        micro_batch_size: int,
        seq_length: int,
        draft: Eagle3Draft | None = None,
        tap_layers: Sequence[int] = (),
        pad_id: int = 0,
        tap_timeout: float = 300.0,
    ) -> None:
        """``draft``: the co-trained draft on the last stage's ranks (elsewhere ignored, or
        kept to receive the trained draft on the rollout rank); ``tap_layers``: its tap layers
        on every rank (empty: the policy alone)."""
        from specrl.integrations.megatron import convert, require, runtime
        from specrl.integrations.megatron.compat import cpu_compat

        require()
        dims = layout.dims
        if dims.cp > 1:
            raise LayoutError(
                f"policy.backend=megatron with parallel.cp={dims.cp}: Megatron-core's context "
                "parallelism needs Transformer Engine's attention (GPU only)",
                hint="use parallel.cp: 1 with this backend, or policy.backend: native",
            )
        vp = dims.virtual_stages
        if (schedule == "interleaved") != (vp > 1):
            raise LayoutError(
                f"Megatron schedule {schedule} with virtual_stages={vp}: the interleaved "
                "schedule and virtual stages go together"
            )
        self.policy, self.layout, self.objective = policy, layout, objective
        self.num_microbatches, self.micro_batch_size = num_microbatches, micro_batch_size
        self.seq_length, self.pad_id = seq_length, pad_id
        self.config = policy.config
        convert.check_supported(self.config)
        dims.check_layers(self.config.num_hidden_layers)
        self.device = policy.device
        runtime.initialize(dims.pp, vp)
        assert layout.groups is not None
        if runtime.pipeline_ranks() != layout.groups.ranks("pp"):
            raise LayoutError(
                f"Megatron's pipeline {runtime.pipeline_ranks()} is not specrl's "
                f"{layout.groups.ranks('pp')}"
            )
        self.tconfig = convert.transformer_config(
            self.config,
            dtype=policy.dtype,
            pp=dims.pp,
            vp=vp,
            batch_p2p_comm=False,
            calculate_per_token_loss=True,
            deallocate_pipeline_outputs=False,
        )
        backend = dist.get_backend()
        check_schedule_config(self.tconfig, backend)
        state = policy.state_dict()
        with cpu_compat():
            from megatron.core import parallel_state as ps

            self.chunks: list[nn.Module] = []
            for v in range(vp):
                stage = v if vp > 1 else None
                chunk = convert.build_gpt(
                    self.config,
                    self.tconfig,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                    vp_stage=stage,
                ).to(self.device)
                convert.load_hf_state(chunk, state, self.config)
                self.chunks.append(chunk)
        check_stage_layers(self.chunks, self.config.num_hidden_layers, dims.pp, vp)
        self._sums: list[torch.Tensor] = []
        self._normalizer = 1.0

        # ------------------------------------------------ the draft and its TapChannel
        if draft is not None and not tap_layers:
            tap_layers = draft.config.tap_layers
        self.tap_layers = tuple(tap_layers)
        self.is_last = layout.hosts_draft
        self.rollout_draft = draft  # the rollout rank's copy receives the trained draft
        self.draft = draft if self.is_last and self.tap_layers else None
        if self.is_last and self.tap_layers and draft is None:
            raise ValueError("this rank runs the last stage: pass the draft to co-train")
        self.channel: TapChannel | None = None
        self._current: dict[int, int] = {}  # id(chunk) → microbatch it is running
        self._draft_sums: list[torch.Tensor] = []
        self._draft_seconds = 0.0
        self._ttt: list[TTTInputs | None] = []
        groups = layout.groups
        pipelines = dims.group_ranks("pp")
        # stage 0 → last stage: the draft's frozen embedding follows the policy's
        self._embed_link = None
        if dims.pp > 1:
            self._embed_link, _ = dist.new_subgroups_by_enumeration(
                [[p[0], p[-1]] for p in pipelines]
            )
        if self.tap_layers:
            distinct = tuple(sorted(set(self.tap_layers)))
            gathered: list[Any] = [None] * dims.pp
            dist.all_gather_object(gathered, self.global_layers(), group=groups["pp"])
            stage_layers = [gathered[s % dims.pp][s // dims.pp] for s in range(dims.pp * vp)]
            stage_ranks = [s % dims.pp for s in range(dims.pp * vp)]
            plan = TapPlan.build(distinct, stage_layers, stage_ranks)
            rows = micro_batch_size * seq_length
            spec = TapSpec(self.config.hidden_size, policy.dtype, rows, self.device)
            self.channel = TapChannel.create(
                plan, spec, pipelines, depth=num_microbatches, timeout=tap_timeout
            )
            for chunk in self.chunks:
                for layer in chunk.decoder.layers:
                    if layer.layer_number - 1 in distinct:
                        layer.register_forward_hook(self._tap_hook(chunk, layer.layer_number - 1))

    # ---------------------------------------------------------------- PolicyStrategy
    def parameters(self) -> list[nn.Parameter]:
        return [p for c in self.chunks for p in c.parameters()]

    def global_layers(self) -> list[list[int]]:
        """This rank's chunks' global 0-based layer ids (``layer_number - 1``)."""
        return [[layer.layer_number - 1 for layer in c.decoder.layers] for c in self.chunks]

    def microbatches(self, samples: Sequence[Sample]) -> list[_Microbatch]:
        """The minibatch's ``num_microbatches`` microbatches (sample i → i mod n), each
        ``micro_batch_size`` right-padded rows of ``seq_length``."""
        b, s, out = self.micro_batch_size, self.seq_length, []
        for j in range(self.num_microbatches):
            mine = list(samples[j :: self.num_microbatches])
            if len(mine) > b:
                raise LayoutError(
                    f"a Megatron microbatch holds {b} samples, got {len(mine)}",
                    hint="raise parallel.microbatches",
                )
            tokens = torch.full((b, s), self.pad_id, dtype=torch.long)
            valid = torch.zeros(b, s, dtype=torch.bool)
            for i, smp in enumerate(mine):
                seq = smp.prompt + smp.response
                if len(seq) > s:
                    raise LayoutError(f"a sample of {len(seq)} tokens exceeds seq_length = {s}")
                tokens[i, : len(seq)] = torch.tensor(seq)
                valid[i, : len(seq)] = True
            if not mine:  # an empty microbatch: one masked dummy token, as pack() makes
                valid[0, 0] = True
            positions = torch.arange(s).expand(b, s)
            dev = self.device
            out.append(
                _Microbatch(
                    j,
                    tokens.to(dev),
                    positions.to(dev),
                    valid.to(dev),
                    pack(mine, dev, self.pad_id),
                )
            )
        return out

    def forward_backward(self, samples: Sequence[Sample], *, draft: DraftMode) -> MinibatchOutput:
        """With tap layers the draft always co-trains (``draft`` is not consulted, as on the
        native pipeline: a frozen draft is not measured here)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from specrl.integrations.megatron.compat import cpu_compat

        t0 = time.perf_counter()
        mbs = self.microbatches(samples)
        count = torch.tensor(
            sum(float(mb.packed.mask.sum()) for mb in mbs), dtype=torch.float64
        ).to(self.layout.device)
        self.layout.sum_(count, "dp")
        self._normalizer = max(float(count), 1.0)
        self._sums, self._draft_sums, self._draft_seconds = [], [], 0.0
        self._mbs = mbs
        params = self.parameters()
        for p in params:
            p.grad = None
        if self.draft is not None:
            self.draft.zero_grad(set_to_none=True)
            k = self.objective.ttt_steps
            self._ttt = [ttt_inputs(m.packed.ids, m.packed.mask, m.packed.layout, k) for m in mbs]
        if self.channel is not None:
            self.channel.begin_step([int(m.valid.sum()) for m in mbs])
        with cpu_compat():
            fb = get_forward_backward_func()
            fb(
                forward_step_func=self._forward_step,
                data_iterator=[iter(mbs) for _ in self.chunks],
                model=self.chunks,
                num_microbatches=self.num_microbatches,
                seq_length=self.seq_length,
                micro_batch_size=self.micro_batch_size,
                forward_only=False,
            )
        self.tap_stats: TapStats | None = None
        if self.channel is not None:
            self.tap_stats = self.channel.end_step()
        if self.layout.dims.dp > 1:
            all_reduce_grads(params, self.layout.group("dp"))
            if self.draft is not None:
                trainable = [p for p in self.draft.parameters() if p.requires_grad]
                all_reduce_grads(trainable, self.layout.group("dp"))
        t_policy = time.perf_counter() - t0 - self._draft_seconds
        result = self._draft_result() if self.channel is not None else None
        sums = torch.zeros(6, dtype=torch.float64)  # [loss, clipped, kl, ratio, nll, tokens]
        for s in self._sums:
            sums += s
        # the last stage's replicas hold every row once; broadcast along the pipeline
        self.layout.sum_(sums, "dp")
        groups = self.layout.groups
        assert groups is not None
        sums = sums.to(self.layout.device)
        dist.broadcast(sums, src=groups.ranks("pp")[-1], group=groups["pp"])
        sums = sums.cpu()
        return MinibatchOutput(float(sums[0]), sums[1:6], result, t_policy, self._draft_seconds)

    def _draft_result(self) -> DraftResult:
        """The draft's loss (mean over microbatches and replicas) and per-step accuracy, on
        every rank: reduced over dp on the last stage, broadcast along the pipeline."""
        k = self.objective.ttt_steps
        sums = torch.zeros(1 + 2 * k, dtype=torch.float64)
        for d in self._draft_sums:
            sums += d
        self.layout.sum_(sums, "dp")  # zeros off the last stage
        groups = self.layout.groups
        assert groups is not None
        buf = sums.to(self.layout.device)
        dist.broadcast(buf, src=groups.ranks("pp")[-1], group=groups["pp"])
        sums = buf.cpu()
        hits, counts = sums[1 : 1 + k], sums[1 + k :]
        acc = (hits / counts.clamp(min=1.0)).tolist()
        tau, run = 1.0, 1.0
        for a in acc:
            run *= a
            tau += run
        return DraftResult(float(sums[0]), acc, tau)

    def _tap_hook(self, chunk: nn.Module, layer: int):
        """A forward hook sending the layer's output (``output[0]``, [s, b, h]) of the running
        microbatch — its real rows, in packing order — through the TapChannel."""

        def hook(module, args, output):
            channel = self.channel
            assert channel is not None
            m = self._current[id(chunk)]
            hidden = output[0] if isinstance(output, tuple) else output
            rows = hidden.detach().transpose(0, 1)[self._mbs[m].valid]  # [T, h]
            channel.send(m, layer, rows)

        return hook

    def _forward_step(self, data_iterator, model):
        mb: _Microbatch = next(data_iterator)
        self._current[id(model)] = mb.index
        logits = model(mb.tokens, mb.position_ids, None)  # [b, s, V] on the last stage
        return logits, lambda out: self._loss(mb, out)

    def _train_draft(self, mb: _Microbatch, rows: torch.Tensor) -> None:
        """The draft's TTT forward and backward on microbatch ``mb`` from its TapChannel taps,
        its own logits ``rows`` ([T, V], detached here) the teacher."""
        draft, obj = self.draft, self.objective
        assert draft is not None and self.channel is not None
        taps = self.channel.collect(mb.index)  # {layer: [T, h]}
        t0 = time.perf_counter()
        feats = Eagle3Draft.concat_taps(taps, self.tap_layers)
        ttt = self._ttt[mb.index]
        assert ttt is not None
        layout = mb.packed.layout
        out = draft.ttt_forward(feats, ttt.step_ids, layout)
        loss = ttt_loss(
            out,
            teacher_from_logits(rows.detach(), draft),
            ttt,
            layout,
            kind=obj.ttt_loss,
            decay=obj.ttt_decay,
        )
        scale = 1.0 / (self.num_microbatches * self.layout.dims.dp)
        (loss.loss * (scale * obj.draft_loss_weight)).backward()
        counts = torch.tensor(loss.count, dtype=torch.float64)
        hits = torch.tensor(loss.acc, dtype=torch.float64) * counts.clamp(min=1.0)
        scaled = loss.loss.detach().to(torch.float64).reshape(1) * scale
        self._draft_sums.append(torch.cat([scaled, hits, counts]))
        self._draft_seconds += time.perf_counter() - t0

    def _loss(self, mb: _Microbatch, logits: torch.Tensor):
        """Σ of the clipped policy loss over the microbatch's real rows / N (module doc)."""
        rows = logits[mb.valid]  # [T, V] in packing order
        if rows.dtype not in (torch.float32, torch.float64):
            rows = rows.float()
        p = mb.packed
        pl = self.objective.policy_loss(
            rows, p.labels, p.old_logp, p.advantages, p.mask, self._normalizer
        )
        self._sums.append(torch.tensor([float(pl.loss.detach()), *pl.sums()], dtype=torch.float64))
        if self.draft is not None:
            self._train_draft(mb, rows)
        tokens = torch.tensor(int(pl.tokens), dtype=torch.int)
        return pl.loss, tokens, {"policy_loss": pl.loss.detach()}

    def clip_policy_(self, max_norm: float) -> float:
        """The policy's global gradient norm over every stage (identical on all ranks)."""
        params = self.parameters()
        sq = torch.zeros((), dtype=torch.float64, device=self.layout.device)
        for p in params:
            if p.grad is not None:
                sq += p.grad.detach().to(torch.float64).pow(2).sum().to(sq.device)
        self.layout.sum_(sq, "pp")
        norm = float(sq.sqrt())
        if max_norm > 0 and norm > max_norm:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def close(self) -> None:
        """Megatron's process-group state released (a later strategy initialises its own)."""
        from specrl.integrations.megatron import runtime

        runtime.destroy()

    def clip_draft_(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        """The norm on the last stage (which holds the draft), sent along the pipeline."""
        return clip_on_last_stage(self.layout, params, max_norm)

    def after_step(self) -> None:
        """The draft's frozen embedding refreshed from stage 0's word embedding (the last
        stage holds no embedding of its own)."""
        if self.draft is None and not (self.tap_layers and self.layout.pp_rank == 0):
            return
        groups = self.layout.groups
        assert groups is not None
        pipeline = groups.ranks("pp")
        if self.layout.pp_rank == 0:
            weight = self.chunks[0].embedding.word_embeddings.weight.detach()
        else:
            assert self.draft is not None
            weight = torch.empty_like(self.draft.embed_tokens.weight)
        if self._embed_link is not None:
            dist.broadcast(weight, src=pipeline[0], group=self._embed_link)
        if self.draft is not None:
            self.draft.refresh_embedding(weight)

    def gather_weights(self) -> None:
        """Every stage's HF-named weights into the rollout rank's native policy, in place
        (point to point along the pipeline; the rollout rank is stage 0)."""
        from specrl.integrations.megatron import convert

        groups = self.layout.groups
        assert groups is not None
        pipeline, me = groups.ranks("pp"), self.layout.pp_rank
        mine = {}
        for c in self.chunks:
            mine.update(convert.chunk_hf_state(c, self.config))
        target = dict(self.policy.named_parameters())
        last = self.layout.dims.pp - 1
        draft = self.draft if me == last else self.rollout_draft if me == 0 else None
        trained = [] if draft is None or not self.tap_layers else _trainable(draft)
        if me != 0:
            names = sorted(mine)
            dist.send_object_list([names], dst=pipeline[0], group=groups["pp"])
            flat = torch.cat([mine[n].reshape(-1) for n in names])
            dist.send(flat.contiguous(), dst=pipeline[0], group=groups["pp"])
            if me == last and trained:
                dist.send(_flat(trained), dst=pipeline[0], group=groups["pp"])
            return
        with torch.no_grad():
            for n, t in mine.items():
                target[n].copy_(t)
            for r in range(1, self.layout.dims.pp):
                holder: list[Any] = [None]
                dist.recv_object_list(holder, src=pipeline[r], group=groups["pp"])
                names = holder[0]
                flat = torch.empty(
                    sum(target[n].numel() for n in names), dtype=self.policy.dtype
                ).to(self.device)
                dist.recv(flat, src=pipeline[r], group=groups["pp"])
                offset = 0
                for n in names:
                    t = target[n]
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
                if r == last and trained:
                    buf = torch.empty_like(_flat(trained))
                    dist.recv(buf, src=pipeline[r], group=groups["pp"])
                    _unflat_(buf, trained)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflat_(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
