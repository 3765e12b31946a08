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
- float32 (1F1B): agreement to 1e-5 relative in norm per tensor (same reason, float32 rounding;
  measured ≤ 2e-6), and **bit-identical** to Megatron's own one-process run of the same
  microbatches (``forward_backward_no_pipelining``, in the test process): the pipeline changes
  nothing but where each layer runs;
- the silent traps: a config without the pipeline size builds every layer on every stage and is
  refused by ``check_stage_layers``; interleaving with ``batch_p2p_comm=True`` on gloo is refused
  by ``check_schedule_config`` (the strategy's own config has it off) — and, run anyway, is
  shown to give a wrong loss and gradients (max gradient error ~1e2 here) with no error.

Layouts: pp 2 × 1F1B, pp 2 × interleaved (2 virtual stages per rank), pp 2 × dp 2 (1F1B).

With the draft (taps from TransformerLayer hooks through the TapChannel to the last stage): its
loss, per-step accuracy and gradients equal the one-process reference (per microbatch TTT token
means, weighted 1/(n · dp)) to the same tolerances, the policy gradients are bit-identical to
the same layout without the draft, and after an SGD step the embedding sync and the weight
gather leave the one-process updated weights on the rollout rank (policy, draft) and in the last
stage's draft embedding.
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
from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
from specrl.train.batch import Sample, pack
from specrl.train.layout import TrainLayout
from specrl.train.strategy import Objective
from specrl.train.ttt import teacher_from_logits, ttt_inputs, ttt_loss

pytestmark = pytest.mark.distributed

V, V_DRAFT, LAYERS, K = 37, 23, 4, 2
LR = 0.1
OBJ = Objective(
    temperature=0.9,
    clip_low=0.2,
    clip_high=0.28,
    kl_coef=0.0,
    ttt_steps=K,
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
    taps: tuple[int, ...] = ()  # the draft's tap layers (empty: no draft)
    step: bool = False  # an SGD step, the embedding sync and the weight gather after it

    def __str__(self) -> str:
        return (
            f"{self.schedule} pp={self.pp}×v={self.virtual} dp={self.dp} {self.dtype} "
            f"taps={self.taps}"
        )


# taps (0, 1, 2) over 4 layers: pp 2 → layers 0, 1 cross the link, 2 is the last stage's own;
# interleaved (stages 0..3 = layers 0..3 on ranks 0, 1, 0, 1) → 0 and 2 come from two chunks of
# rank 0 over two links, 1 from the last stage's rank's other chunk (by reference)
CASES = {
    2: [
        Case("1f1b"),
        Case("1f1b", taps=(0, 1, 2), step=True),
        Case("interleaved", virtual=2),
        Case("interleaved", virtual=2, taps=(0, 1, 2)),
        Case("1f1b", dtype=torch.float32),
    ],
    4: [Case("1f1b", dp=2, microbatches=2, taps=(0, 1, 2), step=True)],
}
# (case with the draft, the same case without): the policy's gradients must be bit-identical
SAME_POLICY = {2: [(1, 0), (3, 2)], 4: []}


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


def make_draft(policy: Transformer, taps: tuple[int, ...]) -> Eagle3Draft:
    cfg = DraftConfig.for_target(policy.config, draft_vocab_size=V_DRAFT, tap_layers=taps)
    draft = init_draft_weights(Eagle3Draft(cfg), 1, std=0.2).to(policy.dtype)
    counts = torch.randint(0, 100, (V,), generator=torch.Generator().manual_seed(0))
    draft.set_vocab_map(build_vocab_map(counts, V_DRAFT))
    draft.refresh_embedding(policy.model.embed_tokens.weight.detach().clone())
    return draft


def draft_reference(policy, draft, batch: list[Sample], n: int, dp: int) -> dict:
    """One process: the draft's objective as the pipelines define it — per microbatch (replica
    d: samples d::dp, microbatch j of it: j::n) the TTT token mean from the policy's own taps and
    logits, weighted 1/(n · dp)."""
    draft.zero_grad(set_to_none=True)
    taps = draft.config.tap_layers
    loss = 0.0
    hits, counts = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    for d in range(dp):
        mine = batch[d::dp]
        for j in range(n):
            p = pack(mine[j::n], policy.device)
            with torch.no_grad():
                out = policy(p.ids, p.layout, taps=taps)
            inputs = ttt_inputs(p.ids, p.mask, p.layout, K)
            res = draft.ttt_forward(
                Eagle3Draft.concat_taps(out.taps, taps), inputs.step_ids, p.layout
            )
            tl = ttt_loss(
                res,
                teacher_from_logits(out.logits, draft),
                inputs,
                p.layout,
                kind=OBJ.ttt_loss,
                decay=OBJ.ttt_decay,
            )
            (tl.loss / (n * dp)).backward()
            loss += float(tl.loss.detach()) / (n * dp)
            c = torch.tensor(tl.count, dtype=torch.float64)
            hits += torch.tensor(tl.acc, dtype=torch.float64) * c.clamp(min=1.0)
            counts += c
    grads = {k: p.grad.detach().clone() for k, p in draft.named_parameters() if p.grad is not None}
    return {"loss": loss, "acc": (hits / counts.clamp(min=1.0)).tolist(), "grads": grads}


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
    draft = ref_draft = None
    if case.taps:
        draft, ref_draft = make_draft(policy, case.taps), make_draft(policy, case.taps)
        want_draft = draft_reference(policy, ref_draft, batch, case.microbatches, case.dp)
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
        draft=draft,
        tap_layers=case.taps,
        tap_timeout=60,
    )
    failures: list[str] = []
    fail = lambda name, got, want: _close(name, got, want, case.dtype, failures)
    try:
        out = strategy.forward_backward(mine, draft="train" if case.taps else None)
        got_sums = torch.tensor([out.policy_loss, *out.sums.tolist()], dtype=torch.float64)
        fail("policy loss and sums", got_sums, want_sums)
        grads: dict[str, torch.Tensor] = {}
        for c in strategy.chunks:
            grads.update(convert.chunk_hf_state(c, policy.config, grads=True))
        for name, g in grads.items():
            fail(f"grad {name}", g, want_grads[name])
        if case.taps:
            if out.draft is None:
                failures.append("no draft result")
            else:
                fail("draft loss", torch.tensor(out.draft.loss), torch.tensor(want_draft["loss"]))
                fail("draft acc", torch.tensor(out.draft.acc), torch.tensor(want_draft["acc"]))
            if layout.hosts_draft:
                for name, p in draft.named_parameters():
                    if p.requires_grad:
                        fail(f"draft grad {name}", p.grad, want_draft["grads"][name])
                stats = strategy.tap_stats
                if stats is None or stats.bytes_received == 0 or stats.local_taps == 0:
                    failures.append(f"tap traffic {stats}: expected remote and local taps")
        if case.step:
            failures += _step_and_gather(
                case, strategy, policy, draft, ref_draft, want_grads, layout
            )
        layers = strategy.global_layers()
    finally:
        strategy.close()
    return {
        "failures": [f"{case} rank {rank}: {f}" for f in failures],
        "names": sorted(grads),
        "layers": layers,
        "grads": grads,
        "policy_loss": out.policy_loss,
    }


def _step_and_gather(case, strategy, policy, draft, ref_draft, want_grads, layout) -> list[str]:
    """SGD on both sides, the embedding sync, the weight gather: the rollout rank's policy and
    draft, and the last stage's draft embedding, hold the one-process updated weights."""
    failures: list[str] = []
    expected = {n: p.detach() - LR * want_grads[n] for n, p in policy.named_parameters()}
    expected_draft = {
        n: p.detach() - LR * p.grad for n, p in ref_draft.named_parameters() if p.grad is not None
    }
    params = strategy.parameters()
    trainable = [p for p in draft.parameters() if p.requires_grad] if layout.hosts_draft else []
    opt = torch.optim.SGD(params + trainable, lr=LR)
    norm = strategy.clip_policy_(0.0)
    want_norm = float(torch.cat([g.reshape(-1) for g in want_grads.values()]).norm())
    _close("policy grad norm", torch.tensor(norm), torch.tensor(want_norm), case.dtype, failures)
    opt.step()
    strategy.after_step()
    strategy.gather_weights()
    if layout.hosts_draft:
        emb = draft.embed_tokens.weight
        _close("draft embedding", emb, expected["model.embed_tokens.weight"], case.dtype, failures)
    if layout.is_rollout_rank:
        for n, p in policy.named_parameters():
            _close(f"gathered {n}", p.detach(), expected[n], case.dtype, failures)
        for n, p in draft.named_parameters():
            if n in expected_draft:
                _close(f"gathered draft {n}", p.detach(), expected_draft[n], case.dtype, failures)
    return failures


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
        failures += _batched_p2p_is_wrong(rank, world)
    finally:
        runtime.destroy()
    return failures


def _batched_p2p_is_wrong(rank: int, world: int) -> list[str]:
    """Why the refusal exists: the interleaved schedule run anyway with batch_p2p_comm=True on
    gloo (the check bypassed) gives a wrong loss and wrong gradients, with no error; False is
    exact (megatron-core 0.16.1 — if this starts passing, the trap is gone)."""
    from specrl.integrations.megatron import convert
    from specrl.integrations.megatron.strategy import MegatronStrategy

    dims = ParallelDims(world_size=world, pp=2, virtual_stages=2)
    layout = TrainLayout(dims, dims.build_groups(), rank)
    policy = Transformer(model_config()).init_weights(0, std=0.3).double()
    batch = samples(8, seed=3)
    want_sums, want = reference(policy, batch)
    strategy = MegatronStrategy(
        policy, layout, OBJ, schedule="interleaved", num_microbatches=4, micro_batch_size=2,
        seq_length=12,
    )  # fmt: skip
    strategy.tconfig.batch_p2p_comm = True  # what check_schedule_config refuses
    out = strategy.forward_backward(batch, draft=None)
    grads: dict[str, torch.Tensor] = {}
    for c in strategy.chunks:
        grads.update(convert.chunk_hf_state(c, policy.config, grads=True))
    loss_err = abs(out.policy_loss - float(want_sums[0]))
    grad_err = max(float((g - want[n]).abs().max()) for n, g in grads.items())
    if max(loss_err, grad_err) < 1e-6:
        return [f"rank {rank}: batch_p2p_comm=True was exact on gloo: the trap is gone"]
    return []


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    results = [run_case(case, rank, world) for case in CASES[world]]
    traps = trap_checks(rank, world) if world == 2 else []
    for with_draft, without in SAME_POLICY[world]:  # the draft leaves the policy untouched
        a, b = results[with_draft]["grads"], results[without]["grads"]
        differ = sorted(n for n in a if n not in b or not torch.equal(a[n], b[n]))
        if differ or a.keys() != b.keys():
            traps.append(f"rank {rank}: policy grads {differ} differ with the draft")
    for case, r in zip(CASES[world], results, strict=True):
        grads = r.pop("grads")  # tensors stay in the worker; float32 ones travel as lists
        if case.dtype == torch.float32:
            r["f32_grads"] = {n: g.tolist() for n, g in grads.items()}
    return {"results": results, "traps": traps}


def megatron_one_process(case: Case) -> tuple[float, dict[str, torch.Tensor]]:
    """Megatron's own one-process run (pp = 1, no pipelining) of the case's microbatches."""
    from specrl.integrations.megatron import convert
    from specrl.integrations.megatron.strategy import MegatronStrategy
    from tests.distributed.megatron_util import one_process_group

    with one_process_group():
        dims = ParallelDims(world_size=1)
        layout = TrainLayout(dims, dims.build_groups(), 0)
        policy = Transformer(model_config()).init_weights(0, std=0.3).to(case.dtype)
        batch = samples(8, seed=3)
        strategy = MegatronStrategy(
            policy,
            layout,
            OBJ,
            schedule="1f1b",
            num_microbatches=case.microbatches,
            micro_batch_size=-(-len(batch) // case.microbatches),
            seq_length=12,
        )
        out = strategy.forward_backward(batch, draft=None)
        grads = convert.chunk_hf_state(strategy.chunks[0], policy.config, grads=True)
    return out.policy_loss, grads


@pytest.mark.parametrize("world", sorted(CASES))
def test_megatron_schedules_match_native_one_process(world: int) -> None:
    per_rank = spawn(_worker, world, timeout=300)
    failures = [f for r in per_rank for res in r["results"] for f in res["failures"]]
    failures += [f for r in per_rank for f in r["traps"]]
    assert not failures, "\n".join(failures)
    for i, case in enumerate(CASES[world]):
        if case.dtype != torch.float32:
            continue
        loss, want = megatron_one_process(case)
        for r in per_rank:
            assert r["results"][i]["policy_loss"] == loss, case
            for name, g in r["results"][i]["f32_grads"].items():
                got = torch.tensor(g, dtype=torch.float32)
                assert torch.equal(got, want[name]), (
                    f"{case}: {name} differs by {float((got - want[name]).abs().max())}"
                )
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
