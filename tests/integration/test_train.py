"""`specrl train` end to end on the seconds-long test recipe: one process, torchrun dp=2,
SIGKILL + resume reproducing the metrics, and bad recipes failing in one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.test_cli_basics import _assert_one_line_error

pytestmark = pytest.mark.integration
RECIPE = str(REPO / "recipes/tests/tiny.yaml")
TIMING = ("time_", "rollout_tokens_per_s")


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _no_timing(recs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in recs]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """The full pipeline once: warm-start → init-draft → RL (artifacts reused below)."""
    base = tmp_path_factory.mktemp("train")
    sets = ["--set", f"policy.path={base / 'target'}", "--set", f"draft.path={base / 'draft'}"]
    proc = run_cli("--json", "train", RECIPE, *sets, "--set", f"run.out_dir={base / 'run'}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["steps"] == 4
    return base, sets


def test_single_process_run(first_run):
    base, _ = first_run
    run = base / "run"
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        for key in (
            "reward",
            "accuracy",
            "tau",
            "per_position_acceptance",
            "draft_loss",
            "draft_sim_tau",
            "policy_loss",
            "rollout_tokens_per_s",
            "time_rollout",
            "time_policy_update",
            "time_draft_update",
            "time_sync",
        ):
            assert key in r, key
        assert r["tau"] is None or r["tau"] >= 1.0  # None: the gate kept that step plain
        assert set(r["drafter_selections"]) <= {
            f"{p}/k={k}" for p in ("eagle3", "ngram") for k in (1, 2, 3)
        }
    assert any(r["tau"] is not None for r in recs)
    # the rollout wave: response-length quantiles, the live batch per engine step
    for r in recs:
        assert r["response_len_p50"] <= r["response_len_p90"] <= r["response_len_max"]
        live = [size for size, drafting, repeats in r["live_batch"] for _ in range(repeats)]
        drafting = [d for _, d, repeats in r["live_batch"] for _ in range(repeats)]
        assert live[0] > 0 and all(0 <= d <= n for n, d in zip(live, drafting, strict=True))
    assert (run / "rollout_wave.png").stat().st_size > 0
    # draft warm-up (default 10 updates, 2 per step here): the learning rate ramps up to draft.lr
    lrs = [r["draft_lr"] for r in recs]
    assert lrs == sorted(set(lrs)) and lrs[0] > 0 and lrs[-1] <= 1e-4  # strictly increasing
    assert "heldout_accuracy" in recs[1] and "heldout_accuracy" in recs[3]
    assert (run / "recipe.resolved.yaml").is_file() and (run / "curves.png").stat().st_size > 0
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == "step-000004"
    step_dir = run / "checkpoints" / latest
    assert {p.name for p in step_dir.iterdir()} >= {
        "policy",
        "draft",
        "rank0.safetensors",
        "rank0.json",
    }
    assert not list(step_dir.rglob("*.pt")) and not list(step_dir.rglob("*.bin"))
    # the warm-started target and the run's policy checkpoints carry the tokenizer files every
    # HF consumer encodes prompts from alike (BOS included for the toy)
    for ckpt in (base / "target", step_dir / "policy"):
        names = {p.name for p in ckpt.iterdir()}
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
        transformers = pytest.importorskip("transformers")
        from specrl.models.tokenizer import TextCodec

        hf = transformers.AutoTokenizer.from_pretrained(str(ckpt))
        ours = TextCodec.from_checkpoint(ckpt)
        assert list(hf("12+34=")["input_ids"]) == ours.encode_prompt("12+34=")
        assert ours.encode_prompt("12+34=")[0] == ours.bos_id is not None


def test_cotrain_with_ngram_only_engine(first_run, tmp_path):
    """A co-trained draft that no proposer uses (n-gram only) trains but is not synced."""
    _, sets = first_run
    run = tmp_path / "ngram-only"
    proc = run_cli(
        "train",
        RECIPE,
        *sets,
        "--set",
        "train.steps=2",
        "--set",
        "checkpoint.every=0",
        "--set",
        "rollout.speculation.proposers=[ngram]",
        "--set",
        f"run.out_dir={run}",
    )
    assert proc.returncode == 0, proc.stderr
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["draft_loss"] is not None for r in recs)
    assert all(set(r["drafter_selections"]) <= {f"ngram/k={k}" for k in (1, 2, 3)} for r in recs)


def test_frozen_sibling_run_gets_a_comparison_plot(first_run):
    """A/B of draft modes: a frozen run next to the co-trained one plots both on shared axes."""
    base, sets = first_run
    run = base / "run-frozen"
    proc = run_cli(
        "train",
        RECIPE,
        *sets,
        "--set",
        "train.steps=2",
        "--set",
        "checkpoint.every=0",
        "--set",
        "draft.mode=frozen",
        "--set",
        f"run.out_dir={run}",
    )
    assert proc.returncode == 0, proc.stderr
    assert (run / "compare.png").stat().st_size > 0
    assert not list(run.glob(".compare*"))  # written through a temp file, renamed


@pytest.fixture(scope="module")
def reference_run(first_run) -> Path:
    """An uninterrupted 5-step run the killed-and-resumed runs must reproduce."""
    base, sets = first_run
    ref = base / "ref"
    proc = run_cli("train", RECIPE, *sets, "--set", "train.steps=5", "--set", f"run.out_dir={ref}")
    assert proc.returncode == 0, proc.stderr
    return ref


def _killed_at(first_run, name: str, failpoint: str) -> tuple[Path, list[str]]:
    """A 5-step run that SIGKILLs itself at ``failpoint`` (``SPECRL_FAILPOINT``: a fixed point
    of the run, so the verdict never depends on the machine's speed)."""
    base, sets = first_run
    run = base / name
    args = [*sets, "--set", "train.steps=5", "--set", f"run.out_dir={run}"]
    proc = run_cli("train", RECIPE, *args, env={"SPECRL_FAILPOINT": failpoint})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return run, args


def test_kill_and_resume_reproduces_metrics(first_run, reference_run):
    """Killed after step 3's metrics (the step-2 checkpoint is the newest): --resume drops the
    third record, redoes step 3 and reproduces the uninterrupted run."""
    run, args = _killed_at(first_run, "killed", "after_metrics:3")
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert [r["step"] for r in _records(run)] == [1, 2, 3]
    resumed = run_cli("train", RECIPE, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert _no_timing(_records(run)) == _no_timing(_records(reference_run))


def test_resume_falls_back_past_a_truncated_checkpoint(first_run, reference_run):
    """Killed right after the step-4 checkpoint, whose rank0.safetensors is then cut in half:
    --resume warns, resumes from step 2 and still reproduces the uninterrupted run."""
    run, args = _killed_at(first_run, "truncated", "after_commit:4")
    newest = run / "checkpoints" / "step-000004"
    assert (run / "checkpoints" / "latest").read_text().strip() == newest.name
    data = (newest / "rank0.safetensors").read_bytes()
    (newest / "rank0.safetensors").write_bytes(data[: len(data) // 2])
    again = run_cli("train", RECIPE, *args)  # without --resume: refused, nothing truncated
    _assert_one_line_error(again, "already holds a run (4 metric records")
    resumed = run_cli("train", RECIPE, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "checkpoint step-000004 is unusable" in resumed.stderr
    assert "resuming from step-000002 instead" in resumed.stderr
    assert f"run directory: {run.resolve()}" in resumed.stderr  # where relative paths led
    assert _no_timing(_records(run)) == _no_timing(_records(reference_run))


def test_sigterm_saves_and_exits(first_run):
    base, sets = first_run
    run = base / "term"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specrl",
            "train",
            RECIPE,
            *sets,
            "--set",
            "train.steps=50",
            "--set",
            "checkpoint.every=0",
            "--set",
            f"run.out_dir={run}",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().strip()):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "stopped by SIGTERM" in stderr
    saved = (run / "checkpoints" / "latest").read_text().strip()
    assert int(saved.split("-")[1]) == len(_records(run))


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``specrl train`` under torchrun with ``nproc`` processes (one thread each)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "-m",
            "specrl",
            "train",
            RECIPE,
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
    )


def _overrides(*sets: str) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


def test_torchrun_dp2(first_run):
    base, sets = first_run
    run = base / "dp2"
    proc = _torchrun(2, *sets, *_overrides("parallel.dp=2", f"run.out_dir={run}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(r["samples_trained"] == 16 for r in recs)  # both ranks' samples counted


def _check_layout_run(run: Path, nproc: int) -> None:
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert r["samples_trained"] == 16  # one replica: its samples counted once
        assert r["draft_loss"] > 0 and r["draft_sim_tau"] >= 1.0
        assert r["policy_grad_norm"] is not None
    assert "heldout_accuracy" in recs[3]
    step_dir = run / "checkpoints" / "step-000004"
    files = {p.name for p in step_dir.iterdir()}
    assert {"policy", "draft"} <= files
    assert {f"rank{r}.safetensors" for r in range(nproc)} <= files


@pytest.fixture(scope="module")
def pp2_run(first_run) -> Path:
    """`specrl train` at pp = 2 (two stages of one layer, the draft on stage 1)."""
    base, sets = first_run
    run = base / "pp2"
    proc = _torchrun(2, *sets, *_overrides("parallel.pp=2", f"run.out_dir={run}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("nproc", "layout"),
    [(2, ["parallel.cp=2"]), (4, ["parallel.pp=2", "parallel.cp=2"])],
    ids=["cp2", "pp2xcp2"],
)
def test_torchrun_cp_layouts(first_run, nproc, layout):
    base, sets = first_run
    run = base / "-".join(layout)
    proc = _torchrun(nproc, *sets, *_overrides(*layout, f"run.out_dir={run}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_layout_run(run, nproc)


@pytest.mark.timeout(300)
def test_torchrun_pp2(pp2_run):
    _check_layout_run(pp2_run, 2)


@pytest.mark.timeout(300)
def test_torchrun_pp2_resume_reproduces_metrics(first_run, pp2_run):
    """The rollout rank assembles the whole policy and draft for the checkpoint; a run stopped
    at step 2 and resumed with the same layout reproduces the uninterrupted one."""
    base, sets = first_run
    run = base / "pp2-resumed"
    first = _torchrun(2, *sets, *_overrides("parallel.pp=2", "train.steps=2",
                                            f"run.out_dir={run}"))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _torchrun(2, *sets, "--resume", *_overrides("parallel.pp=2", f"run.out_dir={run}"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _no_timing(_records(run)) == _no_timing(_records(pp2_run))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("layout", "tied", "needle"),
    [
        (["parallel.cp=3"], False, "dp × cp × pp = 1 × 3 × 1 = 3 does not match the world size 2"),
        (
            ["parallel.pp=2", "parallel.virtual_stages=2", "parallel.pp_schedule=interleaved-1f1b"],
            False,
            "2 decoder layers cannot fill pp × virtual_stages = 2 × 2 = 4 pipeline stages",
        ),
        (["parallel.pp=2"], True, "tied input/output embeddings"),
    ],
    ids=["cp3-on-2", "stages-over-layers", "tied-pp2"],
)
def test_torchrun_bad_layouts(first_run, tmp_path, layout, tied, needle):
    """Every rank fails with the same one-line error before any rendezvous; torchrun exits 1.
    (torchrun stops the other rank as soon as one exits: under load it may not get to print.)"""
    base, sets = first_run
    if tied:  # the same weights with input and output embedding tied (no draft for this target)
        target = tmp_path / "tied"
        shutil.copytree(base / "target", target)
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
        sets = _overrides(f"policy.path={target}", "draft.mode=none", "rollout.speculation=null")
    proc = _torchrun(2, *sets, *_overrides(*layout, f"run.out_dir={tmp_path / 'r'}"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error: ")]
    assert 1 <= len(errors) <= 2 and all(needle in ln for ln in errors), proc.stderr[-3000:]
    assert not re.search(r'File ".*specrl', proc.stderr)  # no traceback from specrl itself


@pytest.mark.parametrize(
    ("sets", "needles"),
    [
        (["--set", "rollout.nn=4"], ["unknown key 'rollout.nn'"]),
        (["--set", "parallel.dp=3"], ["dp × cp × pp = 3 × 1 × 1 = 3", "world size 1"]),
        (["--set", "task.name=jsonl", "--set", "task.path=/nonexistent.jsonl"], ["does not exist"]),
        (
            ["--set", "policy.warmstart=null", "--set", "policy.path=/nonexistent"],
            ["holds no checkpoint"],
        ),
    ],
    ids=["unknown-key", "layout", "missing-data", "missing-policy"],
)
def test_bad_recipes(sets, needles, tmp_path):
    proc = run_cli("train", RECIPE, "--set", f"run.out_dir={tmp_path / 'r'}", *sets)
    _assert_one_line_error(proc, *needles)


def test_draft_target_mismatch(first_run, tmp_path):
    base, _ = first_run
    other = tmp_path / "other-target"
    proc = run_cli(
        "warm-start",
        RECIPE,
        "--out",
        str(other),
        "--set",
        "policy.warmstart.preset=toy-small",
        "--set",
        "policy.warmstart.steps=1",
        "--set",
        f"run.out_dir={tmp_path / 'ws'}",
    )
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(
        "train",
        RECIPE,
        "--set",
        f"policy.path={other}",
        "--set",
        f"draft.path={base / 'draft'}",
        "--set",
        f"run.out_dir={tmp_path / 'r'}",
    )
    _assert_one_line_error(proc, "hidden size")
