"""Losslessness of speculative verification, tested statistically on many packed verifications.

Each test verifies tens of thousands of independent drafts at once against fixed target rows
p_1..p_{K+1} (V = 6 tokens) and draft rows q_1..q_K.  Because p does not depend on earlier
tokens here, the token emitted at position i (among verifications that reached it) must follow
p_i exactly: a chi-square test per position must not reject at 1 %.  Deliberately lossy
verifiers fail the same test, so it has power.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specrl.rollout.sampling import RowParams, SamplingParams, sample_categorical, sampling_probs
from specrl.rollout.verify import decide, decide_greedy, decide_plain, verify

V, K = 6, 3
SIGNIFICANCE = 0.01


def _rows(gen: torch.Generator, n: int) -> torch.Tensor:
    """n distributions over V tokens drawn from a flat Dirichlet; [n, V] float64."""
    x = -torch.rand(n, V, generator=gen, dtype=torch.float64).log()
    return x / x.sum(-1, keepdim=True)


def _target_and_draft(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = _rows(gen, K + 1)  # [K+1, V]
    q = 0.75 * p[:K] + 0.25 * _rows(gen, K)  # [K, V], α = Σ min(p, q) ≥ 0.75
    return p, q


def _batch(p: torch.Tensor, q: torch.Tensor | None, ks: torch.Tensor, seed: int, fixed=None):
    """Packed inputs of N verifications; draft tokens drawn from q (or ``fixed`` one-hot)."""
    gen = torch.Generator().manual_seed(seed)
    n = ks.numel()
    rows = ks + 1
    starts = torch.cumsum(rows, 0) - rows  # [N]
    total = int(rows.sum())
    seq = torch.repeat_interleave(torch.arange(n), rows)  # [R]
    pos = torch.arange(total) - starts[seq]  # [R] position j within its verification
    draft_pos = pos.clamp_max(K - 1)
    if fixed is not None:
        draft_tokens = torch.tensor(fixed)[draft_pos]
        draft_probs = None
    else:
        u = torch.rand(total, generator=gen, dtype=torch.float64)
        draft_tokens = sample_categorical(q[draft_pos], u)
        draft_probs = q[draft_pos]
    return {
        "probs": p[pos],
        "draft_tokens": draft_tokens,
        "draft_probs": draft_probs,
        "uniforms": torch.rand(total, 2, generator=gen, dtype=torch.float64),
        "row_index": starts[:, None] + torch.minimum(torch.arange(K + 1)[None, :], ks[:, None]),
        "num_drafts": ks,
    }


def _per_position(tokens, num_accepted, ks, p) -> list[tuple[float, int, int]]:
    """(chi-square p-value, samples, draws outside p's support) for positions 0..K."""
    out = []
    for i in range(K + 1):
        reached = (ks >= i) & (num_accepted >= i)
        obs = np.bincount(tokens[reached, i].numpy(), minlength=V)
        support = (p[i] > 0).numpy()
        n = int(obs.sum())
        expected = p[i].numpy() * n
        big = support & (expected >= 5)  # cells expecting < 5 draws are pooled into one
        small = support & ~big
        f_obs = np.append(obs[big], obs[small].sum()) if small.any() else obs[big]
        f_exp = np.append(expected[big], expected[small].sum()) if small.any() else expected[big]
        pvalue = stats.chisquare(f_obs, f_exp).pvalue if len(f_obs) > 1 else 1.0
        out.append((float(pvalue), n, int(obs[~support].sum())))
    return out


def _lossy_verify(probs, draft_tokens, draft_probs, uniforms, row_index, num_drafts, *, kind):
    """Two classic mistakes: a lenient acceptance test, or recovering from p instead of p − q."""
    p_d = probs.gather(1, draft_tokens[:, None])[:, 0]
    q_d = draft_probs.gather(1, draft_tokens[:, None])[:, 0]
    ok = p_d >= 0.5 * q_d if kind == "lenient" else uniforms[:, 0] * q_d < p_d
    valid = torch.arange(K + 1)[None, :] < num_drafts[:, None]
    accepted = ok[row_index] & valid
    n_acc = accepted.long().cumprod(1).sum(1)
    stop = row_index.gather(1, n_acc[:, None])[:, 0]
    rejected = (n_acc < num_drafts)[:, None]
    if kind == "no_residual":
        dist = probs[stop]
    else:
        dist = (probs[stop] - draft_probs[stop] * rejected).clamp_min(0)
    final = sample_categorical(dist, uniforms[stop, 1])
    tokens = draft_tokens[row_index].scatter(1, n_acc[:, None], final[:, None])
    return tokens, n_acc


def test_sampled_drafts_are_lossless_at_every_position():
    p, q = _target_and_draft(0)
    ks = torch.full((60_000,), K)
    out = verify(**_batch(p, q, ks, seed=1))
    results = _per_position(out.tokens, out.num_accepted, ks, p)
    for i, (pvalue, n, outside) in enumerate(results):
        assert n >= 20_000, f"position {i}: only {n} samples"
        assert outside == 0
        assert pvalue > SIGNIFICANCE, f"position {i}: chi-square p = {pvalue:.2e}"


def test_acceptance_rate_equals_one_minus_total_variation():
    p, q = _target_and_draft(2)
    ks = torch.full((40_000,), K)
    out = verify(**_batch(p, q, ks, seed=3))
    alpha = torch.minimum(p[0], q[0]).sum().item()  # P(d_1 accepted)
    accepted_first = int((out.num_accepted >= 1).sum())
    assert stats.binomtest(accepted_first, ks.numel(), alpha).pvalue > SIGNIFICANCE


def test_variable_k_per_sequence_is_lossless():
    p, q = _target_and_draft(4)
    ks = torch.randint(0, K + 1, (120_000,), generator=torch.Generator().manual_seed(5))
    out = verify(**_batch(p, q, ks, seed=6))
    assert bool((out.num_accepted <= ks).all())
    for i, (pvalue, n, outside) in enumerate(_per_position(out.tokens, out.num_accepted, ks, p)):
        assert n >= 10_000 and outside == 0
        assert pvalue > SIGNIFICANCE, f"position {i}: chi-square p = {pvalue:.2e}"


def test_one_hot_drafts_are_lossless():
    """n-gram drafts: fixed tokens, q one-hot (draft_probs=None)."""
    p, _ = _target_and_draft(7)
    p = 0.5 * p + 0.5 * torch.nn.functional.one_hot(p.argmax(-1), V)  # a clear favourite
    ks = torch.full((60_000,), K)
    second = int(p[2].argsort()[-2])  # mostly rejected: exercises the residual
    fixed = [int(p[0].argmax()), int(p[1].argmax()), second]
    out = verify(**_batch(p, None, ks, seed=8, fixed=fixed))
    results = _per_position(out.tokens, out.num_accepted, ks, p)
    assert all(n >= 20_000 for _, n, _ in results[:3])
    for i, (pvalue, _, outside) in enumerate(results):
        assert outside == 0
        assert pvalue > SIGNIFICANCE, f"position {i}: chi-square p = {pvalue:.2e}"


def test_none_draft_probs_equal_explicit_one_hot():
    p, q = _target_and_draft(9)
    ks = torch.randint(0, K + 1, (5_000,), generator=torch.Generator().manual_seed(10))
    batch = _batch(p, q, ks, seed=11)
    implicit = verify(**{**batch, "draft_probs": None})
    explicit = verify(
        **{**batch, "draft_probs": torch.nn.functional.one_hot(batch["draft_tokens"], V).double()}
    )
    assert torch.equal(implicit.tokens, explicit.tokens)
    assert torch.equal(implicit.num_accepted, explicit.num_accepted)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=3),
        SamplingParams(temperature=1.2, top_p=0.7),
        SamplingParams(temperature=0.9, top_k=4, top_p=0.8),
    ],
    ids=["top_k", "top_p", "top_k+top_p"],
)
def test_lossless_after_top_k_top_p(params):
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(K + 1, V, generator=gen, dtype=torch.float64) * 1.5
    p = sampling_probs(logits, RowParams.build([params], [K + 1], "cpu"))  # zeros outside
    # full support: drafts outside p's support must always be rejected
    q = 0.75 * p[:K] + 0.25 * _rows(gen, K)
    ks = torch.full((60_000,), K)
    out = verify(**_batch(p, q, ks, seed=14))
    for i, (pvalue, n, outside) in enumerate(_per_position(out.tokens, out.num_accepted, ks, p)):
        assert n >= 20_000 and outside == 0
        assert pvalue > SIGNIFICANCE, f"position {i}: chi-square p = {pvalue:.2e}"


