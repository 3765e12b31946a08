"""How ``specrl train`` lays its ranks out and applies parallelisms to the plain policy.

One :class:`~specrl.core.parallel.ParallelDims` per job, from ``parallel.dp/cp/pp`` and the
launched world, validated *before* the process group starts (its error names every factor), and
its process groups built once (:func:`setup_distributed` → :class:`TrainLayout`).  The trainer
loads the plain single-device policy and applies parallelisms in one fixed order by named
functions; the model code never branches on parallelism:

1. **rollout copy** — the engine deep-copies the plain policy first (it decodes with a KV cache,
   which no training parallelism touches);
2. **context parallel** — :func:`use_context_parallel` sets every attention layer's ``cp`` hook,
   so packed forwards of zigzag shards run ring attention;
3. **pipeline parallel** (pp > 1) — ``PipelineCotrainer`` splits the model into stages and trains
   the draft on the last one; otherwise **data parallel** — DDP over ``dp_cp``, every rank that
   holds the same parameters (dp replicas × the cp ranks sharing each sequence).

Roles, with rank = (pp_index · dp + dp_index) · cp + cp_index:

- the **rollout rank** of data-parallel replica d is (pp 0, dp d, cp 0).  It alone runs the
  replica's engine, scores and groups the samples and broadcasts them to the replica's other
  pp × cp ranks (:meth:`TrainLayout.share`).  Generating redundantly on every rank would not give
  them the same samples: a wall-clock-gated engine's speculation choices (and so its random
  stream) differ from rank to rank.  It also holds the full current policy after every step
  (:meth:`StageSync.gather`) for the engine sync, evaluation and the HF-format checkpoint.
- the **draft** trains on the last pipeline stage (every rank when pp = 1).

Pipeline bookkeeping between steps (:class:`StageSync`):

- after every policy optimizer step the embedding table goes from stage 0 to the last stage over
  a dedicated two-rank group per pipeline, so the draft (whose frozen token embedding *is* the
  policy's) never trains against a stale table;
- once per RL step every stage of the cp-rank-0 pipeline sends its parameters (the last stage
  also the draft's) to the rollout rank, point to point.  Only that rank needs the whole model,
  so this moves (pp − 1)/pp of the policy to one rank instead of to all of them.

Simplification: every rank loads the whole policy before the split (the pipeline keeps only its
stages' modules in its optimizer); a meta-device build per stage would avoid that at scale.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from specrl.config.schema import ParallelConfig
from specrl.core.attention import CPContext
from specrl.core.parallel import GroupName, ParallelDims, ParallelGroups
from specrl.core.pipeline import ScheduleKind, StageLayout, split_model
from specrl.errors import LayoutError
from specrl.models.config import ModelConfig
from specrl.models.decoder import Transformer

_CPU = torch.device("cpu")
# recipe spelling → core.pipeline schedule kind
SCHEDULE_KINDS: dict[str, ScheduleKind] = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved-1f1b": "interleaved",
}


@dataclass(frozen=True)
class TrainLayout:
    """This rank's place in the job: degrees, named groups (None: one process) and roles."""

    dims: ParallelDims
    groups: ParallelGroups | None
    rank: int = 0
    device: torch.device = _CPU  # where collectives run (NCCL: this rank's GPU)

    @property
    def world(self) -> int:
        return self.dims.world_size

    @property
    def pp_rank(self) -> int:
        return self.dims.coords(self.rank).pp

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank).dp

    @property
    def cp_rank(self) -> int:
        return self.dims.coords(self.rank).cp

    @property
    def is_rollout_rank(self) -> bool:
        """Runs its replica's engine and holds the full current policy (pp 0, cp 0)."""
        return self.pp_rank == 0 and self.cp_rank == 0

    @property
    def hosts_draft(self) -> bool:
        """Trains the draft: the last pipeline stage."""
        return self.pp_rank == self.dims.pp - 1

    def group(self, name: GroupName) -> dist.ProcessGroup | None:
        return None if self.groups is None else self.groups[name]

    def cp_context(self) -> CPContext | None:
        """The context-parallel ring of this rank (None without CP)."""
        return CPContext.from_group(self.group("cp")) if self.dims.cp > 1 else None

    def sum_(
        self,
        t: torch.Tensor,
        name: GroupName | None = None,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    ) -> torch.Tensor:
        """In-place all-reduce (sum, or ``op``) of ``t`` over group ``name``, or over every rank
        (None); a tensor off the collective device (host metrics under NCCL) goes through it."""
        if self.groups is not None:
            group = None if name is None else self.groups[name]
            buf = t if t.device == self.device else t.to(self.device)
            dist.all_reduce(buf, op=op, group=group)
            if buf is not t:
                t.copy_(buf)
        return t

    def barrier(self) -> None:
        if self.groups is not None:
            dist.barrier()

    def share(self, obj: Any) -> Any:
        """``obj`` of this replica's rollout rank, on every rank of the replica (pickled): along
        the cp-rank-0 pipeline from stage 0, then along every stage's cp ring from cp rank 0."""
        if self.groups is None:
            return obj
        holder = [obj]
        if self.dims.pp > 1 and self.cp_rank == 0:
            src = self.groups.ranks("pp")[0]
            dist.broadcast_object_list(holder, src=src, group=self.groups["pp"])
        if self.dims.cp > 1:
            src = self.groups.ranks("cp")[0]
            dist.broadcast_object_list(holder, src=src, group=self.groups["cp"])
        return holder[0]


