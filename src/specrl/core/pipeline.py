"""Pipeline parallelism for the specrl decoder on ``torch.distributed.pipelining``.

Pieces, in the order a trainer uses them:

- :class:`StageLayout`: L decoder layers cut into S = pp × virtual contiguous, balanced stages
  (model chunks); stage s runs on pipeline rank s mod pp — the loop placement of interleaved 1F1B,
  so rank r runs stages r, r + pp, …  With one stage per rank it is the plain split.
- :func:`split_model`: this rank's chunks.  A chunk is a ``Transformer`` built on the meta device
  whose embedding (first stage), layers and final norm + lm_head (last stage) *are* the given
  model's modules: parameter names stay the HF ones (``model.layers.5.mlp…``) and nothing is
  copied.  A chunk's forward is the decoder's forward over the layers it holds.
- :class:`StageModule`: the module a ``PipelineStage`` drives.  ``forward(x, mb)`` takes token ids
  [T] (first stage) or hidden states [T, H] and the microbatch index ``mb`` ([1] int64, chunked
  by the schedule from ``arange(n)`` like any input) that selects the microbatch's layout from a
  per-step side table; it returns hidden states [T, H], or logits [T, V] on the last stage.  When
  a :class:`~specrl.core.transport.TapChannel` is attached it sends the stage's tap layers from
  inside this forward (non-blocking); the tensors the schedule moves do not change.
- :func:`make_stage`: the ``PipelineStage`` with static shapes ([T] ids or [T, H] activations):
  every microbatch has the same token budget, so no shape inference runs the model ahead of the
  schedule.
- :func:`build_schedule`: GPipe, 1F1B or Interleaved1F1B, gradients never rescaled (the loss
  function normalizes).
- :func:`tap_slot_depth`: from a schedule's action order, how many microbatches can be in flight
  between a producer stage and the last stage: the TapChannel's ring holds one slot more.

The module knows the decoder only by its contract (``model.embed_tokens``, ``model.layers`` keyed
by global index, ``model.norm``, ``lm_head``, ``forward(inputs, layout, taps=, logits=)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from specrl.core.attention.layout import PackedLayout
from specrl.errors import LayoutError

if TYPE_CHECKING:
    from specrl.core.transport import TapChannel
    from specrl.models.decoder import Transformer

ScheduleKind = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class StageLayout:
    """Which decoder layers every pipeline stage owns; stage s runs on pipeline rank s mod pp."""

    pp: int
    stage_layers: tuple[tuple[int, ...], ...]  # global stage → its layer ids (ascending)

    @classmethod
    def balanced(cls, num_layers: int, pp: int, virtual_stages: int = 1) -> StageLayout:
        """Contiguous stages of ⌊L/S⌋ or ⌈L/S⌉ layers (earlier stages take the extra ones)."""
        stages = pp * virtual_stages
        if pp < 1 or virtual_stages < 1:
            raise LayoutError(f"need pp ≥ 1 and virtual_stages ≥ 1, got {pp}, {virtual_stages}")
        if num_layers < stages:
            raise LayoutError(
                f"{num_layers} decoder layers cannot fill pp × virtual_stages = {pp} × "
                f"{virtual_stages} = {stages} pipeline stages"
            )
        base, extra = divmod(num_layers, stages)
        out, start = [], 0
        for s in range(stages):
            n = base + (s < extra)
            out.append(tuple(range(start, start + n)))
            start += n
        return cls(pp, tuple(out))

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.pp

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """Pipeline rank of every stage."""
        return tuple(s % self.pp for s in range(self.num_stages))

    def rank_stages(self, pp_rank: int) -> tuple[int, ...]:
        """Stages run by ``pp_rank``, in order."""
        return tuple(range(pp_rank, self.num_stages, self.pp))


def split_model(model: Transformer, layout: StageLayout, pp_rank: int) -> list[Transformer]:
    """This rank's chunks of ``model``: decoders that share the model's modules (no copies)."""
    cfg = model.config
    owned = sorted(int(k) for k in model.model.layers)
    wanted = sorted(i for layers in layout.stage_layers for i in layers)
    if owned != wanted:
        raise LayoutError(f"the stage layout covers layers {wanted}, the model has {owned}")
    if cfg.tie_word_embeddings and layout.pp > 1:
        raise LayoutError(
            "tied input/output embeddings would live on the first and the last pipeline rank; "
            "their gradients are not synchronized across stages",
            hint="use a checkpoint with tie_word_embeddings = false, or pp = 1",
        )
    chunks = []
    for s in layout.rank_stages(pp_rank):
        with torch.device("meta"):
            chunk = type(model)(cfg)  # placeholders only: every module is replaced below
        last = s == layout.num_stages - 1
        chunk.model.embed_tokens = model.model.embed_tokens if s == 0 else None
        chunk.model.layers = nn.ModuleDict(
            {str(i): model.model.layers[str(i)] for i in layout.stage_layers[s]}
        )
        chunk.model.norm = model.model.norm if last else None
        chunk.lm_head = model.lm_head if last else None
        chunk.attn_backend = model.attn_backend
        chunks.append(chunk)
    return chunks


class StageModule(nn.Module):
    """One pipeline stage: a model chunk, the step's microbatch layouts, and its tap sends."""

    def __init__(
        self, chunk: Transformer, stage_index: int, num_stages: int, tap_layers: Sequence[int] = ()
    ) -> None:
        super().__init__()
        self.chunk = chunk
        self.stage_index, self.num_stages = stage_index, num_stages
        owned = set(chunk.layer_ids)
        self.tap_layers = tuple(sorted(i for i in tap_layers if i in owned))
        self.channel: TapChannel | None = None  # attached by the trainer; None: no taps sent
        self._layouts: Sequence[PackedLayout] = ()
        self._tap_rows: Sequence[int] = ()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def set_microbatches(self, layouts: Sequence[PackedLayout], tap_rows: Sequence[int]) -> None:
        """The step's side table: layout of microbatch m ([T] tokens, zigzag-local under CP) and
        how many leading rows of it feed the draft (its real tokens)."""
        self._layouts, self._tap_rows = list(layouts), list(tap_rows)

    def forward(
        self,
        x: torch.Tensor,  # [T] int64 ids (first stage) or [T, H] hidden states
        mb: torch.Tensor,  # [1] int64 microbatch index (CPU), chunked by the schedule
    ) -> torch.Tensor:  # [T, H] hidden, or [T, V] logits on the last stage
        m = int(mb[0])
        send = self.channel is not None and bool(self.tap_layers)
        out = self.chunk(
            x, self._layouts[m], taps=self.tap_layers if send else (), logits=self.is_last
        )
        if send:
            rows = self._tap_rows[m]
            for layer, h in out.taps.items():  # detached [T, H]; isend, never blocks
                self.channel.send(m, layer, h[:rows])
        return out.logits if self.is_last else out.hidden


