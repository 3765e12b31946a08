"""Lossless speculative verification (the ratio test of Leviathan et al. and Chen et al., 2023),
batched over packed rows.

A sequence b with k_b draft tokens d_1..d_k feeds ``[x, d_1, …, d_k]`` to the target and gets
k_b + 1 rows of processed target distributions p_1..p_{k+1} (row j scores the token after the
j-th input).  Then, for i = 1..k:

- accept d_i with probability min(1, p_i(d_i) / q_i(d_i))  (test: u_i · q_i(d_i) < p_i(d_i));
- at the first rejection emit a **recovered** token from normalize(max(p_i − q_i, 0)) and stop;
- if all k are accepted emit a **bonus** token from p_{k+1}.

The emitted tokens then follow p exactly, whatever q is.  ``q`` is the distribution the draft
token was sampled from; ``draft_probs=None`` means one-hot q (n-gram and greedy drafts), so the
test is u < p(d) and the residual is p with d removed.  Greedy targets are one-hot p: a draft is
accepted iff it equals the argmax, and the recovered/bonus token is the argmax.  A sequence with
k_b = 0 is plain decoding: its single row emits a bonus token from p.

Shapes stay packed (``[R, V]``, R = Σ (k_b + 1)); only the small ``[B, K+1]`` index and
acceptance tables are padded.  Nothing here synchronizes with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specrl.rollout.sampling import sample_categorical


@dataclass
class VerifyOutput:
    """Emitted tokens per sequence: accepted drafts, then one recovered or bonus token."""

    tokens: torch.Tensor  # [B, K+1] int64; [b, :n_b] accepted drafts, [b, n_b] recovered/bonus
    num_accepted: torch.Tensor  # [B] int64, n_b ≤ k_b; emitted = n_b + 1 tokens


def verify(
    probs: torch.Tensor,  # [R, V] processed target distribution p of every verified row
    draft_tokens: torch.Tensor,  # [R] int64: the draft token scored at this row (d_{j+1} at row j)
    draft_probs: torch.Tensor | None,  # [R, V] q that draft token was drawn from; None: one-hot
    uniforms: torch.Tensor,  # [R, 2] U[0,1): col 0 acceptance test, col 1 recovered/bonus draw
    row_index: torch.Tensor,  # [B, K+1] int64 row of (sequence b, position j); padding: any row
    num_drafts: torch.Tensor,  # [B] int64 k_b; sequence b owns rows row_index[b, :k_b + 1]
) -> VerifyOutput:
    """Accept/reject every draft and draw the recovered or bonus token (see module docstring).

    ``draft_tokens`` and ``draft_probs`` are ignored on each sequence's last row (k_b).
    """
    k1 = row_index.shape[1]
    if k1 == 1:  # nobody drafted (plain step): each sequence emits a bonus token from p
        rows = row_index[:, 0]
        final = sample_categorical(probs[rows], uniforms[rows, 1])  # [B], as the general path
        return VerifyOutput(tokens=final[:, None], num_accepted=torch.zeros_like(num_drafts))
    p_draft = probs.gather(1, draft_tokens[:, None])[:, 0]  # [R] p_i(d_i)
    if draft_probs is None:
        accept_row = uniforms[:, 0] < p_draft  # q_i(d_i) = 1
    else:
        q_draft = draft_probs.gather(1, draft_tokens[:, None])[:, 0]  # [R] q_i(d_i)
        accept_row = uniforms[:, 0].to(q_draft.dtype) * q_draft < p_draft
    positions = torch.arange(k1, device=row_index.device)
    is_draft = positions[None, :] < num_drafts[:, None]  # [B, K+1]
    accepted = accept_row[row_index] & is_draft  # [B, K+1]
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B] leading accepts
    stop_row = row_index.gather(1, num_accepted[:, None])[:, 0]  # [B] first rejected or bonus row
    p_stop = probs[stop_row]  # [B, V]
    rejected = (num_accepted < num_drafts)[:, None]  # [B, 1]; False → bonus row, q = 0 there
    if draft_probs is None:
        q_stop = F.one_hot(draft_tokens[stop_row], probs.shape[1]).to(probs.dtype)  # [B, V]
    else:
        q_stop = draft_probs[stop_row].to(probs.dtype)
    residual = (p_stop - q_stop * rejected).clamp_min(0.0)  # [B, V] unnormalized
    # A rejection implies p(d) < q(d), hence positive residual mass; the fallback to p only
    # guards against that mass rounding to zero.
    dist = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_stop)
    final = sample_categorical(dist, uniforms[stop_row, 1])  # [B]
    tokens = draft_tokens[row_index].scatter(1, num_accepted[:, None], final[:, None])
    return VerifyOutput(tokens=tokens, num_accepted=num_accepted)


def emitted_logprobs(
    probs: torch.Tensor,  # [R, V] processed distribution p
    logits: torch.Tensor,  # [R, V] raw target logits
    row_index: torch.Tensor,  # [B, K+1]
    tokens: torch.Tensor,  # [B, K+1] emitted tokens (VerifyOutput.tokens)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(token), log softmax(logits)(token)) at every (b, j); [B, K+1] each.

    Entries past a sequence's emitted tokens are meaningless (padding).
    """
    sampled = probs[row_index, tokens].log()  # [B, K+1]
    policy = torch.log_softmax(logits, dim=-1)[row_index, tokens]  # [B, K+1]; one native op
    return sampled, policy


def decide(
    probs: torch.Tensor,  # [R, V] processed target distribution p of every verified row
    logits: torch.Tensor,  # [R, V] raw target logits
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    row_index: torch.Tensor,
    num_drafts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`verify` then :func:`emitted_logprobs`: (tokens [B, K+1], num_accepted [B],
    log p [B, K+1], policy log-softmax [B, K+1]), one function for the engine to compile."""
    ver = verify(probs, draft_tokens, draft_probs, uniforms, row_index, num_drafts)
    sampled, policy = emitted_logprobs(probs, logits, row_index, ver.tokens)
    return ver.tokens, ver.num_accepted, sampled, policy


def decide_plain(
    probs: torch.Tensor,  # [B, V] processed distribution p of each sequence's one row
    logits: torch.Tensor,  # [B, V] raw target logits
    uniforms: torch.Tensor,  # [B, 2] U[0,1); column 1 draws the token
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`decide` for a plain step whose rows are its sequences in order (nobody drafted,
    ``row_index`` = arange(B)[:, None]): the same draws and values without the row tables."""
    final = sample_categorical(probs, uniforms[:, 1])[:, None]  # [B, 1]
    sampled = probs.gather(1, final).log()
    policy = torch.log_softmax(logits, dim=-1).gather(1, final)
    return final, torch.zeros_like(final[:, 0]), sampled, policy


def decide_greedy(
    logits: torch.Tensor,  # [B, V] raw target logits of a plain step whose rows are all greedy
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`decide_plain` when every row is greedy: p is one-hot at the argmax (the first
    maximum, as ``sampling_probs``), so the draw is the argmax and log p is 0; p is never
    built."""
    final = logits.argmax(dim=-1, keepdim=True)  # [B, 1]
    policy = torch.log_softmax(logits, dim=-1).gather(1, final)
    return final, torch.zeros_like(final[:, 0]), torch.zeros_like(policy), policy
