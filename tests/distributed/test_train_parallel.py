"""``RLTrainer.update`` under context and pipeline parallelism equals the one-process update.

A 4-layer float64 toy policy and a float64 EAGLE-3 draft (taps 0, 2, 3: one on each side of the
pp = 2 cut, so taps cross the TapChannel and stay local) are trained on the same fixed samples —
8 packed sequences of different lengths, two minibatches, so the second minibatch runs on the
policy the first one updated and, under PP, trains the draft against the embedding table stage 0
sent after that step.  Each layout is compared with the single-process update:

- cp = 2 (zigzag shards, ring attention, ring TTT, teacher shift across shards, DDP over dp × cp):
  every metric, the updated policy and the updated draft;
- pp = 2 with GPipe and one microbatch per minibatch: the same (the draft's pipelined objective,
  a mean of per-microbatch token means, is then the single-process one);
- pp = 2 with 1F1B and two microbatches: the policy's metrics and weights.

Under PP the compared weights are the rollout rank's after ``sync_engine``: stage 1's parameters
and the draft reach it by the gather, so the gather is checked as well.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from specrl.config.loader import load_recipe
from specrl.config.schema import Recipe
from specrl.core.distributed import spawn
from specrl.models.checkpoint import save_model
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
from specrl.models.draft_io import draft_state, save_draft
from specrl.models.presets import preset_config
from specrl.models.tokenizer import char_tokenizer, special_ids
from specrl.train.batch import Sample
from tests.conftest import REPO

pytestmark = pytest.mark.distributed

TOL = 1e-9
POLICY_METRICS = ("policy_loss", "clip_frac", "ratio", "nll", "policy_grad_norm")
DRAFT_METRICS = ("draft_loss", "draft_grad_norm", "draft_sim_tau", "draft_acc")
# name → (--set overrides, whether the draft's objective equals the single-process one)
LAYOUTS = {
    "cp=2": (["parallel.cp=2"], True),
    "pp=2 gpipe ×1": (
        ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.microbatches=1"],
        True,
    ),
    "pp=2 1f1b ×2": (["parallel.pp=2", "parallel.microbatches=2"], False),
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    """A float64 4-layer policy with tokenizer and a float64 draft with a reduced vocabulary."""
    base = tmp_path_factory.mktemp("train-parallel")
    tok = char_tokenizer()
    ids = special_ids(tok)
    cfg = preset_config(
        "toy-tiny",
        vocab_size=tok.get_vocab_size(),
        num_hidden_layers=4,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    policy = Transformer(cfg).init_weights(0, std=0.2).double()
    save_model(policy, base / "target", tokenizer=tok)
    draft_vocab = cfg.vocab_size - 8
    draft = Eagle3Draft(
        DraftConfig.for_target(cfg, draft_vocab_size=draft_vocab, tap_layers=(0, 2, 3))
    )
    draft = init_draft_weights(draft, 1, std=0.2).double()
    counts = torch.randint(0, 100, (cfg.vocab_size,), generator=torch.Generator().manual_seed(0))
    draft.set_vocab_map(build_vocab_map(counts, draft_vocab))
    draft.refresh_embedding(policy.model.embed_tokens.weight)
    save_draft(draft, base / "draft", target=policy)
    return base


def _samples(vocab: int) -> list[Sample]:
    rng = random.Random(0)
    out = []
    for _ in range(8):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        response = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))]
        old = [rng.uniform(-4.5, -2.5) for _ in response]
        out.append(Sample(prompt, response, old, rng.choice([-1.0, -0.5, 0.5, 1.0])))
    return out


def _recipe(base: Path, run: str, sets: list[str]) -> Recipe:
    fixed = [
        f"policy.path={base / 'target'}",
        "policy.dtype=float64",
        "policy.warmstart=null",
        f"draft.path={base / 'draft'}",
        "draft.init=null",
        f"run.out_dir={base / run}",
        "algo.minibatches=2",
    ]
    return load_recipe(REPO / "recipes/tests/tiny.yaml", Recipe, [*fixed, *sets])


def _update(rank: int, world: int, base: Path, layouts: list[list[str]], samples) -> list:
    """Per layout: the update's metrics and (rank 0) the whole policy and draft after the sync."""
    from specrl.train.loop import build_trainer

    out = []
    for i, sets in enumerate(layouts):
        trainer = build_trainer(_recipe(base, f"run-{world}-{i}", sets))
        metrics = trainer.update(samples)
        trainer.sync_engine(1)
        state = None
        if rank == 0:  # numpy: pickled by value (torch tensors would travel by shared memory)
            policy = {k: v.detach().numpy().copy() for k, v in trainer.policy.state_dict().items()}
            state = (policy, {k: v.numpy() for k, v in draft_state(trainer.draft).items()})
        out.append((metrics, state))
    return out


def _mismatches(tag: str, got, want) -> list[str]:
    got, want = (torch.as_tensor(x).to(torch.float64) for x in (got, want))
    err = (got - want).abs().max().item()
    return [] if err <= TOL else [f"{tag}: max error {err:.3e}"]


@pytest.mark.timeout(420)
def test_cp_and_pp_updates_equal_the_single_process_update(artifacts):
    samples = _samples(char_tokenizer().get_vocab_size())
    [ref] = spawn(_update, 1, artifacts, [[]], samples, timeout=180)[0]
    runs = spawn(_update, 2, artifacts, [s for s, _ in LAYOUTS.values()], samples, timeout=300)[0]
    ref_metrics, (ref_policy, ref_draft) = ref
    assert ref_metrics["policy_grad_norm"] > 0 and ref_metrics["draft_loss"] > 0
    failures = []
    for (name, (_, draft_exact)), (metrics, (policy, draft)) in zip(
        LAYOUTS.items(), runs, strict=True
    ):
        keys = POLICY_METRICS + (DRAFT_METRICS if draft_exact else ())
        for k in keys:
            failures += _mismatches(f"{name} {k}", metrics[k], ref_metrics[k])
        for k, v in ref_policy.items():
            failures += _mismatches(f"{name} policy {k}", policy[k], v)
        if draft_exact:
            for k, v in ref_draft.items():
                failures += _mismatches(f"{name} draft {k}", draft[k], v)
    assert not failures, "\n".join(failures[:60])
