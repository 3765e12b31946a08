"""Per-request sampling: parameters, the processed target distribution, and the categorical sampler.

Every token the engine emits is drawn from the *processed* distribution of its row:

    p = softmax(top_p(top_k(logits / temperature)))          (temperature > 0)
    p = one_hot(argmax(logits))                              (temperature == 0, greedy)

in that order (temperature, then top-k, then top-p; vLLM's order).  Speculative verification
(:mod:`specrl.rollout.verify`) uses the same ``p``, so the output follows it exactly.

Two logprobs are reported per emitted token, and they are different things:

- ``logprobs``: log p(token) under the processed distribution above, the one the token was
  actually drawn from (greedy → 0.0).  This is what a sampler-level check compares against.
- ``policy_logprobs``: log softmax(logits)(token), the raw policy at temperature 1 with no
  filtering.  RL importance ratios π_new/π_old need the policy's own distribution: use these.

Randomness: one ``torch.Generator`` per sequence (seeded from the request's seed and the sample
index), consumed as two uniforms per verified row, so a seeded request does not depend on the
random state of other requests.  Sampling is by inverse CDF on one uniform (``sample_categorical``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded (OpenAI-style names; ``n`` samples share the prompt)."""

    max_tokens: int = 64  # generated tokens at most (stop token included)
    temperature: float = 1.0  # 0 → greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 → off
    top_k: int = 0  # keep the k most likely tokens; 0 → off
    seed: int | None = None  # None → drawn from the engine's seeded stream
    n: int = 1  # samples of this prompt (a GRPO group)
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens (the model's eos always stops)
    stop: tuple[str, ...] = field(default=())  # stop strings (text is cut before them)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad field."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be ≥ 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be ≥ 0 (0 disables it), got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be ≥ 1, got {self.n}")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sequence_generator(
    seed: int, index: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    """The generator of sample ``index`` of a request seeded with ``seed`` (independent streams)."""
    state = np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, index]).generate_state(2)
    g = torch.Generator(device=device)
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


@dataclass
class RowParams:
    """Sampling parameters of R logit rows as device tensors, plus host flags that pick the path."""

    temperature: torch.Tensor  # [R] float, 1 on greedy rows (their math is replaced)
    top_k: torch.Tensor  # [R] int64, 0 = off
    top_p: torch.Tensor  # [R] float, 1 = off
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    any_greedy: bool
    any_filter: bool

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], rows: Sequence[int], device: torch.device | str
    ) -> RowParams:
        """``rows[i]`` logit rows use ``params[i]``."""
        temp, top_k, top_p, greedy = [], [], [], []
        for p, n in zip(params, rows, strict=True):
            temp += [p.temperature if p.temperature > 0 else 1.0] * n
            top_k += [p.top_k] * n
            top_p += [p.top_p] * n
            greedy += [p.greedy] * n
        return cls(
            temperature=torch.tensor(temp, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_filter=any((p.top_k > 0 or p.top_p < 1) and not p.greedy for p in params),
        )


def filter_top_k_top_p(
    scaled: torch.Tensor,  # [R, V] temperature-scaled logits
    top_k: torch.Tensor,  # [R] int64, 0 = off
    top_p: torch.Tensor,  # [R] float in (0, 1], 1 = off
) -> torch.Tensor:
    """Set the logits outside each row's top-k and then its top-p nucleus to −inf; [R, V].

    Top-k keeps exactly k tokens (ties broken by sort order); top-p keeps the smallest prefix of
    the top-k-renormalized distribution (sorted by probability) whose mass reaches ``top_p``.
    """
    v = scaled.shape[-1]
    sorted_x, order = scaled.sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(v, device=scaled.device)
    k_eff = torch.where(top_k > 0, top_k.clamp_max(v), torch.full_like(top_k, v))
    sorted_x = sorted_x.masked_fill(rank[None, :] >= k_eff[:, None], float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [R, V] mass of strictly more likely tokens
    cut = (mass_before >= top_p[:, None].to(probs.dtype)) & (top_p[:, None] < 1)
    sorted_x = sorted_x.masked_fill(cut, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_x)


def sampling_probs(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """The processed distribution p of each row (see the module docstring); [R, V]."""
    if rp.all_greedy:
        return _one_hot_argmax(logits)
    scaled = logits / rp.temperature[:, None].to(logits.dtype)
    if rp.any_filter:
        scaled = filter_top_k_top_p(scaled, rp.top_k, rp.top_p)
    probs = torch.softmax(scaled, dim=-1)
    if rp.any_greedy:
        probs = torch.where(rp.greedy[:, None], _one_hot_argmax(logits), probs)
    return probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """One-hot rows at ``argmax`` (first maximum on ties, exactly like plain greedy decoding)."""
    out = torch.zeros_like(logits)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def sample_categorical(
    weights: torch.Tensor,  # [N, V] non-negative, each row with positive mass (need not sum to 1)
    u: torch.Tensor,  # [N] uniforms in [0, 1)
) -> torch.Tensor:
    """Inverse-CDF draw per row: the token whose cumulative-mass interval holds ``u · total``; [N].

    Tokens of zero weight are never returned (the search is for the first cdf value strictly
    above the point, and the point stays strictly below the row total).
    """
    cdf = weights.to(torch.float64).cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:]
    point = torch.minimum(u.to(torch.float64)[:, None] * total, torch.nextafter(total, total * 0))
    idx = torch.searchsorted(cdf, point, right=True)[:, 0]
    return idx.clamp_max(weights.shape[-1] - 1)
