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
from specrl.errors import LayoutError
from specrl.models.decoder import Transformer
from specrl.train.batch import PackedBatch, Sample, pack
from specrl.train.layout import TrainLayout
from specrl.train.strategy import DraftMode, MinibatchOutput, Objective

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
        pad_id: int = 0,
    ) -> None:
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
        if dims.pp < 2:
            raise LayoutError("policy.backend=megatron runs pipelines of pp ≥ 2 stages")
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
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from specrl.integrations.megatron.compat import cpu_compat

        t0 = time.perf_counter()
        mbs = self.microbatches(samples)
        count = torch.tensor(
            sum(float(mb.packed.mask.sum()) for mb in mbs), dtype=torch.float64
        ).to(self.layout.device)
        self.layout.sum_(count, "dp")
        self._normalizer = max(float(count), 1.0)
        self._sums = []
        params = self.parameters()
        for p in params:
            p.grad = None
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
        if self.layout.dims.dp > 1:
            all_reduce_grads(params, self.layout.group("dp"))
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
        return MinibatchOutput(float(sums[0]), sums[1:6], None, time.perf_counter() - t0, 0.0)

    def _forward_step(self, data_iterator, model):
        mb: _Microbatch = next(data_iterator)
        logits = model(mb.tokens, mb.position_ids, None)  # [b, s, V] on the last stage
        return logits, lambda out: self._loss(mb, out)

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
        return float("nan")

    def after_step(self) -> None:
        """Nothing to follow without a draft."""

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
        if me != 0:
            names = sorted(mine)
            dist.send_object_list([names], dst=pipeline[0], group=groups["pp"])
            flat = torch.cat([mine[n].reshape(-1) for n in names])
            dist.send(flat.contiguous(), dst=pipeline[0], group=groups["pp"])
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
