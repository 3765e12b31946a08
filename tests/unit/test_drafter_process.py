"""Decoupled drafting with the drafter in a process of its own (``speculation.drafter: process``).

The proposers live in a spawned child; the engine speaks the Proposer protocol to them over a
pipe.  Greedy decoding equals plain decoding token for token (every proposer, batch 1 and
continuous batching with slot moves); the child really drafts ahead (hits) and really receives
draft updates; sampled decoding follows the policy (χ² at 1 %, with the lossy variant
rejected); a child that raises, dies or hangs fails the call in bounded time with a clear error,
and the engine goes on drafting in process.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from specrl.errors import CheckpointError
from specrl.models.generate import generate
from specrl.rollout import Request, SamplingParams, SpecConfig, decoupled
from specrl.rollout.decoupled import DrafterError
from specrl.rollout.drafter_process import ProcessProposer
from specrl.rollout.proposers import ProposerBase, register_proposer
from specrl.rollout.types import Draft
from tests.unit.test_decoupled import _lossy_split, _pvalues
from tests.unit.test_draft import make_pair
from tests.unit.test_engine import PROMPTS, Garbage, make_engine, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def process_spec(names, **kw) -> SpecConfig:
    return SpecConfig(proposers=names, max_k=3, gate=False, decoupled=True, drafter="process", **kw)


def children(engine) -> list[ProcessProposer]:
    return [p for p in engine.drafting.proposers.values() if isinstance(p, ProcessProposer)]


@pytest.mark.parametrize(
    ("names", "slots"),
    [(("ngram",), 3), (("eagle3",), 3), (("eagle3", "ngram"), 1), (("eagle3", "ngram"), 3)],
    ids=["ngram-continuous", "eagle3-continuous", "best-of-n-batch1", "best-of-n-continuous"],
)
def test_greedy_process_drafter_matches_plain(names, slots):
    target, draft = make_pair()
    if names == ("ngram",):
        target = tiny()  # whose continuations repeat: the n-gram drafter finds matches
    prompts = [*PROMPTS, [4, 4, 5], [6, 1]]
    lengths = [20, 7, 13, 20, 3, 16, 9, 20]  # finishing at different steps: compaction moves
    ref = [generate(target, [p], m)[0] for p, m in zip(prompts, lengths, strict=True)]
    spec = process_spec(names, proposer_options={"eagle3": {"draft": draft}})
    engine = make_engine(target, max_batch_size=slots, spec=spec)
    kids = children(engine)
    assert len(kids) == len(names) and all(k.info["pid"] != os.getpid() for k in kids)
    out = engine.generate([Request(p, greedy(m)) for p, m in zip(prompts, lengths, strict=True)])
    assert [r.tokens for r in out] == ref
    d = engine.stats()["decoupled"]
    assert d["launched"] > 0 and d["hits"] + d["misses"] == d["launched"]
    if "eagle3" in names:  # the child's own state, over the pipe
        assert "temperature_scale" in engine.stats()["drafters"]["eagle3"]
        assert "eagle3" in engine.drafting.state_dict()["proposers"]


def test_the_child_drafts_ahead_and_takes_draft_updates():
    """Target and draft both always pick token 0: every guess holds and the ahead drafts carry
    the decoding; a random draft pushed in makes the guesses miss (the update reached the
    child), with outputs still the target's."""
    target, draft = make_pair(draft_vocab=32)
    with torch.no_grad():
        target.lm_head.weight.zero_()
        draft.lm_head.weight.zero_()
    spec = SpecConfig(
        proposers=("eagle3",), max_k=3, draft_lengths=(3,), gate=False, decoupled=True,
        drafter="process", proposer_options={"eagle3": {"draft": draft}},
    )  # fmt: skip
    engine = make_engine(target, max_batch_size=2, spec=spec)
    out = engine.generate([Request(p, greedy(30)) for p in PROMPTS[:3]])
    assert all(r.tokens == [0] * 30 for r in out)
    first = dict(engine.stats()["decoupled"])
    assert first["hits"] >= 0.7 * first["launched"] > 0

    other = make_pair(draft_vocab=32, seed=5)[1]  # random: drafts 0 about once in 32
    wrong = {k: v for k, v in other.state_dict().items() if not k.startswith("embed")}
    with pytest.raises(CheckpointError):  # validated in the child, nothing loaded
        engine.update_weights(draft={**wrong, "lm_head.weight": wrong["lm_head.weight"][:, :3]})
    engine.update_weights(draft=wrong)
    out = engine.generate([Request(p, greedy(30)) for p in PROMPTS[:3]])
    assert all(r.tokens == [0] * 30 for r in out)
    d = engine.stats()["decoupled"]
    assert d["hits"] - first["hits"] <= 0.1 * (d["launched"] - first["launched"])


