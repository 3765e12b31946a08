"""One decoder implementation for the Llama-3 / Qwen2 / Qwen3 / Mistral family.

Parameter names equal Hugging Face's (``model.layers.3.self_attn.q_proj.weight`` …), so HF
safetensors load without renaming.  Layers live in a ``ModuleDict`` keyed by their global index:
a pipeline stage deletes the layers it does not own and keeps the names.

Forward (``Transformer.forward``) always takes *packed* tokens ``[T]`` with a
:class:`~specrl.core.attention.PackedLayout`:

- training: ``cu_seqlens`` + global ``position_ids``; no attention across sequences;
- cached decoding/verification: the same, plus a :class:`KVCache` and per-sequence slots and
  prefix lengths (each sequence may bring a different number of new tokens).

Taps: ``taps=[X, …]`` returns the **output of decoder layer X** (0-based; this is
SpecForge's convention, vLLM's id is X + 1), detached.

Context parallelism is a hook, not a branch: every :class:`Attention` hands its ``cp`` attribute
(None unless :meth:`Transformer.use_context_parallel` set a
:class:`~specrl.core.attention.CPContext`) to :func:`~specrl.core.attention.attention`, which routes
packed training forwards over the zigzag ring.  The model code is the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specrl.core.attention import CacheView, CPContext, PackedLayout, attention
from specrl.core.attention.kernels import cache_mask, cache_rows
from specrl.models.config import ModelConfig
from specrl.models.fused import DecoderPlan, LayerCopies, project


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype in (torch.float32, torch.float64) and self.weight.dtype == dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # same math, one op
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Rotary:
    """RoPE tables from global position ids (inverse frequencies kept in float64 on the host)."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq_list = config.inv_freq()
        self._inv: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        # (device, dtype) → cos, sin of every position below their length (cos_sin's tables)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(
        self, position_ids: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """cos, sin: [T, 1, D] in ``dtype`` for :func:`apply_rope` (math in float32, or float64
        for float64 models); ``sin`` is sign-folded: −sin on the first half of D, +sin on the
        second.

        ``max_position``: a host bound on the largest position (a cached forward knows one).
        Given, the rows are looked up (two ``index_select``) in tables of every position up to
        it, kept per device and dtype and grown as needed, instead of computed (about ten ops):
        the same elementwise math, so the same bits.  Inside a compiled graph they are always
        computed."""
        if max_position is not None and not torch.compiler.is_compiling():
            key = (position_ids.device, dtype)
            table = self._tables.get(key)
            if table is None or table[0].shape[0] <= max_position:
                have = 0 if table is None else table[0].shape[0]
                rows = torch.arange(max(256, max_position + 1, 2 * have), device=key[0])
                table = self._tables[key] = self._compute(rows, dtype)
            return table[0].index_select(0, position_ids), table[1].index_select(0, position_ids)
        return self._compute(position_ids, dtype)

    def _compute(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        key = (position_ids.device, math_dtype)
        # inside a compiled graph the tables are built, never looked up: a graph that read the
        # host cache would be guarded on its contents (empty or not), a fact its callers'
        # graph-class keys do not name (specrl.rollout.compiled)
        compiling = torch.compiler.is_compiling()
        cached = None if compiling else self._inv.get(key)
        if cached is None:
            inv = torch.tensor(self.inv_freq_list, dtype=torch.float64).to(position_ids.device)
            half = len(self.inv_freq_list)
            sign = torch.tensor([-1.0] * half + [1.0] * half, device=position_ids.device)
            cached = (inv.to(math_dtype), sign.to(math_dtype))
            if not compiling:
                self._inv[key] = cached
        inv, sign = cached
        freqs = position_ids.to(math_dtype)[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None], (emb.sin() * sign).to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] from :meth:`Rotary.cos_sin` (sin sign-folded).

    The usual ``x·cos + rotate_half(x)·sin`` with rotate_half(x) = [−x₂, x₁]: rolling x by D/2
    gives [x₂, x₁], and the folded sin carries the minus sign (negation is exact, so the result
    is bit-identical) in 4 ops instead of 8 per call.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def rope_heads(
    heads: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused q|k|v projection [T, Hq + 2·Hkv, D] → (q, k, v), RoPE on q and k in one pass."""
    qk = apply_rope(heads[:, : num_heads + num_kv_heads], cos, sin)
    return qk[:, :num_heads], qk[:, num_heads:], heads[:, num_heads + num_kv_heads :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.window = config.sliding_window
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # context-parallel ring of packed training forwards (zigzag-local ``layout``); None: local
        self.cp: CPContext | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        layout: PackedLayout,
        cache: CacheView | None = None,
        backend: str = "sdpa",
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attention(q, k, v, layout, cache=cache, backend=backend, window=self.window, cp=self.cp)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, layout, cache=None, backend="sdpa"):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layout, cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


def infer_layer(
    c: LayerCopies,
    x: torch.Tensor,  # [T, H]
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: PackedLayout,
    cache: CacheView | None,
    backend: str,
) -> torch.Tensor:
    """:meth:`DecoderLayer.forward` on the fused inference path (:mod:`specrl.models.fused`):
    one q|k|v projection, one RoPE pass over q and k, o_proj and down_proj with their residual
    added in the GEMM, gate|up as one projection; every weight from the layer's resolved
    :class:`LayerCopies` (same math, no autograd, no module lookups)."""
    (ln1, ln2, (w1, w2), norm_dtype, eps, qkv, qkv_bias, o_w, gate_up, down, attn, inter, tr) = c
    t, hq, hkv, d = x.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    fast_norm = x.dtype == norm_dtype
    y = F.rms_norm(x, w1.shape, w1, eps) if fast_norm else ln1.forward(x)
    heads = project(y, qkv, qkv_bias, None, tr).view(t, hq + 2 * hkv, d)
    if attn.q_norm is None:
        q, k, v = rope_heads(heads, hq, hkv, cos, sin)
    else:  # per-head norms first (Qwen3), then RoPE on each
        q = apply_rope(attn.q_norm.forward(heads[:, :hq]), cos, sin)
        k = apply_rope(attn.k_norm.forward(heads[:, hq : hq + hkv]), cos, sin)
        v = heads[:, hq + hkv :]
    o = attention(q, k, v, layout, cache=cache, backend=backend, window=attn.window, cp=attn.cp)
    x = project(o.reshape(t, hq * d), o_w, None, x, tr)
    y = F.rms_norm(x, w2.shape, w2, eps) if fast_norm else ln2.forward(x)
    gate, up = project(y, gate_up, None, None, tr).split(inter, dim=-1)
    return project(F.silu(gate).mul_(up), down, None, x, tr)


class DecoderBody(nn.Module):
    """HF's ``model.`` prefix: embedding, layers keyed by global index, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(config) for i in range(config.num_hidden_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, config.rms_norm_eps)


class KVCache:
    """Slot-based KV cache: one head-major [num_slots, Hkv, max_len, D] pair per owned
    layer (a sequence's keys of one head are contiguous: the layout attention reads)."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_len: int,
        *,
        layer_ids: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        ids = list(range(config.num_hidden_layers)) if layer_ids is None else list(layer_ids)
        shape = (num_slots, config.num_key_value_heads, max_len, config.head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in ids}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in ids}
        self.num_slots = num_slots
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def copy_slots(self, src: Sequence[int], dst: Sequence[int], rows: int) -> None:
        """Copy the first ``rows`` positions of slots ``src[i]`` into slots ``dst[i]``, every
        layer (a request's samples sharing its prompt, a sequence moving to another slot)."""
        if not src or rows <= 0:
            return
        device = next(iter(self.k.values())).device
        a = torch.tensor(list(src), dtype=torch.int64, device=device)
        b = torch.tensor(list(dst), dtype=torch.int64, device=device)
        for kv in (self.k, self.v):
            for layer in kv.values():
                layer[b, :, :rows] = layer[a, :, :rows]


@dataclass
class CacheBatch:
    """Where the packed new tokens of a cached forward go: slot and prefix length per sequence."""

    cache: KVCache
    slots: torch.Tensor  # [B] int64
    prefix_lens: torch.Tensor  # [B] int64
    max_kv_len: int  # host int ≥ max(prefix_lens + new lengths)
    slots_are_prefix: bool = False  # host flag: slots == arange(B) (no gather needed)
    full_rows: bool = False  # host flag: one new token each, all at position max_kv_len − 1
    mask: torch.Tensor | None = None  # [B, 1, M, max_kv_len], built once per forward
    rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (slot, position) [T], once too

    def prepare(self, layout: PackedLayout, dtype: torch.dtype, window: int | None) -> None:
        """What every layer of a forward shares, built once: the new tokens' cache rows (their
        positions are the RoPE positions) and, unless ``full_rows``, the additive mask."""
        if self.rows is None:
            self.rows = cache_rows(layout, self.slots, self.prefix_lens)
        if self.mask is None and not self.full_rows:
            self.mask = cache_mask(layout, self.prefix_lens, self.max_kv_len, window, dtype)

    def view(self, layer: int) -> CacheView:
        return CacheView(
            self.cache.k[layer],
            self.cache.v[layer],
            self.slots,
            self.prefix_lens,
            self.max_kv_len,
            self.slots_are_prefix,
            self.mask,
            self.full_rows,
            self.rows,
        )


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [T, H] final hidden (after the final norm on the last stage)
    logits: torch.Tensor | None  # [T or len(logits_index), V] in float32
    taps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id → [T, H], detached


class Transformer(nn.Module):
    """Decoder-only target model; ``forward`` works on a full model or a pipeline-stage slice."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head: nn.Linear | None = nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config)
        self.attn_backend = "sdpa"
        # the fused inference path's copies (specrl.models.fused)
        self._plan = DecoderPlan()

    # -------------------------------------------------------------- construction helpers
    def init_weights(self, seed: int = 0, std: float = 0.02) -> Transformer:
        """Random initialization for training from scratch (normal(0, std), norms at one)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
        return self

    @property
    def layer_ids(self) -> list[int]:
        return sorted(int(k) for k in self.model.layers)

    def layer(self, i: int) -> DecoderLayer:
        return self.model.layers[str(i)]

    def use_context_parallel(self, cp: CPContext | None) -> None:
        """Route every attention layer this model (or pipeline chunk) holds over the ring of
        ``cp`` (None: local again); its packed forwards then take zigzag shards."""
        for i in self.layer_ids:
            self.layer(i).self_attn.cp = cp

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        return KVCache(
            self.config,
            num_slots,
            max_len,
            layer_ids=self.layer_ids,
            dtype=dtype or self.dtype,
            device=self.device,
        )

    # -------------------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.model.embed_tokens is not None, "this pipeline stage has no embedding"
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """Final-norm'd hidden → float32 logits (float64 for float64 models); ``fused``: through
        the inference copy of the weight (:mod:`specrl.models.fused`, no autograd)."""
        assert self.lm_head is not None, "this pipeline stage has no lm_head"
        if fused:
            c = self._plan.get(self)
            logits = project(hidden, c.lm_head, None, None, c.transposed)
        else:
            logits = self.lm_head(hidden)
        return logits if logits.dtype == torch.float64 else logits.float()

    def forward(
        self,
        inputs: torch.Tensor,  # [T] token ids (first stage) or [T, H] hidden states
        layout: PackedLayout,
        *,
        taps: Sequence[int] = (),
        cache: CacheBatch | None = None,
        logits: bool = True,
        logits_index: torch.Tensor | None = None,  # [N] rows of T to compute logits for
        fused: bool = False,
    ) -> ModelOutput:
        """``fused=True``: the inference path (:mod:`specrl.models.fused`: fused q|k|v and
        gate|up projections, no module hooks); needs autograd off."""
        if fused and torch.is_grad_enabled():
            raise RuntimeError("the fused inference forward needs torch.no_grad()")
        h = self.embed(inputs) if inputs.dtype in (torch.int32, torch.int64) else inputs
        if cache is not None:  # new tokens continue their slot: positions follow the prefix
            cache.prepare(layout, h.dtype, self.config.sliding_window)
            positions = cache.rows[1]
        else:
            positions = layout.position_ids
        bound = None if cache is None else cache.max_kv_len - 1  # positions < max_kv_len
        cos, sin = self.rotary.cos_sin(positions, h.dtype, bound)
        want = set(taps)
        tapped: dict[int, torch.Tensor] = {}
        backend = self.attn_backend
        plan = self._plan.get(self).layers if fused else None
        for i in self.layer_ids:
            view = cache.view(i) if cache is not None else None
            if plan is None:
                h = self.layer(i)(h, cos, sin, layout, view, backend)
            else:
                h = infer_layer(plan[i], h, cos, sin, layout, view, backend)
            if i in want:
                tapped[i] = h.detach() if h.requires_grad else h
        missing = want - set(tapped)
        if missing:
            raise ValueError(f"tap layers {sorted(missing)} are not in this model/stage")
        out_logits = None
        if self.model.norm is not None:
            h = self.model.norm.forward(h) if fused else self.model.norm(h)
            if logits and self.lm_head is not None:
                rows = h if logits_index is None else h[logits_index]
                out_logits = self.compute_logits(rows, fused=fused)
        return ModelOutput(hidden=h, logits=out_logits, taps=tapped)
