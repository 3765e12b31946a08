"""Compiled decoding (``RolloutEngine(compile=True)``): the same tokens and logprobs as eager
decoding, graphs reused across batch shapes, weight updates seen without recompiling.

Float64 tiny decoders as in ``test_engine``: compiled and eager forwards differ by rounding
only (≈ 1e-15), so greedy tokens must match exactly and logprobs to 1e-9.  Inductor on CPU
builds C++; without a compiler these tests skip (the engine then refuses ``compile=True``, which
the last test checks).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from specrl.errors import ConfigError
from specrl.models.generate import generate
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig
from specrl.rollout.compiled import _ENTRIES
from tests.unit.test_draft import make_pair
from tests.unit.test_engine import PROMPTS, greedy, tiny
from tests.unit.test_engine import make_engine as _make_engine

pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(model, **kwargs) -> RolloutEngine:
    """``test_engine.make_engine`` with every guard-free call of a compiled graph class checked
    first: the compiled-engine tests prove that each class's key names every fact its graph
    depends on."""
    return _make_engine(model, guard_check_every=1, **kwargs)


needs_cxx = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="inductor on CPU needs a C++ compiler",
)


@pytest.fixture(scope="module")
def model():
    """One model for the module: dynamo's graphs are cached per model, so engines share them."""
    return tiny(seed=3)


def requests(params: list[SamplingParams]) -> list[Request]:
    return [
        Request(PROMPTS[i % len(PROMPTS)], sp, request_id=str(i)) for i, sp in enumerate(params)
    ]


MIXED = [  # uneven lengths: sequences finish at different steps, slots move, batches shrink
    SamplingParams(max_tokens=m, temperature=t, top_p=p, n=n, seed=i)
    for i, (m, t, p, n) in enumerate(
        [(20, 0.0, 1.0, 1), (7, 1.0, 1.0, 2), (13, 0.7, 0.9, 1), (3, 0.0, 1.0, 2), (16, 1.3, 1, 1)]
    )
]


def _replay(controller, plans: list, record: bool) -> None:
    """Record the controller's plans into ``plans``, or replay them in order."""
    plan = controller.plan

    def recorded(batch_size, *args, **kwargs):
        arms = plan(batch_size, *args, **kwargs)
        plans.append((batch_size, arms))
        return arms

    def replayed(batch_size, *args, **kwargs):
        size, arms = plans[replayed.step]
        assert size == batch_size, f"step {replayed.step}: batch {batch_size}, recorded {size}"
        replayed.step += 1
        return arms

    replayed.step = 0
    controller.plan = recorded if record else replayed


@needs_cxx
@pytest.mark.parametrize(
    "proposers", [(), ("ngram", "test-garbage", "test-randq")], ids=["plain", "best-of-n"]
)
def test_compiled_engine_emits_what_the_eager_engine_emits(model, proposers):
    spec = SpecConfig(proposers=proposers, max_k=3, gate=False) if proposers else None
    out, plans = {}, []
    for compiled in (False, True):
        engine = make_engine(model, max_batch_size=3, spec=spec, compile=compiled)
        if proposers:  # the same arms: the bandit's values follow the step timings, and steps
            # that compile a graph are no timing sample, so the fits (and arms) would differ
            _replay(engine.controller, plans, record=not compiled)
        out[compiled] = engine.generate(requests(MIXED))
    assert engine.stats()["compiled_graphs"] > 0  # this run compiled (M > 1 is new for best-of-n)
    assert engine._compiled.unguarded > 0  # and most steps skipped dynamo's guards
    assert engine._compiled.direct > 0 or _ENTRIES is None  # (directly, where torch allows)
    eager, comp = out[False], out[True]
    assert [r.tokens for r in comp] == [r.tokens for r in eager]
    for a, b in zip(comp, eager, strict=True):
        assert a.finish_reason == b.finish_reason
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-9)
        torch.testing.assert_close(a.policy_logprobs, b.policy_logprobs, rtol=0, atol=1e-9)
    greedy_rows = [i for i, r in enumerate(comp) if MIXED[int(r.request_id)].temperature == 0]
    for i in greedy_rows:  # and greedy rows are the reference decode
        r = comp[i]
        assert r.tokens == generate(model, [r.prompt_tokens], len(r.tokens))[0]
    if proposers:
        assert 0 < engine.stats()["spec"]["accepted"] < engine.stats()["spec"]["draft_tokens"]


