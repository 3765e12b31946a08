"""Decoupled drafting: the drafter drafts step t + 1 beside step t's verification.

Greedy decoupled decoding is plain decoding token for token (batch 1 and continuous batching,
every proposer); sampled decoding follows the policy (χ² at 1 %) and an off-by-one q in the
ahead drafts is caught; a worker that raises, dies or hangs fails the call in bounded time.
"""

from __future__ import annotations

import copy
import random
import threading
import time

import numpy as np
import pytest
import torch
from scipy import stats

from specrl.core.attention import PackedLayout
from specrl.errors import ConfigError
from specrl.models.generate import generate
from specrl.rollout import Request, SamplingParams, SpecConfig, decoupled
from specrl.rollout.decoupled import DrafterError, DraftWorker, split_ahead
from specrl.rollout.proposers import register_proposer
from specrl.rollout.sampling import RowParams, sampling_probs
from specrl.rollout.types import Draft
from tests.unit.test_draft import make_pair
from tests.unit.test_engine import PROMPTS, Garbage, Oracle, _exact_marginals, make_engine, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

# the test proposers only read the sequences they are given: safe on shadow sequences
Garbage.ahead_safe = True
Oracle.ahead_safe = True


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.mark.parametrize("slots", [1, 3], ids=["batch1", "continuous"])
@pytest.mark.parametrize(
    "proposers",
    [("ngram",), ("test-oracle",), ("test-garbage",), ("ngram", "test-garbage", "test-oracle")],
    ids=["ngram", "oracle", "garbage", "best-of-n"],
)
def test_greedy_decoupled_matches_plain(slots, proposers):
    model = tiny()
    ref = generate(model, PROMPTS, 24)
    spec = SpecConfig(proposers=proposers, max_k=3, gate=False, decoupled=True)
    engine = make_engine(model, max_batch_size=slots, spec=spec)
    out = engine.generate([Request(p, greedy()) for p in PROMPTS])
    assert [r.tokens for r in out] == ref
    d = engine.stats()["decoupled"]
    assert d["launched"] > 0 and d["hits"] + d["misses"] == d["launched"]
    if proposers == ("test-oracle",):  # every draft accepted and every guess right
        assert d["hit_rate"] > 0.5
    if proposers == ("test-garbage",):
        assert d["hits"] < d["launched"] / 4


@pytest.mark.parametrize("slots", [1, 3], ids=["batch1", "continuous"])
@pytest.mark.parametrize("names", [("eagle3",), ("eagle3", "ngram")], ids=["eagle3", "best-of-n"])
def test_greedy_decoupled_eagle3_matches_plain(slots, names):
    """EAGLE-3 drafts ahead by continuing its chain (``propose_ahead``), through slot moves."""
    target, draft = make_pair()
    prompts = [*PROMPTS, [4, 4, 5], [6, 1]]
    lengths = [20, 7, 13, 20, 3, 16, 9, 20]  # finishing at different steps: compaction moves
    ref = [generate(target, [p], m)[0] for p, m in zip(prompts, lengths, strict=True)]
    spec = SpecConfig(
        proposers=names,
        max_k=3,
        gate=False,
        decoupled=True,
        proposer_options={"eagle3": {"draft": draft}},
    )
    engine = make_engine(target, max_batch_size=slots, spec=spec)
    out = engine.generate([Request(p, greedy(m)) for p, m in zip(prompts, lengths, strict=True)])
    assert [r.tokens for r in out] == ref
    d = engine.stats()["decoupled"]
    assert d["launched"] > 0 and d["hits"] + d["misses"] == d["launched"]


def test_greedy_decoupled_eagle3_hits_when_the_draft_is_right():
    """A target and draft that both always pick token 0 (zeroed output heads): every draft
    is accepted and every guess right, so after the first round every step drafts ahead."""
    target, draft = make_pair(draft_vocab=32)
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
    engine = make_engine(target, max_batch_size=2, spec=spec)
    out = engine.generate([Request(p, greedy(30)) for p in PROMPTS[:3]])
    assert all(r.tokens == [0] * 30 for r in out)
    d = engine.stats()["decoupled"]
    assert d["hits"] >= 0.7 * d["launched"] > 0


