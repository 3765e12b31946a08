"""The trainer reaches the policy update only through the ``PolicyStrategy`` Protocol.

A strategy that wraps the native one and records every call trains exactly like it: another
backend (pipeline, Megatron-core) plugs in at ``parallelize_policy`` without touching the loop.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from specrl.config.loader import load_recipe
from specrl.config.schema import Recipe
from specrl.models.checkpoint import save_model
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, init_draft_weights
from specrl.models.draft_io import draft_state, save_draft
from specrl.models.presets import preset_config
from specrl.models.tokenizer import char_tokenizer, special_ids
from specrl.train import loop
from specrl.train.batch import Sample
from specrl.train.strategy import PolicyStrategy
from tests.conftest import REPO

pytestmark = pytest.mark.usefixtures("one_thread")

PROTOCOL = {name for name in vars(PolicyStrategy) if not name.startswith("_")}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("strategy")
    tok = char_tokenizer()
    ids = special_ids(tok)
    cfg = preset_config(
        "toy-tiny",
        vocab_size=tok.get_vocab_size(),
        num_hidden_layers=3,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    policy = Transformer(cfg).init_weights(0, std=0.2).double()
    save_model(policy, base / "target", tokenizer=tok)
    draft = Eagle3Draft(DraftConfig.for_target(cfg, tap_layers=(0, 1, 2)))
    draft = init_draft_weights(draft, 1, std=0.2).double()
    draft.refresh_embedding(policy.model.embed_tokens.weight)
    save_draft(draft, base / "draft", target=policy)
    return base


class Recording:
    """Delegates to a real strategy and records which of its attributes the trainer used."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.inner, name)


def _trainer(base: Path, run: str, monkeypatch, wrap: bool):
    recipe = load_recipe(
        REPO / "recipes/tests/tiny.yaml",
        Recipe,
        [
            f"policy.path={base / 'target'}",
            "policy.dtype=float64",
            "policy.warmstart=null",
            f"draft.path={base / 'draft'}",
            "draft.init=null",
            f"run.out_dir={base / run}",
            "algo.minibatches=2",
        ],
    )
    made = []
    real = loop.parallelize_policy

    def parallelize(*args, **kwargs):
        made.append(Recording(real(*args, **kwargs)) if wrap else real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(loop, "parallelize_policy", parallelize)
    return loop.build_trainer(recipe), made[0]


def test_a_strategy_is_reached_through_its_protocol_only(artifacts, monkeypatch):
    rng = random.Random(0)
    samples = [
        Sample(
            [rng.randrange(3, 30) for _ in range(4)],
            [rng.randrange(3, 30) for _ in range(5)],
            [-3.0] * 5,
            rng.choice([-1.0, 1.0]),
        )
        for _ in range(6)
    ]
    plain, _ = _trainer(artifacts, "plain", monkeypatch, wrap=False)
    wrapped, recording = _trainer(artifacts, "wrapped", monkeypatch, wrap=True)
    want, got = plain.update(samples), wrapped.update(samples)
    plain.sync_engine(1)
    wrapped.sync_engine(1)
    assert set(recording.calls) <= PROTOCOL, sorted(set(recording.calls) - PROTOCOL)
    assert {"forward_backward", "clip_policy_", "clip_draft_", "after_step"} <= set(recording.calls)
    assert "gather_weights" in recording.calls
    for key in ("policy_loss", "policy_grad_norm", "draft_loss", "draft_grad_norm"):
        assert got[key] == want[key], key
    for a, b in zip(plain.policy.parameters(), wrapped.policy.parameters(), strict=True):
        assert torch.equal(a, b)
    for k, v in draft_state(plain.draft).items():
        assert torch.equal(draft_state(wrapped.draft)[k], v)