@pytest.mark.slow  # ~30 s of CPU each
@pytest.mark.parametrize("lossy", [False, True], ids=["process", "lossy-q"])
def test_sampled_process_drafter_follows_the_policy(lossy, monkeypatch):
    """χ² per position at 1 % family-wise over 20 000 samples: drafts drawn in the child with
    its own generators, verified in the engine, follow the policy; with the ahead drafts' q
    rows off by one (in the engine, where ahead drafts are split) the test rejects."""
    if lossy:
        monkeypatch.setattr(decoupled, "split_ahead", _lossy_split)
    model = tiny(seed=3, vocab=12)
    params = SamplingParams(max_tokens=5, temperature=0.9, top_k=8, n=20_000, seed=0)
    spec = SpecConfig(
        proposers=("test-mixq",), max_k=1, gate=False, decoupled=True, drafter="process"
    )
    engine = make_engine(model, max_batch_size=512, max_model_len=8, spec=spec)
    assert children(engine)
    out = engine.generate([Request([1, 2], params)])
    assert engine.stats()["decoupled"]["hits"] > 2000
    pvalues = _pvalues(model, out, [1, 2], 5, params)
    if lossy:
        assert min(pvalues) < 0.01 / 5, pvalues
    else:
        assert min(pvalues) > 0.01 / 5, pvalues


# ------------------------------------------------------------------------- failures
class _ChildFails(Garbage):
    """Drafts garbage coupled; drafting ahead (always in the child) raises, exits or hangs."""

    ahead_safe = True
    how = "raise"

    def propose_ahead(self, batch, drafts, ks):
        if self.how == "raise":
            raise ValueError("boom in the child")
        if self.how == "exit":
            os._exit(3)
        time.sleep(60)


class _Raise(_ChildFails):
    name = "test-child-raise"


class _Exit(_ChildFails):
    name, how = "test-child-exit", "exit"


class _Hang(_ChildFails):
    name, how = "test-child-hang", "hang"


for _kind in (_Raise, _Exit, _Hang):
    register_proposer(
        _kind.name, lambda ctx, k=_kind: k(ctx.target.config.vocab_size, 0), replace=True
    )


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (_Raise, r"ValueError: boom in the child"),
        (_Exit, r"died \(exit code 3\)"),
        (_Hang, r"did not answer within 0\.5 s"),
    ],
    ids=["raises", "dies", "hangs"],
)
def test_a_failing_child_fails_the_call_and_the_engine_recovers(kind, message, caplog):
    spec = SpecConfig(
        proposers=(kind.name,), max_k=2, gate=False, decoupled=True, drafter="process",
        drafter_timeout=0.5,
    )  # fmt: skip
    engine = make_engine(tiny(), max_batch_size=2, spec=spec)
    (child,) = children(engine)
    t0 = time.monotonic()
    with pytest.raises(DrafterError, match=message):
        engine.generate([Request(p, greedy(12)) for p in PROMPTS[:3]])
    assert time.monotonic() - t0 < 20
    assert not engine.has_unfinished() and engine.stats()["running"] == 0
    assert engine.stats()["decoupled"] is None and not children(engine)  # in process now
    assert "decoupled drafting is off" in caplog.text
    child._proc.join(timeout=10)
    assert not child._proc.is_alive()  # a hung child is killed, not left behind
    out = engine.generate([Request(p, greedy(8)) for p in PROMPTS[:3]])
    assert [r.tokens for r in out] == generate(engine.model, PROMPTS[:3], 8)


def test_a_child_that_cannot_build_its_proposer_is_a_clear_error(tmp_path):
    spec = process_spec(("eagle3",), proposer_options={"eagle3": {"path": str(tmp_path)}})
    with pytest.raises(CheckpointError, match="draft"):
        make_engine(make_pair()[0], max_batch_size=1, spec=spec)


def test_calls_queued_while_drafting_is_off_stay_bounded_and_in_order():
    """A gate that keeps drafting off sends the child no request; the queued lifecycle and
    observe calls go unanswered in bounded batches, and drafting later picks up exactly."""
    from specrl.rollout.drafter_process import FLUSH_EVERY

    model = tiny()
    spec = process_spec(("ngram",))
    engine = make_engine(model, max_batch_size=3, spec=spec)
    (child,) = children(engine)
    engine.drafting.controller.force(False)
    engine.generate([Request(p, greedy(40)) for p in PROMPTS])  # > FLUSH_EVERY plain steps
    assert len(child._outbox) < FLUSH_EVERY
    engine.drafting.controller.force(True)
    out = engine.generate([Request(p, greedy(24)) for p in PROMPTS])
    assert [r.tokens for r in out] == generate(model, PROMPTS, 24)
    assert engine.stats()["decoupled"]["launched"] > 0


