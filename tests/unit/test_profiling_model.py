"""The analytic parallelism model: hand-checked numbers on a tiny shape, scaling laws, layouts,
hardware specs, and the answer when nothing fits (CLI included)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specrl.errors import ConfigError, LayoutError
from specrl.models.config import ModelConfig
from specrl.models.presets import preset_config
from specrl.profiling.hardware import PRESETS, GiB, Hardware, parse_hardware
from specrl.profiling.layouts import (
    Layout,
    check_layout,
    enumerate_layouts,
    links,
    rank_layers,
    stage_layers,
)
from specrl.profiling.model import (
    Shapes,
    Workload,
    bubble_fraction,
    draft_phase_bytes,
    estimate,
    in_flight,
    layer_activation_bytes,
    model_config,
    plan,
    suggestion,
    tokens_per_rank,
)
from tests.conftest import run_cli

# H = 8, I = 16, 2 query heads and 1 kv head of D = 4, V = 32, two layers
TINY = dict(
    vocab_size=32,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)
# a local "device" with room for anything, so shapes are tested without memory limits
ROOMY = Hardware("roomy", 1e12, 1e15, 1e12, 1e10, 1e10, gpus_per_node=8, reserve=0.0)


def _cfg(**over) -> ModelConfig:
    return ModelConfig(**{**TINY, **over})


# ---------------------------------------------------------------------------- parameters
def test_tiny_parameter_count_by_hand():
    s = Shapes.of(_cfg())
    # q 8·8 + k, v 2·8·4 + o 8·8 + SwiGLU 3·8·16 + two norms 2·8
    assert s.layer_params == 64 + 64 + 64 + 384 + 16 == 592
    # two layers + embedding and lm_head (32·8 each) + final norm
    assert s.num_params == 2 * 592 + 2 * 256 + 8 == 1704


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"model_type": "qwen2", "attention_bias": True},
        {"model_type": "qwen3", "qk_norm": True},
        {"tie_word_embeddings": True},
    ],
)
def test_parameter_count_matches_config_and_module(over):
    from specrl.models.decoder import Transformer

    cfg = _cfg(**over)
    module = Transformer(cfg)
    numel = sum(p.numel() for p in module.parameters())  # tied weights counted once
    assert Shapes.of(cfg).num_params == cfg.num_params == numel


def test_rank_params_sum_to_the_model():
    cfg = _cfg(num_hidden_layers=8)
    work = Workload(seq_len=16, global_batch=4, precision="fp32", sharding="none")
    for layout in (Layout(1, 1, 2), Layout(1, 1, 4), Layout(1, 1, 2, 2), Layout(2, 2, 2)):
        e = estimate(cfg, layout, work, ROOMY)
        assert sum(r.params for r in e.ranks) == cfg.num_params


def test_draft_parameters_match_a_real_draft():
    from specrl.models.draft import DraftConfig, Eagle3Draft

    cfg = _cfg(num_hidden_layers=8)
    draft = Eagle3Draft(DraftConfig.for_target(cfg, draft_vocab_size=20))
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    assert Shapes.of(cfg).draft_trainable(20) == trainable
    frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)
    assert frozen == Shapes.of(cfg).embed_params


def test_state_bytes_per_parameter():
    cfg = _cfg()
    params = estimate(cfg, Layout(1, 1, 1), Workload(seq_len=16, global_batch=1), ROOMY).ranks[0]
    n = params.params

    def state(layout, **over):
        work = Workload(seq_len=16, global_batch=4, ttt_steps=0, **over)
        m = estimate(cfg, layout, work, ROOMY).ranks[0].memory
        return m["weights"] + m["grads"] + m["optimizer"]

    assert state(Layout(1, 1, 1), precision="bf16", sharding="none") == 18 * n
    assert state(Layout(1, 1, 1), precision="fp32", sharding="none") == 16 * n
    # ZeRO-1 over dp × cp = 4: bf16 weights and fp32 grads whole, 12 bytes of states / 4
    assert state(Layout(2, 2, 1), precision="bf16", sharding="zero1") == (6 + 12 / 4) * n
    assert state(Layout(2, 2, 1), precision="bf16", sharding="fsdp") == 18 / 4 * n


# ---------------------------------------------------------------------------- activations
def test_layer_activation_bytes_by_hand():
    s = Shapes.of(_cfg())
    # two norms 2·((4 + 4)·8 + 4) + fp32 (2·8 + 2·8 + 2·4 + 4·16) elements + 4 B lse per head
    assert layer_activation_bytes(s, 4) == 136 + 4 * 104 + 8 == 560
    assert layer_activation_bytes(s, 2) == 2 * (6 * 8 + 4) + 2 * 104 + 8 == 320
    assert layer_activation_bytes(s, 2, "full") == 16  # the layer input only
    assert layer_activation_bytes(s, 2, "selective") == 2 * (16 + 16 + 8 + 32) + 8
    assert (
        layer_activation_bytes(s, 2, "full")
        < layer_activation_bytes(s, 2, "selective")
        < layer_activation_bytes(s, 2)
    )


def test_layer_activation_bytes_are_what_autograd_keeps():
    """A real decoder layer's saved tensors (params and RoPE tables aside) = T · a_layer."""
    import torch

    from specrl.core.attention import PackedLayout
    from specrl.models.decoder import Rotary, Transformer

    cfg = _cfg(hidden_size=64, intermediate_size=192, num_attention_heads=4)
    layer = Transformer(cfg).layer(0)
    t = 96
    layout = PackedLayout.from_lengths([t])
    cos, sin = Rotary(cfg).cos_sin(layout.position_ids, torch.float32)
    x = torch.randn(t, cfg.hidden_size, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    skip |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(x, cos, sin, layout)
    assert sum(kept.values()) == t * layer_activation_bytes(Shapes.of(cfg), 4)


def test_activations_scale_linearly_in_tokens_and_inversely_in_cp():
    cfg = _cfg(num_hidden_layers=4)
    work = Workload(seq_len=1024, global_batch=4, precision="fp32", sharding="none")

    def acts(seq_len, cp):
        e = estimate(cfg, Layout(1, cp, 1), replace(work, seq_len=seq_len), ROOMY)
        return e.ranks[0].memory["activations"]

    assert acts(2048, 1) == 2 * acts(1024, 1)
    assert acts(1024, 2) == acts(1024, 1) / 2
    assert acts(1024, 4) == acts(1024, 1) / 4
    assert tokens_per_rank(1000, 2, 8) == 2 * 2 * 63  # each sequence padded to 1008 = 16·63
    assert tokens_per_rank(1001, 2, 1) == 2002  # no CP: no padding


def test_draft_teacher_gather_does_not_shrink_with_cp():
    s = Shapes.of(_cfg())
    for mode, shrinks in (("gather", False), ("halo", True)):
        w = Workload(seq_len=4096, teacher_shift=mode)
        at = {cp: draft_phase_bytes(s, w, 2, tokens_per_rank(4096, 1, cp), cp) for cp in (2, 8)}
        assert (at[8] < at[2] / 3) is shrinks, (mode, at)


# ---------------------------------------------------------------------------- schedule
def test_bubble_formula():
    assert bubble_fraction(1, 1, 8) == 0
    assert bubble_fraction(4, 1, 8) == 3 / 11
    assert bubble_fraction(4, 2, 8) == 3 / 19
    cfg = _cfg(num_hidden_layers=8)
    work = Workload(seq_len=64, global_batch=8, precision="fp32", ttt_steps=0)
    e = estimate(cfg, Layout(1, 1, 4), work, ROOMY)
    assert e.bubble == 3 / 11
    slowest = max(r.microbatch_seconds for r in e.ranks)
    assert e.step["bubble"] == pytest.approx(3 * slowest)
    assert e.step_seconds == pytest.approx(sum(e.step.values()))


def test_microbatches_in_flight():
    assert [in_flight("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("gpipe", 4, 1, 8, r) for r in range(4)] == [8] * 4
    assert in_flight("1f1b", 4, 1, 2, 0) == 2
    # torch's interleaved warm-up: (v − 1)·⌊n / rounds⌋ + 2·(pp − 1 − r), + the steady forward
    assert in_flight("interleaved", 2, 2, 4, 0) == (2 + 2 + 1) / 2


def test_attention_flops_causal_half_and_zigzag_share():
    cfg = _cfg()
    hw = replace(ROOMY, peak_flops=1.0, efficiency=1.0)  # seconds = FLOPs
    work = Workload(seq_len=1024, global_batch=1, ttt_steps=0, precision="fp32")
    e1 = estimate(cfg, Layout(1, 1, 1), work, hw)
    e4 = estimate(cfg, Layout(1, 4, 1), work, hw)
    s = Shapes.of(cfg)
    mm = 2 * 1024 * (s.matmul_params() * 2 + s.H * s.V)
    attn = 2 * 2 * 1024**2 / 2 * s.Q * 2  # QKᵀ and PV over the causal half, two layers
    assert e1.ranks[0].time["compute"] == pytest.approx(3 * mm + 3.5 * attn)
    assert e4.ranks[0].time["compute"] == pytest.approx((3 * mm + 3.5 * attn) / 4)


# ---------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("layers,pp,v", [(8, 2, 1), (7, 2, 1), (9, 4, 1), (8, 2, 2), (12, 3, 2)])
def test_stage_split_matches_the_pipeline(layers, pp, v):
    from specrl.core.pipeline import StageLayout

    real = StageLayout.balanced(layers, pp, v)
    assert stage_layers(layers, pp, v) == [len(s) for s in real.stage_layers]
    assert rank_layers(layers, pp, v) == [
        sum(len(real.stage_layers[s]) for s in real.rank_stages(r)) for r in range(pp)
    ]


def test_enumeration_and_rejections():
    ok, rejected = enumerate_layouts(
        8, num_layers=4, tied_embeddings=False, seq_len=64, micro_batch=1, global_batch=8
    )
    assert all(x.world == 8 for x in ok + [r.layout for r in rejected])
    assert Layout(1, 8, 1) in ok and Layout(8, 1, 1) in ok and Layout(1, 2, 4) in ok
    reasons = {r.layout: r.reason for r in rejected}
    assert "8 stages > 4 layers" in reasons[Layout(1, 1, 8)]
    common = dict(tied_embeddings=False, seq_len=64, micro_batch=1, global_batch=8)
    assert "tied" in check_layout(
        Layout(1, 1, 2), num_layers=4, **{**common, "tied_embeddings": True}, schedule="1f1b"
    )
    assert "global batch" in check_layout(
        Layout(3, 1, 1), num_layers=4, **{**common, "global_batch": 8}, schedule="1f1b"
    )
    assert "2·cp" in check_layout(
        Layout(1, 64, 1), num_layers=4, **{**common, "seq_len": 64}, schedule="1f1b"
    )
    assert "equal chunks" in check_layout(
        Layout(1, 1, 2, 2), num_layers=6, **common, schedule="interleaved"
    )
    with pytest.raises(LayoutError, match="whole nodes"):
        enumerate_layouts(
            12, num_layers=4, tied_embeddings=False, seq_len=64, micro_batch=1, global_batch=8
        )


def test_node_placement():
    placed = links(Layout(2, 4, 4), 8)
    assert placed.cp_intra and placed.dp_cp_intra and not placed.pp_intra
    placed = links(Layout(1, 16, 1), 8)
    assert not placed.cp_intra and not placed.dp_cp_intra
    assert links(Layout(1, 2, 4), 8).pp_intra


# ---------------------------------------------------------------------------- hardware
def test_hardware_specs():
    h200 = parse_hardware("h200")
    assert h200 == PRESETS["h200"] and h200.precision == "bf16"
    assert h200.usable_bytes(64) == pytest.approx(h200.hbm_bytes - 4 * GiB)
    smaller = parse_hardware("H200:hbm_gib=96,gpus_per_node=4")
    assert smaller.hbm_bytes == 96 * GiB and smaller.gpus_per_node == 4
    custom = parse_hardware(
        "custom:peak_tflops=100,hbm_gib=10,hbm_tbps=1,nvlink_gbps=100,ib_gbps=10"
    )
    assert custom.peak_flops == 100e12 and custom.inter_bandwidth == 10e9
    with pytest.raises(ConfigError, match="needs ib_gbps"):
        parse_hardware("custom:peak_tflops=1,hbm_gib=1,hbm_tbps=1,nvlink_gbps=1")
    with pytest.raises(ConfigError, match="unknown hardware"):
        parse_hardware("tpu")
    with pytest.raises(ConfigError, match="cannot read"):
        parse_hardware("h100:hbm=3")


def test_model_config_sources(tmp_path):
    assert model_config("llama-8b").num_hidden_layers == 32
    assert model_config("toy-tiny").vocab_size > 0
    (tmp_path / "config.json").write_text(json.dumps(preset_config("qwen-32b").to_hf_dict()))
    assert model_config(str(tmp_path)).hidden_size == 5120
    with pytest.raises(ConfigError, match="neither a preset"):
        model_config(str(tmp_path / "missing"))


# ---------------------------------------------------------------------------- feasibility
def test_infeasible_reason_names_the_binding_term():
    work = Workload(seq_len=262144, global_batch=8)
    e = estimate(preset_config("dense-122b"), Layout(1, 1, 8), work, PRESETS["h200"])
    assert not e.feasible
    term = max(e.peak.memory, key=e.peak.memory.get)
    assert term in e.binding and "GiB usable on h200" in e.binding
    assert f"{e.peak_bytes / GiB:.0f} GiB >" in e.binding
    # the same job on a device with room for it fits
    roomy = replace(PRESETS["h200"], hbm_bytes=1e15)
    assert estimate(preset_config("dense-122b"), Layout(1, 1, 8), work, roomy).feasible


def test_plan_ranks_feasible_by_time_then_closest():
    cfg = preset_config("llama-8b")
    result = plan(cfg, 8, Workload(seq_len=32768, global_batch=16), PRESETS["h200"])
    assert result.fits
    times = [e.step_seconds for e in result.feasible]
    assert times == sorted(times)
    over = [e.peak_bytes / e.usable_bytes for e in result.infeasible]
    assert over == sorted(over) and all(x > 1 for x in over)
    assert all("would fit" in e.binding or "no cp fits" in e.binding for e in result.infeasible)


def test_nothing_fits_gets_a_suggestion():
    cfg = preset_config("dense-122b")
    work = Workload(seq_len=262144, global_batch=64)
    result = plan(cfg, 128, work, PRESETS["h200"])
    assert not result.fits and result.infeasible
    hint = suggestion(cfg, 128, work, PRESETS["h200"])
    assert hint is not None and "fits" in hint


@pytest.mark.integration
def test_cli_fits_nowhere_names_the_binding_constraint():
    args = ("--model", "dense-122b", "--seq-len", "262144", "--gpus", "8")
    proc = run_cli("profile-parallelism", *args)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "no layout of 8 × h200 fits" in errors[0]
    assert "GiB usable on h200" in errors[0]
    assert "dp1·cp" in proc.stdout  # the closest candidates are shown
    proc = run_cli("--json", "profile-parallelism", *args)
    assert proc.returncode == 1
    data = json.loads(proc.stdout)
    assert data["fits"] is False
    assert all(not c["feasible"] and "usable" in c["binding"] for c in data["candidates"])


@pytest.mark.integration
def test_cli_ranks_layouts():
    args = ("--model", "llama-8b", "--seq-len", "32768", "--gpus", "8", "--global-batch", "16")
    proc = run_cli("--json", "profile-parallelism", *args, "--top", "3")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["fits"] and len(data["candidates"]) == 3
    assert data["candidates"][0]["feasible"]
    times = [c["step_seconds"] for c in data["candidates"] if c["feasible"]]
    assert times == sorted(times)
    proc = run_cli("profile-parallelism", *args, "--hardware", "tpu")
    assert proc.returncode == 1 and "Error: unknown hardware" in proc.stderr
