"""``examples/prompts.jsonl`` is valid toy-task input and README's ``specrl rollout`` command on
it runs as written (with this test's tiny target and draft in place of the main job's)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch

from specrl.cli.app import main
from specrl.models.checkpoint import load_model, save_model
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
from specrl.models.draft_io import save_draft
from specrl.models.presets import preset_config
from specrl.models.tokenizer import char_tokenizer, special_ids

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "examples" / "prompts.jsonl"


def readme_rollout_command() -> list[str]:
    """README's one ``specrl rollout`` command line on the example prompts."""
    lines = [
        line.strip()
        for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
        if line.strip().startswith("specrl rollout ") and "examples/prompts.jsonl" in line
    ]
    assert len(lines) == 1, f"README should show one rollout command on the examples: {lines}"
    return shlex.split(lines[0])


def test_example_prompts_are_addition_problems_with_their_answers():
    records = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert len(records) >= 8
    assert len({r["id"] for r in records}) == len(records)
    for r in records:
        a, b = r["prompt"].removesuffix("=").split("+")
        assert r["prompt"].endswith("=") and int(r["answer"]) == int(a) + int(b), r


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target with the toy tokenizer and a random EAGLE-3 draft for it."""
    tok = char_tokenizer()
    ids = special_ids(tok)
    config = preset_config(
        "toy-tiny", vocab_size=tok.get_vocab_size(), bos_token_id=ids["bos"],
        eos_token_id=ids["eos"], pad_token_id=ids["pad"], max_position_embeddings=64,
        num_hidden_layers=3,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("examples")
    save_model(Transformer(config).init_weights(1, std=0.2), root / "target", tokenizer=tok)
    target = load_model(root / "target")
    cfg = DraftConfig.for_target(target.config, draft_vocab_size=40, tap_layers=(0, 1, 2))
    head = init_draft_weights(Eagle3Draft(cfg), 3, std=0.2)
    head.set_vocab_map(build_vocab_map(torch.arange(target.config.vocab_size) % 7, 40))
    head.refresh_embedding(target.model.embed_tokens.weight)
    save_draft(head, root / "draft", target=target)
    return root / "target", root / "draft"


def test_readme_rollout_command_runs_on_the_example_prompts(pair, tmp_path, monkeypatch, capsys):
    argv = readme_rollout_command()
    assert argv[:2] == ["specrl", "rollout"]
    swap = {"--target": str(pair[0]), "--draft": str(pair[1]), "--out": str(tmp_path / "o.jsonl")}
    for flag, value in swap.items():
        assert flag in argv, f"README's rollout command has no {flag}"
        argv[argv.index(flag) + 1] = value
    assert argv[argv.index("--prompts") + 1] == "examples/prompts.jsonl"
    argv[argv.index("--prompts") + 1] = str(PROMPTS)
    monkeypatch.setattr(sys, "argv", [*argv[:1], "--json", *argv[1:], "--max-tokens", "8"])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    assert (exc.value.code or 0) == 0, out.err
    summary = json.loads(out.out)
    records = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert summary["prompts"] == len(records)
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert {r["id"] for r in rows} == {r["id"] for r in records}
    assert all(r["answer"] == next(x for x in records if x["id"] == r["id"])["answer"] for r in rows)
