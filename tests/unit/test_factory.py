"""The engine factory: one mapping from a recipe's rollout section to an engine."""

from __future__ import annotations

import pytest
import torch

from specrl.config.schema import RolloutConfig, SpeculationConfig
from specrl.errors import ConfigError
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, init_draft_weights
from specrl.models.presets import preset_config
from specrl.rollout import Request, SamplingParams
from specrl.rollout.engine import RolloutEngine
from specrl.rollout.factory import build_engine, spec_config
from specrl.rollout.types import Engine, Results

pytestmark = pytest.mark.usefixtures("one_thread")


def _policy() -> Transformer:
    cfg = preset_config("toy-tiny", vocab_size=32, num_hidden_layers=3)
    return Transformer(cfg).init_weights(0, std=0.2).to(torch.float64)


def _draft(policy: Transformer) -> Eagle3Draft:
    cfg = DraftConfig.for_target(policy.config, tap_layers=(0, 1, 2))
    draft = init_draft_weights(Eagle3Draft(cfg), 1, std=0.2).to(torch.float64)
    draft.refresh_embedding(policy.model.embed_tokens.weight)
    return draft


def test_every_speculation_field_reaches_the_engine():
    speculation = SpeculationConfig(
        proposers=["ngram"],
        max_k=3,
        gate=False,
        epsilon=0.3,
        k_by_batch_size={1: 2, 8: 0},
        decoupled=True,
        drafter_timeout=2,
    )
    engine = build_engine(RolloutConfig(max_batch_size=2, speculation=speculation), _policy())
    assert engine.spec == speculation  # the recipe's section itself: no field left behind
    assert engine.controller.config == speculation
    lookahead = engine.drafting.lookahead
    assert lookahead is not None and lookahead.worker.timeout == 2
    assert spec_config(None) is None and spec_config(SpeculationConfig(proposers=[])) is None


def test_eagle3_gets_the_draft_and_the_recipes_k():
    policy = _policy()
    rollout = RolloutConfig(
        max_batch_size=3, speculation=SpeculationConfig(proposers=["eagle3", "ngram"], max_k=5)
    )
    draft = _draft(policy)
    engine = build_engine(rollout, policy, draft, seed=1)
    assert isinstance(engine, RolloutEngine) and isinstance(engine, Engine)
    assert engine.max_batch_size == 3 and list(engine.proposers) == ["eagle3", "ngram"]
    eagle3 = engine.proposers["eagle3"]
    assert eagle3.max_k == 5
    # the engine owns copies: training the given modules does not change what it decodes
    assert engine.model is not policy and eagle3.draft is not draft
    with pytest.raises(ConfigError, match="eagle3"):
        build_engine(rollout, policy, None)


def test_plain_rollout_section_builds_a_plain_engine_whose_calls_count_themselves():
    engine = build_engine(RolloutConfig(max_batch_size=2, speculation=None), _policy())
    assert engine.proposers == {}
    params = SamplingParams(max_tokens=5, temperature=0.0)
    first = engine.generate([Request([1, 2, 3], params), Request([4, 5], params)])
    second = engine.generate([Request([6], params)])
    assert isinstance(second, Results) and len(second) == 1
    assert (first.stats["tokens"], second.stats["tokens"]) == (10, 5)
    assert second.stats["prefill_forwards"] == 1 and second.stats["decode_forwards"] == 4
    assert engine.stats()["tokens"] == 15  # the engine's own counters span both calls