@pytest.mark.parametrize("moved", [False, True])
def test_eagle3_propose_ahead_continues_the_chain_exactly(moved):
    """Drafting k then continuing k' ahead draws the tokens and q a k + k' long round would
    (the first ahead token is d_{k+1}, the guess of the bonus token; the same generator, so
    the same uniforms), also after the sequence moved to another slot (its chain rows move
    with it)."""
    target, draft = make_pair(seed=4)
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3)

    def prefilled():
        spec = SpecConfig(
            proposers=("eagle3",), max_k=8, gate=False,
            proposer_options={"eagle3": {"draft": draft, "temperature_scale": 1.0}},
        )  # fmt: skip
        engine = make_engine(target, max_batch_size=3, spec=spec)
        engine.add_requests([Request(PROMPTS[0], params), Request(PROMPTS[3], params)])
        engine.step()  # prefill: the proposer holds the prompts' taps
        return engine, engine.proposers["eagle3"], engine.scheduler.running

    _, prop, seqs = prefilled()
    long = prop.propose(seqs, [6, 6])
    _, prop, seqs = prefilled()
    short = prop.propose(seqs, [2, 3])
    if moved:  # the second sequence moves from slot 1 to slot 2
        prop.move([(seqs[1], 2)])
        seqs[1].slot = 2
    ahead = prop.propose_ahead(seqs, short, [4, 3])
    for b, (k, k2) in enumerate(((2, 4), (3, 3))):
        assert short[b].tokens + ahead[b].tokens == long[b].tokens[: k + k2]
        q = torch.cat([short[b].probs, ahead[b].probs])
        torch.testing.assert_close(q, long[b].probs[: k + k2])
    assert len(set(long[0].tokens)) > 1  # a chain that depends on its rows
    # a draft that is not the proposer's last chain is not continued
    assert prop.propose_ahead(seqs, [Draft([1, 2]), Draft([])], [3, 3])[0].tokens == []


def test_split_ahead_moves_the_guess_and_its_q_row():
    q = torch.eye(4, dtype=torch.float64)[[2, 0, 3]]
    guess, nxt = split_ahead(Draft([2, 0, 3], q))
    assert guess == 2 and nxt.tokens == [0, 3]
    assert torch.equal(nxt.probs, q[1:])
    assert split_ahead(Draft([])) == (None, Draft([]))


# ------------------------------------------------------------------------- sampling
class MixQ(Garbage):
    """Samples drafts from q = ½ p + ½ n_t (p: the target's processed distribution, n_t a fixed
    random distribution per position t) and reports q: often accepted, so ahead drafts are
    often used, yet q ≠ p, so a wrong q row shows in the output distribution."""

    name = "test-mixq"
    ahead_safe = True

    def __init__(self, target, seed: int) -> None:
        super().__init__(target.config.vocab_size, seed)
        self.model = copy.deepcopy(target)
        g = torch.Generator().manual_seed(seed + 99)
        self.noise = torch.rand(64, self.vocab, generator=g, dtype=torch.float64) ** 4
        self.noise /= self.noise.sum(-1, keepdim=True)

    def propose(self, batch, ks):
        toks = [list(s.tokens) for s in batch]
        drawn: list[list[int]] = [[] for _ in batch]
        qs: list[list[torch.Tensor]] = [[] for _ in batch]
        for j in range(max(ks, default=0)):
            live = [b for b, k in enumerate(ks) if k > j]
            layout = PackedLayout.from_lengths([len(toks[b]) for b in live])
            with torch.no_grad():
                logits = self.model(
                    torch.tensor([t for b in live for t in toks[b]]),
                    layout,
                    logits_index=layout.cu_seqlens[1:] - 1,
                ).logits
            rows = RowParams.build([batch[b].params for b in live], [1] * len(live), "cpu")
            p = sampling_probs(logits, rows)
            for r, b in enumerate(live):
                q = 0.5 * p[r] + 0.5 * self.noise[len(toks[b])]
                t = int(torch.multinomial(q, 1, generator=self.gen))
                toks[b].append(t)
                drawn[b].append(t)
                qs[b].append(q)
        return [Draft(d, torch.stack(q) if q else None) for d, q in zip(drawn, qs, strict=True)]


