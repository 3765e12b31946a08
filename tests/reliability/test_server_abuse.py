"""The rollout server under hostile or careless clients (issue 28 items 10–14).

Each case is followed by a normal request whose answer must be exactly the engine's: the server
keeps serving, and correctly, after every abuse.
"""

from __future__ import annotations

import pytest

from specrl.models.generate import generate
from specrl.rollout import Request, SpecConfig
from tests.unit.test_draft import make_pair
from tests.unit.test_engine import greedy, make_engine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 6, 7, 5, 6], [3, 4, 3, 4, 3], [9], [10, 11, 12, 13, 10, 11, 12], [2, 2]]


# ----------------------------------------------------------------------- engine.abort
@pytest.mark.parametrize("proposers", [("ngram",), ("eagle3", "ngram")], ids=["ngram", "eagle3"])
def test_aborting_requests_frees_their_slots_and_leaves_the_others_exact(proposers):
    """What the server does for a cancelled request or a failed step: the dropped requests'
    samples leave the engine mid-flight, waiting or running; the others finish exactly."""
    target, draft = make_pair()
    spec = SpecConfig(
        proposers=proposers, max_k=3, gate=False, proposer_options={"eagle3": {"draft": draft}}
    )
    engine = make_engine(target, max_batch_size=3, spec=spec)
    ids = engine.add_requests([Request(p, greedy(12)) for p in PROMPTS])
    engine.step()
    engine.step()
    assert engine.queued_requests() == set(ids[3:])
    dropped = engine.abort([ids[0], ids[4]])  # one running (slot 0), one still queued
    assert dropped == 2
    assert engine.queued_requests() == {ids[3]}
    results = {}
    while engine.has_unfinished():
        for r in engine.step():
            results[r.request_id] = r.tokens
    assert sorted(results) == sorted([ids[1], ids[2], ids[3]])
    expected = generate(target, PROMPTS, 12)
    for i in (1, 2, 3):
        assert results[ids[i]] == expected[i]
    assert engine.abort([ids[0]]) == 0  # gone already: nothing to drop
    again = engine.generate([Request(p, greedy(12)) for p in PROMPTS])  # slots all free again
    assert [r.tokens for r in again] == expected
