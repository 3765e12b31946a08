"""An independent, functional EAGLE-3 forward that reads only a serving export.

``specrl export-draft --verify`` reloads the exported ``config.json`` + ``model.safetensors``
here — no :class:`~specrl.models.draft.Eagle3Draft`, no specrl attention — and compares logits
with the training module.  It follows the serving engines' formulation (vLLM's fused
add-and-norm with an explicit residual stream, target ids via ``d2t``) and plain dense causal
attention, so a key-name, transpose, norm-order or vocabulary-map mistake in the export shows up
as a logits mismatch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on [T, H, D] (no scaling; export-verify inputs use small positions)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.to(torch.float64)[:, None] * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-b, a], -1) * sin


class ExportedEagle3:
    """Exported weights + config; ``embed`` is the target's embedding table [V, H]."""

    def __init__(self, path: str | Path, embed: torch.Tensor) -> None:
        p = Path(path)
        self.cfg = json.loads((p / "config.json").read_text(encoding="utf-8"))
        self.w = {
            k: v.to(torch.float64) if v.is_floating_point() else v
            for k, v in load_file(str(p / "model.safetensors")).items()
        }
        self.embed = embed.detach().to(torch.float64)
        c = self.cfg
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or c["hidden_size"] // self.nh
        self.eps = c["rms_norm_eps"]

    def _layer(self, feat, ids, pos, past_k=None, past_v=None):
        """feat [T, H], ids [T], pos [T]; attends causally to past (cached) + these rows."""
        w, m = self.w, "midlayer."
        residual = feat
        x = torch.cat(
            [
                _rms(self.embed[ids], w[m + "input_layernorm.weight"], self.eps),
                _rms(feat, w[m + "hidden_norm.weight"], self.eps),
            ],
            -1,
        )
        t = x.shape[0]
        q = (x @ w[m + "self_attn.q_proj.weight"].T).view(t, self.nh, self.hd)
        k = (x @ w[m + "self_attn.k_proj.weight"].T).view(t, self.nkv, self.hd)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).view(t, self.nkv, self.hd)
        theta = self.cfg.get("rope_theta", 10000.0)
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        if past_k is not None:
            k, v = torch.cat([past_k, k]), torch.cat([past_v, v])
        kk = k.repeat_interleave(self.nh // self.nkv, 1)
        vv = v.repeat_interleave(self.nh // self.nkv, 1)
        s = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(self.hd)
        n_past = kk.shape[0] - t
        causal = torch.ones(t, kk.shape[0], dtype=torch.bool).tril(n_past)
        s = s.masked_fill(~causal, float("-inf"))
        o = torch.einsum("hts,shd->thd", s.softmax(-1), vv).reshape(t, -1)
        attn = o @ w[m + "self_attn.o_proj.weight"].T
        residual = attn + residual  # fused add + post_attention_layernorm
        h = _rms(residual, w[m + "post_attention_layernorm.weight"], self.eps)
        mlp = (
            F.silu(h @ w[m + "mlp.gate_proj.weight"].T) * (h @ w[m + "mlp.up_proj.weight"].T)
        ) @ w[m + "mlp.down_proj.weight"].T
        prenorm = mlp + residual
        return prenorm, k, v

    def target_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[T, V] over the target vocabulary (−inf outside the draft vocabulary)."""
        w = self.w
        logits = _rms(prenorm, w["norm.weight"], self.eps) @ w["lm_head.weight"].T
        ids = torch.arange(logits.shape[-1])  # no d2t: the draft vocabulary is the target's
        if "d2t" in w:
            ids = ids + w["d2t"].to(torch.int64)
        full = logits.new_full((logits.shape[0], self.embed.shape[0]), float("-inf"))
        full[:, ids] = logits
        return full

    def chain(self, taps: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Step 0 over a causal sequence, then ``steps − 1`` chained steps from its last index.

        Returns target-vocabulary logits: [T, V] for step 0, then [1, V] per chained step.
        """
        t = ids.shape[0]
        pos = torch.arange(t)
        feat = taps.to(torch.float64) @ self.w["fc.weight"].T
        h, k, v = self._layer(feat, ids, pos)
        out = [self.target_logits(h)]
        last = h[-1:]
        for j in range(1, steps):
            tok = out[-1][-1:].argmax(-1)
            last, k, v = self._layer(last, tok, torch.tensor([t - 1 + j]), k, v)
            out.append(self.target_logits(last))
        return out
