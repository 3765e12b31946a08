"""`specrl init-draft` / `specrl export-draft` end to end on a tiny target, and their errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.integration.test_cli_basics import _assert_one_line_error

pytestmark = pytest.mark.integration

FAST = ["--prompts", "8", "--eval-prompts", "4", "--max-new-tokens", "12", "--draft-vocab", "24"]


@pytest.fixture(scope="module")
def draft_dir(tiny_target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draft") / "d"
    proc = run_cli(
        "--json",
        "init-draft",
        "--target",
        str(tiny_target),
        "--out",
        str(out),
        *FAST,
        "--steps",
        "2",
        "--ttt-steps",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["draft_vocab"] == 24 and summary["warmup_steps"] == 2
    assert len(summary["heldout_acc_after"]) == 4  # --eval-k default
    assert 1.0 <= summary["heldout_tau_after"] <= 5.0
    meta = json.loads((out / "specrl_draft.json").read_text())
    assert meta["provenance"]["target"] == str(tiny_target)
    assert (out / "warmup.jsonl").read_text().count("\n") == 2
    return out


def test_export_verify_and_reimport(draft_dir, tiny_target, tmp_path):
    exp = tmp_path / "export"
    proc = run_cli(
        "--json",
        "export-draft",
        "--draft",
        str(draft_dir),
        "--out",
        str(exp),
        "--format",
        "vllm",
        "--dtype",
        "bf16",
        "--verify",
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["verify_ok"] is True
    assert res["aux_layer_ids"] == [i + 1 for i in res["specrl_tap_layers"]]
    assert json.loads((exp / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = tmp_path / "again"
    proc = run_cli(
        "--json",
        "init-draft",
        "--target",
        str(tiny_target),
        "--out",
        str(again),
        *FAST,
        "--from-eagle3",
        str(exp),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["vocab_source"].startswith("imported from")


def test_checkpoint_errors_are_one_line(tiny_target, tmp_path):
    proc = run_cli("init-draft", "--target", str(tmp_path / "none"), "--out", str(tmp_path / "o"))
    _assert_one_line_error(proc, "does not exist")

    trunc = tmp_path / "trunc"
    shutil.copytree(tiny_target, trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 3])
    proc = run_cli("init-draft", "--target", str(trunc), "--out", str(tmp_path / "o"))
    _assert_one_line_error(proc, "model.safetensors", "not a readable safetensors file")

    arch = tmp_path / "arch"
    shutil.copytree(tiny_target, arch)
    cfg = json.loads((arch / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (arch / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("init-draft", "--target", str(arch), "--out", str(tmp_path / "o"))
    _assert_one_line_error(proc, "unsupported architecture")
    assert not (tmp_path / "o").exists()


def test_guards_are_one_line(tiny_target, draft_dir, tmp_path):
    proc = run_cli(
        "init-draft",
        "--target",
        str(tiny_target),
        "--out",
        str(tmp_path / "o"),
        *FAST[:6],
        "--tap-layers",
        "0,1,9",
    )
    _assert_one_line_error(proc, "tap layers [9] out of range")
    proc = run_cli(
        "init-draft",
        "--target",
        str(tiny_target),
        "--out",
        str(tmp_path / "o"),
        *FAST[:6],
        "--draft-vocab",
        "100000",
    )
    _assert_one_line_error(proc, "--draft-vocab 100000")
    proc = run_cli("export-draft", "--draft", str(tiny_target), "--out", str(tmp_path / "x"))
    _assert_one_line_error(proc, "not a specrl draft")
    assert not (tmp_path / "o").exists() and not (tmp_path / "x").exists()
