"""The train/inference mismatch probe: ~0 when the trainer holds the weights that decoded the
rollout, large when it does not (what a broken weight sync looks like)."""

from __future__ import annotations

import copy

import pytest
import torch

from specrl.models.decoder import Transformer
from specrl.models.presets import preset_config
from specrl.rollout import Request, RolloutEngine, SamplingParams
from specrl.train.batch import Sample
from specrl.train.mismatch import logprob_gap

pytestmark = pytest.mark.usefixtures("one_thread")


def _rollout(model, temperature):
    engine = RolloutEngine(copy.deepcopy(model), max_batch_size=8)
    params = SamplingParams(max_tokens=10, temperature=temperature, n=3, seed=1)
    res = engine.generate([Request([1, 5, 6], params), Request([1, 9], params)])
    return [Sample(r.prompt_tokens, r.tokens, r.logprobs, 1.0) for r in res]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gap_is_zero_in_sync_and_large_out_of_sync(temperature):
    model = Transformer(preset_config("toy-tiny", vocab_size=32)).init_weights(0, std=0.2)
    samples = _rollout(model, temperature)
    same = logprob_gap(model, samples, temperature)
    assert same["logp_gap_max"] < 1e-4, same
    stale = copy.deepcopy(model)
    with torch.no_grad():
        stale.lm_head.weight.mul_(1.2)  # the trainer's policy moved on; the engine did not
    moved = logprob_gap(stale, samples, temperature)
    assert moved["logp_gap_mean"] > 1e-3 and moved["logp_gap_max"] > moved["logp_gap_mean"]


def test_no_tokens_no_gap():
    model = Transformer(preset_config("toy-tiny", vocab_size=32)).init_weights(0, std=0.2)
    assert logprob_gap(model, [Sample([1], [], [], 0.0)], 1.0) == {
        "logp_gap_mean": None,
        "logp_gap_max": None,
    }
