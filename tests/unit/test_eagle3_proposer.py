"""The EAGLE-3 proposer inside the engine: exact greedy, lossless sampling, weight updates."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from scipy import stats

from specrl.errors import CheckpointError, ConfigError
from specrl.models.generate import generate
from specrl.rollout import Request, SamplingParams, SpecConfig
from specrl.rollout.proposers.eagle3 import SCALES, TemperatureScale
from tests.unit.test_draft import make_pair
from tests.unit.test_engine import _exact_marginals, greedy, make_engine

pytestmark = pytest.mark.usefixtures("one_thread")


PROMPTS = [[1, 5, 6, 7, 5, 6], [3, 4, 3, 4, 3], [9], [10, 11, 12, 13, 10, 11, 12], [2, 2]]


def spec_with(draft, *names, k=4, **options):
    return SpecConfig(
        proposers=names,
        max_k=k,
        gate=False,
        proposer_options={"eagle3": {"draft": draft, **options}},
    )


@pytest.mark.parametrize("slots", [1, 3], ids=["batch1", "continuous"])
@pytest.mark.parametrize("names", [("eagle3",), ("eagle3", "ngram")], ids=["eagle3", "best-of-n"])
def test_greedy_eagle3_matches_plain(slots, names):
    target, draft = make_pair()
    ref = generate(target, PROMPTS, 20)
    engine = make_engine(target, max_batch_size=slots, spec=spec_with(draft, *names))
    out = engine.generate([Request(p, greedy(20)) for p in PROMPTS])
    assert [r.tokens for r in out] == ref
    s = engine.stats()
    assert s["spec"]["draft_tokens"] > 0
    assert "eagle3" in {arm.split("/")[0] for arm in s["gating"]["selections"]}


@pytest.mark.parametrize("scale", ["auto", 0.1])
def test_sampled_eagle3_is_lossless(scale):
    """Lossless whatever q the draft samples from: its own (learned scale, which visits every
    scale) or a much sharper one."""
    target, draft = make_pair(seed=2)
    params = SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, n=3000, seed=1)
    spec = spec_with(draft, "eagle3", k=2, temperature_scale=scale)
    engine = make_engine(target, max_batch_size=256, max_model_len=8, spec=spec)
    out = engine.generate([Request([1, 2], params)])
    assert engine.stats()["spec"]["drafts"] > 500
    rounds = engine.stats()["drafters"]["eagle3"]["temperature_scale"]["scales"]
    if scale == "auto":  # every scale drafted
        assert all(r["rounds"] > 0 and r["drafts"] > 0 for r in rounds.values())
    else:
        assert sum(r["rounds"] for r in rounds.values()) == 0
    tokens = np.array([r.tokens for r in out])
    v = target.config.vocab_size
    for pos, exact in enumerate(_exact_marginals(target, [1, 2], 3, params)):
        obs = np.bincount(tokens[:, pos], minlength=v)
        assert obs[exact == 0].sum() == 0
        keep = exact * len(out) >= 5
        pool = (exact > 0) & ~keep
        f_obs = np.append(obs[keep], obs[pool].sum()) if pool.any() else obs[keep]
        f_exp = np.append(exact[keep], exact[pool].sum()) if pool.any() else exact[keep]
        # 1 % family-wise over the 3 positions (Bonferroni)
        assert stats.chisquare(f_obs, f_exp * len(out)).pvalue > 0.01 / 3, f"position {pos}"


def test_draft_weight_update_changes_drafts_not_outputs():
    target, draft = make_pair()
    _, other = make_pair(seed=5)
    engine = make_engine(target, max_batch_size=2, spec=spec_with(draft, "eagle3"))
    ref = generate(target, PROMPTS[:2], 12)
    state = {k: v for k, v in other.state_dict().items() if not k.startswith("embed")}
    engine.update_weights(draft=state, version=3)
    out = engine.generate([Request(p, greedy(12)) for p in PROMPTS[:2]])
    assert [r.tokens for r in out] == ref
    assert engine.stats()["draft_version"] == 3
    prop = engine.proposers["eagle3"]
    assert torch.equal(prop.draft.fc.weight, other.fc.weight)
    bad = dict(state)
    bad["fc.weight"] = bad["fc.weight"][:, :5]
    with pytest.raises(CheckpointError, match="shape"):
        engine.update_weights(draft=bad)


def test_policy_update_reaches_the_shared_embedding():
    target, draft = make_pair()
    engine = make_engine(target, max_batch_size=1, spec=spec_with(draft, "eagle3"))
    new = {k: v + 0.1 for k, v in target.state_dict().items()}
    engine.update_weights(policy=new)
    emb = engine.proposers["eagle3"].draft.embed_tokens.weight
    assert torch.equal(emb, engine.model.model.embed_tokens.weight)


def _drafts_per_sequence(engine, requests):
    """Run ``requests``; per request id, each eagle3 draft and the draft state it started from
    (the pre-norm hidden at the last committed position, after catching up)."""
    prop = engine.proposers["eagle3"]
    inner = prop.propose
    seen: dict[str, list[tuple[list[int], torch.Tensor]]] = {}

    def recording(batch, ks):
        out = inner(batch, ks)
        for seq, d, k in zip(batch, out, ks, strict=True):
            if k == 0:  # passed along at its last token (the engine keeps batches whole)
                continue
            h = prop._state[seq.seq_id].h_last.clone()
            seen.setdefault(seq.request_id, []).append((d.tokens, h))
        return out

    prop.propose = recording
    engine.generate(requests)
    return seen


@pytest.mark.parametrize("with_move", [True, False], ids=["move", "no-move-control"])
def test_slot_compaction_moves_the_draft_cache(with_move):
    """Sequences that change slots draft exactly as when decoded alone (k = 1, float64);
    the control (state left behind in the old slot) shows the check has power."""
    target, draft = make_pair()
    lengths = [3, 16, 16, 16, 16]
    requests = [
        Request(p, greedy(n), request_id=f"r{i}")
        for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))
    ]
    alone = {}
    for r in requests:
        solo = make_engine(target, max_batch_size=1, spec=spec_with(draft, "eagle3", k=1))
        alone.update(_drafts_per_sequence(solo, [r]))
    engine = make_engine(target, max_batch_size=3, spec=spec_with(draft, "eagle3", k=1))
    prop = engine.proposers["eagle3"]
    moved = []
    inner_move = prop.move

    def move(moves):
        moved.extend((s.request_id, s.slot, slot) for s, slot in moves)
        if with_move:
            inner_move(moves)

    prop.move = move
    together = _drafts_per_sequence(engine, requests)
    assert ("r2", 2, 0) in moved  # r0 finished first: r2 left slot 2 for slot 0
    assert together.keys() == alone.keys()
    gap = 0.0
    for rid, steps in together.items():
        assert len(steps) == len(alone[rid])
        for (tokens, h), (tokens_alone, h_alone) in zip(steps, alone[rid], strict=True):
            gap = max(gap, (h - h_alone).abs().max().item())
            if with_move:
                assert tokens == tokens_alone
    if with_move:
        assert gap <= 1e-10
    else:
        assert gap > 1e-4


def test_backlog_counts_the_positions_the_draft_has_not_seen():
    """``backlog`` = positions committed since the draft's last step-0 pass: the prompts after
    prefill, one more per sequence each plain step, all caught up by a drafting call (whose
    cost sample carries that backlog), then the newly committed positions."""
    target, draft = make_pair()
    engine = make_engine(target, max_batch_size=2, spec=spec_with(draft, "eagle3", k=2))
    prop = engine.proposers["eagle3"]
    running: dict[int, object] = {}
    observe, propose, caught_up = prop.observe, prop.propose, []

    def spy_observe(batch, *args):
        running.update((s.seq_id, s) for s in batch)
        observe(batch, *args)

    def spy_propose(batch, ks):
        caught_up.append(prop.backlog(batch))
        return propose(batch, ks)

    prop.observe, prop.propose = spy_observe, spy_propose
    engine.controller.force(False)
    engine.add_requests([Request(p, greedy(12)) for p in PROMPTS[:2]])
    queued = []
    for _ in range(4):
        engine.step()
        queued.append(prop.backlog(list(running.values())))
    assert queued == [11, 13, 15, 17]  # prompts of 6 and 5 tokens, then +2 a plain step
    engine.controller.force(True)
    engine.step()
    assert caught_up == [17]  # the drafting call caught up all of it ...
    assert engine.controller.costs.drafting["eagle3"].observations == 1  # ... in its cost sample
    assert 2 <= prop.backlog(list(running.values())) <= 2 * 3  # then what it committed


needs_cxx = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="torch.compile on CPU needs a C++ compiler",
)


@needs_cxx
def test_a_compiled_round_is_continued_ahead_exactly():
    """A compiled round (the whole batch in every pass, shorter chains cut afterwards) keeps
    its chains' ends as an eager round does: k compiled tokens, then k' drafted ahead, are the
    tokens and q of one compiled k + k' round (the same generator draws, float64).  A
    vocabulary of its own: the graphs compiled here are its own (other tests count theirs)."""
    target, draft = make_pair(seed=4, vocab=43)
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3)
    options = {"eagle3": {"draft": draft, "temperature_scale": 1.0}}
    spec = SpecConfig(proposers=("eagle3",), max_k=8, gate=False, proposer_options=options)

    def prefilled():
        engine = make_engine(target, max_batch_size=3, spec=spec, compile=True, guard_check_every=1)
        engine.add_requests([Request(PROMPTS[0], params), Request(PROMPTS[3], params)])
        engine.step()  # prefill: the proposer holds the prompts' taps
        prop, starts = engine.proposers["eagle3"], []
        inner = prop._compiled_start

        def start(*args, **kwargs):  # the compiled round's first pass ran
            starts.append(kwargs["key"])
            return inner(*args, **kwargs)

        prop._compiled_start = start
        return prop, engine.scheduler.running, starts

    prop, seqs, starts = prefilled()
    long = prop.propose(seqs, [6, 6])
    prop, seqs, starts_short = prefilled()
    short = prop.propose(seqs, [2, 3])
    assert starts and starts_short  # both rounds were compiled
    ahead = prop.propose_ahead(seqs, short, [4, 3])
    for b, (k, k2) in enumerate(((2, 4), (3, 3))):
        assert short[b].tokens + ahead[b].tokens == long[b].tokens[: k + k2]
        q = torch.cat([short[b].probs, ahead[b].probs])
        torch.testing.assert_close(q, long[b].probs[: k + k2], rtol=0, atol=1e-12)
    assert len(set(long[0].tokens)) > 1  # a chain that depends on its rows


class _CallSpy:
    """A callable's stand-in that counts its calls (every other attribute is the callable's)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@needs_cxx
