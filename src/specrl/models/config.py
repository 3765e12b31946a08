"""Target model configuration: one dataclass for the Llama-3 / Qwen2 / Qwen3 / Mistral family.

Reads and writes Hugging Face ``config.json`` (both the classic ``rope_theta`` + ``rope_scaling``
form and the newer ``rope_parameters`` form).  The four families differ only in switches:

| family  | qkv bias | q/k norm | rope scaling      | sliding window |
| ------- | -------- | -------- | ----------------- | -------------- |
| llama   | no       | no       | llama3 / linear   | no             |
| mistral | no       | no       | –                 | optional       |
| qwen2   | yes      | no       | –                 | no (here)      |
| qwen3   | no       | yes      | –                 | no (here)      |
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrl.errors import CheckpointError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    """Shape and switches of a decoder-only target model (names follow HF ``config.json``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 → hidden_size // num_attention_heads
    model_type: str = "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral-style local attention window (tokens)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.rope_scaling is not None:
            rtype = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope type '{rtype}' is not supported (supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)})"
                )

    @property
    def architecture(self) -> str:
        return {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.model_type]

    @property
    def num_params(self) -> int:
        """Parameter count (embedding and lm_head counted once each; tied counted once)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        layer = attn + 3 * h * i + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h

    def inv_freq(self) -> list[float]:
        """RoPE inverse frequencies (float64 math, returned as Python floats)."""
        dim = self.head_dim
        base = [1.0 / (self.rope_theta ** (j / dim)) for j in range(0, dim, 2)]
        rs = self.rope_scaling or {}
        rtype = rs.get("rope_type", rs.get("type", "default"))
        if rtype == "linear":
            return [f / float(rs["factor"]) for f in base]
        if rtype == "llama3":
            factor = float(rs["factor"])
            lo, hi = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
            old = float(rs["original_max_position_embeddings"])
            lo_wl, hi_wl = old / lo, old / hi
            out = []
            for f in base:
                wl = 2 * math.pi / f
                if wl < hi_wl:
                    out.append(f)
                elif wl > lo_wl:
                    out.append(f / factor)
                else:
                    smooth = (old / wl - lo) / (hi - lo)
                    out.append((1 - smooth) * f / factor + smooth * f)
            return out
        return base

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        family = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                family = SUPPORTED_ARCHITECTURES[a]
        if family is None and model_type in SUPPORTED_ARCHITECTURES.values() and not archs:
            family = model_type
        if family is None:
            raise CheckpointError(
                f"{source}: unsupported architecture {archs or model_type!r}",
                hint="supported: " + ", ".join(SUPPORTED_ARCHITECTURES),
            )
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        if isinstance(rope_scaling, dict) and rope_scaling.get(
            "rope_type", rope_scaling.get("type")
        ) in (None, "default"):
            rope_scaling = None
        sliding = d.get("sliding_window")
        if family == "qwen2" or family == "qwen3":
            if d.get("use_sliding_window", False):
                raise CheckpointError(
                    f"{source}: use_sliding_window=true is not supported for {family}",
                    hint="set use_sliding_window to false (full attention)",
                )
            sliding = None
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        for key in required:
            if key not in d:
                raise CheckpointError(f"{source}: missing field '{key}'")
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
                head_dim=int(d.get("head_dim") or 0),
                model_type=family,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
                qk_norm=family == "qwen3",
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                pad_token_id=d.get("pad_token_id"),
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
                extra={k: v for k, v in d.items() if k not in known},
            )
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"{source}: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias if self.model_type != "qwen2" else True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.torch_dtype,
        }
        if self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
            d["sliding_window"] = None
        if self.model_type == "llama":
            d["mlp_bias"] = False
        return d

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"'{p}' does not exist") from None
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{p}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{p}: expected a JSON object")
        return cls.from_hf_dict(data, source=str(p))


def default_tap_layers(num_layers: int) -> list[int]:
    """Default EAGLE-3 tap layer ids in specrl's convention (output of decoder layer X, 0-based).

    For L ≥ 8 this is SpecForge's ``[1, L//2 − 1, L − 4]`` (= vLLM's ``(2, L//2, L − 3)``); tiny
    models get low/middle/high layers spread over what exists.
    """
    n = num_layers
    if n >= 8:
        return [1, n // 2 - 1, n - 4]
    return [0, (n - 1) // 2, max(n - 2, 0)]