class TapDigest(ProposerBase):
    """Drafts that depend on every tap row it was shown: token = a digest of a sequence's taps
    so far (order-sensitive), so one lost, swapped or foreign row changes the drafts."""

    name = "test-tap-digest"
    tap_layers = (0, 1)

    def __init__(self, vocab: int) -> None:
        self.vocab, self.digest = vocab, {}

    def reset(self, seq):
        self.digest[seq.seq_id] = 0.0

    def release(self, seq):
        del self.digest[seq.seq_id]

    def observe(self, batch, accepted, taps, committed):
        rows = torch.cat([taps[0], taps[1]], dim=-1).double()
        start = 0
        for seq, c in zip(batch, committed, strict=True):
            for row in rows[start : start + c]:
                d = self.digest[seq.seq_id]
                self.digest[seq.seq_id] = (d * 1.618 + float(row.sum()) * 1e3) % 1e6
            start += c

    def propose(self, batch, ks):
        return [
            Draft([(int(self.digest[s.seq_id]) + j) % self.vocab for j in range(k)])
            for s, k in zip(batch, ks, strict=True)
        ]


register_proposer(TapDigest.name, lambda ctx: TapDigest(ctx.target.config.vocab_size), replace=True)


@pytest.mark.parametrize("name", [TapDigest.name, "ngram"])
def test_a_long_plain_stretch_reaches_the_child_intact(name):
    """Kept plain for more than FLUSH_EVERY steps (taps sent batched, one array per layer; the
    short requests that came and went meanwhile never sent, their rows cut out of the steps
    they shared; an n-gram drafter, which observes nothing, sent nothing per step), then only
    the batch's first sequence drafts: every draft of the child's proposer is the in-process
    one's, and so is every sampled token.  :class:`TapDigest`'s drafts depend on every tap row
    it saw, an n-gram drafter's on its siblings' tokens (two samples per request, sampled:
    they differ), which the child must have although they did not draft."""
    from specrl.rollout.drafter_process import FLUSH_EVERY

    model = tiny()

    def run(drafter: str) -> tuple[list, list]:
        spec = SpecConfig(proposers=(name,), max_k=2, gate=False, decoupled=True, drafter=drafter)
        engine = make_engine(model, max_batch_size=3, spec=spec, max_model_len=256)
        plan, launch, steps, drafts = engine.drafting.controller.plan, engine.drafting.plan, [0], []

        def planned(batch_size: int, backlog=None):  # plain for FLUSH_EVERY + 9, then slot 0
            steps[0] += 1
            arms = plan(batch_size, backlog) if steps[0] > FLUSH_EVERY + 9 else None
            return arms and [arms[0]] + [None] * (batch_size - 1)

        def launched(*args):
            out = launch(*args)
            drafts.append([list(d.tokens) for d in out.drafts])
            return out

        engine.drafting.controller.plan, engine.drafting.plan = planned, launched
        requests = [
            Request(p, SamplingParams(max_tokens=m, temperature=1.0, n=2))
            for p, m in zip(PROMPTS, lengths, strict=True)
        ]
        return [r.tokens for r in engine.generate(requests)], drafts

    lengths = [110, 6, 110, 9, 12, 110]  # the short ones live and die while drafting is off
    tokens, drafts = run("process")
    assert (tokens, drafts) == run("thread")
    assert sum(len(d) for step in drafts for d in step) >= 20  # 177 and 39 tokens drafted


def test_a_drafter_process_gets_a_thread_in_decoupled_steps_only():
    """Decoupled steps run the target on the engine's threads less the drafter's; any other
    step, and the caller after ``generate``, has them all."""
    seen = []
    engine = make_engine(tiny(), max_batch_size=2, spec=process_spec(("ngram",)))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        real = engine._run
        engine._run = lambda launch: (seen.append(torch.get_num_threads()), real(launch))[1]
        engine.generate([Request(p, greedy(16)) for p in PROMPTS[:2]])
        assert torch.get_num_threads() == 2
        assert engine.stats()["decoupled"]["launched"] > 0
        assert 1 in seen and 2 in seen  # decoupled steps: 1; prefill and plain steps: 2
    finally:
        torch.set_num_threads(before)


def test_a_drafter_process_without_decoupled_drafting_is_refused():
    with pytest.raises(ValueError, match="decoupled true or auto"):
        SpecConfig(proposers=("ngram",), drafter="process")
