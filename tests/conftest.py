"""Shared fixtures: tiny checkpoints the project makes itself (no model hubs)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    on a shared 2-core machine OpenMP spinning across busy cores is far slower than 1 thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600):
    """Run ``python -m specrl …`` in a subprocess; returns CompletedProcess (text)."""
    import subprocess

    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    full_env.pop("SPECRL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "specrl", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A randomly initialised toy-tiny target saved as an HF-format checkpoint with tokenizer."""
    import torch

    from specrl.models.checkpoint import save_model
    from specrl.models.decoder import Transformer
    from specrl.models.presets import preset_config
    from specrl.models.tokenizer import char_tokenizer, special_ids

    tok = char_tokenizer()
    ids = special_ids(tok)
    cfg = preset_config(
        "toy-tiny",
        vocab_size=tok.get_vocab_size(),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    torch.manual_seed(0)
    model = Transformer(cfg).init_weights(0, std=0.2)
    path = tmp_path_factory.mktemp("ckpt") / "tiny-target"
    save_model(model, path, tokenizer=tok)
    return path
