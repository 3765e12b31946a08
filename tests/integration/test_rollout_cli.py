"""``specrl rollout`` end to end on a tiny checkpoint: output file, summary, error policy."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specrl.cli.app import main
from specrl.cli.rollout import rollout_config
from specrl.models.checkpoint import load_model, save_model
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
from specrl.models.draft_io import save_draft
from specrl.models.presets import preset_config
from specrl.models.tokenizer import char_tokenizer, special_ids
from specrl.rollout import Request, SamplingParams
from specrl.rollout.factory import build_engine

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tok = char_tokenizer()
    ids = special_ids(tok)
    config = preset_config(
        "toy-tiny",
        vocab_size=tok.get_vocab_size(),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        max_position_embeddings=64,
        num_hidden_layers=3,  # room for three distinct EAGLE-3 tap layers
    )
    model = Transformer(config).init_weights(1, std=0.2).to(torch.float64)
    path = tmp_path_factory.mktemp("cli") / "target"
    save_model(model, path, tokenizer=tok, dtype=torch.float64)
    return path


@pytest.fixture(scope="module")
def draft(checkpoint, tmp_path_factory) -> Path:
    """A random EAGLE-3 draft for the checkpoint, in specrl's draft format."""
    target = load_model(checkpoint)
    cfg = DraftConfig.for_target(target.config, draft_vocab_size=40, tap_layers=(0, 1, 2))
    head = init_draft_weights(Eagle3Draft(cfg), 3, std=0.2).to(torch.float64)
    counts = torch.arange(target.config.vocab_size) % 7
    head.set_vocab_map(build_vocab_map(counts, 40))
    head.refresh_embedding(target.model.embed_tokens.weight)
    path = tmp_path_factory.mktemp("cli") / "draft"
    save_draft(head, path, target=target)
    return path


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _flat(text: str) -> str:
    """Text without whitespace: Rich folds long lines at the console width."""
    return re.sub(r"\s", "", text)