def test_decoupled_drafting_continues_compiled_rounds():
    """In a compiled engine: a target and draft that both always pick token 0 (zeroed output
    heads) accept every draft and every guess, so the steps after a compiled round draft ahead
    from its chains' ends (a compiled round used to keep none: nothing to continue)."""
    target, draft = make_pair(seed=4, vocab=43)  # the shapes of the test above: its graphs
    draft.set_vocab_map(torch.arange(29))  # draft id 0 is token 0
    with torch.no_grad():
        target.lm_head.weight.zero_()
        draft.lm_head.weight.zero_()
    spec = SpecConfig(
        proposers=("eagle3",),
        max_k=3,
        draft_lengths=(3,),
        gate=False,
        decoupled=True,
        proposer_options={"eagle3": {"draft": draft}},
    )
    engine = make_engine(target, max_batch_size=2, spec=spec, compile=True, guard_check_every=1)
    prop = engine.proposers["eagle3"]
    prop._compiled_start = start = _CallSpy(prop._compiled_start)  # a compiled round's start
    out = engine.generate([Request(p, greedy(30)) for p in PROMPTS[:3]])
    assert all(r.tokens == [0] * 30 for r in out)
    assert start.calls  # each sequence's first round (and any after a miss) ran compiled
    d = engine.stats()["decoupled"]
    assert d["hits"] >= 0.7 * d["launched"] > 0