@needs_cxx
def test_compiled_graphs_are_reused_across_batch_shapes(model):
    spec = SpecConfig(proposers=("ngram", "test-garbage"), max_k=4, gate=False)
    engine = make_engine(model, max_batch_size=4, spec=spec, compile=True)
    engine.generate(requests(MIXED))  # warm-up: B = 1 and B > 1, M = 1 and M > 1
    assert engine._compiled.graphs <= 4  # the decode step's graphs
    assert engine._compiled_decide.graphs <= 4  # and the verification's
    # new batch sizes, draft lengths, KV lengths and prompts: no graph may be compiled
    later = [SamplingParams(max_tokens=m, temperature=0.0, n=n) for m, n in [(30, 3), (5, 1)]]
    with torch.compiler.set_stance("fail_on_recompile"):
        out = engine.generate(requests(later + MIXED[:2]))
        plain = make_engine(model, max_batch_size=2, compile=True)
        plain_out = plain.generate(requests(later))
    for r in [*out[:4], *plain_out]:
        assert r.tokens == generate(model, [r.prompt_tokens], len(r.tokens))[0]


@needs_cxx
def test_compiled_engine_follows_weight_updates_without_recompiling():
    # a vocabulary of its own: parameter shapes are static, so this model compiles its graphs
    model, other = tiny(seed=0, vocab=40), tiny(seed=9, vocab=40)
    engine = make_engine(
        model, max_batch_size=2, spec=SpecConfig(proposers=["ngram"], max_k=2), compile=True
    )
    prompts = PROMPTS[:3]
    first = engine.generate([Request(p, greedy(10)) for p in prompts])
    assert [r.tokens for r in first] == generate(tiny(seed=0, vocab=40), prompts, 10)
    assert engine.stats()["compiled_graphs"] > 0
    engine.update_weights(policy=other.state_dict(), version=1)
    with torch.compiler.set_stance("fail_on_recompile"):  # parameters are read at each call
        out = engine.generate([Request(p, greedy(10)) for p in prompts])
    assert [r.tokens for r in out] == generate(other, prompts, 10)


