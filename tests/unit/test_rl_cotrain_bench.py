"""benchmarks/rl_cotrain.py's summaries: where speculation ran in a wave, which targets a subset
of modes decides, and the ``--modes`` check."""

from __future__ import annotations

import sys

import pytest
from benchmarks import rl_cotrain


def test_wave_shares_counts_rl_steps_engine_steps_and_the_tail():
    recs = [
        # peak 64: engine steps with ≤ 16 live are the tail (1 + 3 + 2 = 6 of 10 steps)
        {"tau": 1.8, "live_batch": [[64, 0, 4], [16, 0, 1], [4, 4, 3], [1, 1, 2]]},
        # no drafts at all: τ is null; peak 8, tail ≤ 2 live (1 step)
        {"tau": None, "live_batch": [[8, 0, 5], [2, 0, 1]]},
    ]
    got = rl_cotrain.wave_shares(recs)
    assert got["rl_steps_drafting"] == 0.5
    assert got["engine_steps_drafting"] == pytest.approx(5 / 16)
    assert got["tail_share"] == pytest.approx(7 / 16)
    assert got["tail_steps_drafting"] == pytest.approx(5 / 7)


def test_wave_shares_without_waves_has_no_engine_shares():
    got = rl_cotrain.wave_shares([{"tau": None}])
    assert got == {
        "rl_steps_drafting": 0.0,
        "engine_steps_drafting": None,
        "tail_share": None,
        "tail_steps_drafting": None,
    }


def _row(mode: str, rollout_s: float, **kw) -> dict:
    base = {
        "mode": mode,
        "reward_start": 0.4,
        "reward_end": 0.5,
        "draft_tau_start": 2.0,
        "draft_tau_end": 2.1,
        "rollout_s": rollout_s,
        "step_s": rollout_s + 1.0,
        "policy_update_s": 1.0,
        "draft_update_s": 0.05,
    }
    return {**base, **kw}


def test_targets_of_cotrain_against_none_only_leave_frozen_out():
    by = {"cotrain": _row("cotrain", 0.8), "none": _row("none", 1.0)}
    recs = {
        "cotrain": [{"time_rollout": t} for t in (0.8, 0.7, 0.9)],
        "none": [{"time_rollout": t} for t in (1.0, 1.0, 1.0)],
    }
    got = rl_cotrain.targets_met(by, recs)
    assert not any("frozen" in k for k in got)
    met, measured = got["rollout time cotrain ≤ 0.85 × none (issue 31, long tail)"]
    assert met and measured == "0.80× (per-step median 0.80×)"
    assert not got["rollout time cotrain ≤ 0.6 × none (issue 7)"][0]
    assert got["draft update ≤ 10 % of policy update"] == (True, "5%")


@pytest.mark.parametrize("modes", ["none,frozen", "cotrain", "cotrain,cotrain", "cotrain,plain"])
def test_modes_need_cotrain_and_a_baseline(modes, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["rl_cotrain.py", "--modes", modes])
    with pytest.raises(SystemExit) as exc:
        rl_cotrain.main()
    assert exc.value.code == 2
    assert "--modes" in capsys.readouterr().err