def test_greedy_target_accepts_exactly_the_argmax_prefix():
    logits = torch.randn(K + 1, V, generator=torch.Generator().manual_seed(15))
    p = sampling_probs(logits, RowParams.build([SamplingParams(temperature=0)], [K + 1], "cpu"))
    best = logits.argmax(-1)  # [K+1]
    _, q = _target_and_draft(16)
    ks = torch.full((2_000,), K)
    batch = _batch(p.double(), q, ks, seed=17)
    out = verify(**batch)
    drafts = batch["draft_tokens"][batch["row_index"]][:, :K]  # [N, K]
    matches = (drafts == best[:K]).long().cumprod(1).sum(1)
    assert torch.equal(out.num_accepted, matches)
    for b in range(200):
        n = int(out.num_accepted[b])
        assert out.tokens[b, : n + 1].tolist() == best[: n + 1].tolist()


@pytest.mark.parametrize("kind", ["lenient", "no_residual"])
def test_lossy_verifiers_are_rejected(kind):
    p, q = _target_and_draft(0)
    ks = torch.full((50_000,), K)
    tokens, n_acc = _lossy_verify(**_batch(p, q, ks, seed=1), kind=kind)
    worst = min(
        pvalue if outside == 0 else 0.0
        for pvalue, _, outside in _per_position(tokens, n_acc, ks, p)
    )
    assert worst < SIGNIFICANCE


@pytest.mark.parametrize("greedy", [False, True])
def test_plain_decide_equals_the_general_decide_on_identity_rows(greedy):
    """The engine's plain-step shortcut draws the same tokens and log-probabilities as
    ``decide`` with one row per sequence (``row_index`` = arange), bit for bit."""
    gen = torch.Generator().manual_seed(3)
    b, v = 7, 23
    logits = torch.randn(b, v, generator=gen, dtype=torch.float64) * 3
    logits[0, 5] = logits[0, 2] = logits[0].max() + 1  # a tie: the first maximum wins
    temps = [0.0 if greedy else 0.5 + i / 10 for i in range(b)]
    rp = RowParams.build([SamplingParams(8, t) for t in temps], [1] * b, torch.device("cpu"))
    probs = sampling_probs(logits, rp)
    uniforms = torch.rand(b, 2, generator=gen)
    rows = torch.arange(b)[:, None]
    zeros = torch.zeros(b, dtype=torch.int64)
    want = decide(probs, logits, zeros, None, uniforms, rows, zeros)
    shortcuts = [decide_plain(probs, logits, uniforms)]
    if greedy:  # all rows greedy: the argmax without building p
        shortcuts.append(decide_greedy(logits))
    for got in shortcuts:
        for a, w in zip(got, want, strict=True):
            assert a.shape == w.shape and a.dtype == w.dtype
            assert torch.equal(a, w)
