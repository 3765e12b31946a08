"""specrl's decoder families as Megatron-core ``GPTModel`` s, and their weights both ways.

The run's Hugging Face checkpoints stay the interchange format: a Megatron policy is built from
the same :class:`~specrl.models.config.ModelConfig` and loaded from the same HF-named state
(:func:`hf_to_megatron`), and its weights go back to HF names (:func:`megatron_to_hf`) for the
rollout engine and the checkpoints.  Both directions are pure re-layouts (``cat``/``view``/
``split`` of the same values), so HF → Megatron → HF is bit-identical.

Layouts (Megatron-core 0.16, local layer spec):

| HF (``model.layers.i.``)                     | Megatron (``decoder.layers.i.``)              |
| -------------------------------------------- | --------------------------------------------- |
| ``input_layernorm.weight``                   | ``input_layernorm.weight``                    |
| ``self_attn.{q,k,v}_proj.weight`` (+ bias)   | ``self_attention.linear_qkv.weight`` (+ bias) |
| ``self_attn.o_proj.weight``                  | ``self_attention.linear_proj.weight``         |
| ``self_attn.{q,k}_norm.weight`` (Qwen3)      | ``self_attention.{q,k}_layernorm.weight``     |
| ``post_attention_layernorm.weight``          | ``pre_mlp_layernorm.weight``                  |
| ``mlp.gate_proj`` ‖ ``mlp.up_proj``          | ``mlp.linear_fc1.weight`` (gate rows first)   |
| ``mlp.down_proj.weight``                     | ``mlp.linear_fc2.weight``                     |
| ``model.embed_tokens`` / ``model.norm`` /    | ``embedding.word_embeddings`` /               |
| ``lm_head``                                  | ``decoder.final_layernorm`` / ``output_layer``|

The fused QKV projection is grouped by key/value head: for each of the ``n_kv`` groups, its
``n_q / n_kv`` query heads, then its key head, then its value head (``head_dim`` rows each).
Tied embeddings (``tie_word_embeddings``) have no ``output_layer``: Megatron shares the word
embedding (``share_embeddings_and_output_weights``) and HF has no ``lm_head.weight``.

Megatron numbers layers globally inside a pipeline stage's ``decoder.layers`` by local index;
``TransformerLayer.layer_number`` (1-based) is the global id.  :func:`load_hf_state` and
:func:`chunk_hf_state` go through ``layer_number`` so they work on any stage or virtual chunk.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from specrl.errors import CheckpointError
from specrl.models.config import ModelConfig

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MG_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# per-layer names that only rename (HF suffix → Megatron suffix)
_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


def check_supported(config: ModelConfig) -> None:
    """One-line error for a model this backend cannot build exactly."""
    if config.sliding_window is not None:
        raise CheckpointError(
            f"policy.backend=megatron: sliding-window attention (sliding_window="
            f"{config.sliding_window}) has no Megatron-core local-spec equivalent",
            hint="use policy.backend: native for this checkpoint",
        )


def transformer_config(
    config: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    pp: int = 1,
    vp: int | None = None,
    **overrides: Any,
) -> Any:
    """The Megatron ``TransformerConfig`` of ``config`` (local layers, CPU initialisation, no
    dropout, no fusions).  ``pp``/``vp`` are the pipeline and virtual sizes: Megatron reads the
    stage's layer count from them, and without them every stage silently builds all layers."""
    from megatron.core.transformer import TransformerConfig

    check_supported(config)
    kwargs: dict[str, Any] = dict(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=config.attention_bias,
        qk_layernorm=config.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(
    config: ModelConfig,
    tconfig: Any,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    transformer_engine: bool = False,
) -> nn.Module:
    """One ``GPTModel`` chunk of ``config`` (call inside :func:`cpu_compat`, after
    ``parallel_state.initialize_model_parallel``): its rotary inverse frequencies are
    ``config.inv_freq()`` (every rope type specrl reads, in the model's precision), its
    parameters all in the config's dtype (Megatron's torch norms default to float32).

    ``transformer_engine``: Transformer Engine's layer spec (GPU; needed for context
    parallelism) instead of the local one.  Its norms are fused into ``linear_qkv`` /
    ``linear_fc1`` (``layer_norm_weight``), so the HF conversion here, written for the local
    spec, does not apply to it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if transformer_engine:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_norm)
    else:
        spec = specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_norm, normalization="RMSNorm")
    model = GPTModel(
        tconfig,
        spec,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(config.rope_theta),
        vp_stage=vp_stage,
    )
    dtype = tconfig.params_dtype
    model.to(dtype)
    if getattr(model, "rotary_pos_emb", None) is not None:
        math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        inv = torch.tensor(config.inv_freq(), dtype=torch.float64)
        model.rotary_pos_emb.inv_freq = inv.to(math_dtype)
    return model


def _qkv_split(config: ModelConfig) -> tuple[int, int, int]:
    g = config.num_key_value_heads
    return g, config.num_attention_heads // g, config.head_dim


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig
) -> torch.Tensor:
    """HF q/k/v rows ([n_q·d, …], [n_kv·d, …] twice) → Megatron's grouped ``linear_qkv``
    ([(n_q + 2·n_kv)·d, …]: per group its query heads, its key head, its value head)."""
    g, per, d = _qkv_split(config)
    rest = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1
    )
    return grouped.reshape(g * (per + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`fuse_qkv`."""
    g, per, d = _qkv_split(config)
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
    return q.reshape(g * per * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def _layer_to_megatron(suffix_state: Mapping[str, torch.Tensor], config: ModelConfig):
    """One layer's HF suffixes → Megatron suffixes."""
    out: dict[str, torch.Tensor] = {}
    s = dict(suffix_state)
    for part in ("weight", "bias"):
        names = [f"self_attn.{x}_proj.{part}" for x in "qkv"]
        if all(n in s for n in names):
            out[f"self_attention.linear_qkv.{part}"] = fuse_qkv(*(s.pop(n) for n in names), config)
    gate, up = s.pop("mlp.gate_proj.weight", None), s.pop("mlp.up_proj.weight", None)
    if gate is not None and up is not None:
        out["mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    for name, t in s.items():
        if name not in _RENAMES:
            raise CheckpointError(f"weight '{name}' has no Megatron-core counterpart")
        out[_RENAMES[name]] = t
    return out


def hf_to_megatron(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, Any]:
    """An HF-named state (whole model) → Megatron names with **global** layer indices
    (``decoder.layers.<global>.…``)."""
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _HF_LAYER.fullmatch(name)
        if m:
            per_layer.setdefault(int(m[1]), {})[m[2]] = t
        elif name in _GLOBAL:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # tied: the embedding is the output layer
            out[_GLOBAL[name]] = t
        else:
            raise CheckpointError(f"weight '{name}' has no Megatron-core counterpart")
    for i, suffixes in sorted(per_layer.items()):
        for suffix, t in _layer_to_megatron(suffixes, config).items():
            out[f"decoder.layers.{i}.{suffix}"] = t
    return out


def megatron_to_hf(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, Any]:
    """Inverse of :func:`hf_to_megatron` (global layer indices); Megatron's non-parameter
    entries (``_extra_state``) are skipped."""
    back = {v: k for k, v in _RENAMES.items()}
    glob = {v: k for k, v in _GLOBAL.items()}
    inter = config.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("_extra_state") or t is None:
            continue
        m = _MG_LAYER.fullmatch(name)
        if m is None:
            if name not in glob:
                raise CheckpointError(f"Megatron weight '{name}' has no HF counterpart")
            out[glob[name]] = t
            continue
        prefix, suffix = f"model.layers.{m[1]}.", m[2]
        if suffix.startswith("self_attention.linear_qkv."):
            part = suffix.rsplit(".", 1)[1]
            for x, piece in zip("qkv", split_qkv(t, config), strict=True):
                out[f"{prefix}self_attn.{x}_proj.{part}"] = piece
        elif suffix == "mlp.linear_fc1.weight":
            gate, up = t.split([inter, inter], dim=0)
            out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
        elif suffix in back:
            out[prefix + back[suffix]] = t
        else:
            raise CheckpointError(f"Megatron weight '{name}' has no HF counterpart")
    return out


def _local_to_global(chunk: nn.Module) -> dict[int, int]:
    """A chunk's ``decoder.layers`` local index → global 0-based layer id."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}


def chunk_hf_state(
    chunk: nn.Module, config: ModelConfig, *, grads: bool = False
) -> dict[str, torch.Tensor]:
    """The HF-named tensors one Megatron chunk (a stage or virtual chunk) holds, detached
    (views of its parameters: no copy); ``grads``: their gradients instead (None skipped)."""
    to_global = _local_to_global(chunk)
    state: dict[str, torch.Tensor] = {}
    for name, p in chunk.named_parameters():
        m = _MG_LAYER.fullmatch(name)
        if m is not None:
            name = f"decoder.layers.{to_global[int(m[1])]}.{m[2]}"
        t = p.grad if grads else p
        if t is not None:
            state[name] = t.detach()
    return megatron_to_hf(state, config)


def load_hf_state(chunk: nn.Module, state: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    """Copy the HF-named ``state`` (the whole model) into the parameters one Megatron chunk
    holds; every parameter of the chunk must be covered, with its exact shape."""
    mg = hf_to_megatron(state, config)
    to_global = _local_to_global(chunk)
    with torch.no_grad():
        for name, p in chunk.named_parameters():
            m = _MG_LAYER.fullmatch(name)
            key = name if m is None else f"decoder.layers.{to_global[int(m[1])]}.{m[2]}"
            if key not in mg:
                raise CheckpointError(f"the checkpoint has no weight for Megatron's '{key}'")
            src = mg[key]
            if tuple(src.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"Megatron's '{key}' is {tuple(p.shape)}, the checkpoint gives "
                    f"{tuple(src.shape)}"
                )
            p.copy_(src)
