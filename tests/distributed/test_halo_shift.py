"""``HaloShift`` (K-row halo exchange) equals the global TTT teacher shift, on real gloo groups.

One spawned group per cp size runs every case (packs × max_shift K × n = 1..K), float64:

- the halo shift of a zigzag shard whose pad rows carry random noise equals sharding the global
  ``shift_within_sequences`` exactly, for a [T, V] teacher and a [T] flag, and so does
  ``GatheredShift``;
- packs with a chunk shorter than K (1-token sequences, large cp) take the gather fallback, the
  others the halo path: both are exercised at every cp > 1;
- the halo path posts one ``batch_isend_irecv`` of four ops per tensor on every rank (none at
  cp = 1, none when falling back), however many n are asked for;
- the draft's TTT loss, metrics and gradients (draft parameters and taps) with ring TTT attention
  and ``HaloShift`` equal the single-process ones.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from specrl.core.attention import CPContext
from specrl.core.attention.layout import PackedLayout
from specrl.core.attention.zigzag import ZigzagPlan, shift_within_sequences
from specrl.core.distributed import spawn
from specrl.models.draft import Eagle3Draft
from specrl.train.ttt import (
    GatheredShift,
    HaloShift,
    TTTInputs,
    teacher_from_logits,
    ttt_inputs,
    ttt_loss,
)
from tests.distributed.test_ring_attention import _shard
from tests.unit.test_draft import V as TARGET_VOCAB
from tests.unit.test_draft import make_pair

pytestmark = pytest.mark.distributed

MAX_SHIFTS = (1, 3, 7)
VOCAB = 5  # teacher columns of the shift cases
DRAFT_PACK = [17, 25, 33, 19]  # chunks ≥ 3 rows up to cp = 4: the halo path at K = 3
DRAFT_STEPS = 3
TOL = 1e-10


def _packs(cp: int) -> list[list[int]]:
    """1-token, odd and short packs (fallback for K > 1 at cp > 1), a random one, a long one."""
    gen = torch.Generator().manual_seed(200 + cp)
    random_pack = torch.randint(1, 40, (5,), generator=gen).tolist()
    return [[1, 7, 13, 2], [11, 1, 24, 3, 5], random_pack, [57, 49, 63, 51, 64]]


def _expect_gathered(cp: int, lengths: list[int], k: int) -> bool:
    return cp > 1 and min(-(-n // (2 * cp)) for n in lengths) < k


def _run_shift_case(cp: CPContext, case_id: int, lengths: list[int], k: int, calls) -> list[str]:
    layout = PackedLayout.from_lengths(lengths)
    plan = ZigzagPlan.build(layout, cp.size, cp.rank)
    gen = torch.Generator().manual_seed(case_id)
    t = layout.num_tokens
    teacher = torch.randn(t, VOCAB, generator=gen, dtype=torch.float64)
    flag = (torch.rand(t, generator=gen) > 0.3).to(torch.float64)
    seed = 1000 * (cp.rank + 1) + case_id  # pad noise differs per rank
    local = {"teacher": _shard(plan, teacher, seed), "flag": _shard(plan, flag, seed + 1)}
    full = {"teacher": teacher, "flag": flag}

    name = f"cp={cp.size} rank={cp.rank} lengths={lengths} K={k}"
    halo = HaloShift(plan, layout, cp, max_shift=k)
    gathered = GatheredShift(plan, layout, cp)
    failures = []
    if halo.gathered != _expect_gathered(cp.size, lengths, k):
        failures.append(f"{name}: gathered={halo.gathered}")
    before = len(calls)
    for n in range(1, k + 1):
        for key, x in local.items():
            want = plan.shard(shift_within_sequences(full[key], layout, n, 0))
            got = halo(x, n)
            if got.shape != want.shape or not torch.equal(got, want):
                failures.append(f"{name} n={n} {key}: halo shift differs from the global shift")
            if not torch.equal(gathered(x, n), want):
                failures.append(f"{name} n={n} {key}: gathered shift differs")
    exchanges = calls[before:]
    expected = [] if halo.gathered or cp.size == 1 else [4, 4]  # one per tensor, four ops each
    if exchanges != expected:
        failures.append(f"{name}: batch_isend_irecv op counts {exchanges} != {expected}")
    for bad in (0, k + 1):
        try:
            halo(local["flag"], bad)
            failures.append(f"{name}: n={bad} accepted")
        except ValueError:
            pass
    return failures


def _draft_loss_and_grads(draft, taps, inputs, teacher, layout, cp=None, **loss_kw):
    """TTT loss of ``draft`` on ``taps`` ([T, 3H], leaf) and the gradients of loss.loss."""
    res = draft.ttt_forward(taps, inputs.step_ids, layout, cp=cp, mode="ring")
    loss = ttt_loss(res, teacher, inputs, layout, **loss_kw)
    params = [p for p in draft.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss.loss, [*params, taps])
    return loss, list(grads[:-1]), grads[-1]


def _run_draft_case(cp: CPContext) -> list[str]:
    """cp ranks with HaloShift vs one process: loss, metrics, parameter and tap gradients."""
    target, draft = make_pair()
    layout = PackedLayout.from_lengths(DRAFT_PACK)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, TARGET_VOCAB, (layout.num_tokens,), generator=gen)
    mask = (torch.rand(layout.num_tokens, generator=gen) > 0.2).to(torch.float64)
    with torch.no_grad():
        out = target(ids, layout, taps=draft.config.tap_layers)
    taps = Eagle3Draft.concat_taps(out.taps, draft.config.tap_layers)  # [T, 3H]
    inputs = ttt_inputs(ids, mask, layout, DRAFT_STEPS)
    ref, ref_params, ref_taps = _draft_loss_and_grads(
        draft,
        taps.clone().requires_grad_(),
        inputs,
        teacher_from_logits(out.logits, draft),
        layout,
    )

    plan = ZigzagPlan.build(layout, cp.size, cp.rank)
    seed = 77 * (cp.rank + 1)
    local_inputs = TTTInputs(
        torch.stack([plan.shard(x) for x in inputs.step_ids]),  # [K, T_local]
        torch.stack([plan.shard(x) for x in inputs.step_mask]),
    )
    shift = HaloShift(plan, layout, cp, max_shift=DRAFT_STEPS)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        if cp.size > 1:
            dist.all_reduce(t, group=cp.group)
        return t

    loss, params, local_taps = _draft_loss_and_grads(
        draft,
        _shard(plan, taps, seed).requires_grad_(),
        local_inputs,
        teacher_from_logits(_shard(plan, out.logits, seed + 1), draft),  # noisy pad logits
        plan.local,
        cp=cp if cp.size > 1 else None,
        shift=shift,
        reduce=reduce,
    )
    total = reduce(loss.loss.detach().clone())
    name = f"draft cp={cp.size} rank={cp.rank}"
    failures = [f"{name}: fell back to the gather"] if shift.gathered else []
    errors = {
        "loss": total - ref.loss.detach(),
        "step_loss": torch.tensor(loss.step_loss) - torch.tensor(ref.step_loss),
        "acc": torch.tensor(loss.acc) - torch.tensor(ref.acc),
        "count": torch.tensor(loss.count) - torch.tensor(ref.count),
        "taps grad": local_taps - plan.shard(ref_taps),
    }
    for i, (g, want) in enumerate(zip(params, ref_params, strict=True)):
        errors[f"param {i} grad"] = reduce(g.clone()) - want
    for key, err in errors.items():
        worst = err.abs().max().item()
        if not worst <= TOL:  # also catches NaN
            failures.append(f"{name}: {key} max error {worst:.3e} > {TOL:.0e}")
    if not any(g.abs().sum() > 0 for g in ref_params):
        failures.append(f"{name}: reference gradients are all zero")
    return failures


def _worker(rank: int, world: int) -> dict:
    cp = CPContext.from_group(dist.group.WORLD)
    calls: list[int] = []  # ops per batch_isend_irecv call, in order
    original = dist.batch_isend_irecv

    def counting(ops):
        calls.append(len(ops))
        return original(ops)

    dist.batch_isend_irecv = counting
    failures, paths = [], set()
    for case_id, (lengths, k) in enumerate(itertools.product(_packs(world), MAX_SHIFTS)):
        failures += _run_shift_case(cp, case_id, lengths, k, calls)
        paths.add(_expect_gathered(world, lengths, k))
    dist.batch_isend_irecv = original
    failures += _run_draft_case(cp)
    return {"failures": failures, "calls": calls, "paths": paths}


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_halo_shift_equals_global_shift(cp: int) -> None:
    results = spawn(_worker, cp, timeout=240, threads=1)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:20])
    # the same point-to-point batches on every rank (else gloo/NCCL deadlock)
    assert all(r["calls"] == results[0]["calls"] for r in results)
    assert results[0]["paths"] == ({False} if cp == 1 else {False, True})
