"""ParallelDims: degrees validated against the world size, rank grid, named group rank lists."""

from __future__ import annotations

import itertools

import pytest

from specrl.core.parallel import GROUP_NAMES, ParallelDims
from specrl.errors import LayoutError


def test_mismatch_names_every_factor():
    with pytest.raises(LayoutError) as err:
        ParallelDims(world_size=8, dp=2, cp=2, pp=3)
    msg = str(err.value)
    assert "dp × cp × pp = 2 × 2 × 3 = 12" in msg
    assert "world size 8" in msg
    assert err.value.hint


@pytest.mark.parametrize("bad", [{"dp": 0}, {"cp": -1}, {"pp": 0}, {"virtual_stages": 0}])
def test_non_positive_degrees_rejected(bad):
    with pytest.raises(LayoutError, match="positive integers"):
        ParallelDims(world_size=1, **bad)


def test_layers_must_fill_every_stage():
    dims = ParallelDims(world_size=4, pp=4, virtual_stages=2)
    assert dims.num_stages == 8
    dims.check_layers(8)
    with pytest.raises(LayoutError, match="4 × 2 = 8 pipeline stages"):
        dims.check_layers(7)


@pytest.mark.parametrize("dp,cp,pp", [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (3, 1, 2)])
def test_rank_grid_round_trip_and_order(dp, cp, pp):
    dims = ParallelDims(world_size=dp * cp * pp, dp=dp, cp=cp, pp=pp)
    seen = set()
    for p, d, c in itertools.product(range(pp), range(dp), range(cp)):
        r = dims.rank(p, d, c)
        coords = dims.coords(r)
        assert (coords.pp, coords.dp, coords.cp) == (p, d, c)
        seen.add(r)
    assert seen == set(range(dims.world_size))
    # cp innermost: the ranks of a ring are neighbours; pp outermost
    assert dims.rank(0, 0, 1 % cp) == (1 % cp)
    assert dims.rank(pp - 1, 0, 0) == (pp - 1) * dp * cp


@pytest.mark.parametrize("dp,cp,pp", [(2, 2, 2), (1, 2, 4), (3, 1, 2)])
def test_group_rank_lists_partition_the_world(dp, cp, pp):
    dims = ParallelDims(world_size=dp * cp * pp, dp=dp, cp=cp, pp=pp)
    sizes = {"pp": pp, "dp": dp, "cp": cp, "dp_cp": dp * cp}
    varying = {"pp": {"pp"}, "dp": {"dp"}, "cp": {"cp"}, "dp_cp": {"dp", "cp"}}
    for name in GROUP_NAMES:
        lists = dims.group_ranks(name)
        flat = sorted(r for ranks in lists for r in ranks)
        assert flat == list(range(dims.world_size)), name
        assert all(len(ranks) == sizes[name] for ranks in lists), name
        for ranks in lists:
            coords = [dims.coords(r) for r in ranks]
            for f in ("pp", "dp", "cp"):
                values = {getattr(c, f) for c in coords}
                assert len(values) == (sizes[f] if f in varying[name] else 1), (name, f)
    # pipelines list their ranks in stage order
    for ranks in dims.group_ranks("pp"):
        assert [dims.coords(r).pp for r in ranks] == list(range(pp))
    with pytest.raises(ValueError, match="unknown group"):
        dims.group_ranks("tp")  # type: ignore[arg-type]
