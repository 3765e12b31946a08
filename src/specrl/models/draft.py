"""EAGLE-3 draft head (docs/draft.md): fc over three target taps, one decoder layer, reduced vocab.

Structure (names are those of the serving format, so export is a rename-free copy)::

    fc            Linear(3·H_target → H)             taps (low, mid, high) concatenated per position
    midlayer      input_layernorm(embed) ‖ hidden_norm(feature) → q/k/v (2H in) → o_proj (→ H)
                  residual = the feature before its norm; then post_attention_layernorm + SwiGLU
    norm          RMSNorm(H)
    lm_head       Linear(H → draft_vocab)             over the reduced draft vocabulary
    d2t, t2d      draft id i ↦ target id i + d2t[i];  t2d: bool mask over the target vocabulary

The token embedding is the *target's*, frozen inside the draft; RL moves the policy's embedding,
so :meth:`Eagle3Draft.refresh_embedding` copies (or shares) the current one.  The pre-norm output
``h`` of a step is the feature of the next step.

Two ways to run it:

- training-time test (:meth:`Eagle3Draft.ttt_forward`): K unrolled steps over a packed batch,
  step k attending causally to the step-0 keys of its sequence plus its own branch keys
  (``core.attention.ttt``; or the dense reference for tests), optionally context-parallel;
- decoding (:meth:`Eagle3Draft.decode`): the same layer with a slot KV cache whose main entries
  are step-0 keys of real positions and whose tail holds the current speculative chain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specrl.core.attention import PackedLayout, attention, dense_attention
from specrl.core.attention.ttt import CPContext, Mode, ttt_session
from specrl.models.config import ModelConfig
from specrl.models.decoder import (
    MLP,
    CacheBatch,
    KVCache,
    RMSNorm,
    Rotary,
    apply_rope,
    rope_heads,
)
from specrl.models.fused import DraftPlan, project


@dataclass
class DraftConfig:
    """Shape of an EAGLE-3 draft and its link to the target (taps, vocabularies)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    tap_layers: tuple[int, ...]  # specrl convention: output of target decoder layer X (0-based)
    target_num_layers: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.tap_layers = tuple(int(i) for i in self.tap_layers)
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if len(self.tap_layers) != 3:
            raise ValueError(f"EAGLE-3 needs exactly 3 tap layers, got {list(self.tap_layers)}")
        if list(self.tap_layers) != sorted(self.tap_layers):
            raise ValueError(f"tap layers must be ascending, got {list(self.tap_layers)}")
        bad = [i for i in self.tap_layers if not 0 <= i < self.target_num_layers]
        if bad:
            raise ValueError(
                f"tap layers {bad} out of range for a {self.target_num_layers}-layer target "
                f"(valid: 0..{self.target_num_layers - 1}, output-of-layer convention)"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        *,
        draft_vocab_size: int | None = None,
        tap_layers: Sequence[int] | None = None,
        **over: Any,
    ) -> DraftConfig:
        """A draft shaped like one layer of ``target`` (the usual EAGLE-3 choice)."""
        from specrl.models.config import default_tap_layers

        fields = dict(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            target_hidden_size=target.hidden_size,
            tap_layers=tuple(tap_layers or default_tap_layers(target.num_hidden_layers)),
            target_num_layers=target.num_hidden_layers,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
        )
        fields.update(over)
        return cls(**fields)

    def rope_config(self) -> ModelConfig:
        """The attention/RoPE shape as a ModelConfig (for Rotary and KV caches)."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tap_layers": list(self.tap_layers),
            "target_num_layers": self.target_num_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
        }


class DraftAttention(nn.Module):
    """q/k/v from the 2H concatenation (embedding ‖ feature); o_proj back to H."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k (RoPE applied), v."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def attn_input(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(feat)], dim=-1)  # [T, 2H]

    def finish(self, feat: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual (the un-normed feature) + o_proj, then the MLP block → pre-norm h [T, H]."""
        t = attn_out.shape[0]
        h = feat + self.self_attn.o_proj(attn_out.reshape(t, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class TTTOutput:
    logits: list[torch.Tensor]  # K × [T, draft_vocab] (float32, or float64 for float64 drafts)
    hidden: list[torch.Tensor]  # K × [T, H] pre-norm outputs


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.rotary = Rotary(cfg.rope_config())
        self._plan = DraftPlan()  # the decoding path's copies (specrl.models.fused)

    # ------------------------------------------------------------------ vocab / embedding
    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """Install the draft vocabulary: ``draft_to_target`` [Vd] ascending target ids."""
        ids = draft_to_target.to(torch.int64).cpu()
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} ids, got {ids.numel()}")
        if not torch.all(ids[1:] > ids[:-1]) or ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError("draft vocabulary ids must be unique, ascending and in range")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.t2d.copy_(t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:  # [Vd] target id of each draft id
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def refresh_embedding(self, target_embedding: torch.Tensor, *, share: bool = False) -> None:
        """Copy (or share by reference) the current target embedding [V, H]; stays frozen."""
        if tuple(target_embedding.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding {tuple(target_embedding.shape)} does not fit the draft's "
                f"{tuple(self.embed_tokens.weight.shape)}"
            )
        if share:
            self.embed_tokens.weight = nn.Parameter(target_embedding.detach(), requires_grad=False)
        else:
            self.embed_tokens.weight.copy_(target_embedding.detach())

    # --------------------------------------------------------------------------- pieces
    def logits(self, h: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """Pre-norm hidden [T, H] → draft-vocabulary logits [T, Vd] (float32 / float64);
        ``fused``: through the decoding path's copies (no autograd)."""
        if fused:
            _need_no_grad()
            c = self._plan.get(self)
            w = c.norm_weights[3]
            y = F.rms_norm(h, w.shape, w, c.eps) if h.dtype == c.norm_dtype else c.norms[3](h)
            out = project(y, c.lm_head, None, None, c.transposed)
        else:
            out = self.lm_head(self.norm(h))
        return out if out.dtype == torch.float64 else out.float()

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """Concatenated taps [T, 3·H_target] → step-0 feature [T, H]."""
        return self.fc(taps.to(self.fc.weight.dtype))

    @staticmethod
    def concat_taps(taps: dict[int, torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
        return torch.cat([taps[i] for i in layers], dim=-1)  # [T, 3·H_target]

    # ---------------------------------------------------------------- training-time test
    def ttt_forward(
        self,
        taps: torch.Tensor,  # [T, 3·H_target] concatenated taps (ascending layer order)
        step_ids: torch.Tensor,  # [K, T] token input of step k at index t (= x_{t+k+1})
        layout: PackedLayout,  # global position ids (zigzag-local under CP)
        *,
        attn: str = "efficient",  # "efficient" (core.attention.ttt) | "reference" (dense)
        cp: CPContext | None = None,
        mode: Mode = "ring",
        kernel: str = "torch",
    ) -> TTTOutput:
        """K unrolled draft steps with branch attention; returns logits and pre-norm h per step."""
        layer = self.midlayer
        attn_mod = layer.self_attn
        steps = step_ids.shape[0]
        feat = self.project(taps)
        scale = 1.0 / math.sqrt(attn_mod.head_dim)
        session = None
        main_k = main_v = None
        branch_k: list[torch.Tensor] = []
        branch_v: list[torch.Tensor] = []
        logits, hidden = [], []
        for k in range(steps):
            cos, sin = self.rotary.cos_sin(layout.position_ids + k, feat.dtype)
            x = layer.attn_input(self.embed_tokens(step_ids[k]), feat)
            q, kk, vv = attn_mod.qkv(x, cos, sin)
            if k == 0:
                main_k, main_v = kk, vv
                if attn == "efficient":
                    session = ttt_session(
                        kk, vv, layout, cp=cp, mode=mode, kernel=kernel, scale=scale
                    )
            else:
                branch_k.append(kk)
                branch_v.append(vv)
            if attn == "efficient":
                # per-step branch tensors, never re-stacked: O(K) saved memory, not O(K²)
                out = session.attend(q, list(branch_k) or None, list(branch_v) or None)
            elif attn == "reference":
                if cp is not None and cp.size > 1:
                    raise ValueError("the dense reference runs single-process only")
                bk = torch.stack(branch_k) if branch_k else None
                bv = torch.stack(branch_v) if branch_v else None
                out, _ = dense_attention(
                    q, main_k, main_v, layout, branch_k=bk, branch_v=bv, scale=scale
                )
            else:
                raise ValueError(f"unknown TTT attention path {attn!r}")
            feat = layer.finish(feat, out)
            hidden.append(feat)
            logits.append(self.logits(feat))
        return TTTOutput(logits, hidden)

    # ----------------------------------------------------------------------- decoding
    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache(
            self.config.rope_config(),
            num_slots,
            max_len,
            layer_ids=[0],
            dtype=self.fc.weight.dtype,
            device=self.fc.weight.device,
        )

    def decode(
        self,
        feat: torch.Tensor,  # [T, H] step-0 features (project(taps)) or chain features (prev h)
        ids: torch.Tensor,  # [T] token input at each new index
        layout: PackedLayout,  # new tokens per sequence
        cache: CacheBatch,  # draft cache: rows are RoPE positions (main entries, then chain)
        fused: bool | None = None,
    ) -> torch.Tensor:
        """One draft layer pass over new cache rows; returns pre-norm h [T, H].

        The cache row of index t at chain step j is t + j (= its RoPE position), so the main
        entries of real positions are followed by the current chain, exactly the TTT branch mask.
        ``fused``: the fused q|k|v and gate|up projections; default: when autograd is off
        (inference).  A compiled caller passes False (the fused copies are kept on the host).
        """
        cache.prepare(layout, feat.dtype, None)
        # positions = cache rows, below max_kv_len
        cos, sin = self.rotary.cos_sin(cache.rows[1], feat.dtype, cache.max_kv_len - 1)
        if fused is None:
            fused = not torch.is_grad_enabled()  # decoding is inference: fused projections
        if fused:
            _need_no_grad()
            return self._decode_fused(feat, ids, layout, cache, cos, sin)
        layer = self.midlayer
        x = layer.attn_input(self.embed_tokens(ids), feat)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        out = attention(q, k, v, layout, cache=cache.view(0))
        return layer.finish(feat, out)

    def _decode_fused(
        self,
        feat: torch.Tensor,
        ids: torch.Tensor,
        layout: PackedLayout,
        cache: CacheBatch,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`decode` from the draft's resolved copies (:class:`DraftPlan`): one q|k|v
        projection, one RoPE pass, o_proj and down_proj with their residual added in the GEMM,
        gate|up as one projection; same math, no module lookups."""
        (emb, norms, ws, norm_dtype, eps, qkv, o_w, gate_up, down, _, heads, inter, tr) = (
            self._plan.get(self)
        )
        hq, hkv, d = heads
        t = feat.shape[0]
        e = F.embedding(ids, emb)
        e = F.rms_norm(e, ws[0].shape, ws[0], eps) if e.dtype == norm_dtype else norms[0](e)
        f = (
            F.rms_norm(feat, ws[1].shape, ws[1], eps)
            if feat.dtype == norm_dtype
            else norms[1](feat)
        )
        x = torch.cat([e, f], dim=-1)  # [T, 2H]
        qkv_out = project(x, qkv, None, None, tr).view(t, hq + 2 * hkv, d)
        q, k, v = rope_heads(qkv_out, hq, hkv, cos, sin)
        out = attention(q, k, v, layout, cache=cache.view(0))
        h = project(out.reshape(t, hq * d), o_w, None, feat, tr)
        w = ws[2]
        y = F.rms_norm(h, w.shape, w, eps) if h.dtype == norm_dtype else norms[2](h)
        gate, up = project(y, gate_up, None, None, tr).split(inter, dim=-1)
        return project(F.silu(gate).mul_(up), down, None, h, tr)


def _need_no_grad() -> None:
    """The decoding copies are detached: a fused pass under autograd would drop gradients."""
    if torch.is_grad_enabled():
        raise RuntimeError("the draft's fused decoding path needs torch.no_grad()")


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Top-``draft_vocab_size`` target ids by count, sorted by id (``d2t``/``t2d`` derive from it).

    ``counts`` [V]: token frequencies under the loss mask.  Ties break toward lower ids; if fewer
    tokens were seen than the draft vocabulary holds, the rest is filled with the lowest unseen
    ids, so the map always has exactly ``draft_vocab_size`` entries.
    """
    v = counts.numel()
    if not 1 <= draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size must be in 1..{v}, got {draft_vocab_size}")
    # stable sort by descending count keeps lower ids first among ties
    order = torch.sort(-counts.to(torch.float64), stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def init_from_target_layer(draft: Eagle3Draft, layer: nn.Module, seed: int = 0) -> None:
    """Initialise the midlayer from a target decoder layer of the same shape.

    q/k/v take the target weights on the feature half of their 2H input and small random weights
    on the embedding half; o_proj, the MLP and the norms are copied.
    """
    mid = draft.midlayer
    h = draft.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            src = getattr(layer.self_attn, name).weight
            dst = getattr(mid.self_attn, name).weight
            if dst.shape != (src.shape[0], 2 * src.shape[1]) or src.shape[1] != h:
                raise ValueError(f"target layer {name} {tuple(src.shape)} does not fit the draft")
            noise = torch.randn(src.shape, generator=gen, dtype=torch.float32) * 0.02
            dst.copy_(torch.cat([noise.to(dst.dtype), src.to(dst.dtype)], dim=1))
        mid.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mid.mlp, name).weight.copy_(getattr(layer.mlp, name).weight)
        mid.input_layernorm.weight.copy_(layer.input_layernorm.weight)
        mid.hidden_norm.weight.copy_(layer.input_layernorm.weight)
        mid.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)


def init_draft_weights(draft: Eagle3Draft, seed: int = 0, std: float = 0.02) -> Eagle3Draft:
    """Random init of the trainable parts (normal(0, std), norms at one); embedding untouched."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith("embed_tokens"):
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
    return draft