register_proposer("test-mixq", lambda ctx: MixQ(ctx.target, ctx.seed), replace=True)


def _lossy_split(draft: Draft):
    """An off-by-one q: the next draft keeps the q rows of the guess and the tokens before."""
    if not draft.tokens:
        return None, Draft([])
    probs = None if draft.probs is None else draft.probs[: len(draft.tokens) - 1]
    return int(draft.tokens[0]), Draft(list(draft.tokens[1:]), probs)


def _pvalues(model, out, prompt, steps, params) -> list[float]:
    tokens = np.array([r.tokens for r in out])
    v = model.config.vocab_size
    pvalues = []
    for pos, exact in enumerate(_exact_marginals(model, prompt, steps, params)):
        obs = np.bincount(tokens[:, pos], minlength=v)
        if obs[exact == 0].sum():
            pvalues.append(0.0)
            continue
        keep = exact * len(out) >= 5
        pool = (exact > 0) & ~keep  # cells expecting < 5 draws are pooled into one
        f_obs = np.append(obs[keep], obs[pool].sum()) if pool.any() else obs[keep]
        f_exp = np.append(exact[keep], exact[pool].sum()) if pool.any() else exact[keep]
        pvalues.append(stats.chisquare(f_obs, f_exp * len(out)).pvalue)
    return pvalues


@pytest.mark.slow  # ~25 s of CPU each (~90 s wall on the loaded 2-core machine)
@pytest.mark.parametrize("lossy", [False, True], ids=["decoupled", "lossy-q"])
def test_sampled_decoupled_follows_the_policy(lossy, monkeypatch):
    """χ² per position at 1 % family-wise over 20 000 samples: the decoupled path follows the
    policy; the same run with the ahead drafts' q rows off by one is rejected."""
    if lossy:
        monkeypatch.setattr(decoupled, "split_ahead", _lossy_split)
    model = tiny(seed=3, vocab=12)
    # 5 tokens: the prefill's, step 1's d_1 + bonus (drafted ahead: the guess and d'_1), step
    # 2's d'_1 (the ahead draft when the guess held) + bonus
    params = SamplingParams(max_tokens=5, temperature=0.9, top_k=8, n=20_000, seed=0)
    spec = SpecConfig(proposers=("test-mixq",), max_k=1, gate=False, decoupled=True)
    engine = make_engine(model, max_batch_size=512, max_model_len=8, spec=spec)
    out = engine.generate([Request([1, 2], params)])
    d = engine.stats()["decoupled"]
    assert d["hits"] > 2000  # the ahead drafts carry a good share of the decoding
    pvalues = _pvalues(model, out, [1, 2], 5, params)
    if lossy:
        assert min(pvalues) < 0.01 / 5, pvalues
    else:
        assert min(pvalues) > 0.01 / 5, pvalues


# ------------------------------------------------------------------------- failures
def test_worker_errors_death_and_hangs_fail_in_bounded_time():
    w = DraftWorker("t", timeout=0.5)
    assert w.wait(w.submit(lambda x: x + 1, 1)) == 2
    with pytest.raises(DrafterError, match="failed: ValueError: boom"):
        w.wait(w.submit(_raise, ValueError("boom")))
    with pytest.raises(DrafterError, match="unusable"):
        w.submit(lambda: 0)

    hung = DraftWorker("h", timeout=0.3)
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(DrafterError, match=r"hung: no draft within 0\.3 s"):
        hung.wait(hung.submit(release.wait, 30))
    assert time.monotonic() - t0 < 5
    release.set()

    dead = DraftWorker("d", timeout=10)
    fut = dead.submit(_raise, SystemExit(3))  # the thread itself ends
    t0 = time.monotonic()
    with pytest.raises(DrafterError, match="died"):
        dead.wait(fut)
    assert time.monotonic() - t0 < 5


def test_a_collected_worker_stops_its_thread():
    import gc

    w = DraftWorker("gc", timeout=5)
    assert w.wait(w.submit(lambda: 7)) == 7
    thread = w._thread
    assert thread is not None and thread.is_alive()
    del w
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def _raise(exc: BaseException):
    raise exc


