"""Megatron-core's process-group state for a specrl layout.

Megatron orders ranks tp (innermost), cp, dp, pp (outermost) — with tp = 1 that is specrl's
``rank = (pp · dp + dp_index) · cp + cp_index`` (:mod:`specrl.core.parallel`), so the pipeline
Megatron builds for a rank is the one specrl's ``"pp"`` group names.  :func:`initialize` checks
that instead of assuming it.
"""

from __future__ import annotations

import torch.distributed as dist

from specrl.integrations.megatron import require
from specrl.integrations.megatron.compat import cpu_compat


def initialize(pp: int = 1, vp: int | None = None, *, seed: int = 0) -> None:
    """``parallel_state.initialize_model_parallel`` (tp = 1, cp = 1) over the default process
    group, and Megatron's model-parallel RNG seeded (its tracker on the CPU generator where
    CUDA is absent); a state of the same sizes is kept (several strategies of one layout share
    it), one of other sizes destroyed first.  Collective: every rank."""
    require()
    with cpu_compat():
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        if ps.model_parallel_is_initialized():
            same = ps.get_pipeline_model_parallel_world_size() == pp and (
                ps.get_virtual_pipeline_model_parallel_world_size() or 1
            ) == (vp or 1)
            if same:  # several strategies of one layout share Megatron's state
                return
            destroy()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
        )
        model_parallel_cuda_manual_seed(seed)


def pipeline_ranks() -> list[int]:
    """The global ranks of this rank's Megatron pipeline, in stage order."""
    from megatron.core import parallel_state as ps

    return dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())


def destroy() -> None:
    """Megatron's groups and globals released (its RNG tracker reset)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mg_random

    ps.destroy_model_parallel()
    mg_random.initialize_rng_tracker(force_reset=True)
