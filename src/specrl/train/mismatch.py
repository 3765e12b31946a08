"""Train/inference mismatch: |Δ log p| between the rollout engine's logprobs and the trainer's.

Every RL step, before the update, the trainer recomputes log π(token) of the rollout tokens
with its own forward (the policy that produced them: the engine was synced to it after the last
step) and compares it with what the engine reported for the same tokens
(``Result.logprobs``: the distribution each token was drawn from, temperature applied — the
behaviour log-probs the PPO ratio divides by).  Kernels, dtypes and batching differ between the
two, so the gap is small but never zero; a jump means the engine decodes other weights than the
trainer holds (a sync bug) or samples from another distribution.  vLLM users of every RL
framework watch this number.

Measured on at most :data:`MAX_SAMPLES` samples of the step (one extra no-grad forward of those,
on the rollout rank), reported as ``logp_gap_mean`` / ``logp_gap_max`` over their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specrl.models.decoder import Transformer
from specrl.train.batch import Sample, pack
from specrl.train.policy_loss import token_logprobs

MAX_SAMPLES = 16  # samples per step the gap is measured on (their tokens, all of them)


@torch.no_grad()
def logprob_gap(
    policy: Transformer,
    samples: Sequence[Sample],
    temperature: float,
    pad_id: int = 0,
    max_samples: int = MAX_SAMPLES,
) -> dict[str, float | None]:
    """Mean and max |trainer log p − engine log p| over the response tokens of the first
    ``max_samples`` samples (None when there are none)."""
    chosen = [s for s in samples if s.response][:max_samples]
    if not chosen:
        return {"logp_gap_mean": None, "logp_gap_max": None}
    batch = pack(chosen, policy.device, pad_id)
    was_training = policy.training
    policy.eval()
    try:
        logits = policy(batch.ids, batch.layout).logits.float()
    finally:
        policy.train(was_training)
    mine = token_logprobs(logits, batch.labels, temperature)
    on = batch.mask > 0
    gap = (mine[on] - batch.old_logp[on]).abs()
    return {"logp_gap_mean": float(gap.mean()), "logp_gap_max": float(gap.max())}
