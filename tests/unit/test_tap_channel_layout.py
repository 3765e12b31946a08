"""Stage layouts and TapChannel routing: who produces each tap, which links exist, slot depths."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from specrl.core.pipeline import StageLayout, tap_slot_depth
from specrl.core.transport import TapPlan
from specrl.errors import LayoutError


def plan_for(num_layers: int, pp: int, virtual: int, taps) -> TapPlan:
    layout = StageLayout.balanced(num_layers, pp, virtual)
    return TapPlan.build(taps, layout.stage_layers, layout.stage_ranks)


@pytest.mark.parametrize("layers,pp,v", [(8, 2, 1), (8, 4, 2), (7, 2, 2), (9, 4, 1), (3, 3, 1)])
def test_balanced_layout_is_contiguous_and_even(layers, pp, v):
    layout = StageLayout.balanced(layers, pp, v)
    assert layout.num_stages == pp * v and layout.virtual_stages == v
    flat = [i for stage in layout.stage_layers for i in stage]
    assert flat == list(range(layers))
    sizes = [len(stage) for stage in layout.stage_layers]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    # loop placement: rank r runs stages r, r + pp, …
    assert layout.stage_ranks == tuple(s % pp for s in range(pp * v))
    for r in range(pp):
        assert layout.rank_stages(r) == tuple(range(r, pp * v, pp))


def test_too_few_layers_for_the_stages():
    with pytest.raises(LayoutError, match="2 × 2 = 4 pipeline stages"):
        StageLayout.balanced(3, 2, 2)


def test_plan_pp2_plain_split():
    plan = plan_for(8, 2, 1, (1, 3, 6))  # stages: 0..3 | 4..7
    assert plan.consumer_stage == 1 and plan.consumer_rank == 1
    assert [plan.stage_of(i) for i in (1, 3, 6)] == [0, 0, 1]
    assert plan.remote_stages == (0,) and plan.layers_of(0) == (1, 3)
    assert plan.local_layers == (6,)


def test_plan_interleaved_chunk_owns_the_layer():
    # pp = 2, two chunks per rank: stages (0,1) (2,3) (4,5) (6,7) on ranks 0 1 0 1
    plan = plan_for(8, 2, 2, (1, 3, 6))
    assert [plan.stage_of(i) for i in (1, 3, 6)] == [0, 1, 3]
    # layer 3 lives on the draft's rank but in its *other* chunk: still local, no link
    assert plan.local_layers == (3, 6) and plan.remote_stages == (0,)
    # two chunks of rank 0 produce taps: one link each (a chunk, not a rank, owns a layer)
    plan = plan_for(8, 2, 2, (1, 4, 7))
    assert plan.remote_stages == (0, 2)
    assert {plan.stage_ranks[s] for s in plan.remote_stages} == {0}
    assert plan.local_layers == (7,)


def test_plan_pp4_interleaved_no_tap_on_the_last_stage():
    plan = plan_for(8, 4, 2, (1, 4, 6))  # one layer per stage, stage s on rank s % 4
    assert plan.consumer_stage == 7 and plan.consumer_rank == 3
    assert plan.remote_stages == (1, 4, 6) and plan.local_layers == ()
    assert "tap 4: stage 4 on pipeline rank 0 (link stage 4 → 7)" in plan.describe()


def test_plan_validation():
    with pytest.raises(LayoutError, match="owned by no pipeline stage"):
        TapPlan.build((1, 9), ((0, 1), (2, 3)), (0, 1))
    with pytest.raises(LayoutError, match="owned by stages 0 and 1"):
        TapPlan.build((1,), ((0, 1), (1, 2)), (0, 1))
    with pytest.raises(LayoutError, match="distinct"):
        TapPlan.build((1, 1), ((0, 1), (2, 3)), (0, 1))
    with pytest.raises(LayoutError, match="stage ranks"):
        TapPlan.build((1,), ((0, 1), (2, 3)), (0,))
    with pytest.raises(ValueError, match="not a tap layer"):
        plan_for(8, 2, 1, (1, 3, 6)).stage_of(2)


class Action(NamedTuple):
    stage_index: int
    computation_type: str
    microbatch_index: int


def order(text: str) -> list[Action | None]:
    """'0F0 0F1 _ 0B0' → actions (``_``: an idle step)."""
    out: list[Action | None] = []
    for tok in text.split():
        if tok == "_":
            out.append(None)
            continue
        kind = next(c for c in tok if c.isalpha())
        stage, mb = tok.split(kind)
        out.append(Action(int(stage), kind, int(mb)))
    return out


def test_slot_depth_gpipe_holds_every_microbatch():
    gpipe = {0: order("0F0 0F1 0F2 0F3 _ _ 0B0 0B1 0B2 0B3")}
    assert tap_slot_depth(gpipe, 0, 0, 4) == 4


def test_slot_depth_1f1b_is_bounded_by_warmup():
    # stage 0 of a 2-rank 1F1B: two warm-up forwards, then one forward per backward
    one_f_one_b = {0: order("0F0 0F1 _ 0B0 0F2 0B1 0F3 0B2 0B3")}
    assert tap_slot_depth(one_f_one_b, 0, 0, 4) == 2
    # an input-only backward (I) of a later stage on the same rank frees slots as well
    interleaved = {0: order("0F0 0F1 2F0 2F1 2I0 0F2 2I1 0F3")}
    assert tap_slot_depth(interleaved, 0, 0, 4) == 2
    assert tap_slot_depth(interleaved, 2, 0, 4) == 2
    assert tap_slot_depth(one_f_one_b, 0, 0, 1) == 1  # never more than the microbatches
