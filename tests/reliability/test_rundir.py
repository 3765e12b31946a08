"""Issue 28 items 4, 5 and 8 (checkpoints): one writer per run directory, no truncation without
``--resume``/``--overwrite``, pruning by step number, and resume falling back past a truncated or
corrupt newest checkpoint."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from specrl.errors import CheckpointError, ConfigError
from specrl.train import checkpoint as ckpt
from specrl.train.rundir import RunDirBusy, open_run_dir
from tests.conftest import REPO
from tests.reliability.conftest import assert_one_line_error

TINY = REPO / "recipes/tests/tiny.yaml"


@pytest.fixture
def holder(tmp_path):
    """A second process holding the run directory's lock until the test ends."""
    run = tmp_path / "run"
    code = textwrap.dedent(
        f"""
        import sys
        from specrl.train.rundir import open_run_dir
        lock = open_run_dir({str(run)!r}, resume=False, overwrite=False)
        print("locked", flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"  # deterministic: no sleeping
    yield run, proc.pid
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_second_trainer_stops_naming_the_holder(holder, cli, tmp_path):
    """Item 4: two trainers on one run directory."""
    run, pid = holder
    with pytest.raises(RunDirBusy, match=f"in use by pid {pid} on host {socket.gethostname()}"):
        open_run_dir(run, resume=False, overwrite=False)
    with pytest.raises(RunDirBusy):
        open_run_dir(run, resume=True, overwrite=False)
    sets = ["--set", f"policy.path={tmp_path / 't'}", "--set", f"draft.path={tmp_path / 'd'}"]
    result = cli("train", TINY, *sets, "--set", f"run.out_dir={run}")
    assert_one_line_error(result, f"in use by pid {pid}")
    assert not (tmp_path / "t").exists()  # refused before any warm-start


def test_the_lock_is_released_when_the_holder_dies(tmp_path):
    run = tmp_path / "run"
    code = f"from specrl.train.rundir import open_run_dir; open_run_dir({str(run)!r}, resume=False, overwrite=False); import os, signal; os.kill(os.getpid(), signal.SIGKILL)"  # noqa: E501
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    open_run_dir(run, resume=False, overwrite=False).release()


def _finished_run(run: Path, records: int, steps: list[int]) -> None:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1}) + "\n" for i in range(records))
    )
    for s in steps:
        _fake_checkpoint(run, s)
    (run / "target").mkdir()
    (run / "target" / "config.json").write_text("{}")


def test_rerun_without_resume_is_refused_and_overwrite_starts_over(tmp_path):
    """Item 5: a finished run re-run without --resume keeps its 8 records."""
    run = tmp_path / "run"
    _finished_run(run, 8, [6, 8])
    with pytest.raises(
        ConfigError,
        match=r"already holds a run \(8 metric records, checkpoints up to step-000008\)",
    ):
        open_run_dir(run, resume=False, overwrite=False)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 8
    open_run_dir(run, resume=True, overwrite=False).release()  # --resume may continue it
    with pytest.raises(ConfigError, match="exclude each other"):
        open_run_dir(run, resume=True, overwrite=True)
    open_run_dir(run, resume=False, overwrite=True).release()
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    assert (run / "target" / "config.json").is_file()  # a policy kept in the run dir stays


@pytest.mark.parametrize("where", ["file", "proc"])
def test_run_dir_that_cannot_be_one_is_one_line(tmp_path, where, cli):
    """Item 8: run.out_dir is a regular file, or under /proc."""
    out = tmp_path / "f" if where == "file" else Path("/proc/specrl-run")
    if where == "file":
        out.write_text("x")
    sets = ["--set", f"policy.path={tmp_path / 't'}", "--set", f"draft.path={tmp_path / 'd'}"]
    assert_one_line_error(cli("train", TINY, *sets, "--set", f"run.out_dir={out}"), "run directory")


# ----------------------------------------------------------------------------- checkpoints
def _fake_checkpoint(run: Path, step: int, keep: int = 100) -> Path:
    tmp = ckpt.begin(run, step)
    (tmp / "policy").mkdir()
    (tmp / "policy" / "config.json").write_text("{}")
    from safetensors.torch import save_file

    save_file({"w": torch.full((64,), float(step))}, str(tmp / "policy" / "model.safetensors"))
    ckpt.write_rank(tmp, 0, {"opt": torch.arange(256.0)}, {"step": step})
    return ckpt.commit(run, tmp, step, keep)


def _names(run: Path) -> list[str]:
    return [p.name for p in ckpt.step_dirs(run)]


def test_pruning_sorts_by_step_number_and_keeps_the_newest(tmp_path):
    run = tmp_path / "run"
    for s in (999_998, 999_999, 1_000_000):
        _fake_checkpoint(run, s, keep=2)
    assert _names(run) == ["step-999999", "step-1000000"]
    assert ckpt.latest(run).name == "step-1000000"


def test_a_rerun_timeline_replaces_abandoned_newer_checkpoints(tmp_path):
    """Item 5's sequence: step-000006/8 exist and step-000002 is written: it stays, latest names
    it, and --resume finds it."""
    run = tmp_path / "run"
    for s in (6, 8, 2):
        _fake_checkpoint(run, s, keep=2)
    assert _names(run) == ["step-000002"]
    assert ckpt.resume_point(run, 1) == (run / "checkpoints" / "step-000002", [])


def test_stale_temporaries_are_cleaned(tmp_path):
    run = tmp_path / "run"
    _fake_checkpoint(run, 2)
    root = run / "checkpoints"
    (root / ".latest.tmp-abc-1").write_text("step-000002\n")
    (root / ".step-000004.tmp-xyz").mkdir()
    _fake_checkpoint(run, 4)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002", "step-000004"]


def _truncate(path: Path) -> None:
    """Cut a file in half (as a copy or a disk that filled up would)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "damage",
    ["rank0.safetensors", "rank0.json", "policy/model.safetensors", "policy/config.json", "gone"],
)
def test_resume_falls_back_past_an_unusable_newest_checkpoint(tmp_path, damage):
    """Item 8: a truncated rank0.safetensors / rank0.json (or policy files), or ``latest``
    naming a directory that is gone."""
    run = tmp_path / "run"
    for s in (2, 4):
        _fake_checkpoint(run, s)
    newest = run / "checkpoints" / "step-000004"
    if damage == "gone":
        import shutil

        shutil.rmtree(newest)
    else:
        _truncate(newest / damage)
    path, warnings = ckpt.resume_point(run, 1)
    assert path == run / "checkpoints" / "step-000002"
    assert "step-000004" in warnings[0] and warnings[-1] == "resuming from step-000002 instead"
    _fake_checkpoint(run, 4, keep=2)  # the resumed run writes step 4 again
    assert ckpt.resume_point(run, 1) == (newest, [])