def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run ``specrl …`` in-process through the console entry point (its error policy)."""
    monkeypatch.setattr(sys, "argv", ["specrl", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err


RECORDS = [
    {"prompt": "12+34=", "id": "a", "answer": "46"},
    {"prompt": "7*8=", "answer": "56"},
    {"prompt": "999+1=", "id": 17},
]


@pytest.mark.parametrize(
    "compiled",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                shutil.which("c++") is None and shutil.which("g++") is None,
                reason="inductor on CPU needs a C++ compiler",
            ),
        ),
    ],
    ids=["eager", "compiled"],
)
def test_rollout_writes_samples_and_a_json_summary(
    checkpoint, tmp_path, monkeypatch, capsys, compiled
):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps(r) for r in RECORDS] + [""])
    out = tmp_path / "sub" / "out.jsonl"
    args = ["--target", str(checkpoint), "--prompts", str(prompts), "--out", str(out)]
    opts = ["--n", "2", "--temperature", "0", "--max-tokens", "10", "--k", "3", "--batch-size", "4"]
    if compiled:
        opts.append("--compile")
    code, stdout, _ = _cli(monkeypatch, capsys, "rollout", *args, *opts, "--json")
    assert code == 0
    summary = json.loads(stdout)
    assert summary["prompts"] == 3 and summary["samples"] == 6
    assert ("compiled_graphs" in summary) == compiled
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [(r["id"], r["index"]) for r in rows] == [
        ("a", 0),
        ("a", 1),
        (2, 0),
        (2, 1),
        (17, 0),
        (17, 1),
    ]
    assert rows[0]["answer"] == "46" and "answer" not in rows[4]
    assert summary["tokens"] == sum(len(r["tokens"]) for r in rows)
    engine = build_engine(rollout_config("none", 4, 4, False, None), checkpoint, device="cpu")
    params = SamplingParams(max_tokens=10, temperature=0)
    direct = engine.generate([Request(r["prompt"], params) for r in RECORDS])
    for row in rows:
        ref = direct[[r["prompt"] for r in RECORDS].index(row["prompt"])]
        assert (row["text"], row["tokens"]) == (ref.text, ref.tokens)
        assert len(row["logprobs"]) == len(row["policy_logprobs"]) == len(row["tokens"])
        assert row["finish_reason"] in ("stop", "length")
        assert set(row["spec"]) >= {"tau", "per_position", "drafts", "forwards_per_token"}
    assert not list(out.parent.glob(".*tmp*"))  # the temporary file was renamed away


def test_draft_adds_the_eagle3_drafter(checkpoint, draft, tmp_path, monkeypatch, capsys):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps(r) for r in RECORDS])
    out = tmp_path / "out.jsonl"
    args = ["--target", str(checkpoint), "--prompts", str(prompts), "--out", str(out)]
    opts = ["--draft", str(draft), "--temperature", "0", "--max-tokens", "12", "--json"]
    code, stdout, _ = _cli(monkeypatch, capsys, "rollout", *args, *opts)
    assert code == 0
    summary = json.loads(stdout)
    assert {arm.split("/")[0] for arm in summary["selections"]} == {"ngram", "eagle3"}
    engine = build_engine(rollout_config("none", 4, 4, False, None), checkpoint, device="cpu")
    direct = engine.generate([Request(r["prompt"], SamplingParams(12, 0.0)) for r in RECORDS])
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["tokens"] for r in rows] == [d.tokens for d in direct]  # lossless under greedy
    code, _, stderr = _cli(monkeypatch, capsys, "rollout", *args, "--draft", str(tmp_path))
    assert code == 1 and _flat(stderr).startswith("Error:")


def test_chat_template_flag(checkpoint, tmp_path, monkeypatch, capsys):
    """--chat-template: prompts go through the checkpoint's template (the same tokens as the
    codec's chat encoding, greedy); a checkpoint without one is a one-line error."""
    from specrl.models.tokenizer import TextCodec

    prompts = _write(tmp_path / "p.jsonl", [json.dumps(RECORDS[0])])
    args = ["--prompts", str(prompts), "--temperature", "0", "--max-tokens", "6"]
    code, _, err = _cli(
        monkeypatch, capsys, "rollout", "--target", str(checkpoint), *args, "--out",
        str(tmp_path / "x.jsonl"), "--chat-template",
    )  # fmt: skip
    assert code == 1 and "no chat template" in err and len(err.strip().splitlines()) == 2
    chat = tmp_path / "chat"
    shutil.copytree(checkpoint, chat)
    cfg = json.loads((chat / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}Q:{{ m['content'] }}{% endfor %}A:"
    )
    (chat / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = tmp_path / "chat.jsonl"
    code, _, _ = _cli(
        monkeypatch, capsys, "rollout", "--target", str(chat), *args, "--out", str(out),
        "--proposers", "none", "--chat-template",
    )  # fmt: skip
    assert code == 0
    row = json.loads(out.read_text().splitlines()[0])
    codec = TextCodec.from_checkpoint(chat, chat=True)
    ids = codec.encode_prompt("12+34=")
    assert codec.tokenizer.decode(ids, skip_special_tokens=False) == "<bos>Q:12+34=A:"
    engine = build_engine(rollout_config("none", 4, 4, False, None), chat, device="cpu")
    ref = engine.generate([Request(ids, SamplingParams(max_tokens=6, temperature=0))])[0]
    assert row["tokens"] == ref.tokens


def test_human_summary_goes_to_stdout(checkpoint, tmp_path, monkeypatch, capsys):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps(RECORDS[0])])
    out = tmp_path / "out.jsonl"
    args = ["--target", str(checkpoint), "--prompts", str(prompts), "--out", str(out)]
    code, stdout, stderr = _cli(monkeypatch, capsys, "rollout", *args, "--max-tokens", "4")
    assert code == 0
    assert "tokens_per_s" in stdout and "rollout" in stderr  # table on stdout, progress on stderr


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "1+1="}', "{oops", '{"prompt": "2"}'], ":2: malformed JSON"),
        (['{"prompt": "1+1="}', "[1, 2]"], ":2: expected a JSON object"),
        (['{"id": 3}'], ":1: needs a non-empty string field 'prompt'"),
        (['{"prompt": "1+1=", "id": [1]}'], ":1: field 'id'"),
        (['{"prompt": "1+1="}', '{"prompt": "' + "9" * 70 + '"}'], ":2: prompt (71 tokens)"),
    ],
    ids=["malformed", "not-object", "no-prompt", "bad-id", "too-long"],
)
def test_bad_prompt_files_are_one_line_errors_naming_file_and_line(
    checkpoint, tmp_path, monkeypatch, capsys, lines, message
):
    prompts = _write(tmp_path / "bad.jsonl", lines)
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n", encoding="utf-8")
    args = ["--target", str(checkpoint), "--prompts", str(prompts), "--out", str(out)]
    args.append("--overwrite")  # the existing output is replaced only by a complete new one
    code, stdout, stderr = _cli(monkeypatch, capsys, "rollout", *args, "--max-tokens", "4")
    assert code == 1 and stdout == ""
    assert _flat(stderr).startswith(_flat(f"Error: {prompts}"))
    assert _flat(message) in _flat(stderr)
    assert "Traceback" not in stderr
    assert out.read_text(encoding="utf-8") == "previous\n"  # untouched


def test_usage_and_config_errors(checkpoint, tmp_path, monkeypatch, capsys):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps(RECORDS[0])])
    out = tmp_path / "out.jsonl"
    code, _, stderr = _cli(monkeypatch, capsys, "rollout", "--prompts", str(prompts))
    assert code == 2 and "--target" in stderr
    args = ["--target", str(checkpoint), "--prompts", str(prompts), "--out", str(out)]
    code, _, stderr = _cli(monkeypatch, capsys, "rollout", *args, "--proposers", "nope")
    assert code == 1 and _flat("Error: unknown proposer 'nope'") in _flat(stderr)
    code, _, stderr = _cli(
        monkeypatch,
        capsys,
        "rollout",
        "--target",
        str(tmp_path),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
    )
    assert code == 1 and "Error:" in stderr and "config.json" in stderr


def test_console_script_end_to_end(checkpoint, tmp_path):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps(r) for r in RECORDS])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "specrl", "--json", "rollout", "--target", str(checkpoint)]
    cmd += ["--prompts", str(prompts), "--out", str(out), "--n", "2", "--max-tokens", "6"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["samples"] == 6
    assert len(out.read_text(encoding="utf-8").splitlines()) == 6
    bad = _write(tmp_path / "bad.jsonl", ['{"prompt": "1"}', "nope"])
    cmd[cmd.index(str(prompts))] = str(bad)
    cmd.append("--overwrite")  # past the output check: the bad prompt line is what fails
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1
    assert _flat(done.stderr).startswith(_flat(f"Error: {bad}:2: malformed JSON"))
