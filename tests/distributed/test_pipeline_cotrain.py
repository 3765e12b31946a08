"""Pipelined policy step with draft co-training on real gloo groups, against one process (fp64).

Two spawned worlds (2 and 4 ranks) run every case of their size.  A case builds a tiny 8-layer
float64 policy and EAGLE-3 draft, splits the policy per the case's layout and schedule, and runs
steps of packed microbatches (1–3 sequences of 1–9 tokens each: different lengths per
microbatch).  Per case:

- the draft's loss, per-step accuracy and gradients equal the single-process run over the same
  microbatches (policy forward with taps, then the TTT loss with its own logits as teacher) to
  ≤ 1e-10, and so do the policy's loss and gradients;
- the policy's loss and gradients are bit-identical to the same pipeline without the draft (no
  TapChannel, no draft in the loss function);
- the TapChannel moved what the layout implies: taps on the draft's rank (its own stage or another
  of its chunks) by reference, every other tap over its link, bytes counted exactly; GPipe's
  landing rings hold every microbatch, 1F1B's at most pp.

One case runs two steps with optimizers: the policy's global gradient norm (across stages) and the
draft's equal the reference's, both are clipped, and both sides take the same SGD step before the
second step is compared.

Layouts: pp ∈ {2, 4} under GPipe, 1F1B and Interleaved1F1B (two chunks per rank), pp = 2 × cp = 2
(ring attention in every stage and in the draft's TTT), and pp = 2 × dp = 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specrl.core.attention import PackedLayout
from specrl.core.attention.zigzag import shift_within_sequences
from specrl.core.distributed import spawn
from specrl.core.parallel import ParallelDims
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
from specrl.models.presets import preset_config
from specrl.train.pipeline_cotrain import (
    CotrainConfig,
    PackedMicrobatch,
    PipelineCotrainer,
    masked_cross_entropy,
)
from specrl.train.ttt import teacher_from_logits, ttt_inputs, ttt_loss

pytestmark = pytest.mark.distributed

V, V_DRAFT, H, LAYERS, K = 41, 29, 16, 8, 3
TOL = 1e-10
CLIP, LR = 0.05, 0.5  # a clip below the gradient norms, so clipping is exercised


@dataclass(frozen=True)
class Case:
    schedule: str
    taps: tuple[int, ...]
    pp: int
    virtual: int = 1
    cp: int = 1
    dp: int = 1
    microbatches: int = 4
    steps: int = 1
    optimize: bool = False  # clip and SGD-step both models after every step

    def __str__(self) -> str:
        return (
            f"{self.schedule} pp={self.pp}×v={self.virtual} cp={self.cp} dp={self.dp} "
            f"taps={self.taps}"
        )


CASES = {
    2: [
        Case("gpipe", (1, 3, 6), pp=2, steps=2, optimize=True),  # taps 1, 3 over one link
        Case("1f1b", (1, 4, 7), pp=2, microbatches=6),
        Case("interleaved", (1, 3, 6), pp=2, virtual=2),  # tap 3: the draft rank's other chunk
        Case("interleaved", (1, 4, 7), pp=2, virtual=2),  # two links from two chunks of rank 0
    ],
    4: [
        Case("gpipe", (1, 3, 6), pp=4),
        Case("1f1b", (1, 4, 7), pp=4),
        Case("interleaved", (1, 3, 6), pp=4, virtual=2),  # one layer per stage
        Case("interleaved", (1, 4, 7), pp=4, virtual=2),
        Case("1f1b", (1, 4, 7), pp=2, cp=2),
        Case("interleaved", (1, 3, 6), pp=2, virtual=2, cp=2),
        Case("1f1b", (1, 3, 6), pp=2, dp=2, microbatches=2),
    ],
}


def _models(taps: tuple[int, ...]) -> tuple[Transformer, Eagle3Draft]:
    cfg = preset_config(
        "toy-tiny",
        vocab_size=V,
        num_hidden_layers=LAYERS,
        hidden_size=H,
        intermediate_size=2 * H,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    policy = Transformer(cfg).init_weights(0, std=0.3).double()
    draft_cfg = DraftConfig.for_target(cfg, draft_vocab_size=V_DRAFT, tap_layers=taps)
    draft = init_draft_weights(Eagle3Draft(draft_cfg), 1, std=0.2).double()
    counts = torch.randint(0, 100, (V,), generator=torch.Generator().manual_seed(0))
    draft.set_vocab_map(build_vocab_map(counts, V_DRAFT))
    draft.refresh_embedding(policy.model.embed_tokens.weight)
    return policy, draft


def _microbatches(n: int, seed: int) -> list[PackedMicrobatch]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(
            1, 10, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen
        )
        t = int(lengths.sum())
        ids = torch.randint(0, V, (t,), generator=gen)
        mask = (torch.rand(t, generator=gen) > 0.25).double()
        out.append(PackedMicrobatch(ids, lengths.tolist(), mask))
    return out


def _reference(policy, draft, batch: list[PackedMicrobatch], n_mb: int, dp: int) -> dict:
    """One process, whole model: the losses, accuracies and gradients the pipeline must give."""
    taps = draft.config.tap_layers
    policy.zero_grad(set_to_none=True)
    draft.zero_grad(set_to_none=True)
    total = sum(float(mb.loss_mask.sum()) for mb in batch)
    policy_loss = draft_loss = 0.0
    hits, counts = torch.zeros(K, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    for mb in batch:
        layout = PackedLayout.from_lengths(mb.lengths)
        out = policy(mb.ids, layout, taps=taps)
        tokens = {"labels": shift_within_sequences(mb.ids, layout, 1, 0), "loss_mask": mb.loss_mask}
        loss = masked_cross_entropy(out.logits, tokens) / total
        loss.backward()
        policy_loss += loss.item()
        inputs = ttt_inputs(mb.ids, mb.loss_mask, layout, K)
        res = draft.ttt_forward(Eagle3Draft.concat_taps(out.taps, taps), inputs.step_ids, layout)
        tl = ttt_loss(res, teacher_from_logits(out.logits, draft), inputs, layout)
        (tl.loss / (n_mb * dp)).backward()
        draft_loss += tl.loss.item() / (n_mb * dp)
        c = torch.tensor(tl.count, dtype=torch.float64)
        hits += torch.tensor(tl.acc, dtype=torch.float64) * c.clamp(min=1.0)
        counts += c
    grads = lambda m: {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    return {
        "policy_loss": policy_loss,
        "draft_loss": draft_loss,
        "acc": (hits / counts.clamp(min=1.0)).tolist(),
        "policy": grads(policy),
        "draft": grads(draft),
    }


def _close(name: str, got, want, failures: list[str]) -> None:
    err = (torch.as_tensor(got) - torch.as_tensor(want)).abs().max().item()
    if not err <= TOL:  # also catches NaN
        failures.append(f"{name}: max error {err:.3e} > {TOL:.0e}")


def _run_case(case: Case, seed: int) -> list[str]:
    dims = ParallelDims(
        world_size=case.pp * case.cp * case.dp,
        dp=case.dp,
        cp=case.cp,
        pp=case.pp,
        virtual_stages=case.virtual,
    )
    groups = dims.build_groups()
    hosts = PipelineCotrainer.hosts_draft(groups)
    config = CotrainConfig(
        schedule=case.schedule,
        microbatch_tokens=40,
        ttt_steps=K,
        tap_timeout=60,
        policy_grad_clip=CLIP,
        draft_grad_clip=CLIP,
    )
    n, me = case.microbatches, groups.coords.dp
    steps = [_microbatches(n * case.dp, seed + s) for s in range(case.steps)]

    policy, draft = _models(case.taps)
    trainer = PipelineCotrainer(
        policy,
        groups,
        config,
        num_microbatches=n,
        tap_layers=case.taps,
        draft=draft if hosts else None,
    )
    plain_policy, _ = _models(case.taps)
    plain = PipelineCotrainer(plain_policy, groups, config, num_microbatches=n)
    ref_policy, ref_draft = _models(case.taps)
    sgd = lambda params: torch.optim.SGD(list(params), lr=LR) if case.optimize else None
    opts = {"policy_optimizer": sgd(trainer.policy_parameters())}
    if hosts:
        opts["draft_optimizer"] = sgd(p for p in draft.parameters() if p.requires_grad)
    plain_opt = sgd(plain.policy_parameters())

    failures: list[str] = []
    for s, batch in enumerate(steps):
        mine = batch[me * n : (me + 1) * n]  # this data-parallel replica's microbatches
        stats = trainer.step(mine, **opts)
        plain_stats = plain.step(mine, policy_optimizer=plain_opt)
        ref = _reference(ref_policy, ref_draft, batch, n, case.dp)
        tag = f"{case} step {s}"
        if case.optimize:  # the trainer clipped its gradients in place: clip the reference's
            ref_norms = (
                float(torch.nn.utils.clip_grad_norm_(ref_policy.parameters(), CLIP)),
                float(torch.nn.utils.clip_grad_norm_(ref_draft.parameters(), CLIP)),
            )
            norms = (stats.policy_grad_norm, stats.draft_grad_norm)
            _close(f"{tag} grad norms", norms, ref_norms, failures)
            if min(ref_norms) <= CLIP:
                failures.append(f"{tag}: norms {ref_norms} do not exercise the clip {CLIP}")
        _close(f"{tag} policy loss", stats.policy_loss, ref["policy_loss"], failures)
        _close(f"{tag} draft loss", stats.draft_loss, ref["draft_loss"], failures)
        _close(f"{tag} draft acc", stats.draft_acc, ref["acc"], failures)
        if plain_stats.policy_loss != stats.policy_loss or plain_stats.draft_loss is not None:
            failures.append(f"{tag}: policy loss {stats.policy_loss!r} with the draft, "
                            f"{plain_stats.policy_loss!r} without")  # fmt: skip
        owned = trainer.policy_parameters()
        named = [(n_, p) for n_, p in policy.named_parameters() if p.grad is not None]
        if len(named) != len(owned):
            failures.append(f"{tag}: {len(named)} policy grads, {len(owned)} owned parameters")
        plain_named = dict(plain_policy.named_parameters())
        for name, p in named:
            _close(f"{tag} policy grad {name}", p.grad, ref["policy"][name], failures)
            if not torch.equal(p.grad, plain_named[name].grad):
                failures.append(f"{tag} policy grad {name}: differs without the draft")
        if hosts:
            for name, p in draft.named_parameters():
                if p.requires_grad:
                    _close(f"{tag} draft grad {name}", p.grad, ref["draft"][name], failures)
        if case.optimize:
            with torch.no_grad():
                for model in (ref_policy, ref_draft):
                    for p in model.parameters():
                        if p.grad is not None:
                            p -= LR * p.grad
        failures += _check_taps(case, trainer, mine, dims.cp, tag)
    return failures


def _check_taps(case: Case, trainer: PipelineCotrainer, mine, cp: int, tag: str) -> list[str]:
    """The channel's traffic on this rank is exactly what the tap plan implies."""
    channel, stats = trainer.channel, None
    plan = channel.plan
    stats = channel.stats
    rows = [
        sum(-(-n // (2 * cp)) * 2 for n in mb.lengths) if cp > 1 else sum(mb.lengths) for mb in mine
    ]  # this rank's real rows per microbatch (zigzag shard under CP)
    step_bytes = sum(r * H * 8 + 64 for r in rows)  # payload + header per tap
    failures = []
    if channel.is_consumer:
        remote = len(plan.tap_layers) - len(plan.local_layers)
        if stats.local_taps != len(plan.local_layers) * len(mine):
            failures.append(f"{tag}: {stats.local_taps} local taps")
        if stats.bytes_received != remote * step_bytes:
            failures.append(f"{tag}: received {stats.bytes_received} B")
        bound = min(len(mine), case.pp) if case.schedule == "1f1b" else len(mine)
        for s, d in channel.depth.items():
            if not 1 <= d <= bound or (case.schedule == "gpipe" and d != bound):
                failures.append(f"{tag}: {case.schedule} ring of stage {s} holds {d} slots")
    else:
        sent = sum(len(plan.layers_of(s)) for s in trainer.layout.rank_stages(channel.pp_rank))
        if stats.bytes_sent != sent * step_bytes:
            failures.append(f"{tag}: sent {stats.bytes_sent} B for {sent} tap layers")
    return failures


def _worker(rank: int, world: int) -> list[str]:
    failures = []
    for i, case in enumerate(CASES[world]):
        failures += _run_case(case, seed=100 * i)
    return failures


@pytest.mark.parametrize("world", sorted(CASES))
def test_pipelined_cotraining_matches_single_process(world: int) -> None:
    results = spawn(_worker, world, timeout=240)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:30])