class _Hang(Garbage):
    """Drafts coupled normally; its ahead drafts (on the worker thread) never return."""

    name = "test-hang"

    def __init__(self, vocab: int, seed: int) -> None:
        super().__init__(vocab, seed)
        self.main = threading.current_thread()
        self.unblock = threading.Event()

    def propose(self, batch, ks):
        if threading.current_thread() is not self.main:
            self.unblock.wait(60)
        return super().propose(batch, ks)


class _Die(_Hang):
    name = "test-die"

    def propose(self, batch, ks):
        if threading.current_thread() is not self.main:
            raise SystemExit(1)  # ends the worker thread
        return super().propose(batch, ks)


@pytest.mark.parametrize("kind", [_Hang, _Die], ids=["hung", "dead"])
def test_a_hung_or_dead_drafter_fails_the_call_and_the_engine_recovers(kind, caplog):
    from specrl.rollout.proposers import register_proposer

    kind.ahead_safe = True
    made = []
    register_proposer(
        kind.name, lambda ctx: made.append(kind(ctx.target.config.vocab_size, 0)) or made[-1],
        replace=True,
    )  # fmt: skip
    spec = SpecConfig(
        proposers=(kind.name,), max_k=2, gate=False, decoupled=True, drafter_timeout=0.5
    )
    engine = make_engine(tiny(), max_batch_size=2, spec=spec)
    t0 = time.monotonic()
    with pytest.raises(DrafterError, match=r"hung|died"):
        engine.generate([Request(p, greedy(12)) for p in PROMPTS[:3]])
    assert time.monotonic() - t0 < 20
    made[0].unblock.set()
    assert not engine.has_unfinished() and engine.stats()["running"] == 0
    assert engine.stats()["decoupled"] is None  # the engine drafts coupled from now on
    assert "decoupled drafting is off" in caplog.text
    out = engine.generate([Request(p, greedy(8)) for p in PROMPTS[:3]])
    assert [r.tokens for r in out] == generate(engine.model, PROMPTS[:3], 8)


# ------------------------------------------------------------------------- the choice
def _simulate_modes(ctrl, batch, steps, contention, seed=0):
    """Decode steps under ``ctrl``: a target step of r rows costs 10 ms up to 16 rows, then
    linearly more (× ``contention`` in decoupled steps: the worker shares the cores); coupled
    drafting costs 6 ms a step, decoupled 0.5 ms of waiting; drafts accepted with p 0.8.
    Returns (tokens, seconds)."""
    rng, tokens, seconds = random.Random(seed), 0, 0.0
    for _ in range(steps):
        arms = [a for a in ctrl.plan(batch) or [] if a is not None]
        tokens += batch - len(arms)
        for arm in arms:
            acc = 0
            while acc < arm.k and rng.random() < 0.8:
                acc += 1
            ctrl.record(arm, arm.k, acc + 1)
            tokens += acc + 1
        mode = arms[0].mode if arms else "plain"
        rows = batch + sum(a.k for a in arms)
        step = 1e-2 * max(1.0, rows / 16) * (contention if mode == "decoupled" else 1.0)
        ctrl.record_step(rows, step, mode)
        draft = 0.0
        if arms:
            draft = 5e-4 if mode == "decoupled" else 6e-3
            ctrl.record_draft("p", sum(a.k for a in arms), draft, ahead=mode == "decoupled")
        seconds += step + draft
    return tokens, seconds


@pytest.mark.parametrize("contention", [1.1, 2.0], ids=["own-core", "shared-core"])
def test_the_gate_picks_plain_coupled_or_decoupled_per_batch_size(contention):
    """One measured-cost policy: decoupled at batch 1 where the drafter has a core of its own,
    coupled where it only competes with the target, plain at a compute-bound batch 64."""
    from specrl.rollout.gating import SpecController

    ctrl = SpecController(SpecConfig(["p"], max_k=4, decoupled="auto"), ["p"], ahead=["p"])
    _simulate_modes(ctrl, 1, 400, contention)
    chosen = ctrl.to_dict()["selections"]
    ahead = sum(v for a, v in chosen.items() if a.endswith("/ahead"))
    coupled = sum(chosen.values()) - ahead
    assert (ahead > 3 * coupled) if contention < 1.5 else (coupled > 3 * ahead)
    tokens, seconds = _simulate_modes(ctrl, 64, 400, contention)
    assert ctrl.gate.states[1] is True and ctrl.gate.states[64] is False
    assert tokens / seconds > 0.97 * 64 / 0.04  # never below plain (probes cost < 3 %)


