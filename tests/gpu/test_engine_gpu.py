"""The rollout engine on CUDA: greedy decoding, plain and speculative, equals the CPU reference.

The engine's device paths (CUDA-event step timing, on-device verification, the EAGLE-3
drafter's passes) run only on a GPU.  Tiny random decoders in float64 (the CPU engine tests'
``tiny``), so greedy outputs computed on CUDA and on the CPU agree exactly, token for token,
whatever the batch shapes; the test drafters of tests/unit/test_engine.py (garbage drafts,
random-q samples, the target's own continuation) and an EAGLE-3 proposer with a random draft
exercise rejections, the q path and full acceptance.
"""

from __future__ import annotations

import pytest
import torch

from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
from specrl.models.generate import generate
from specrl.rollout import RolloutEngine, SpecConfig
from tests.unit.test_engine import PROMPTS, greedy, run, tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _draft(target) -> Eagle3Draft:
    cfg = DraftConfig.for_target(target.config, draft_vocab_size=16)
    draft = init_draft_weights(Eagle3Draft(cfg), 1)
    counts = torch.arange(target.config.vocab_size, 0, -1, dtype=torch.float64)
    draft.set_vocab_map(build_vocab_map(counts, 16))
    draft = draft.to(device=target.device, dtype=target.dtype)
    draft.refresh_embedding(target.model.embed_tokens.weight)
    return draft


@pytest.mark.parametrize("slots", [1, 4], ids=["batch1", "continuous"])
def test_plain_engine_on_cuda_matches_cpu_reference(slots: int) -> None:
    model = tiny()
    ref = generate(model, PROMPTS, 24)
    out = run(RolloutEngine(model.to("cuda"), max_batch_size=slots), PROMPTS, greedy())
    assert [r.tokens for r in out] == ref


@pytest.mark.parametrize("gate", [False, True], ids=["always", "gated"])
def test_speculative_engine_on_cuda_matches_cpu_reference(gate: bool) -> None:
    model = tiny()
    ref = generate(model, PROMPTS, 24)
    target = model.to("cuda")
    proposers = ("ngram", "test-garbage", "test-randq", "test-oracle", "eagle3")
    spec = SpecConfig(
        proposers=proposers, max_k=4, gate=gate,
        proposer_options={"eagle3": {"draft": _draft(target)}},
    )  # fmt: skip
    engine = RolloutEngine(target, max_batch_size=3, spec=spec, seed=0)
    out = run(engine, PROMPTS, greedy())
    assert [r.tokens for r in out] == ref
    s = engine.stats()
    if not gate:
        assert {a.split("/")[0] for a in s["gating"]["selections"]} == set(proposers)
        assert 0 < s["spec"]["accepted"] < s["spec"]["draft_tokens"]
