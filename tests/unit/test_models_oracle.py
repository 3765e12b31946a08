"""specrl's decoder vs the `transformers` oracle, plus packed/cached/round-trip exactness."""

from __future__ import annotations

import json

import pytest
import torch

from specrl.core.attention import PackedLayout
from specrl.errors import CheckpointError
from specrl.models.checkpoint import load_model, save_model
from specrl.models.decoder import CacheBatch, Transformer
from specrl.models.presets import preset_config

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _families():
    t = transformers
    return {
        "llama3": (
            t.LlamaConfig,
            t.LlamaForCausalLM,
            dict(
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            ),
        ),
        "llama-mha-tied": (
            t.LlamaConfig,
            t.LlamaForCausalLM,
            dict(num_key_value_heads=4, tie_word_embeddings=True),
        ),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, dict(head_dim=24)),
        "mistral-window": (t.MistralConfig, t.MistralForCausalLM, dict(sliding_window=7)),
    }


@pytest.fixture(scope="module", params=list(_families()))
def family(request, tmp_path_factory):
    cfg_cls, model_cls, extra = _families()[request.param]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**{**COMMON, **extra})).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


@pytest.mark.parametrize("fused", [False, True], ids=["module", "fused"])
def test_logits_match_transformers(family, fused):
    name, hf, path = family
    ours = load_model(path)
    ids = torch.randint(0, 97, (3, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits  # [3, 29, V]
        lens = [29, 29, 29]
        out = ours(ids.reshape(-1), PackedLayout.from_lengths(lens), fused=fused)
        got = out.logits.view(3, 29, -1)
    assert (got - ref).abs().max().item() <= 1e-5, name


def test_taps_are_layer_outputs_and_detached(family):
    _, hf, path = family
    ours = load_model(path)
    ids = torch.randint(0, 97, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states  # emb, layer0 … (last is normed)
    out = ours(ids[0], PackedLayout.from_lengths([17]), taps=[0, 1])
    for layer in (0, 1):
        assert not out.taps[layer].requires_grad
        assert (out.taps[layer] - hs[layer + 1][0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family_name", ["qwen3"])
def test_sharded_checkpoint_loads(family_name, tmp_path):
    cfg_cls, model_cls, extra = _families()[family_name]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**{**COMMON, **extra})).eval()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path)
    ids = torch.arange(12)[None] % 97
    with torch.no_grad():
        ref = hf(ids).logits[0]
        got = ours(ids[0], PackedLayout.from_lengths([12])).logits
    assert (got - ref).abs().max().item() <= 1e-5


def _model(**over) -> Transformer:
    cfg = preset_config("toy-tiny", vocab_size=61, **over)
    return Transformer(cfg).init_weights(3, std=0.2).double().eval()


@pytest.mark.parametrize("over", [{}, {"sliding_window": 4}])
def test_packed_equals_per_sequence(over):
    model = _model(**over)
    lens = [1, 7, 3, 12, 2]
    ids = torch.randint(0, 61, (sum(lens),), generator=torch.Generator().manual_seed(0))
    packed = model(ids, PackedLayout.from_lengths(lens)).logits
    start = 0
    for n in lens:
        single = model(ids[start : start + n], PackedLayout.from_lengths([n])).logits
        torch.testing.assert_close(packed[start : start + n], single, rtol=0, atol=1e-12)
        start += n


@pytest.mark.parametrize("over", [{}, {"sliding_window": 5}])
def test_cached_decoding_equals_full_forward(over):
    """Prefill, then chunks of differing sizes per sequence (as speculative verify does)."""
    model = _model(**over)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 61, (n,), generator=gen) for n in (9, 14, 4)]
    full = [model(s, PackedLayout.from_lengths([len(s)])).logits for s in seqs]
    cache = model.new_cache(num_slots=5, max_len=20)
    slots = torch.tensor([4, 0, 2])
    # chunk schedule: per step, how many new tokens each sequence brings
    schedule = [[3, 5, 1], [1, 1, 1], [4, 2, 2], [1, 6, 0]]
    done = [0, 0, 0]
    for chunk in schedule:
        active = [i for i in range(3) if chunk[i] > 0]
        ids = torch.cat([seqs[i][done[i] : done[i] + chunk[i]] for i in active])
        layout = PackedLayout.from_lengths([chunk[i] for i in active])
        prefix = torch.tensor([done[i] for i in active])
        max_kv = max(done[i] + chunk[i] for i in active)
        cb = CacheBatch(cache, slots[active], prefix, max_kv)
        logits = model(ids, layout, cache=cb).logits
        start = 0
        for i in active:
            ref = full[i][done[i] : done[i] + chunk[i]]
            torch.testing.assert_close(logits[start : start + chunk[i]], ref, rtol=0, atol=1e-12)
            start += chunk[i]
            done[i] += chunk[i]
    assert done == [9, 14, 4]


@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip_is_exact(tmp_path, tied):
    cfg = preset_config("toy-tiny", vocab_size=61, tie_word_embeddings=tied, attention_bias=True)
    model = Transformer(cfg).init_weights(5)
    save_model(model, tmp_path / "m", max_shard_bytes=20_000)
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    again = load_model(tmp_path / "m")
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if tied:
        assert again.lm_head.weight is again.model.embed_tokens.weight


def test_checkpoint_errors(tmp_path, tiny_target):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    bad = tmp_path / "trunc"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_target / "config.json").read_text())
    data = (tiny_target / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated or corrupt|not a readable"):
        load_model(bad)
    arch = tmp_path / "arch"
    arch.mkdir()
    cfg = json.loads((tiny_target / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        load_model(arch)
    shape = tmp_path / "shape"
    shape.mkdir()
    cfg = json.loads((tiny_target / "config.json").read_text())
    cfg["intermediate_size"] = 200
    (shape / "config.json").write_text(json.dumps(cfg))
    (shape / "model.safetensors").write_bytes(data)
    with pytest.raises(CheckpointError, match="has shape"):
        load_model(shape)