@pytest.mark.parametrize("bad", [0, -0.5, "hot", True, None])
def test_temperature_scale_rejects_bad_values(bad):
    with pytest.raises(ConfigError, match="temperature_scale"):
        TemperatureScale(bad)


def test_fixed_temperature_scale_draws_nothing_and_reports_its_q():
    """A fixed scale s: q = softmax(draft logits / (T·s)) exactly, every round."""
    target, draft = make_pair(seed=3)
    engine = make_engine(
        target, max_batch_size=1, spec=spec_with(draft, "eagle3", k=1, temperature_scale=0.25)
    )
    prop = engine.proposers["eagle3"]
    inner, seen = prop.propose, []

    def recording(batch, ks):
        h = [prop._state[s.seq_id] for s in batch]
        out = inner(batch, ks)
        for st, d in zip(h, out, strict=True):
            if d.tokens:
                seen.append((st.h_last.clone(), d.probs[0].clone()))
        return out

    prop.propose = recording
    engine.generate([Request(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.8, seed=4))])
    assert seen
    for h, q in seen:
        logits = prop.draft.logits(h[None])[0]
        want = torch.zeros_like(q)
        want[prop.passes.to_target] = torch.softmax(logits.double() / (0.8 * 0.25), -1).to(q.dtype)
        torch.testing.assert_close(q, want)
    assert prop.temperature_scale.to_dict()["mode"] == "fixed"


