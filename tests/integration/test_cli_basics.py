"""The CLI frame: help without torch, version, env, completions, error policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.integration


def test_help_does_not_import_torch():
    code = (
        "import sys; from specrl.cli.app import app\n"
        "try:\n    app(['--help'], prog_name='specrl')\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip().endswith("NO-TORCH"), proc.stdout[-500:]
    assert "warm-start" in proc.stdout


def test_version_and_usage_error():
    from specrl import __version__

    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"specrl {__version__}"
    proc = run_cli("no-such-command")
    assert proc.returncode == 2


def test_env_json():
    proc = run_cli("--json", "env")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["packages"]["torch"]
    assert {b["backend"] for b in info["backends"]} == {
        "vllm",
        "megatron.core",
        "flash_attn",
        "transformer_engine",
    }
    for b in info["backends"]:
        if b["status"] != "ok":
            assert b["install"] == f"pip install 'specrl[{b['extra']}]'"
    assert info["distributed"]["gloo"] is True
    policy = {b["backend"]: b for b in info["policy_backends"]}
    assert policy.keys() == {"native", "megatron"}
    megatron = next(b for b in info["backends"] if b["backend"] == "megatron.core")
    assert policy["megatron"]["status"] == megatron["status"]
    if megatron["status"] == "ok" and not info["cuda_available"]:
        assert policy["megatron"]["device"].startswith("cpu")


def test_completions_are_current():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/update_completions.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout


def test_completion_protocol_lists_every_command():
    from specrl.cli.app import app

    env = {
        **os.environ,
        "_SPECRL_COMPLETE": "complete_bash",
        "COMP_WORDS": "specrl ",
        "COMP_CWORD": "1",
    }
    proc = subprocess.run([sys.executable, "-m", "specrl"], env=env, capture_output=True, text=True)
    offered = set(proc.stdout.split())
    registered = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert registered and registered <= offered, (registered, offered)


def _assert_one_line_error(proc, *needles: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert lines[0].startswith("Error: "), proc.stderr
    assert len(lines) <= 2  # the error and an optional hint
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_bad_recipes_give_one_line_errors(tmp_path: Path):
    bad_key = tmp_path / "k.yaml"
    bad_key.write_text("task:\n  nmae: addition\n")
    proc = run_cli("warm-start", str(bad_key))
    _assert_one_line_error(proc, "unknown key 'task.nmae'", str(bad_key))
    assert "did you mean 'task.name'" in proc.stderr

    proc = run_cli(
        "warm-start", str(REPO / "recipes/toy/cotrain.yaml"), "--set", "policy.warmstart.steps=many"
    )
    _assert_one_line_error(proc, "policy.warmstart.steps", "must be int")

    proc = run_cli("warm-start", str(tmp_path / "missing.yaml"))
    _assert_one_line_error(proc, "does not exist")


def test_malformed_jsonl_names_line(tmp_path: Path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    proc = run_cli(
        "warm-start",
        str(REPO / "recipes/toy/cotrain.yaml"),
        "--set",
        "task.name=jsonl",
        "--set",
        f"task.path={data}",
        "--set",
        f"run.out_dir={tmp_path / 'run'}",
        "--out",
        str(tmp_path / "t"),
    )
    _assert_one_line_error(proc, f"{data}:2: malformed JSON")
    assert not (tmp_path / "t").exists()


def test_debug_shows_traceback(tmp_path: Path):
    bad_key = tmp_path / "k.yaml"
    bad_key.write_text("bogus: 1\n")
    proc = run_cli("--debug", "warm-start", str(bad_key))
    assert proc.returncode != 0 and "Traceback" in proc.stderr
