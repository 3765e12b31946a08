"""Named model shapes: tiny toy targets (trainable on a laptop CPU) and large shapes for planning.

Toy presets get their vocabulary from the tokenizer they are built with; the large shapes
(``llama-8b``-like … ``moe-122b``-like dense equivalents) only feed the analytic profiler and are
never instantiated here.
"""

from __future__ import annotations

from typing import Any

from specrl.errors import ConfigError
from specrl.models.config import ModelConfig

# name → HF-config fields (vocab_size filled in by the tokenizer for toy presets)
TOY_PRESETS: dict[str, dict[str, Any]] = {
    # unit/integration tests: seconds on CPU
    "toy-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # the README's main job: warm-starts to 30–80 % task accuracy in ≤ 3 min on 2 cores
    "toy-small": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
# toy-small's width at 4× its depth: one draft layer weighs a quarter as much against the target
# (benchmarks of speculation, where the draft/target cost ratio decides)
TOY_PRESETS["toy-deep"] = {**TOY_PRESETS["toy-small"], "num_hidden_layers": 16}

LARGE_PRESETS: dict[str, dict[str, Any]] = {
    "llama-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "qwen-32b": dict(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
    ),
    "llama-70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "dense-122b": dict(
        vocab_size=152064,
        hidden_size=10240,
        intermediate_size=36864,
        num_hidden_layers=88,
        num_attention_heads=80,
        num_key_value_heads=8,
        rope_theta=1000000.0,
        max_position_embeddings=262144,
    ),
}


def preset_config(name: str, *, vocab_size: int | None = None, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` for a named preset (toy presets need ``vocab_size``)."""
    if name in TOY_PRESETS:
        if vocab_size is None:
            raise ValueError(f"toy preset {name!r} needs a vocab_size (from its tokenizer)")
        fields = {
            **TOY_PRESETS[name],
            "vocab_size": vocab_size,
            "max_position_embeddings": 512,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        }
    elif name in LARGE_PRESETS:
        fields = dict(LARGE_PRESETS[name])
    else:
        known = ", ".join([*TOY_PRESETS, *LARGE_PRESETS])
        raise ConfigError(f"unknown model preset {name!r}", hint=f"choose one of {known}")
    fields.update(overrides)
    return ModelConfig(model_type="llama", **fields)


SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def check_shape(config: ModelConfig, preset: str, source: str = "policy") -> None:
    """Raise ConfigError when ``config`` does not have the shape of the named large preset."""
    want = preset_config(preset)
    diff = [
        f"{f} {getattr(config, f)} ≠ {getattr(want, f)}"
        for f in SHAPE_FIELDS
        if getattr(config, f) != getattr(want, f)
    ]
    if diff:
        raise ConfigError(
            f"{source}: checkpoint does not have the '{preset}' shape: " + ", ".join(diff),
            hint="fix policy.shape or policy.path",
        )
