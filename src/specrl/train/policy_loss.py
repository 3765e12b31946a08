"""The policy objective: PPO-style clipped surrogate with clip-higher, token-level normalisation.

For response token t of sample i with advantage A_i, new log-prob ℓ_t (from the packed training
forward, logits / temperature) and behaviour log-prob ℓ_t^old (what the rollout engine sampled
with):

    ρ_t = exp(ℓ_t − ℓ_t^old)
    L_t = −min(ρ_t · A_i, clip(ρ_t, 1 − ε_low, 1 + ε_high) · A_i)
    loss = Σ_t L_t / N_tokens     (token-level: every token weighs the same, DAPO)

plus, when ``kl_coef > 0``, β · KL(π_θ ‖ π_ref) per token with the non-negative k3 estimator
``exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1``.  ``normalizer`` is the global token count so data-parallel
ranks sum to the single-process loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # scalar (this rank's share of the global mean)
    clip_frac: float  # tokens whose ratio was clipped
    kl: float  # mean k3 KL to the reference (0 when off)
    ratio_mean: float
    entropy_proxy: float  # mean −ℓ over response tokens (sampled-token NLL)
    tokens: float  # response tokens of this call (the count behind the means)

    def sums(self) -> list[float]:
        """[clipped, kl, ratio, nll, tokens] summed over the tokens: add these across ranks or
        microbatches and divide by the summed tokens for the global means."""
        n = self.tokens
        return [self.clip_frac * n, self.kl * n, self.ratio_mean * n, self.entropy_proxy * n, n]


def token_logprobs(
    logits: torch.Tensor,  # [T, V] float32 (rows predict the next token)
    targets: torch.Tensor,  # [T] next tokens
    temperature: float = 1.0,
) -> torch.Tensor:  # [T]
    """log π(target | prefix) of every row, with the sampling temperature applied."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1)


def clipped_policy_loss(
    logp: torch.Tensor,  # [T] new log-probs (with grad)
    old_logp: torch.Tensor,  # [T] behaviour log-probs
    advantages: torch.Tensor,  # [T] advantage of the sample each token belongs to
    mask: torch.Tensor,  # [T] 1 for response tokens
    *,
    clip_low: float,
    clip_high: float,
    normalizer: float,
    ref_logp: torch.Tensor | None = None,  # [T]
    kl_coef: float = 0.0,
) -> PolicyLoss:
    m = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    kl_val = 0.0
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
        kl_val = float((kl.detach() * m).sum() / m.sum().clamp(min=1))
    loss = (per_token * m).sum() / max(normalizer, 1.0)
    with torch.no_grad():
        tokens = float(m.sum())
        n = m.sum().clamp(min=1)
        clip_frac = float(((clipped != unclipped).to(m.dtype) * m).sum() / n)
        ratio_mean = float((ratio * m).sum() / n)
        ent = float((-logp.detach() * m).sum() / n)
    return PolicyLoss(loss, clip_frac, kl_val, ratio_mean, ent, tokens)
