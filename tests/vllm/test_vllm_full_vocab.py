"""An export whose draft vocabulary is the target's (init-draft's default; no d2t/t2d) loads in
vLLM, is accepted (τ > 1.5 at k = 3) and keeps greedy outputs those of the embedded engine;
its hot updates load."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import vllm_marks
from tests.vllm.test_vllm_generation import greedy_embedded, task_prompts

pytestmark = vllm_marks()


@pytest.fixture(scope="module")
def full_vocab(toy_pair):
    from specrl.integrations.vllm_engine import VllmEngine

    # the serving export itself, as a vLLM user would pass it
    engine = VllmEngine(
        toy_pair.target, method="eagle3", draft_export=toy_pair.exports["full"], max_model_len=256
    )
    yield engine
    engine.close()


def test_full_vocab_export_loads_and_is_accepted(toy_pair, full_vocab):
    from specrl.rollout import Request, SamplingParams

    prompts = task_prompts(16)
    res = full_vocab.generate(
        [Request(p, SamplingParams(max_tokens=48, temperature=0)) for p in prompts]
    )
    assert res.stats["spec"]["tau"] > 1.5, res.stats["spec"]
    ours = greedy_embedded(toy_pair.target, prompts, max_tokens=48)
    assert [r.tokens for r in res] == [r.tokens for r in ours]


def test_full_vocab_draft_update_loads(toy_pair, full_vocab):
    """Hot updates of a full-vocabulary draft (no draft→target map in vLLM) load and verify."""
    from specrl.models.checkpoint import load_model
    from specrl.models.draft_io import draft_state, load_draft

    draft, _ = load_draft(toy_pair.drafts["full"], load_model(toy_pair.target))
    full_vocab.update_weights(draft=draft_state(draft), version=3)
    assert full_vocab.draft_version == 3 and full_vocab.last_sync["tensors_verified"] > 0
