"""The headline rollout benchmark runs end to end on the engine as it is (``--quick``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_rollout_benchmark_quick_run_writes_every_variant(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "rollout.json"
    cmd = [sys.executable, "benchmarks/rollout.py", "--target", str(target), "--draft", str(draft)]
    cmd += ["--quick", "--max-tokens", "8", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    body = json.loads(out.read_text())
    assert body["meta"]["command"].startswith("python benchmarks/rollout.py")
    rows = {(r["batch"], r["variant"]): r for r in body["rows"]}
    for batch in (1, 8):
        for variant in ("specrl plain", "specrl ngram", "specrl eagle3", "specrl best-of-N"):
            assert rows[batch, variant]["tok_s"] > 0
        assert rows[batch, "hf plain"]["tok_s"] > 0
    assert rows[8, "hf prompt lookup"]["tok_s"] is None  # transformers: batch 1 only
    assert {t["target"] for t in body["targets"]} >= {"best-of-N / plain at B=1"}
    assert "targets" in done.stdout


def test_rollout_benchmark_decoupled_variant(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "rollout.json"
    cmd = [sys.executable, "benchmarks/rollout.py", "--target", str(target), "--draft", str(draft)]
    cmd += ["--quick", "--max-tokens", "8", "--out", str(out), "--decoupled"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    refused = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "--clock wall" in refused.stderr  # a CPU clock misses it
    done = subprocess.run(
        [*cmd, "--clock", "wall"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    body = json.loads(out.read_text())
    rows = {(r["batch"], r["variant"]): r for r in body["rows"]}
    assert all(rows[b, "specrl decoupled best-of-N"]["tok_s"] > 0 for b in (1, 8))
    assert body["config"]["drafter"] == "process"  # the default: its own process on CPU
    assert body["config"]["threads"]["decoupled"] == {
        "target": 1,
        "drafter": 1,
        "target in plain and coupled steps": 1,
    }
    names = {t["target"] for t in body["targets"]}
    assert {"decoupled / serial best-of-N at B=1", "decoupled best-of-N / plain at B=8"} <= names


@pytest.mark.parametrize("interleave", ["step", "call"])
def test_cold_engine_benchmark_runs_fresh_engines_in_turns(tiny_pair, tmp_path, interleave):
    target, draft = tiny_pair
    out = tmp_path / "cold.json"
    cmd = [sys.executable, "benchmarks/cold_engine.py", "--target", str(target)]
    cmd += ["--draft", str(draft), "--quick", "--prompts", "12", "--max-tokens", "8"]
    cmd += ["--interleave", interleave, "--clock", "wall", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    body = json.loads(out.read_text())
    assert body["interleave"] == interleave
    rows = {(r["batch"], r["variant"]): r for r in body["rows"]}
    assert set(rows) == {(b, v) for b in (1, 8) for v in ("plain", "best-of-N", "plain again")}
    for row in rows.values():  # greedy: every engine emits the plain engine's tokens
        assert row["exact"] and row["tok_s"] > 0
    assert all(rows[b, "plain"]["vs_plain"] == 1 for b in (1, 8))
