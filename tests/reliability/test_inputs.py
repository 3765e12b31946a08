"""Issue 28 items 7 and 8 outside the recipe: command-line numbers and weights files.

A negative or non-finite command-line number is a usage error (exit 2, naming the option); NaN
weights in a checkpoint are a one-line error naming the file and the tensor when it is loaded,
not a RuntimeError at the first weight sync."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specrl.errors import CheckpointError
from specrl.models.checkpoint import load_model
from tests.reliability.conftest import assert_one_line_error


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--steps", "-5"], "--steps"),
        (["--prompts", "0"], "--prompts"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "-1"], "--lr"),
        (["--temperature", "nan"], "--temperature"),
        (["--batch-size", "0"], "--batch-size"),
    ],
)
def test_init_draft_numbers_are_usage_errors(target, tmp_path, cli, args, option):
    code, _, err = cli("init-draft", "--target", target, "--out", tmp_path / "d", *args)
    assert code == 2 and option in err and "Traceback" not in err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("args", [["--temperature", "nan"], ["--top-p", "nan"]])
def test_rollout_nan_options_are_usage_errors(target, tmp_path, cli, args):
    q = tmp_path / "q.jsonl"
    q.write_text('{"prompt": "1+1="}\n')
    code, _, err = cli(
        "rollout", "--target", target, "--prompts", q, "--out", tmp_path / "o", *args
    )
    assert code == 2 and args[0] in err and "Traceback" not in err


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_load(target, tmp_path, cli, value):
    bad = tmp_path / "bad"
    shutil.copytree(target, bad)
    weights = load_file(str(bad / "model.safetensors"))
    name = sorted(weights)[3]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[7] = value
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' holds 1 non-finite values"):
        load_model(bad)
    q = tmp_path / "q.jsonl"
    q.write_text('{"prompt": "1+1="}\n')
    result = cli("rollout", "--target", bad, "--prompts", q, "--out", tmp_path / "o.jsonl")
    assert_one_line_error(result, str(bad / "model.safetensors"), name)
    assert torch.isfinite(load_model(target).lm_head.weight).all()  # the original is fine


def test_unreadable_token_file_is_one_line(target, tmp_path, cli):
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe secret")
    result = cli("rollout", "serve", "--target", target, "--update-token-file", token)
    assert_one_line_error(result, f"token file '{token}' is unreadable")
