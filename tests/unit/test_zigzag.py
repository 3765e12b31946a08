"""Zigzag sharding and the ring's step-case table, checked against the true packed causal mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrl.core.attention.blocks import segments
from specrl.core.attention.layout import PackedLayout
from specrl.core.attention.ring import BlockSpec, RingGeometry, step_case
from specrl.core.attention.zigzag import ZigzagPlan, shift_within_sequences, shifted_steps

lengths_st = st.lists(st.integers(0, 23), min_size=1, max_size=6).filter(lambda x: sum(x) > 0)
cp_st = st.integers(1, 4)


def _naive_zigzag(lengths: list[int], cp: int, rank: int) -> list[tuple[int, int]]:
    """(sequence, padded position) of every local token, written out by hand."""
    out = []
    for b, n in enumerate(lengths):
        c = -(-n // (2 * cp))
        for chunk in (rank, 2 * cp - 1 - rank):
            out += [(b, chunk * c + w) for w in range(c)]
    return out


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, cp=cp_st)
def test_shard_unshard_round_trip(lengths: list[int], cp: int) -> None:
    layout = PackedLayout.from_lengths(lengths)
    x = torch.randn(layout.num_tokens, 3, 2)
    plans = [ZigzagPlan.build(layout, cp, r) for r in range(cp)]
    shards = [p.shard(x, fill=7.0) for p in plans]
    assert torch.equal(plans[0].unshard(shards), x)
    assert torch.equal(plans[0].unshard(torch.cat(shards)), x)
    for p, s in zip(plans, shards, strict=True):
        assert s.shape[0] == p.num_local == p.num_padded // cp
        assert torch.all(s[~p.valid] == 7.0)
    # every real token is held exactly once
    assert sum(int(p.valid.sum()) for p in plans) == layout.num_tokens


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, cp=cp_st)
def test_local_layout_is_the_zigzag_of_the_padded_batch(lengths: list[int], cp: int) -> None:
    layout = PackedLayout.from_lengths(lengths)
    padded = [-(-n // (2 * cp)) * 2 * cp for n in lengths]
    for rank in range(cp):
        plan = ZigzagPlan.build(layout, cp, rank)
        naive = _naive_zigzag(lengths, cp, rank)
        assert plan.local.seq_ids.tolist() == [b for b, _ in naive]
        assert plan.local.position_ids.tolist() == [pos for _, pos in naive]  # global, pads too
        assert plan.valid.tolist() == [pos < lengths[b] for b, pos in naive]
        cu_padded = torch.tensor([0, *padded]).cumsum(0)
        assert torch.equal(plan.local.cu_seqlens, cu_padded // cp)
        assert plan.local.max_seqlen == max(padded) // cp
        assert plan.padded_lengths.tolist() == padded


def test_position_ids_follow_the_global_layout() -> None:
    layout = PackedLayout.from_lengths([3, 5])
    layout.position_ids = layout.position_ids + 100  # e.g. a continued sequence
    plan = ZigzagPlan.build(layout, 2, 1)
    # rank 1 holds chunks 1 and 2 of each sequence (c = 1 and 2): pads continue the positions
    assert plan.local.position_ids.tolist() == [101, 102, 102, 103, 104, 105]
    assert plan.valid.tolist() == [True, True, True, True, True, False]


@pytest.mark.parametrize(("cp", "rank"), [(0, 0), (2, 2), (2, -1)])
def test_bad_rank_is_rejected(cp: int, rank: int) -> None:
    with pytest.raises(ValueError, match="rank"):
        ZigzagPlan.build(PackedLayout.from_lengths([4]), cp, rank)


def _pairs(spec: BlockSpec, n_q: int, n_k: int) -> torch.Tensor:
    """[n_q, n_k] int: which (local query, key row) pairs a kernel call computes."""
    q_rows = torch.arange(n_q) if spec.q_rows is None else spec.q_rows
    k_rows = torch.arange(n_k) if spec.kv_rows is None else spec.kv_rows
    sq, oq = segments(spec.cu_q, len(q_rows))
    sk, ok = segments(spec.cu_k, len(k_rows))
    allowed = sq[:, None] == sk[None, :]
    if spec.causal:
        allowed &= ok[None, :] <= oq[:, None]
    out = torch.zeros(n_q, n_k, dtype=torch.int64)
    out[q_rows[:, None], k_rows[None, :]] = allowed.long()
    return out


def _true_mask(q_plan: ZigzagPlan, k_plans: list[ZigzagPlan]) -> torch.Tensor:
    """Packed causal mask on global padded positions between q_plan's tokens and k_plans'."""
    seq_k = torch.cat([p.local.seq_ids for p in k_plans])
    pos_k = torch.cat([p.local.position_ids for p in k_plans])
    seq_q, pos_q = q_plan.local.seq_ids, q_plan.local.position_ids
    return ((seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])).long()


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, cp=cp_st)
def test_step_cases_compute_exactly_the_causal_mask(lengths: list[int], cp: int) -> None:
    layout = PackedLayout.from_lengths(lengths)
    plans = [ZigzagPlan.build(layout, cp, r) for r in range(cp)]
    n = plans[0].num_local
    work = torch.zeros(cp, cp, dtype=torch.int64)  # [rank, step] query-key pairs
    for r in range(cp):
        geometry = RingGeometry(plans[r].local, cp, r)
        for src in range(cp):
            spec = geometry.ring_block(src)
            assert (spec.causal, spec.q_rows is None, spec.kv_rows is None) == {
                "diagonal": (True, True, True),
                "front": (False, True, False),
                "back": (False, False, True),
            }[step_case(r, src)]
            got = _pairs(spec, n, n)
            assert torch.equal(got, _true_mask(plans[r], [plans[src]])), (r, src)
            work[r, (r - src) % cp] = got.sum()
    # load balance: every rank computes the same number of pairs at every ring step
    assert torch.all(work == work[:1])


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, cp=cp_st)
def test_gathered_blocks_compute_exactly_the_causal_mask(lengths: list[int], cp: int) -> None:
    layout = PackedLayout.from_lengths(lengths)
    plans = [ZigzagPlan.build(layout, cp, r) for r in range(cp)]
    n = plans[0].num_local
    for r in range(cp):
        blocks = RingGeometry(plans[r].local, cp, r).gathered_blocks()
        assert len(blocks) <= 3
        got = sum(_pairs(spec, n, cp * n) for spec in blocks)
        assert torch.equal(got, _true_mask(plans[r], plans)), r  # also: no pair counted twice


def test_ring_geometry_rejects_an_unsharded_layout() -> None:
    with pytest.raises(ValueError, match=r"ZigzagPlan\.local"):
        RingGeometry(PackedLayout.from_lengths([3, 4]), 2, 0)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, k=st.integers(0, 5))
def test_shift_stays_inside_each_sequence(lengths: list[int], k: int) -> None:
    layout = PackedLayout.from_lengths(lengths)
    x = torch.arange(layout.num_tokens) + 1
    expected = []
    start = 0
    for n in lengths:
        expected += [start + t + k + 1 if t + k < n else 0 for t in range(n)]
        start += n
    assert shift_within_sequences(x, layout, k).tolist() == expected
    mask = torch.ones(layout.num_tokens, dtype=torch.bool)
    shifted = shift_within_sequences(mask, layout, k, fill=False)
    assert shifted.dtype == torch.bool
    assert shifted.tolist() == [e != 0 for e in expected]  # the shifted-out tail has mask 0


def test_shifted_steps_stack_every_shift() -> None:
    layout = PackedLayout.from_lengths([3, 2])
    x = torch.tensor([[1, 10], [2, 20], [3, 30], [4, 40], [5, 50]])
    steps = shifted_steps(x, layout, 3, fill=-1)
    assert steps.shape == (3, 5, 2)
    assert steps[:, :, 0].tolist() == [[1, 2, 3, 4, 5], [2, 3, -1, 5, -1], [3, -1, -1, -1, -1]]
    with pytest.raises(ValueError, match="shift"):
        shift_within_sequences(x, layout, -1)