def test_every_checkpoint_unusable_is_one_error(tmp_path):
    run = tmp_path / "run"
    _fake_checkpoint(run, 2)
    _truncate(run / "checkpoints" / "step-000002" / "rank0.safetensors")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        ckpt.resume_point(run, 1)
    assert ckpt.resume_point(tmp_path / "fresh", 1) == (None, [])


def test_a_trainer_holds_its_run_dir_until_its_steps_end(target, draft, tmp_path):
    """In one process too: a second trainer on the directory is refused while the first one
    holds it; abandoning the first one's steps (or finishing them) frees it."""
    from specrl.config import Recipe, load_recipe
    from specrl.train.loop import build_trainer

    run = tmp_path / "run"
    sets = [f"policy.path={target}", "policy.warmstart=null", f"draft.path={draft}"]
    sets += ["draft.init=null", f"run.out_dir={run}", "train.steps=1", "train.plots=false"]
    sets += ["rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=4"]
    recipe = load_recipe(TINY, Recipe, sets)
    first = build_trainer(recipe)
    with pytest.raises(RunDirBusy, match=f"pid {__import__('os').getpid()}"):
        build_trainer(recipe, resume=True)
    steps = first.steps()
    next(steps)
    steps.close()  # abandoned after its one step
    second = build_trainer(recipe, resume=True)
    assert second.start_step == 1 and list(second.steps()) == []
    assert open_run_dir(run, resume=True, overwrite=False).held  # released at the end


def test_relative_paths_resolve_against_the_current_directory(
    target, draft, tmp_path, cli, monkeypatch
):
    """Item 17: a recipe run from another directory: its relative paths resolve against the
    current directory (documented in ``specrl train --help``), and the resolved run directory
    is printed."""
    import shutil

    work = tmp_path / "work"
    shutil.copytree(target, work / "models" / "target")
    shutil.copytree(draft, work / "models" / "draft")
    sets = ["policy.path=models/target", "policy.warmstart=null", "draft.path=models/draft"]
    sets += ["draft.init=null", "run.out_dir=out/run", "train.steps=1", "train.plots=false"]
    sets += ["rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=4"]
    monkeypatch.chdir(work)
    code, _, err = cli("train", TINY, *[a for s in sets for a in ("--set", s)])
    assert code == 0, err
    assert f"run directory: {work / 'out' / 'run'}" in err
    assert (work / "out" / "run" / "metrics.jsonl").is_file()
    assert not (TINY.parent / "models").exists() and not (TINY.parent / "out").exists()
    code, out, _ = cli("train", "--help")
    assert "resolve against the current directory" in " ".join(out.split())
