"""Who is who in a ``specrl train`` job: parallel degrees, named groups, each rank's roles.

One :class:`~specrl.core.parallel.ParallelDims` per job, from ``parallel.dp/cp/pp`` and the
launched world, validated *before* the process group starts (its error names every factor), and
its process groups built once (:func:`setup_distributed` → :class:`TrainLayout`).

Roles, with rank = (pp_index · dp + dp_index) · cp + cp_index:

- the **rollout rank** of data-parallel replica d is (pp 0, dp d, cp 0).  It alone runs the
  replica's engine, scores and groups the samples and broadcasts them to the replica's other
  pp × cp ranks (:meth:`TrainLayout.share`).  Generating redundantly on every rank would not give
  them the same samples: a wall-clock-gated engine's speculation choices (and so its random
  stream) differ from rank to rank.  It also holds the full current policy after every step
  (the strategy's ``gather_weights``) for the engine sync, evaluation and the HF checkpoint.
- the **draft** trains on the last pipeline stage (every rank when pp = 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from specrl.config.schema import ParallelConfig, Recipe
from specrl.core.attention import CPContext
from specrl.core.parallel import GroupName, ParallelDims, ParallelGroups
from specrl.errors import LayoutError
from specrl.models.config import ModelConfig

_CPU = torch.device("cpu")


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


def check_split(recipe: Recipe) -> None:
    """One-line errors for work a valid layout cannot split (after the layout's own checks)."""
    par = recipe.parallel
    if recipe.rollout.prompts_per_step % par.dp:
        raise LayoutError(
            f"rollout.prompts_per_step={recipe.rollout.prompts_per_step} is not divisible by "
            f"parallel.dp={par.dp}",
        )
    if par.pp > 1 and recipe.algo.kl_coef > 0:
        raise LayoutError(
            f"algo.kl_coef={recipe.algo.kl_coef} needs the reference model's forward, which "
            f"does not run pipelined (parallel.pp={par.pp})",
            hint="set algo.kl_coef: 0 or parallel.pp: 1",
        )