@needs_cxx
def test_compiled_engine_and_eagle3_chain_draft_what_eager_ones_draft():
    target, draft = make_pair()
    spec = SpecConfig(
        proposers=("eagle3", "ngram"),
        max_k=3,
        gate=False,
        proposer_options={"eagle3": {"draft": draft}},
    )
    # greedy requests (one-hot drafts) and sampled ones (drafts drawn from q, which is reported)
    params = [
        greedy(16) if i % 2 == 0 else SamplingParams(max_tokens=16, temperature=0.8, seed=i)
        for i in range(len(PROMPTS))
    ]
    drafts, outs = {}, {}
    for compiled in (True, False):
        engine = make_engine(target, max_batch_size=3, spec=spec, compile=compiled)
        eagle3, seen = engine.proposers["eagle3"], drafts.setdefault(compiled, [])

        def propose(batch, ks, _inner=eagle3.propose, _seen=seen):
            got = _inner(batch, ks)
            _seen.extend((d.tokens, d.probs) for d in got)
            return got

        eagle3.propose = propose
        reqs = [Request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
        outs[compiled] = engine.generate(reqs)
        # the target's decode steps and the draft's chain steps both ran compiled
        assert (eagle3.compiled_graphs > 0) == compiled
        assert (engine.stats()["compiled_graphs"] or 0) > 0 or not compiled
        if compiled and _ENTRIES is not None:  # every compiled callable ran direct calls
            parts = (engine._compiled, engine._compiled_decide, eagle3._compiled)
            assert all(c.direct > 0 for c in (*parts, eagle3._compiled_start))
    assert [r.tokens for r in outs[True]] == [r.tokens for r in outs[False]]
    ref = generate(target, PROMPTS, 16)
    assert [r.tokens for r in outs[True][::2]] == ref[::2]
    # the draft read the taps of the committed rows only, and its compiled chain step computes
    # what the eager one does: the same drafts, the same q
    assert [t for t, _ in drafts[True]] == [t for t, _ in drafts[False]]
    for (_, a), (_, b) in zip(drafts[True], drafts[False], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert sum(len(t) for t, q in drafts[True] if q is not None) > 10  # sampled drafts
    assert sum(len(t) for t, q in drafts[True] if q is None) > 10  # greedy drafts


@needs_cxx
def test_warmup_compiles_every_graph_class_and_leaves_no_other_trace():
    model = tiny(seed=2, vocab=41)  # a vocabulary of its own: nothing compiled yet
    # a drafter that always drafts (garbage, mostly rejected), gate off: M > 1 in every step
    spec = SpecConfig(proposers=("ngram", "test-garbage"), max_k=3, gate=False)
    engine = make_engine(model, max_batch_size=4, spec=spec, compile=True)
    before = engine.state_dict()
    assert engine.warmup() > 0
    assert engine.state_dict() == before  # counters, bandit, gate, n-gram history: as they were
    assert engine.stats()["tokens"] == 0 and engine.stats()["compiled_graphs"] > 0
    # batch sizes 1 to 4, steps with and without drafts: every shape class is compiled already
    mixed = [SamplingParams(max_tokens=m, temperature=0.0, n=n) for m, n in [(14, 3), (9, 1)]]
    with torch.compiler.set_stance("fail_on_recompile"):
        out = engine.generate(requests([*mixed, SamplingParams(max_tokens=6, temperature=0.0)]))
    for r in out:
        assert r.tokens == generate(model, [r.prompt_tokens], len(r.tokens))[0]
    assert engine.stats()["spec"]["draft_tokens"] > 0
    assert make_engine(model).warmup() == 0  # eager: nothing to compile


@needs_cxx
def test_warmup_covers_the_eagle3_drafter_greedy_and_sampled():
    target, draft = make_pair()
    spec = SpecConfig(
        proposers=("eagle3",), max_k=3, gate=False, proposer_options={"eagle3": {"draft": draft}}
    )
    # greedy and sampled rows mixed, batches of 1 to 3, chains cut short near max_tokens
    params = [
        greedy(12),
        SamplingParams(max_tokens=9, temperature=0.8, seed=1, n=2),
        SamplingParams(max_tokens=5, temperature=1.0, seed=2),
        greedy(7),
    ]
    eager, plans = make_engine(target, max_batch_size=3, spec=spec), []
    _replay(eager.controller, plans, record=True)
    reference = eager.generate(requests(params))
    engine = make_engine(target, max_batch_size=3, spec=spec, compile=True)
    assert engine.warmup() > 0  # (and restores the decision state it used)
    eagle3 = engine.proposers["eagle3"]
    graphs = eagle3.compiled_graphs
    assert graphs > 0
    _replay(engine.controller, plans, record=False)
    with torch.compiler.set_stance("fail_on_recompile"):
        out = engine.generate(requests(params))
    assert eagle3.compiled_graphs == graphs
    # the eager engine's tokens, sampled rows too: the compiled round drafts the same tokens
    # with the same q and generator draws (greedy rows are the reference decode as well)
    assert [r.tokens for r in out] == [r.tokens for r in reference]
    for i in (0, 4):
        assert out[i].tokens == generate(target, [out[i].prompt_tokens], len(out[i].tokens))[0]
    assert engine.stats()["spec"]["draft_tokens"] > 0


@needs_cxx
def test_every_graph_class_stays_direct_engine_after_engine():
    """Engines built one after another on one target share dynamo's graphs, while a fresh
    draft's host caches (its RoPE tables) start empty.  With every direct call's guards checked
    (``guard_check_every=1``), no graph class of any compiled callable may fall back to
    guarded calls: the classes' keys name every fact the graphs depend on."""
    target, _ = make_pair()
    params = [greedy(10), SamplingParams(max_tokens=10, temperature=1.0, seed=3)]
    for _ in range(2):
        _, draft = make_pair()  # fresh, empty host caches; same shapes
        options = {"eagle3": {"draft": draft}}
        spec = SpecConfig(proposers=("eagle3",), max_k=3, gate=False, proposer_options=options)
        for batch in (1, 2):
            engine = make_engine(target, max_batch_size=batch, spec=spec, compile=True)
            engine.generate(requests(params))
            eagle3 = engine.proposers["eagle3"]
            parts = (engine._compiled, engine._compiled_decide)
            parts += (eagle3._compiled, eagle3._compiled_start)
            assert [c.what for c in parts if c._always_guarded] == []
            assert all(c.direct > 0 for c in parts) or _ENTRIES is None


@needs_cxx
def test_compilation_time_stays_out_of_the_gate_cost_model():
    """Steps that compile a graph take seconds; the gate's cost model must not see them (one
    such sample among milliseconds would make plain or speculative steps look slow for the
    whole fit window).  Real clock, a model of its own so its graphs compile here."""
    model = tiny(seed=1, vocab=37)
    spec = SpecConfig(proposers=["ngram"], max_k=3)
    engine = RolloutEngine(model, max_batch_size=3, spec=spec, compile=True, guard_check_every=1)
    engine.generate(requests([SamplingParams(max_tokens=12, temperature=0.0, n=2)] * 3))
    assert engine.stats()["compiled_graphs"] > 0
    curves = engine.controller.costs.target.values()
    timed = sum(c.observations for c in curves)
    assert 0 < timed < engine.stats()["decode_forwards"]  # compiling steps left out
    for curve in curves:
        assert all(t < 0.1 for _, t in curve.points)  # steps take milliseconds, compiling seconds


@needs_cxx
def test_a_backend_failure_is_a_one_line_config_error():
    from specrl.rollout.compiled import Compiled

    compiled = Compiled(lambda x: x + 1, torch.device("cpu"), "the test step")

    def fail(*args, **kwargs):
        raise torch._dynamo.exc.BackendCompilerFailed(None, OSError("cc1plus: killed"), None)

    compiled._fn = fail
    with pytest.raises(ConfigError, match=r"could not build the test step.*cc1plus") as exc:
        compiled(torch.ones(2))
    assert "--compile" in exc.value.hint


@needs_cxx
def test_guards_are_skipped_only_for_graph_classes_already_served():
    from torch._dynamo import eval_frame

    from specrl.rollout.compiled import Compiled

    def step(x: torch.Tensor, flag: bool) -> torch.Tensor:
        return x * 2 + 1 if flag else x * 2 - 1

    compiled = Compiled(step, torch.device("cpu"), "the test step")
    x = torch.arange(3.0)
    for expect_unguarded in (0, 0, 1, 2):  # compile; guarded, served; then guard-free
        assert compiled(x, True, key="on").tolist() == [1.0, 3.0, 5.0]
        assert compiled.unguarded == expect_unguarded
        assert eval_frame._stance.stance == "default"
        assert not eval_frame._stance.skip_guard_eval_unsafe  # restored after every call
    # a new class runs guarded: its graph compiles, the first class's is not reused for it
    assert compiled(torch.arange(5.0), False, key="off").tolist() == [-1.0, 1.0, 3.0, 5.0, 7.0]
    assert compiled.unguarded == 2 and compiled.graphs == 2
    assert compiled.direct == (2 if compiled._raw is not None else 0)  # dynamo's entry code
    # inside another stance (a test's fail_on_recompile) every call is fully guarded
    with torch.compiler.set_stance("fail_on_recompile"):
        assert compiled(x, True, key="on").tolist() == [1.0, 3.0, 5.0]
        with pytest.raises(RuntimeError, match=r"fail_on_recompile|Recompil"):
            compiled(x.double(), True, key="on")  # a new dtype: guarded, so caught
    assert compiled.unguarded == 2


@needs_cxx
def test_direct_calls_run_the_entry_dynamo_would_run_with_its_side_effects():
    """A bound method whose call mutates its argument (the decode forward stores the cache rows
    it built on its CacheBatch): direct calls replay the mutation, pick the right entry per
    class, never bypass dynamo for a grad mode the class was not served in, and compile
    nothing."""
    from dataclasses import dataclass

    from specrl.rollout.compiled import Compiled

    @dataclass
    class Box:
        x: torch.Tensor
        flag: bool
        out: torch.Tensor | None = None

    class Stepper:
        def __init__(self) -> None:
            self.w = torch.tensor([2.0, 3.0, 4.0])

        def step(self, box: Box, shift: float) -> torch.Tensor:
            y = box.x * self.w + shift if box.flag else box.x - self.w
            box.out = y * 2
            return y

    stepper = Stepper()
    compiled = Compiled(stepper.step, torch.device("cpu"), "the test step")
    if compiled._raw is None:
        pytest.skip("this torch exposes no dynamo cache entries")
    x = torch.arange(3.0)
    with torch.no_grad():
        for _ in range(2):  # compile each class, then serve it
            for flag in (True, False):
                compiled(Box(x, flag), 1.0, key=flag)
        graphs = compiled.graphs
        for shift in (1.0, 5.0, -2.0):  # a host float: a dynamic input, not part of the key
            for flag in (True, False):
                box = Box(x, flag)
                want = x * stepper.w + shift if flag else x - stepper.w
                torch.testing.assert_close(compiled(box, shift, key=flag), want)
                torch.testing.assert_close(box.out, want * 2)  # the side effect, replayed
    assert compiled.direct == 6 and compiled.graphs == graphs
    # with grad enabled, the classes are new: guarded calls (compiling what they need) first
    direct = compiled.direct
    torch.testing.assert_close(compiled(Box(x, True), 1.0, key=True), x * stepper.w + 1)
    assert compiled.direct == direct


def test_compile_without_a_cxx_compiler_is_a_config_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"C\+\+ compiler.*without --compile"):
        RolloutEngine(tiny(), compile=True)


@needs_cxx
def test_a_guard_free_call_that_needs_a_new_graph_reruns_guarded():
    """A key that misses a fact the graphs depend on (here the mode): the direct call's guard
    check (every call: ``check_every=1``) fails, so the call runs fully guarded (compiling the
    right graph) and its class stays guarded; without direct calls, the guard-free stance finds
    no graph and the call is rerun guarded."""
    from specrl.rollout.compiled import Compiled

    def step(x: torch.Tensor, mode: str) -> torch.Tensor:
        return {"add": x + 1, "sub": x - 1, "mul": x * 3}[mode]

    def step_2(x: torch.Tensor, mode: str) -> torch.Tensor:  # its own code: its own graphs
        return {"add": x + 1, "sub": x - 1, "mul": x * 3}[mode]

    for direct, fn in ((True, step), (False, step_2)):
        compiled = Compiled(fn, torch.device("cpu"), "the test step", check_every=1)
        if not direct:
            compiled._raw = None  # a torch without dynamo's cache entries: the stance path
        x = torch.arange(3.0)
        for mode in ("add", "sub"):  # two classes, each compiled (once), then served
            for _ in range(3):
                compiled(x, mode, key=mode)
        assert compiled.unguarded == 2 and compiled.direct == (2 if direct else 0)
        graphs = compiled.graphs
        # the caller files "mul" under the key of "add": caught, run guarded, right
        assert compiled(x, "mul", key="add").tolist() == [0.0, 3.0, 6.0]
        assert compiled.graphs == graphs + 1  # its own graph, compiled by the guarded run
        assert compiled.unguarded == (2 if direct else 3)
        for _ in range(2):  # the class stays guarded (and right) from now on
            assert compiled(x, "add", key="add").tolist() == [1.0, 2.0, 3.0]
            assert compiled(x, "mul", key="add").tolist() == [0.0, 3.0, 6.0]
        assert compiled.unguarded == (2 if direct else 3)
        assert compiled.check_every == 1
