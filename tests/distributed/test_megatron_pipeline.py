"""Megatron-core's own pipeline schedules on gloo, against specrl's native one-process run.

A spawned world runs every case of its size (2 or 4 ranks): a tiny 4-layer Llama-family policy
(GQA, 2 query heads per kv head), the same RL samples on every rank (prompts and responses of
different lengths), :class:`MegatronStrategy` per the case's layout; on every rank the native
decoder computes the one-process objective over all the samples (packed, SDPA attention).

- float64: the policy loss, its per-token sums and every policy gradient (each rank's stages, by
  HF name; together every parameter) equal the native run to 1e-10 relative.  Not bit-identical:
  the two backends use different kernels (Megatron's baddbmm + softmax over padded [b, s] rows,
  fused QKV and fc1 GEMMs, vs SDPA over packed rows and separate projections) — float64 makes
  their agreement a sharp test (any layout or reduction error is ≫ 1e-10);
- float32 (1F1B): agreement to 1e-5 relative in norm per tensor (same reason, float32 rounding);
- the silent traps: a config without the pipeline size builds every layer on every stage and is
  refused by ``check_stage_layers``; interleaving with ``batch_p2p_comm=True`` on gloo is refused
  by ``check_schedule_config`` (the strategy's own config has it off).

Layouts: pp 2 × 1F1B, pp 2 × interleaved (2 virtual stages per rank), pp 2 × dp 2 (1F1B).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'specrl[megatron]'")

from specrl.core.distributed import spawn
from specrl.core.parallel import ParallelDims
from specrl.models.config import ModelConfig
from specrl.models.decoder import Transformer
from specrl.train.batch import Sample, pack
from specrl.train.layout import TrainLayout
from specrl.train.strategy import Objective

pytestmark = pytest.mark.distributed

V, LAYERS = 37, 4
OBJ = Objective(
    temperature=0.9,
    clip_low=0.2,
    clip_high=0.28,
    kl_coef=0.0,
    ttt_steps=2,
    ttt_loss="ce",
    ttt_decay=0.8,
    draft_loss_weight=1.0,
    ttt_cp_mode="ring",
)


@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int = 2
    virtual: int = 1
    dp: int = 1
    microbatches: int = 4
    dtype: torch.dtype = torch.float64

    def __str__(self) -> str:
        return f"{self.schedule} pp={self.pp}×v={self.virtual} dp={self.dp} {self.dtype}"


CASES = {
    2: [
        Case("1f1b"),
        Case("interleaved", virtual=2),
        Case("1f1b", dtype=torch.float32),
    ],
    4: [Case("1f1b", dp=2, microbatches=2)],
}


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500.0,
        max_position_embeddings=64,
    )


def samples(n: int, seed: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, r = (int(x) for x in torch.randint(1, 7, (2,), generator=gen))
        prompt = torch.randint(0, V, (p,), generator=gen).tolist()
        response = torch.randint(0, V, (r,), generator=gen).tolist()
        old = (-torch.rand(r, generator=gen) * 3).tolist()
        adv = float(torch.randn(1, generator=gen))
        out.append(Sample(prompt, response, old, adv))
    return out


def reference(policy: Transformer, batch: list[Sample]) -> tuple[torch.Tensor, dict]:
    """The native one-process objective over every sample: loss and per-token sums, grads."""
    policy.zero_grad(set_to_none=True)
    full = pack(batch, policy.device)
    out = policy(full.ids, full.layout)
    total = float(full.mask.sum())
    pl = OBJ.policy_loss(out.logits, full.labels, full.old_logp, full.advantages, full.mask, total)
    pl.loss.backward()
    sums = torch.tensor([float(pl.loss.detach()), *pl.sums()], dtype=torch.float64)
    grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
    return sums, grads


def _close(name: str, got: torch.Tensor, want: torch.Tensor, dtype, failures: list[str]) -> None:
    got, want = got.double(), want.double()
    if dtype == torch.float64:
        err = float((got - want).abs().max())
        bound = 1e-10 * max(float(want.abs().max()), 1e-3)
    else:
        err = float((got - want).norm())
        bound = 1e-5 * max(float(want.norm()), 1e-3)
    if not err <= bound:
        failures.append(f"{name}: error {err:.3e} > {bound:.3e}")


def run_case(case: Case, rank: int, world: int) -> dict:
    from specrl.integrations.megatron import convert
    from specrl.integrations.megatron.strategy import MegatronStrategy

    dims = ParallelDims(world_size=world, dp=case.dp, pp=case.pp, virtual_stages=case.virtual)
    layout = TrainLayout(dims, dims.build_groups(), rank)
    policy = Transformer(model_config()).init_weights(0, std=0.3).to(case.dtype)
    batch = samples(8, seed=3)
    want_sums, want_grads = reference(policy, batch)
    mine = batch[layout.dp_rank :: case.dp]  # this replica's share
    per_mb = -(-len(mine) // case.microbatches)
    strategy = MegatronStrategy(
        policy,
        layout,
        OBJ,
        schedule=case.schedule,
        num_microbatches=case.microbatches,
        micro_batch_size=per_mb,
        seq_length=12,
    )
    failures: list[str] = []
    try:
        out = strategy.forward_backward(mine, draft=None)
        got_sums = torch.tensor([out.policy_loss, *out.sums.tolist()], dtype=torch.float64)
        _close("policy loss and sums", got_sums, want_sums, case.dtype, failures)
        grads: dict[str, torch.Tensor] = {}
        for c in strategy.chunks:
            grads.update(convert.chunk_hf_state(c, policy.config, grads=True))
        for name, g in grads.items():
            _close(f"grad {name}", g, want_grads[name], case.dtype, failures)
        params = {
            n: p.detach()
            for c in strategy.chunks
            for n, p in convert.chunk_hf_state(c, policy.config).items()
        }
        layers = strategy.global_layers()
    finally:
        strategy.close()
    return {
        "failures": [f"{case} rank {rank}: {f}" for f in failures],
        "names": sorted(grads),
        "layers": layers,
        "policy": sorted(params),
    }


def trap_checks(rank: int, world: int) -> list[str]:
    """Each silent trap is caught: the stage layer count, interleaved p2p batching on gloo."""
    import torch.distributed as dist

    from specrl.errors import LayoutError
    from specrl.integrations.megatron import convert, runtime
    from specrl.integrations.megatron.compat import cpu_compat
    from specrl.integrations.megatron.strategy import check_schedule_config, check_stage_layers

    failures = []
    cfg = model_config()
    runtime.initialize(2, 2)
    try:
        with cpu_compat():
            from megatron.core import parallel_state as ps

            first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0)
            # the trap: no pipeline sizes in the config → every layer on every stage, no error
            wrong = convert.build_gpt(
                cfg,
                convert.transformer_config(cfg, pp=1, vp=None),
                pre_process=first,
                post_process=False,
                vp_stage=0,
            )
            right = convert.build_gpt(
                cfg,
                convert.transformer_config(cfg, pp=2, vp=2),
                pre_process=first,
                post_process=False,
                vp_stage=0,
            )
        if len(wrong.decoder.layers) != LAYERS:
            failures.append(f"expected the trap to build {LAYERS} layers")
        try:
            check_stage_layers([wrong], LAYERS, 2, 2)
            failures.append("check_stage_layers accepted a stage holding every layer")
        except LayoutError:
            pass
        check_stage_layers([right], LAYERS, 2, 2)
        want = [rank] if rank == 0 else [1]  # chunk 0 of pp rank r: global layer r
        if [layer.layer_number - 1 for layer in right.decoder.layers] != want:
            failures.append(f"layer numbers {[x.layer_number for x in right.decoder.layers]}")
        bad = convert.transformer_config(cfg, pp=2, vp=2, batch_p2p_comm=True)
        try:
            check_schedule_config(bad, dist.get_backend())
            failures.append("check_schedule_config accepted batch_p2p_comm=True on gloo")
        except LayoutError:
            pass
        check_schedule_config(
            convert.transformer_config(cfg, pp=2, vp=2, batch_p2p_comm=False), "gloo"
        )
    finally:
        runtime.destroy()
    return failures


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    results = [run_case(case, rank, world) for case in CASES[world]]
    traps = trap_checks(rank, world) if world == 2 else []
    return {"results": results, "traps": traps}


@pytest.mark.parametrize("world", sorted(CASES))
def test_megatron_schedules_match_native_one_process(world: int) -> None:
    per_rank = spawn(_worker, world, timeout=300)
    failures = [f for r in per_rank for res in r["results"] for f in res["failures"]]
    failures += [f for r in per_rank for f in r["traps"]]
    assert not failures, "\n".join(failures)
    everything = set(Transformer(model_config()).state_dict())
    for i, case in enumerate(CASES[world]):
        covered = [set(r["results"][i]["names"]) for r in per_rank]
        assert set().union(*covered) == everything, case  # every policy gradient compared
        dims = ParallelDims(world_size=world, dp=case.dp, pp=case.pp, virtual_stages=case.virtual)
        first = dims.group_ranks("pp")[0]
        pipeline_layers = sorted(
            x for r in first for c in per_rank[r]["results"][i]["layers"] for x in c
        )
        assert pipeline_layers == list(range(LAYERS)), case  # each layer on exactly one stage
        chunks = per_rank[0]["results"][i]["layers"]
        assert len(chunks) == case.virtual, case
