"""Fixtures of the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specrl.models.checkpoint import load_model, save_model
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
from specrl.models.draft_io import save_draft
from specrl.models.presets import preset_config
from specrl.models.tokenizer import char_tokenizer, special_ids


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target with the toy tokenizer and a random EAGLE-3 draft for it."""
    tok = char_tokenizer()
    ids = special_ids(tok)
    config = preset_config(
        "toy-tiny", vocab_size=tok.get_vocab_size(), bos_token_id=ids["bos"],
        eos_token_id=ids["eos"], pad_token_id=ids["pad"], max_position_embeddings=64,
        num_hidden_layers=3,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("pair")
    save_model(Transformer(config).init_weights(1, std=0.2), root / "target", tokenizer=tok)
    target = load_model(root / "target")
    cfg = DraftConfig.for_target(target.config, draft_vocab_size=40, tap_layers=(0, 1, 2))
    head = init_draft_weights(Eagle3Draft(cfg), 3, std=0.2)
    head.set_vocab_map(build_vocab_map(torch.arange(target.config.vocab_size) % 7, 40))
    head.refresh_embedding(target.model.embed_tokens.weight)
    save_draft(head, root / "draft", target=target)
    return root / "target", root / "draft"