def test_learned_temperature_scale_settles_on_the_best_scale():
    """Simulated verifications where s = 0.25 accepts most: after the round-robin start, the
    bandit plays it in the large majority of rounds and still revisits the others."""
    rng = np.random.default_rng(0)
    rate = {1.0: 0.5, 0.5: 0.6, 0.25: 0.7, 0.1: 0.65}
    ts = TemperatureScale("auto", seed=0)
    picks = []
    for _ in range(2000):
        s = ts.pick()
        picks.append(s)
        ts.record(s, int(rng.binomial(4, rate[s])), 4)
    late = picks[500:]
    assert late.count(0.25) / len(late) > 0.8
    assert set(late) == set(SCALES)  # exploration continues (the draft drifts)
    est = {float(k): v["acceptance"] for k, v in ts.to_dict()["scales"].items()}
    assert max(est, key=est.get) == 0.25


def test_learned_temperature_scale_is_resumable():
    """The scale bandit is engine state: a fresh engine loading ``state_dict()`` samples the
    same tokens as the engine it came from."""
    target, draft = make_pair(seed=2)
    spec = spec_with(draft, "eagle3", k=2)
    first = make_engine(target, max_batch_size=2, spec=spec)
    params = SamplingParams(max_tokens=8, temperature=1.0, n=4, seed=3)
    first.generate([Request(p, params) for p in PROMPTS[:2]])
    fresh = make_engine(target, max_batch_size=2, spec=spec)
    fresh.load_state_dict(first.state_dict())
    scale = {e: e.proposers["eagle3"].temperature_scale for e in (first, fresh)}
    assert scale[first].to_dict() == scale[fresh].to_dict()
    assert scale[first].to_dict()["scales"]["1.0"]["drafts"] > 0
    again = [
        Request(p, SamplingParams(max_tokens=8, temperature=1.0, n=4, seed=9)) for p in PROMPTS
    ]
    a = [r.tokens for r in first.generate(again)]
    b = [r.tokens for r in fresh.generate(again)]
    assert a == b
    assert scale[first].to_dict() == scale[fresh].to_dict()
