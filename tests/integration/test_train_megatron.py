"""`specrl train` with ``policy.backend=megatron`` end to end: ``torchrun --nproc-per-node 2 -m
specrl train recipes/tests/tiny.yaml --set policy.backend=megatron --set parallel.pp=2`` with a
co-trained draft (TapChannel taps on Megatron's schedule), checkpoints, and ``--resume`` from the
step-2 checkpoint reproducing the uninterrupted run's metrics; layouts the backend cannot run
fail in one line before any process group starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'specrl[megatron]'")

from tests.conftest import REPO, run_cli
from tests.integration.test_cli_basics import _assert_one_line_error

pytestmark = pytest.mark.integration
RECIPE = str(REPO / "recipes/tests/tiny.yaml")
TIMING = ("time_", "rollout_tokens_per_s")
MEGATRON = ["--set", "policy.backend=megatron", "--set", "parallel.pp=2"]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _no_timing(recs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in recs]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", "2", "-m", "specrl", "train", RECIPE, *MEGATRON, *args),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
    )


@pytest.mark.timeout(400)
def test_megatron_pp2_train_checkpoint_and_resume(tmp_path):
    sets = [
        "--set",
        f"policy.path={tmp_path / 'target'}",
        "--set",
        f"draft.path={tmp_path / 'draft'}",
    ]
    run = tmp_path / "run"
    # weight decay moves every policy weight each step even where the toy rewards give no
    # gradient: the checkpoints show every stage's weights reached the rollout rank
    sets += ["--set", "algo.weight_decay=0.5"]
    proc = _torchrun(*sets, "--set", f"run.out_dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert r["samples_trained"] == 16
        assert r["draft_loss"] > 0 and r["draft_sim_tau"] >= 1.0  # the draft co-trained
        assert r["policy_grad_norm"] is not None
    assert len({r["draft_loss"] for r in recs}) == 4
    for step in ("step-000002", "step-000004"):
        files = {p.name for p in (run / "checkpoints" / step).iterdir()}
        assert {"policy", "draft", "rank0.safetensors", "rank1.safetensors"} <= files
    from specrl.models.checkpoint import load_model

    start = load_model(tmp_path / "target").state_dict()
    trained = load_model(run / "checkpoints" / "step-000004" / "policy").state_dict()
    assert trained.keys() == start.keys()
    unchanged = [k for k in start if torch.equal(start[k], trained[k])]
    assert not unchanged, f"not trained or not gathered from their stage: {unchanged}"

    # the run as if stopped after its step-2 checkpoint, then resumed: the same metrics
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000004")
    (resumed / "checkpoints" / "latest").write_text("step-000002")
    proc = _torchrun(*sets, "--resume", "--set", f"run.out_dir={resumed}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _no_timing(_records(resumed)) == _no_timing(recs)


def test_megatron_backend_cp2_is_a_one_line_error(tmp_path):
    """Megatron-core's CP needs Transformer Engine (GPU): refused before any process starts."""
    args = ["--set", "policy.backend=megatron", "--set", "parallel.pp=2", "--set", "parallel.cp=2"]
    proc = run_cli("train", RECIPE, "--set", f"run.out_dir={tmp_path / 'r'}", *args)
    _assert_one_line_error(proc, "needs Transformer Engine's attention")


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["parallel.pp=1"], "parallel.pp must be ≥ 2"),
        (["parallel.pp=2", "parallel.cp=2"], "needs Transformer Engine's attention"),
        (["parallel.pp=2", "parallel.pp_schedule=gpipe"], "has no gpipe schedule"),
        (["parallel.pp=2", "draft.mode=frozen"], "draft.mode: frozen"),
    ],
    ids=["pp1", "cp2", "gpipe", "frozen"],
)
def test_check_backend(sets, needle):
    from specrl.config.loader import load_recipe
    from specrl.config.schema import Recipe
    from specrl.errors import LayoutError
    from specrl.train.parallelize import check_backend

    with pytest.raises(LayoutError, match=needle):
        check_backend(load_recipe(RECIPE, Recipe, ["policy.backend=megatron", *sets]))
    check_backend(load_recipe(RECIPE, Recipe, sets))  # the native backend takes any of these
