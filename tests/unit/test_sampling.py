"""Processed sampling distributions (temperature, top-k, top-p, greedy) and the sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specrl.rollout.sampling import (
    RowParams,
    SamplingParams,
    sample_categorical,
    sampling_probs,
    sequence_generator,
)


def _probs(logits: torch.Tensor, *params: SamplingParams) -> torch.Tensor:
    rp = RowParams.build(list(params), [1] * len(params), "cpu")
    return sampling_probs(logits, rp)


def test_temperature_matches_scaled_softmax():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p = _probs(logits, *(SamplingParams(temperature=t) for t in (0.5, 1.0, 2.0)))
    for row, t in enumerate((0.5, 1.0, 2.0)):
        torch.testing.assert_close(p[row], torch.softmax(logits[row] / t, -1))


def test_greedy_is_one_hot_at_first_argmax():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [2.0, 0.0, 1.0, 2.0]])
    p = _probs(logits, SamplingParams(temperature=0), SamplingParams(temperature=0))
    assert p.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_top_k_keeps_exactly_the_k_most_likely():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0, 3.0]])
    p = _probs(logits, SamplingParams(top_k=3))[0]
    assert (p > 0).nonzero().flatten().tolist() == [1, 3, 5]
    torch.testing.assert_close(p[[1, 3, 5]], torch.softmax(torch.tensor([5.0, 4.0, 3.0]), -1))


def test_top_p_keeps_smallest_prefix_reaching_the_mass():
    base = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64)
    logits = base.log()[None]
    # 0.5 < 0.6 → need the second token; 0.75 ≥ 0.6 → stop there
    p = _probs(logits, SamplingParams(top_p=0.6))[0]
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0], dtype=torch.float64))
    # a mass below the first token's keeps only it
    assert _probs(logits, SamplingParams(top_p=0.45))[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    # top_p = 1 is off even with a zero-probability tail
    torch.testing.assert_close(_probs(logits, SamplingParams(top_p=1.0))[0], base)


def test_top_k_then_top_p_on_the_renormalized_distribution():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64).log()[None]
    # top-2 renormalized: [4/7, 3/7]; top_p 0.5 keeps only the first
    p = _probs(logits, SamplingParams(top_k=2, top_p=0.5))[0]
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_mixed_rows_equal_rows_processed_alone():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=gen, dtype=torch.float64)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0),
    ]
    together = _probs(logits, *params)
    for i, p in enumerate(params):
        torch.testing.assert_close(together[i], _probs(logits[i : i + 1], p)[0])


def test_sampler_matches_distribution_and_never_draws_zero_weight():
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0, 0.0], dtype=torch.float64)
    n = 50_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    draws = sample_categorical(weights.expand(n, -1), u)
    counts = np.bincount(draws.numpy(), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    support = weights > 0
    expected = (weights[support] / weights.sum() * n).numpy()
    assert stats.chisquare(counts[support.numpy()], expected).pvalue > 0.01


def test_sampler_edges_of_the_unit_interval():
    weights = torch.tensor([[0.0, 1.0, 1.0, 0.0]] * 3)
    u = torch.tensor([0.0, 0.5, np.nextafter(np.float32(1), np.float32(0))])
    assert sample_categorical(weights, u).tolist() == [1, 2, 2]


def test_sequence_generators_are_reproducible_and_independent():
    a = torch.rand(4, generator=sequence_generator(7, 0))
    assert torch.equal(a, torch.rand(4, generator=sequence_generator(7, 0)))
    assert not torch.equal(a, torch.rand(4, generator=sequence_generator(7, 1)))
    assert not torch.equal(a, torch.rand(4, generator=sequence_generator(8, 0)))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"stop_token_ids": (100,)}, "stop token"),
        ({"stop": ("",)}, "stop strings"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate(vocab_size=50)
