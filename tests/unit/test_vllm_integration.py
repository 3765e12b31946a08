"""The vLLM rollout backend's conversions (vLLM-shaped objects) and its missing-extra error."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import pytest

from specrl.errors import DependencyError
from specrl.integrations import vllm_engine as V
from specrl.rollout.sampling import SamplingParams


class FakeVllm:
    """Records the keyword arguments vLLM's SamplingParams would receive."""

    @staticmethod
    def SamplingParams(**kw):
        return kw


def test_sampling_params_mapping():
    p = SamplingParams(
        max_tokens=12,
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        seed=3,
        n=4,
        stop=("##",),
        stop_token_ids=(2,),
    )
    kw = V.to_vllm_params(p, FakeVllm)
    assert kw == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 12,
        "seed": 3,
        "stop": ["##"],
        "stop_token_ids": [2],
        "logprobs": 0,
    }


def test_request_output_mapping():
    lp = lambda x: SimpleNamespace(logprob=x)
    out = SimpleNamespace(
        request_id="r1",
        outputs=[
            SimpleNamespace(
                index=0,
                token_ids=[5, 6],
                text="ab",
                finish_reason="stop",
                stop_reason=2,
                logprobs=[{5: lp(-0.1)}, {6: lp(-0.2), 9: lp(-3.0)}],
            ),
            SimpleNamespace(
                index=1,
                token_ids=[7],
                text="c",
                finish_reason="length",
                stop_reason=None,
                logprobs=None,
            ),
        ],
    )
    res = V.from_vllm_output(out, [1, 2], (3, 3))
    assert [r.tokens for r in res] == [[5, 6], [7]]
    assert res[0].logprobs == [-0.1, -0.2] and res[0].finish_reason == "stop"
    assert math.isnan(res[1].logprobs[0]) and res[1].finish_reason == "length"
    assert res[0].request_id == "r1" and res[1].index == 1 and res[0].prompt_tokens == [1, 2]


def test_spec_metrics_mapping():
    m = lambda n, v: SimpleNamespace(name=f"vllm:spec_decode_{n}", value=v)
    s = V.spec_stats_from_metrics(
        [
            m("num_drafts", 10),
            m("num_accepted_tokens", 25),
            m("num_draft_tokens", 40),
            SimpleNamespace(name="vllm:other", value=1),
        ]
    )
    assert s["tau"] == 3.5 and s["acceptance_rate"] == 25 / 40 and s["drafts"] == 10


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_missing_vllm_names_the_extra():
    with pytest.raises(DependencyError) as exc:
        V.VllmRolloutEngine("/nonexistent")
    assert exc.value.hint == "pip install 'specrl[vllm]'"
