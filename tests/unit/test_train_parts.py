"""The trainer's parts outside its loop: recipe checks before any process group, one update's
metrics from its minibatches', a rank's checkpointed state, the rollout counters' sum."""

from __future__ import annotations

import random

import pytest
import torch

from specrl.config.loader import load_recipe
from specrl.config.schema import Recipe
from specrl.core.runtime import UnitClock
from specrl.errors import ConfigError
from specrl.train.artifacts import check_artifacts
from specrl.train.experience import COUNTERS, sum_counters
from specrl.train.metrics import merge_minibatches
from specrl.train.parallelize import check_backend
from specrl.train.state_io import load_trainer_state, trainer_state
from tests.conftest import REPO


def _recipe(tmp_path, *sets: str) -> Recipe:
    return load_recipe(
        REPO / "recipes/tests/tiny.yaml",
        Recipe,
        [
            f"run.out_dir={tmp_path / 'run'}",
            f"policy.path={tmp_path / 'target'}",
            f"draft.path={tmp_path / 'draft'}",
            *sets,
        ],
    )


def test_eagle3_without_a_draft_is_refused_before_the_layout(tmp_path):
    recipe = _recipe(tmp_path, "draft.mode=none")
    with pytest.raises(ConfigError, match=r"proposers has 'eagle3' but draft\.mode is 'none'"):
        check_artifacts(recipe, "tiny.yaml")
    check_artifacts(_recipe(tmp_path), "tiny.yaml")  # the recipe as shipped passes


def test_the_vllm_backend_needs_a_single_process(tmp_path):
    recipe = _recipe(tmp_path, "rollout.backend=vllm", "parallel.dp=2")
    with pytest.raises(ConfigError, match="needs dp = cp = pp = 1"):
        check_backend(recipe)
    check_backend(_recipe(tmp_path, "rollout.backend=vllm"))
    check_backend(_recipe(tmp_path, "parallel.dp=2"))  # the embedded engine: any layout


def test_minibatch_metrics_merge():
    recs = [
        {"loss": 1.0, "time_policy_update": 0.5, "draft_acc": [1.0, 0.5], "draft_loss": None},
        {"loss": 3.0, "time_policy_update": 0.25, "draft_acc": [0.0, 0.5], "draft_loss": 2.0},
    ]
    assert merge_minibatches(recs) == {
        "loss": 2.0,
        "time_policy_update": 0.75,  # times add up
        "draft_acc": [0.5, 0.5],  # per draft position
        "draft_loss": 2.0,  # over the minibatches that report it
    }


def test_counters_are_summed_in_their_order_missing_ones_zero():
    seen = []

    def sum_(t: torch.Tensor) -> torch.Tensor:  # a two-replica all-reduce
        seen.append(t.dtype)
        return t * 2

    summed = sum_counters({"count": 3, "accepted": 5}, sum_)
    assert list(summed) == list(COUNTERS) and seen == [torch.float64]
    assert summed["count"] == 6 and summed["accepted"] == 10 and summed["drafts"] == 0


def _optimizer(seed: int) -> torch.optim.Optimizer:
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    return opt


def test_a_ranks_state_round_trips(tmp_path):
    saved, prompt_rng = _optimizer(0), random.Random(5)
    prompt_rng.random()
    torch.manual_seed(11)
    random.seed(12)
    tensors, meta = trainer_state(7, {"policy": saved}, prompt_rng, engine={"v": 1}, clock=3.0)
    expect = (torch.rand(2), random.random(), prompt_rng.random())
    assert meta["step"] == 7 and meta["engine"] == {"v": 1} and meta["clock"] == 3.0

    restored, other_rng = _optimizer(1), random.Random(0)
    load_trainer_state(tmp_path, tensors, meta, {"policy": restored}, other_rng)
    assert torch.equal(torch.rand(2), expect[0]) and random.random() == expect[1]
    assert other_rng.random() == expect[2]
    a, b = saved.state_dict(), restored.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(a["state"][0][key], b["state"][0][key])

    with pytest.raises(ConfigError, match="has no draft optimizer"):
        load_trainer_state(tmp_path, tensors, meta, {"draft": _optimizer(2)}, other_rng)


def test_the_unit_clock_counts_readings_and_resumes():
    clock = UnitClock()
    assert (clock(), clock(), clock.state()) == (1.0, 2.0, 2.0)
    assert UnitClock(clock.state())() == 3.0
