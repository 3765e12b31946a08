"""Fixtures of the reliability suite: a toy target and draft the project writes itself, and the
CLI run in-process through its console entry point (the same error policy as a shell)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def target(tmp_path_factory) -> Path:
    """A toy-tiny target (HF format, tokenizer included) with three layers for EAGLE-3 taps."""
    from specrl.models.checkpoint import save_model
    from specrl.models.decoder import Transformer
    from specrl.models.presets import preset_config
    from specrl.models.tokenizer import char_tokenizer, special_ids

    tok = char_tokenizer()
    ids = special_ids(tok)
    config = preset_config(
        "toy-tiny",
        vocab_size=tok.get_vocab_size(),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        max_position_embeddings=64,
        num_hidden_layers=3,
    )
    model = Transformer(config).init_weights(1, std=0.2)
    path = tmp_path_factory.mktemp("rel") / "target"
    save_model(model, path, tokenizer=tok)
    return path


@pytest.fixture(scope="session")
def draft(target, tmp_path_factory) -> Path:
    """A random specrl EAGLE-3 draft for ``target``."""
    from specrl.models.checkpoint import load_model
    from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
    from specrl.models.draft_io import save_draft

    tgt = load_model(target)
    cfg = DraftConfig.for_target(tgt.config, draft_vocab_size=24, tap_layers=(0, 1, 2))
    head = init_draft_weights(Eagle3Draft(cfg), 3, std=0.2)
    head.set_vocab_map(build_vocab_map(torch.arange(tgt.config.vocab_size) % 7, 24))
    head.refresh_embedding(tgt.model.embed_tokens.weight)
    path = tmp_path_factory.mktemp("rel") / "draft"
    save_draft(head, path, target=tgt, provenance={"target": str(target)})
    return path


@pytest.fixture
def cli(monkeypatch, capsys):
    """``cli(*args) -> (exit code, stdout, stderr)`` of ``specrl …`` run in-process."""
    from specrl.cli.app import main

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["specrl", *map(str, args)])
        monkeypatch.setenv("COLUMNS", "400")
        with pytest.raises(SystemExit) as exc:
            main()
        captured = capsys.readouterr()
        return int(exc.value.code or 0), captured.out, captured.err

    return run


def assert_one_line_error(result: tuple[int, str, str], *needles: str) -> str:
    """Exit 1, ``Error: …`` on one line (plus an optional hint line), no traceback."""
    code, _out, err = result
    assert code == 1, (code, err)
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines and lines[0].startswith("Error: "), err
    assert len(lines) <= 2, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]
