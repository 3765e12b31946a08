"""The rollout wave in the metrics record: response-length quantiles, live batch, its plot."""

from __future__ import annotations

import json

import pytest

from specrl.rollout.types import Result, Results
from specrl.train.experience import run_lengths, wave_metrics
from specrl.train.plots import plot_waves


def _results(lengths: list[int], wave: list[list[int]] | None) -> Results:
    out = [
        Result(
            request_id="r",
            index=i,
            prompt_tokens=[1],
            tokens=[3] * n,
            text="",
            logprobs=[0.0] * n,
            policy_logprobs=[0.0] * n,
            finish_reason="length",
            stop_reason=None,
            spec={},
            policy_versions=(0, 0),
        )
        for i, n in enumerate(lengths)
    ]
    return Results(out, {"wave": wave} if wave is not None else {})


def test_run_lengths_folds_equal_neighbours():
    assert run_lengths([(4, 0), (4, 0), (3, 3), (3, 3), (3, 2), (4, 0)]) == [
        [4, 0, 2],
        [3, 3, 2],
        [3, 2, 1],
        [4, 0, 1],
    ]
    assert run_lengths([]) == []


def test_wave_metrics_quantiles_and_live_batch():
    lengths = [5, 1, 9, 3, 7, 2, 8, 4, 6, 100]  # 1..9 and a tail of 100
    m = wave_metrics(_results(lengths, [[10, 0], [10, 0], [2, 1]]))
    # nearest rank: p50 is the 5th of 10 sorted, p90 the 9th
    assert (m["response_len_p50"], m["response_len_p90"], m["response_len_max"]) == (5, 9, 100)
    assert m["live_batch"] == [[10, 0, 2], [2, 1, 1]]
    assert wave_metrics(None) == {}
    assert "live_batch" not in wave_metrics(_results([3], None))  # an engine without waves
    assert wave_metrics(_results([4], None))["response_len_p90"] == 4


def test_plot_waves_writes_a_png(tmp_path):
    recs = [
        {"step": s, "response_len_p50": 10, "response_len_p90": 30, "response_len_max": 90 + s,
         "live_batch": [[8, 0, 1], [8, 0, 5], [3, 0, 10], [1, 1, 60]]}
        for s in range(1, 6)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    path = plot_waves(tmp_path)
    assert path == tmp_path / "rollout_wave.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0}) + "\n")
    assert plot_waves(tmp_path, out=tmp_path / "none.png") is None


@pytest.mark.parametrize("waves", [1, 3])
def test_plot_waves_picks_spread_steps(tmp_path, waves):
    recs = [{"step": s, "live_batch": [[2, 1, 3]]} for s in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert plot_waves(tmp_path, waves=waves).stat().st_size > 0