def check_layout(parallel: ParallelConfig, world: int) -> ParallelDims:
    """The job's degrees against the launched world and against each other (no model needed)."""
    try:
        dims = ParallelDims(
            world_size=world,
            dp=parallel.dp,
            cp=parallel.cp,
            pp=parallel.pp,
            virtual_stages=parallel.virtual_stages,
        )
    except LayoutError as exc:
        launch = f"torchrun --nproc-per-node {parallel.world_size} … or change parallel.dp/cp/pp"
        hint = launch if parallel.world_size != world else exc.hint
        raise LayoutError(f"parallel layout: {exc.message}", hint=hint) from None
    interleaved = parallel.pp_schedule == "interleaved-1f1b"
    if interleaved != (parallel.virtual_stages > 1):
        raise LayoutError(
            f"parallel.pp_schedule={parallel.pp_schedule} with parallel.virtual_stages="
            f"{parallel.virtual_stages}: the interleaved schedule and virtual stages go together",
            hint="set both (interleaved-1f1b, virtual_stages ≥ 2) or neither",
        )
    if parallel.pp > 1 and parallel.pp_schedule == "1f1b" and parallel.microbatches < parallel.pp:
        raise LayoutError(
            f"1F1B needs parallel.microbatches ≥ pp, got {parallel.microbatches} < {parallel.pp}",
            hint="raise parallel.microbatches or use pp_schedule: gpipe",
        )
    return dims


def check_model(dims: ParallelDims, config: ModelConfig) -> None:
    """The model against the layout: every stage needs a layer; tied embeddings need pp = 1."""
    dims.check_layers(config.num_hidden_layers)
    if dims.pp > 1 and config.tie_word_embeddings:
        raise LayoutError(
            "tied input/output embeddings would live on the first and the last pipeline stage "
            f"(parallel.pp={dims.pp}); their gradients are not synchronized across stages",
            hint="use a checkpoint with tie_word_embeddings = false, or parallel.pp: 1",
        )


def setup_distributed(
    parallel: ParallelConfig, device: torch.device, model: ModelConfig | None = None
) -> TrainLayout:
    """Check the layout (and ``model`` against it, when its config is already known) before
    joining the torchrun group — a bad layout fails at once on every rank, no rendezvous — then
    join it (if launched by torchrun: gloo, or NCCL on this rank's ``LOCAL_RANK`` GPU) and build
    the named groups once."""
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    dims = check_layout(parallel, world)
    if model is not None:
        check_model(dims, model)
    if world == 1:
        return TrainLayout(dims, None)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    collective = (
        torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else _CPU
    )
    return TrainLayout(dims, dims.build_groups(), dist.get_rank(), collective)


# ---------------------------------------------------------------------------- parallelisms
def use_context_parallel(model: Transformer, cp: CPContext) -> None:
    """Route every attention layer of ``model`` (or of a pipeline chunk) over the ring of ``cp``;
    the model's packed forwards then take zigzag shards (``ZigzagPlan.local`` layouts)."""
    for i in model.layer_ids:
        model.layer(i).self_attn.cp = cp


def all_reduce_grads(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


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
    """Parameter traffic of a pipelined policy between steps (see the module docstring).

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
