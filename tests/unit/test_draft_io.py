"""Draft checkpoints, serving export/import, layer-id conventions, guards, decode == TTT."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from specrl.core.attention import PackedLayout
from specrl.errors import CheckpointError
from specrl.models.draft_io import (
    aux_ids_for,
    export_draft,
    import_eagle3,
    load_draft,
    module_chain,
    save_draft,
    verify_export,
)
from tests.unit.test_draft import make_pair

SERVING_KEYS = {
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


@pytest.fixture
def pair():
    return make_pair(dtype=torch.float32)


@pytest.mark.parametrize(
    ("dtype", "torch_dtype"),
    [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)],
)
def test_export_keys_dtypes_and_config(pair, tmp_path, dtype, torch_dtype):
    _, draft = pair
    export_draft(draft, tmp_path / "e", server="vllm", dtype=dtype)
    tensors = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert set(tensors) == SERVING_KEYS  # no embed_tokens
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(v.dtype == torch_dtype for k, v in tensors.items() if k not in ("d2t", "t2d"))
    assert tensors["lm_head.weight"].shape == (29, draft.config.hidden_size)
    assert tensors["t2d"].shape == (41,)
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == 41 and cfg["draft_vocab_size"] == 29
    assert cfg["torch_dtype"] == str(torch_dtype).removeprefix("torch.")
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "rms_norm_eps",
        "rope_theta",
    ):
        assert key in cfg
    assert "target_hidden_size" not in cfg  # equal to hidden_size here


def test_full_vocabulary_export_has_no_map_for_vllm(tmp_path):
    """vLLM builds no draft→target map when the draft vocabulary is the target's (a d2t would
    fail its load); SGLang/SpecForge's layout keeps both buffers.  Both import back exactly."""
    target, draft = make_pair(draft_vocab=41, dtype=torch.float32)
    for server in ("vllm", "sglang"):
        export_draft(draft, tmp_path / server, server=server, dtype="fp32")
        tensors = load_file(str(tmp_path / server / "model.safetensors"))
        cfg = json.loads((tmp_path / server / "config.json").read_text())
        assert cfg["draft_vocab_size"] == cfg["vocab_size"] == 41
        if server == "vllm":
            assert set(tensors) == SERVING_KEYS - {"d2t", "t2d"}
        else:
            assert set(tensors) == SERVING_KEYS
            assert not tensors["d2t"].any() and tensors["t2d"].all()
        back = import_eagle3(tmp_path / server, target, server=server, dtype=torch.float32)
        sd = draft.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in back.state_dict().items())
        report = verify_export(draft, tmp_path / server, target, server=server)
        assert report["ok"], report


def test_layer_id_conventions_round_trip(pair, tmp_path):
    target, draft = pair
    taps = draft.config.tap_layers  # (0, 1, 2): outputs of layers 0, 1, 2
    assert aux_ids_for("vllm", taps) == [1, 2, 3]  # vLLM: input to layer X = output of X − 1
    assert aux_ids_for("sglang", taps) == [0, 1, 2]
    for server in ("vllm", "sglang"):
        export_draft(draft, tmp_path / server, server=server, dtype="fp32")
        cfg = json.loads((tmp_path / server / "config.json").read_text())
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == aux_ids_for(server, taps)
        back = import_eagle3(tmp_path / server, target, server=server)
        assert back.config.tap_layers == taps
    # reading a vLLM export as if it used SGLang's convention shifts every tap: the guard
    # catches the out-of-range one (layer 3 of a 3-layer target)
    with pytest.raises(CheckpointError, match="out of range"):
        import_eagle3(tmp_path / "vllm", target, server="sglang")