def make_stage(
    module: StageModule,
    tokens: int,
    group: dist.ProcessGroup,
    device: torch.device | str,
) -> PipelineStage:
    """A ``PipelineStage`` with static shapes for microbatches of ``tokens`` rows."""
    chunk = module.chunk
    h, v, dtype = chunk.config.hidden_size, chunk.config.vocab_size, chunk.dtype
    logits_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if module.is_first:
        inputs = torch.empty(tokens, dtype=torch.int64, device=device)
    else:
        inputs = torch.empty(tokens, h, dtype=dtype, device=device, requires_grad=True)
    if module.is_last:
        outputs = torch.empty(tokens, v, dtype=logits_dtype, device=device, requires_grad=True)
    else:
        outputs = torch.empty(tokens, h, dtype=dtype, device=device, requires_grad=True)
    return PipelineStage(
        module,
        module.stage_index,
        module.num_stages,
        torch.device(device),
        input_args=inputs,
        output_args=outputs,
        group=group,
    )


def build_schedule(
    kind: ScheduleKind,
    stages: Sequence[PipelineStage],
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """The torch pipeline schedule for this rank's stages (gradients are not rescaled)."""
    if kind not in SCHEDULES:
        raise LayoutError(f"unknown pipeline schedule {kind!r}; choose one of {SCHEDULES}")
    if kind == "interleaved":
        if len(stages) < 2:
            raise LayoutError("the interleaved schedule needs virtual_stages ≥ 2 per rank")
        pp = stages[0].group_size
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise LayoutError(
                f"interleaved 1F1B runs {n_microbatches} microbatches in {rounds} rounds of pp = "
                f"{pp}: the count must be a multiple of the rounds"
            )
        return ScheduleInterleaved1F1B(
            list(stages), n_microbatches, loss_fn=loss_fn, scale_grads=False
        )
    if len(stages) != 1:
        raise LayoutError(f"the {kind} schedule runs one stage per rank; use 'interleaved'")
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)


def tap_slot_depth(
    pipeline_order: Mapping[int, Sequence[Any]], stage: int, pp_rank: int, n_microbatches: int
) -> int:
    """Microbatches that can be in flight from ``stage`` (on ``pp_rank``) to the last stage.

    Walks the rank's action order (``schedule.pipeline_order``): a backward of microbatch m on
    any of the rank's stages implies the last stage already ran (and consumed) microbatch m's
    forward, so at each forward of ``stage`` at most (forwards so far − distinct microbatches
    already backwarded on the rank) of its taps are waiting.  GPipe gives n, 1F1B ≤ pp.
    """
    forwarded, backwarded, worst = 0, set(), 1
    for action in pipeline_order[pp_rank]:
        if action is None:
            continue
        kind = action.computation_type
        if kind == "F" and action.stage_index == stage:
            forwarded += 1
            worst = max(worst, forwarded - len(backwarded))
        elif kind in ("B", "I"):
            backwarded.add(action.microbatch_index)
    return min(worst, n_microbatches)