def test_decoupled_only_falls_back_to_plain_where_that_is_cheaper():
    from specrl.rollout.gating import SpecController

    ctrl = SpecController(SpecConfig(["p"], max_k=4, decoupled=True), ["p"], ahead=["p"])
    assert all(a.ahead for a in ctrl.arms)
    tokens, seconds = _simulate_modes(ctrl, 64, 300, contention=1.1)
    assert tokens / seconds > 0.97 * 64 / 0.04 and ctrl.gate.states[64] is False
    _simulate_modes(ctrl, 1, 200, contention=1.1)
    assert ctrl.gate.states[1] is True


@pytest.mark.parametrize("slots", [1, 3], ids=["batch1", "continuous"])
def test_greedy_auto_mode_matches_plain_and_uses_both_modes(slots):
    model = tiny()
    ref = generate(model, PROMPTS, 24)
    spec = SpecConfig(proposers=("ngram", "test-oracle"), max_k=3, gate=False, decoupled="auto")
    engine = make_engine(model, max_batch_size=slots, spec=spec)
    out = engine.generate([Request(p, greedy()) for p in PROMPTS])
    assert [r.tokens for r in out] == ref
    chosen = engine.stats()["gating"]["selections"]  # the bandit played both modes' arms
    assert {a.endswith("/ahead") for a in chosen} == {True, False}
    assert engine.stats()["decoupled"]["launched"] > 0
    with pytest.raises(ConfigError, match="decoupled"):
        make_engine(model, spec=SpecConfig(proposers=["ngram"], decoupled="sometimes"))


def test_ceiling_pair_accepts_every_draft(tmp_path):
    """benchmarks/studies/ceiling_pair.py: both models put all-zero logits on every token, so
    greedy drafts are always accepted and every decoupled guess holds."""
    from benchmarks.studies.ceiling_pair import make_pair as ceiling_pair

    from specrl.models.checkpoint import load_model

    target_dir, draft_dir = ceiling_pair("toy-tiny", tmp_path / "pair")
    model = load_model(target_dir)
    spec = SpecConfig(
        proposers=("eagle3",), max_k=3, gate=False, decoupled=True,
        proposer_options={"eagle3": {"path": str(draft_dir)}},
    )  # fmt: skip
    engine = make_engine(model, max_batch_size=2, spec=spec)
    out = engine.generate([Request([1, 5, 6], greedy(20)), Request([1, 7], greedy(20))])
    assert all(r.tokens == [0] * 20 for r in out)
    s = engine.stats()
    assert s["spec"]["acceptance_rate"] == 1.0 and s["decoupled"]["hits"] > 0


def test_ngram_drafts_ahead_into_the_drafts_it_assumes():
    """On a shadow (the sequence with its drafts appended) n-gram's own-context match
    continues into the drafted tokens, as it would once they are accepted."""
    from specrl.rollout.decoupled import shadow as make_shadow
    from specrl.rollout.proposers.ngram import NgramProposer
    from specrl.rollout.types import SeqState

    ngram = NgramProposer(min_n=2, max_n=4)
    seq = SeqState(0, "r", 0, [1, 2, 3, 1, 2, 3, 1], 2, greedy(), None)
    ngram.reset(seq)
    assert ngram.propose([seq], [3])[0].tokens == [2, 3, 1]
    shadow = make_shadow(seq, Draft([2, 3]), None)
    # the latest (2, 3) ends at 5: it continues with shadow[6:9] (the index alone has [1])
    assert ngram.propose([shadow], [4])[0].tokens == [1, 2, 3]
    assert seq.tokens == [1, 2, 3, 1, 2, 3, 1]  # the real sequence is untouched
