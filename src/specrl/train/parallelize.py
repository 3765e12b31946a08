"""Parallelisms applied to the plain policy, in one fixed order: :func:`parallelize_policy`.

The trainer loads the plain single-device policy (and draft) on every rank, builds the rollout
engine from copies of them first (the engine decodes with a KV cache, which no training
parallelism touches), then calls :func:`parallelize_policy`, which applies, in this order:

1. **context parallel** (cp > 1) — every attention layer of the policy (and of the reference
   model, for the KL term) routes packed forwards over the cp ring
   (:meth:`~specrl.models.decoder.Transformer.use_context_parallel`); minibatches become
   zigzag shards;
2. **pipeline parallel** (pp > 1) — :class:`~specrl.train.pipeline_cotrain.PipelineStrategy`
   splits the policy into stages and trains the draft on the last one (with
   ``policy.backend: megatron``: :class:`~specrl.integrations.megatron.strategy.
   MegatronStrategy`, Megatron-core chunks under Megatron's schedules); otherwise **data
   parallel** — :class:`~specrl.train.strategy.NativeStrategy`, DDP over ``dp_cp`` (the dp
   replicas × the cp ranks sharing each sequence).

It returns the :class:`~specrl.train.strategy.PolicyStrategy` the trainer's one minibatch path
calls.  The model code never branches on parallelism; who runs what is
:mod:`specrl.train.layout`'s.

Simplification: every rank loads the whole policy before the split (the pipeline keeps only its
stages' modules in its optimizer); a meta-device build per stage would avoid that at scale.
"""

from __future__ import annotations

from specrl.config.schema import Recipe
from specrl.core.pipeline import ScheduleKind
from specrl.errors import ConfigError, LayoutError
from specrl.models.decoder import Transformer
from specrl.models.draft import Eagle3Draft
from specrl.train.batch import microbatch_budget
from specrl.train.layout import TrainLayout
from specrl.train.pipeline_cotrain import PipelineStrategy
from specrl.train.strategy import NativeStrategy, Objective, PolicyStrategy

# recipe spelling → core.pipeline schedule kind
SCHEDULE_KINDS: dict[str, ScheduleKind] = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved-1f1b": "interleaved",
}


# recipe spelling → Megatron-core schedule (Megatron has no GPipe)
MEGATRON_SCHEDULES = {"1f1b": "1f1b", "interleaved-1f1b": "interleaved"}


def check_backend(recipe: Recipe) -> None:
    """One-line errors for layouts ``policy.backend`` and ``rollout.backend`` cannot run (before
    any process starts)."""
    par = recipe.parallel
    if recipe.rollout.backend == "vllm" and par.world_size > 1:
        raise ConfigError(
            "rollout.backend: vllm runs in the trainer's process: it needs dp = cp = pp = 1",
            hint="use rollout.backend: embedded for parallel layouts",
        )
    if recipe.policy.backend != "megatron":
        return
    if par.cp > 1:
        raise LayoutError(
            f"policy.backend=megatron with parallel.cp={par.cp}: Megatron-core's context "
            "parallelism needs Transformer Engine's attention, which needs a GPU",
            hint="set parallel.cp: 1, or policy.backend: native (specrl's ring attention)",
        )
    if par.pp < 2:
        raise LayoutError(
            f"policy.backend=megatron runs Megatron's pipeline schedules: parallel.pp must be "
            f"≥ 2, got {par.pp}",
            hint="set parallel.pp: 2 (or more), or policy.backend: native",
        )
    if par.pp_schedule not in MEGATRON_SCHEDULES:
        raise LayoutError(
            f"policy.backend=megatron has no {par.pp_schedule} schedule",
            hint="use parallel.pp_schedule: 1f1b or interleaved-1f1b",
        )
    if recipe.draft.mode == "frozen":
        raise LayoutError(
            "policy.backend=megatron co-trains the draft or runs without one; draft.mode: frozen "
            "is not measured on pipelines",
            hint="set draft.mode: cotrain or none",
        )


def parallelize_policy(
    policy: Transformer,
    layout: TrainLayout,
    recipe: Recipe,
    *,
    draft: Eagle3Draft | None = None,
    cotrain: bool = True,
    reference: Transformer | None = None,
    pad_id: int = 0,
    max_seq_len: int,
) -> PolicyStrategy:
    """Apply the recipe's parallelisms to ``policy`` in place and return its strategy.

    ``draft``: the draft, ``cotrain``: whether it trains (a frozen one is only measured, and
    only under pp = 1); ``reference``: the KL reference model
    (pp = 1 only); ``max_seq_len``: the longest sample, which sizes pipeline microbatches.
    Collective (every rank)."""
    par, objective = recipe.parallel, Objective.from_recipe(recipe)
    cp = layout.cp_context()
    if cp is not None:
        for model in (policy, reference):
            if model is not None:
                model.use_context_parallel(cp)
    if layout.dims.pp == 1:
        return NativeStrategy(
            policy, layout, objective, draft=draft, reference=reference, pad_id=pad_id
        )
    r = recipe.rollout
    per_replica = r.prompts_per_step // layout.dims.dp * r.n  # samples, before DAPO filtering
    per_minibatch = -(-per_replica // recipe.algo.minibatches)
    if recipe.policy.backend == "megatron":
        from specrl.integrations.megatron.strategy import MegatronStrategy

        check_backend(recipe)
        trained = draft if cotrain else None
        return MegatronStrategy(
            policy,
            layout,
            objective,
            schedule=MEGATRON_SCHEDULES[par.pp_schedule],  # type: ignore[arg-type]
            num_microbatches=par.microbatches,
            micro_batch_size=-(-per_minibatch // par.microbatches),
            seq_length=max_seq_len,
            draft=trained,
            tap_layers=trained.config.tap_layers if trained is not None else (),
            pad_id=pad_id,
        )
    return PipelineStrategy(
        policy,
        layout,
        objective,
        schedule=SCHEDULE_KINDS[par.pp_schedule],
        num_microbatches=par.microbatches,
        microbatch_tokens=microbatch_budget(per_minibatch, par.microbatches, max_seq_len, par.cp),
        draft=draft if cotrain else None,
        pad_id=pad_id,
    )
