"""Megatron-core backend, one process: the CPU compatibility scope, HF ↔ Megatron weights, and
the forward against specrl's native decoder."""

from __future__ import annotations

import pytest
import torch

from specrl.models.config import ModelConfig
from specrl.models.decoder import Transformer

pytest.importorskip("megatron.core", reason="pip install 'specrl[megatron]'")

from specrl.integrations.megatron import compat, convert
from tests.distributed.megatron_util import one_process_group

FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2", attention_bias=True),
    "qwen3": dict(model_type="qwen3", qk_norm=True),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama3-rope": dict(
        model_type="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


def tiny_config(**over) -> ModelConfig:
    base = dict(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1000.0,
        max_position_embeddings=64,
    )
    return ModelConfig(**{**base, **over})


def native(config: ModelConfig, dtype=torch.float64, seed: int = 0) -> Transformer:
    return Transformer(config).init_weights(seed, std=0.3).to(dtype)


@pytest.fixture(scope="module")
def group():
    with one_process_group():
        yield


def test_cpu_compat_is_scoped_and_restored():
    """Inside: Megatron's modules see CUDA calls answered on the CPU; outside (and for every
    other module, inside too): torch.cuda behaves as before."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mg_random

    before = (schedules.torch, mg_random._get_cuda_rng_state, mg_random._set_cuda_rng_state)
    assert schedules.torch is torch
    with compat.cpu_compat():
        if compat.needed():
            assert compat.active()
            assert schedules.torch.cuda.current_device() == torch.device("cpu")
            assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
            with compat.cpu_compat():  # re-entrant
                assert compat.active()
            assert compat.active()
        # the real torch is untouched, even inside
        assert torch.zeros(1).device.type == "cpu"
        assert torch.cuda.current_device is not schedules.torch.cuda.current_device
    assert not compat.active()
    assert (schedules.torch, mg_random._get_cuda_rng_state, mg_random._set_cuda_rng_state) == before
    if compat.needed():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()


def test_cpu_compat_restores_after_an_error():
    from megatron.core.pipeline_parallel import schedules

    with pytest.raises(ValueError), compat.cpu_compat():
        raise ValueError("boom")
    assert schedules.torch is torch and not compat.active()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_megatron_round_trip_is_bit_identical(family):
    config = tiny_config(**FAMILIES[family])
    hf = {k: v.clone() for k, v in native(config, torch.float32).state_dict().items()}
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight")
    mg = convert.hf_to_megatron(hf, config)
    assert ("output_layer.weight" in mg) != config.tie_word_embeddings
    assert mg["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (
        (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim,
        config.hidden_size,
    )
    back = convert.megatron_to_hf(mg, config)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_fused_qkv_is_grouped_by_kv_head():
    """Group g of linear_qkv holds query heads g·per … (g+1)·per − 1, then key head g, then
    value head g (Megatron's layout), checked on labelled rows."""
    config = tiny_config()
    d, hq, hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q = torch.arange(hq).repeat_interleave(d)[:, None].float()  # row → its query head
    k = 100 + torch.arange(hkv).repeat_interleave(d)[:, None].float()
    v = 200 + torch.arange(hkv).repeat_interleave(d)[:, None].float()
    heads = convert.fuse_qkv(q, k, v, config)[::d, 0].tolist()
    assert heads == [0, 1, 100, 200, 2, 3, 101, 201]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_megatron_forward_matches_native(group, family):
    """The same weights through Megatron's GPTModel (padded [b, s] rows, causal) and specrl's
    packed decoder: float64 logits and every gradient agree to 1e-12 relative (different
    attention kernels: Megatron's baddbmm + softmax vs SDPA, so not bit-identical)."""
    from specrl.core.attention import PackedLayout

    config = tiny_config(**FAMILIES[family])
    ref = native(config)
    lengths = [7, 5]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lengths]
    out = ref(torch.cat(seqs), PackedLayout.from_lengths(lengths))
    out.logits.pow(2).sum().backward()

    with compat.cpu_compat():
        tconfig = convert.transformer_config(config, dtype=torch.float64)
        model = convert.build_gpt(config, tconfig)
        convert.load_hf_state(model, ref.state_dict(), config)
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        logits = model(ids, pos, None)  # [b, s, V]
    rows = torch.cat([logits[i, :n] for i, n in enumerate(lengths)])
    assert torch.allclose(rows, out.logits, rtol=1e-12, atol=1e-12)
    rows.pow(2).sum().backward()
    grads = convert.chunk_hf_state(model, config, grads=True)
    for name, p in ref.named_parameters():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        assert torch.allclose(grads[name], p.grad, rtol=1e-10, atol=1e-12), name