def test_export_import_gives_identical_logits(pair, tmp_path):
    target, draft = pair
    export_draft(draft, tmp_path / "e", dtype="fp32")
    again = import_eagle3(tmp_path / "e", target)
    gen = torch.Generator().manual_seed(0)
    taps = torch.randn(9, 3 * draft.config.target_hidden_size, generator=gen)
    ids = torch.randint(0, 41, (9,), generator=gen)
    for a, b in zip(
        module_chain(draft, taps, ids, 3), module_chain(again, taps, ids, 3), strict=True
    ):
        assert torch.equal(a, b)
    sd_a, sd_b = draft.state_dict(), again.state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_verify_export_functional_path(pair, tmp_path, dtype):
    target, draft = pair
    export_draft(draft, tmp_path / "e", dtype=dtype)
    rep = verify_export(draft, tmp_path / "e", target, server="vllm")
    assert rep["ok"] and rep["functional_vs_module_max_abs"] <= 1e-9
    if dtype == "fp32":
        assert rep["export_vs_original_rel"] <= 1e-6
    # a corrupted export (a wrong norm weight) is caught by the functional path
    t = load_file(str(tmp_path / "e" / "model.safetensors"))
    from safetensors.torch import save_file

    t["midlayer.hidden_norm.weight"] = t["midlayer.hidden_norm.weight"] * 0 + 3
    save_file(t, str(tmp_path / "e" / "model.safetensors"))
    bad = verify_export(draft, tmp_path / "e", target, server="vllm")
    assert not bad["ok"] and bad["export_vs_original_rel"] > bad["export_rel_tolerance"]


def test_decode_chain_equals_ttt_steps():
    """Inference (slot cache: main entries + chain) reproduces TTT step k at the chain's index."""
    _, draft = make_pair(dtype=torch.float64)
    t, steps = 7, 4
    gen = torch.Generator().manual_seed(3)
    taps = torch.randn(t, 3 * draft.config.target_hidden_size, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 41, (t,), generator=gen)
    chain = module_chain(draft, taps, ids, steps)  # target-vocab logits
    drafted = [int(c[-1].argmax()) for c in chain[:-1]]  # d_1 .. d_{steps-1}
    # TTT over the sequence whose next tokens are ids, then the drafted chain
    s = t + steps
    x = torch.zeros(s, dtype=torch.int64)
    x[1 : t + 1] = ids
    x[t + 1 : t + steps] = torch.tensor(drafted)
    feats = torch.cat([taps, torch.zeros(s - t, taps.shape[1], dtype=torch.float64)])
    layout = PackedLayout.from_lengths([s])
    step_ids = torch.stack(
        [torch.cat([x[k + 1 :], torch.zeros(k + 1, dtype=torch.int64)]) for k in range(steps)]
    )
    out = draft.ttt_forward(feats, step_ids, layout)
    to_target = draft.draft_to_target
    for k in range(steps):
        torch.testing.assert_close(
            out.logits[k][t - 1], chain[k][-1][to_target], rtol=0, atol=1e-10
        )


def test_save_load_and_fingerprint_policy(pair, tmp_path, caplog):
    target, draft = pair
    save_draft(draft, tmp_path / "d", target=target, provenance={"note": "test"})
    again, meta = load_draft(tmp_path / "d", target)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in draft.state_dict().items())
    assert meta["tap_convention"].startswith("output of target decoder layer X")
    # same architecture, moved embedding (an RL-updated policy): warning + refresh
    with torch.no_grad():
        target.model.embed_tokens.weight.add_(0.5)
    with caplog.at_level(logging.WARNING):
        moved, _ = load_draft(tmp_path / "d", target)
    assert "embedding changed" in caplog.text
    assert torch.equal(moved.embed_tokens.weight, target.model.embed_tokens.weight)
    # a different target architecture: error
    other, _ = make_pair(dtype=torch.float32)
    other.config.rope_theta = 12345.0
    with pytest.raises(CheckpointError, match="different target"):
        load_draft(tmp_path / "d", other)


def test_guards(pair, tmp_path):
    target, draft = pair
    with pytest.raises(CheckpointError, match="does not exist"):
        load_draft(tmp_path / "missing", target)
    export_draft(draft, tmp_path / "e", dtype="fp32")
    with pytest.raises(CheckpointError, match="not a specrl draft"):
        load_draft(tmp_path / "e", target)
    from specrl.models.decoder import Transformer
    from specrl.models.presets import preset_config

    wide = Transformer(
        preset_config("toy-tiny", vocab_size=41, hidden_size=96, num_hidden_layers=3)
    )
    save_draft(draft, tmp_path / "d", target=target)
    with pytest.raises(CheckpointError, match="hidden size"):
        load_draft(tmp_path / "d", wide)
    other_vocab = Transformer(preset_config("toy-tiny", vocab_size=50, num_hidden_layers=3))
    with pytest.raises(CheckpointError, match="vocabulary"):
        load_draft(tmp_path / "d", other_vocab)
    shallow = Transformer(preset_config("toy-tiny", vocab_size=41, num_hidden_layers=2))
    with pytest.raises(CheckpointError, match="out of range"):
        load_draft(tmp_path / "d", shallow)
