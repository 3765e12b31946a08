"""The speculation policy through its public API: estimates, gate, bandit, controller, engine.

No wall-clock time is asserted: timings are synthetic, either fed to the controller directly
(:func:`simulate`: a target step of r rows costs a + b·r seconds) or produced by a virtual clock
that a forward hook advances by a + b·tokens per target forward.
"""

from __future__ import annotations

import copy
import itertools
import json
import random

import pytest
import torch

from specrl.models.decoder import Transformer
from specrl.models.generate import generate
from specrl.models.presets import preset_config
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig
from specrl.rollout.bandit import EpsilonGreedy, RunningMean
from specrl.rollout.estimates import ChainAcceptance, CostCurve
from specrl.rollout.gating import Arm, SpecController, SpeculationGate
from specrl.rollout.proposers import Draft, ProposerBase, register_proposer

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------- estimates
def test_chain_acceptance_serves_every_k_from_the_positions():
    acc = ChainAcceptance(max_k=4)
    assert acc.estimate(3) == (4.0, 4.0)  # untried: every draft accepted
    for emitted in (5, 3, 2, 1):  # 4, 2, 1, 0 of 4 drafted tokens accepted
        acc.add(cap=4, k_used=4, emitted=emitted)
    # A_j = P(≥ j accepted) = 3/4, 2/4, 1/4, 1/4; every draft was 4 long
    assert acc.estimate(1) == pytest.approx((1.75, 2.0))
    assert acc.estimate(4) == pytest.approx((1 + 0.75 + 0.5 + 0.25 + 0.25, 5.0))
    acc.add(cap=1, k_used=1, emitted=2)  # a short draft teaches position 1 only
    assert acc.samples(1) == 5 and acc.samples(2) == 4
    assert acc.estimate(1)[0] == pytest.approx(1.8)


def test_chain_acceptance_is_non_increasing_along_the_chain():
    acc = ChainAcceptance(max_k=3)
    acc.add(cap=3, k_used=3, emitted=4)  # all three accepted
    acc.add(cap=1, k_used=1, emitted=1)
    acc.add(cap=1, k_used=1, emitted=1)
    # position 1 accepted in one of three, positions 2 and 3 in their only sample: capped
    assert acc.estimate(3)[0] == pytest.approx(1 + 3 * (1 / 3))


def test_cost_curve_interpolates_and_extrapolates_conservatively():
    curve = CostCurve()
    assert curve.predict(8) is None
    for x in (1, 8, 64):
        curve.observe(x, 1e-3 if x < 64 else 8e-3)  # flat, then compute-bound
    assert curve.predict(8) == pytest.approx(1e-3)
    assert curve.predict(36) == pytest.approx(1e-3 + 7e-3 * 28 / 56)
    assert curve.predict(128) == pytest.approx(16e-3)  # above: proportional (dear) ...
    assert curve.predict(128, optimistic=True) == pytest.approx(8e-3)  # ... or flat
    assert curve.predict(0.5) == pytest.approx(1e-3)  # below: flat ...
    assert curve.predict(0.5, optimistic=True) == pytest.approx(0.5e-3)  # ... or proportional


def test_cost_curve_never_predicts_a_larger_step_cheaper():
    curve = CostCurve()
    curve.observe(4, 2e-3)
    curve.observe(16, 1e-3)  # noise: the bigger step measured faster
    assert curve.predict(4) <= curve.predict(10) <= curve.predict(16)


def test_cost_curve_follows_a_drifting_machine():
    curve = CostCurve(rate=1 / 8)
    for _ in range(100):
        curve.observe(8, 1e-3)
    for _ in range(40):
        curve.observe(8, 2e-3)  # the machine got slower
    assert curve.predict(8) == pytest.approx(2e-3, rel=0.01)


def test_cost_curve_forgets_by_steps_not_by_observations():
    curve = CostCurve(rate=1 / 32)
    for step in range(100):
        curve.observe(8, 1e-3, step)
    curve.observe(8, 2e-3, 99 + 64)  # measured again 64 steps later: mostly forgotten
    assert curve.predict(8) == pytest.approx(2e-3 - 1e-3 * (31 / 32) ** 64)
    curve.observe(8, 1e-3, 99 + 65)  # the next step: one step's weight
    assert curve.predict(8) == pytest.approx(2e-3 - 1e-3 * (31 / 32) ** 64 - 1e-3 / 32, rel=0.02)


# ------------------------------------------------------------------------- bandit
def test_bandit_plays_young_arms_round_robin_then_the_best():
    bandit = EpsilonGreedy(["a", "b", "c"], epsilon=0.0, min_samples=2)
    values = {"a": 1.0, "b": 3.0, "c": 2.0}
    young = [bandit.choose(values, {"a": 0, "b": 1, "c": 2}) for _ in range(4)]
    assert young == ["a", "b", "a", "b"]  # c has its samples
    assert bandit.choose(values, dict.fromkeys("abc", 2)) == "b"


def test_bandit_exploration_costs_at_most_epsilon_times_gap():
    arms = [f"arm{i}" for i in range(5)]
    values = {a: v for a, v in zip(arms, (1.0, 0.2, 0.1, 0.97, 0.3), strict=True)}
    bandit = EpsilonGreedy(arms, epsilon=0.1, gap=0.1, seed=3)
    picks = [bandit.choose(values, dict.fromkeys(arms, 99)) for _ in range(20000)]
    mean = sum(values[p] for p in picks) / len(picks)
    assert mean >= 1.0 - 0.1 * 0.1  # the bound
    assert "arm2" in picks and "arm3" in picks  # clearly worse arms are still revisited


def test_bandit_state_replays_its_choices():
    values, samples = {"a": 1.0, "b": 0.99}, {"a": 9, "b": 9}
    first = EpsilonGreedy(["a", "b"], epsilon=0.5, seed=1)
    for _ in range(7):
        first.choose(values, samples)
    second = EpsilonGreedy(["a", "b"], epsilon=0.5, seed=99)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [first.choose(values, samples) for _ in range(50)] == [
        second.choose(values, samples) for _ in range(50)
    ]


def test_running_mean_is_exact_while_young_then_exponential():
    m = RunningMean(rate=0.25)
    for x in (1.0, 3.0, 5.0, 7.0):
        m.add(x)
    assert m.value == 4.0  # the mean of the first 1/rate samples
    m.add(20.0)
    assert m.value == 4.0 + 0.25 * 16  # then weight rate (a mean would give 1/5)


# ------------------------------------------------------------------------- gate
def test_gate_hysteresis_per_batch_size_and_a_cold_start_off():
    gate = SpeculationGate(hysteresis=0.1)
    assert gate.state(8) is False  # nothing measured: off
    assert gate.decide(8, 1.05) is False  # not a clear win
    assert gate.decide(8, 1.2) is True
    assert gate.decide(8, 1.05) is True  # no flapping near the break-even
    assert gate.decide(8, 0.95) is False
    gate.decide(1, 2.0)
    assert gate.state(2) is True and gate.state(7) is False  # unseen: as the nearest seen
    assert gate.switches == 3


# ------------------------------------------------------------------------- controller
def spec(**kw) -> SpecConfig:
    kw.setdefault("proposers", ["p"])
    kw.setdefault("max_k", 4)
    return SpecConfig(**kw)


def simulate(ctrl, batch, steps, a, b, alpha, draft=0.0, seed=0):
    """Run ``steps`` decode steps of ``batch`` sequences: a target step of r rows costs
    a + b·r s, a propose call ``draft`` s, each draft token is accepted with probability
    ``alpha`` (until the first rejection).  Returns (tokens emitted, seconds)."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for _ in range(steps):
        arms = ctrl.plan(batch)
        rows, proposers = 0, set()
        for arm in arms or [None] * batch:
            if arm is None:
                rows, tokens = rows + 1, tokens + 1
                continue
            accepted = 0
            while accepted < arm.k and rng.random() < alpha:
                accepted += 1
            ctrl.record(arm, arm.k, accepted + 1)
            rows, tokens = rows + 1 + arm.k, tokens + accepted + 1
            proposers.add(arm.proposer)
        step = a + b * rows
        ctrl.record_step(rows, step, "coupled" if rows > batch else "plain")
        for p in proposers:
            ctrl.record_draft(p, batch, draft)
        seconds += step + draft * len(proposers)
    return tokens, seconds


def test_a_cold_controller_measures_plain_then_probes_a_slice():
    ctrl = SpecController(spec(), ["p"])
    assert ctrl.plan(64) is None  # the plain baseline first
    ctrl.record_step(64, 1e-2, "plain")
    probe = ctrl.plan(64)
    assert sum(a is not None for a in probe) == 8  # ⌈64/8⌉ sequences draft, the rest plain
    assert {a for a in probe if a is not None} == {Arm("p", 4)}  # the longest k teaches all


def test_gate_stays_off_where_speculation_loses_and_probes_rarely():
    ctrl = SpecController(spec(), ["p"])
    plain_tokens, plain_t = 64 * 400, 400 * (0.0 + 1e-3 * 64)
    tokens, t = simulate(ctrl, 64, 400, a=0.0, b=1e-3, alpha=0.6)  # compute-bound
    assert tokens / t > 0.97 * plain_tokens / plain_t  # probes cost < 3 %
    assert ctrl.to_dict()["gate_on_batch_sizes"] == []
    assert ctrl.counts["probe_steps"] <= 0.05 * 400 + 1


def test_gate_turns_on_where_speculation_pays():
    ctrl = SpecController(spec(), ["p"])
    tokens, t = simulate(ctrl, 1, 300, a=1e-2, b=1e-5, alpha=0.8)  # latency-bound
    assert ctrl.to_dict()["gate_on_batch_sizes"] == [1]
    assert tokens / t > 2.0 * (1 / (1e-2 + 1e-5))  # well above plain's rate


def test_gate_turns_off_when_the_machine_speeds_up_and_speculation_stops_paying():
    # while on, plain is measured only by probes: its cost must age by steps, or the machine's
    # slow past keeps S above 1 for as many probes as a busy curve needs steps
    ctrl = SpecController(spec(), ["p"])
    simulate(ctrl, 1, 600, a=2e-3, b=2e-5, alpha=0.9, draft=2e-4)  # a slow machine: pays
    assert ctrl.to_dict()["gate_on"]
    before = ctrl.counts["spec_steps"]
    tokens, t = simulate(ctrl, 1, 600, a=1e-3, b=1e-5, alpha=0.3, draft=8e-4)  # 2× faster: loses
    assert ctrl.counts["spec_steps"] - before < 120  # was: on for 576 of the 600 steps
    assert tokens / t > 0.9 / (1e-3 + 1e-5)


def test_a_gate_off_probe_is_priced_with_the_positions_it_catches_up():
    # an EAGLE-3-like drafter: a probe after a plain stretch first runs the draft over every
    # position the stretch committed (up to a sequence's length, 60), 0.1 plain steps each;
    # speculating loses (S ≤ 0.99); priced as if they caught up τ̂ positions, probes cost ~4×
    # their budget
    ctrl = SpecController(spec(), ["p"])
    rng = random.Random(0)
    tokens = seconds = 0.0
    last = 0
    for step in range(3000):
        arms = ctrl.plan(1)
        if arms is None:
            ctrl.record_step(1, 1e-3, "plain")
            tokens, seconds = tokens + 1, seconds + 1e-3
            continue
        arm, backlog, last = arms[0], min(step - last, 60) if step - last > 1 else 2, step
        accepted = sum(itertools.takewhile(bool, (rng.random() < 0.5 for _ in range(arm.k))))
        ctrl.record(arm, arm.k, accepted + 1)
        ctrl.record_step(1 + arm.k, 1e-3 + 1e-5 * (1 + arm.k), "coupled")
        drafting = 3e-4 + 1e-4 * (arm.k + backlog)
        ctrl.record_draft("p", arm.k, drafting, backlog)
        tokens += accepted + 1
        seconds += 1e-3 + 1e-5 * (1 + arm.k) + drafting
    assert ctrl.costs.queued["p"].value > 30  # what probes really caught up
    assert tokens / seconds > 0.96 / 1e-3  # the probe budget (2 %) and the cold start


def test_gate_speculates_in_the_tail_and_not_in_the_full_batch():
    # a GPU-like step: flat up to 64 rows, then linear — the full batch fills it
    ctrl = SpecController(spec(), ["p"])

    def run(batch, steps, seed):
        rng = random.Random(seed)
        for _ in range(steps):
            arms = ctrl.plan(batch)
            rows = 0
            for arm in arms or [None] * batch:
                if arm is None:
                    rows += 1
                    continue
                acc = 0
                while acc < arm.k and rng.random() < 0.7:
                    acc += 1
                ctrl.record(arm, arm.k, acc + 1)
                rows += 1 + arm.k
            ctrl.record_step(
                rows, 1e-2 * max(1.0, rows / 64), "coupled" if rows > batch else "plain"
            )

    for wave in range(4):
        run(64, 80, wave)
        run(2, 80, wave)
    states = ctrl.gate.states
    assert states[2] is True and states[64] is False


def waves(ctrl, shape, seed=0):
    """Waves of ``(batch, steps)`` stretches on a GPU-like step (1 ms up to 8 rows, then
    linear: speculation loses at batch 8 and pays at batch 1, α 0.8) with an EAGLE-3-like
    drafter: 0.1 ms per drafted row and per position it catches up — every position a sequence
    committed since it last drafted (its prompt: 20).  Returns (tokens, seconds, the tail's
    speculative steps)."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    tail_spec = 0
    for batch, steps in shape:
        queued = [20] * batch  # positions each sequence's drafter lacks
        for _ in range(steps):
            arms = ctrl.plan(batch, lambda _name, q=queued: sum(q))
            rows = asked = caught = 0
            for i, arm in enumerate(arms or [None] * batch):
                if arm is None:
                    rows, tokens, queued[i] = rows + 1, tokens + 1, queued[i] + 1
                    continue
                acc = sum(itertools.takewhile(bool, (rng.random() < 0.8 for _ in range(arm.k))))
                ctrl.record(arm, arm.k, acc + 1)
                rows, tokens = rows + 1 + arm.k, tokens + acc + 1
                asked, caught, queued[i] = asked + arm.k, caught + queued[i], acc + 1
            step = 1e-3 * max(1.0, rows / 8)
            ctrl.record_step(rows, step, "coupled" if rows > batch else "plain")
            if asked:
                name = next(a for a in arms if a is not None).proposer
                ctrl.record_draft(name, asked, 1e-4 * (asked + caught), caught)
            seconds += step + 1e-4 * (asked + caught)
            tail_spec += batch == 1 and arms is not None
    return tokens, seconds, tail_spec


def test_speculation_starts_after_a_plain_stretch_only_where_it_earns_the_catch_up_back():
    # a tail of one sequence that lasts 2 steps: speculating pays 2.5× once caught up, but the
    # first speculative step catches up ~50 positions (5 plain steps) — more than 2 steps earn
    ctrl = SpecController(spec(), ["p"])
    tokens, seconds, tail_spec = waves(ctrl, [(8, 30), (1, 2)] * 40)
    assert tail_spec <= 6  # probes only (was: 31 of the tails' 80 steps, each tail's first dear)
    assert tokens / seconds > 0.97 * (8 * 30 + 2) / 32e-3  # was 0.964× plain
    # a tail that lasts: speculation starts once the stretch has lasted about as many steps as
    # the catch-up costs, and stays on
    _, _, tail_spec = waves(ctrl, [(8, 30), (1, 300), (8, 10)], seed=1)
    assert tail_spec > 250
    # how long stretches last is state: a resumed policy starts the next tail alike (at once)
    twin = SpecController(spec(), ["p"], seed=9)
    twin.load_state_dict(json.loads(json.dumps(ctrl.state_dict())))
    tail = waves(ctrl, [(8, 20), (1, 40)], seed=3)
    assert tail == waves(twin, [(8, 20), (1, 40)], seed=3) and tail[2] > 36
    assert ctrl.state_dict() == twin.state_dict()


def test_one_sequence_probe_does_not_keep_a_paying_batch_off():
    # The batch-8 regression: a slice probe is one sequence at B = 8, and a drafter whose cost
    # is per pass (EAGLE-3's k sequential passes, not its rows) priced from one sequence,
    # conservatively, looks 8× too dear for the whole batch.  A batch twice as wide as any that
    # drafted is probed whole at once where an optimistic S might pay.
    ctrl = SpecController(spec(max_k=8), ["p"])
    rng, spec_steps = random.Random(0), 0
    for _ in range(40):
        arms = ctrl.plan(8)
        drafting = [a for a in arms or [] if a is not None]
        rows = 8 + sum(a.k for a in drafting)
        for arm in drafting:
            acc = 0
            while acc < arm.k and rng.random() < 0.9:
                acc += 1
            ctrl.record(arm, arm.k, acc + 1)
        ctrl.record_step(rows, 1e-2 + 2e-4 * rows, "coupled" if drafting else "plain")
        if drafting:
            k = drafting[0].k
            ctrl.record_draft("p", len(drafting) * k, 2e-3 * k + 1e-5 * len(drafting) * k)
        spec_steps += len(drafting) == 8
    assert ctrl.to_dict()["gate_on_batch_sizes"] == [8]
    assert spec_steps >= 30  # on from the first steps, not after ~90 plain ones


def test_a_dear_drafter_is_gated_off_even_at_full_acceptance():
    ctrl = SpecController(spec(), ["p"])
    simulate(ctrl, 1, 300, a=1e-2, b=1e-5, alpha=1.0, draft=0.2)
    assert ctrl.to_dict()["gate_on_batch_sizes"] == []


def test_best_of_n_picks_the_better_drafter_and_k():
    ctrl = SpecController(spec(proposers=["good", "poor"]), ["good", "poor"])
    rng = random.Random(0)
    for _ in range(400):
        arms = ctrl.plan(1)
        if arms is None:
            ctrl.record_step(1, 1e-2, "plain")
            continue
        arm = arms[0]
        alpha = 0.9 if arm.proposer == "good" else 0.2
        acc = 0
        while acc < arm.k and rng.random() < alpha:
            acc += 1
        ctrl.record(arm, arm.k, acc + 1)
        ctrl.record_step(1 + arm.k, 1e-2, "coupled")
    chosen = ctrl.to_dict()["selections"]
    assert max(chosen, key=chosen.get) == "good/k=4"
    assert chosen.get("poor/k=4", 0) < 0.2 * chosen["good/k=4"]


def test_static_table_sets_k_by_batch_size_and_plain_at_zero():
    ctrl = SpecController(spec(k_by_batch_size={1: 4, 8: 2, 32: 0}), ["p"])
    assert {a.k for a in ctrl.plan(1)} == {4}
    assert {a.k for a in ctrl.plan(7)} == {4}
    assert {a.k for a in ctrl.plan(8)} == {2} and {a.k for a in ctrl.plan(31)} == {2}
    assert ctrl.plan(32) is None and ctrl.plan(64) is None


def test_draft_lengths_restrict_the_arms():
    ctrl = SpecController(spec(max_k=8, draft_lengths=[8, 2, 2]), ["p"])
    assert [a.k for a in ctrl.arms] == [2, 8]


def test_settings_out_of_range_are_refused_by_the_recipe_section():
    for bad in ({"max_k": 0}, {"draft_lengths": [2, 5]}, {"k_by_batch_size": {1: 9}}):
        with pytest.raises(ValueError):
            spec(**bad)


def test_force_overrides_the_gate_both_ways():
    ctrl = SpecController(spec(), ["p"])
    ctrl.force(True)
    assert ctrl.plan(64) is not None and None not in ctrl.plan(64)
    ctrl.force(False)
    assert ctrl.plan(1) is None
    ctrl.force(None)
    assert ctrl.plan(1) is None  # cold again: the plain baseline first


def test_controller_is_deterministic_given_seed_and_timings():
    runs = []
    for _ in range(2):
        ctrl = SpecController(spec(proposers=["p", "q"]), ["p", "q"], seed=4)
        simulate(ctrl, 4, 200, a=1e-2, b=1e-3, alpha=0.6)
        runs.append(json.dumps(ctrl.to_dict()))
    assert runs[0] == runs[1]


def test_controller_state_round_trips_through_json_and_replays_decisions():
    ctrl = SpecController(spec(proposers=["p", "q"]), ["p", "q"], seed=2)
    simulate(ctrl, 4, 150, a=1e-2, b=1e-3, alpha=0.6)
    state = json.loads(json.dumps(ctrl.state_dict()))
    twin = SpecController(spec(proposers=["p", "q"]), ["p", "q"], seed=77)
    twin.load_state_dict(state)
    simulate(ctrl, 4, 100, a=1e-2, b=1e-3, alpha=0.6, seed=5)
    simulate(twin, 4, 100, a=1e-2, b=1e-3, alpha=0.6, seed=5)
    assert ctrl.to_dict() == twin.to_dict()
    assert ctrl.to_dict()["spec_steps"] > 0


# ------------------------------------------------------------------------- the engine, virtual time
class VirtualClock:
    """Time that only target forwards advance: a + b·tokens each."""

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b, self.now = a, b, 0.0

    def __call__(self) -> float:
        return self.now

    def hook(self, _module, args, _out) -> None:
        self.now += self.a + self.b * args[0].numel()


class Oracle(ProposerBase):
    """Drafts the target's own greedy continuation (a perfect draft under greedy decoding)."""

    name = "test-gating-oracle"
    tap_layers: tuple[int, ...] = ()

    def __init__(self, target: Transformer) -> None:
        self.draft = copy.deepcopy(target)

    def propose(self, batch, ks):
        outs = generate(self.draft, [s.tokens for s in batch], max(ks))
        return [Draft(o[:k]) for o, k in zip(outs, ks, strict=True)]

    def observe(self, batch, accepted, taps, committed):
        pass

    def reset(self, seq):
        pass

    def release(self, seq):
        pass


class SlowOracle(Oracle):
    """The same perfect drafts, at a (virtual) price per propose call."""

    name = "test-gating-slow-oracle"
    clock: VirtualClock | None = None  # set by the test: propose advances it
    price = 0.0

    def propose(self, batch, ks):
        SlowOracle.clock.now += SlowOracle.price
        return super().propose(batch, ks)


register_proposer("test-gating-oracle", lambda ctx: Oracle(ctx.target), replace=True)
register_proposer("test-gating-slow-oracle", lambda ctx: SlowOracle(ctx.target), replace=True)


def _virtual_run(model, spec, a, b, prompts, max_tokens=24, draft_price=0.0):
    clock = VirtualClock(a, b)
    SlowOracle.clock, SlowOracle.price = clock, draft_price
    engine = RolloutEngine(model, max_batch_size=len(prompts), spec=spec, clock=clock, seed=5)
    handle = model.register_forward_hook(clock.hook)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        out = engine.generate([Request(p, params) for p in prompts])
    finally:
        handle.remove()
    return [r.tokens for r in out], clock.now, engine.stats()


@pytest.fixture(scope="module")
def model():
    m = Transformer(preset_config("toy-tiny", vocab_size=32)).init_weights(0, std=0.2)
    return m.to(torch.float64)


PROMPTS = [[1 + i % 7, 2 + i % 5, 3 + i % 3] for i in range(32)]


def test_engine_gate_keeps_a_compute_bound_batch_as_fast_as_plain(model):
    a, b = 0.0, 1e-3  # every token costs the same: speculation can only lose
    plain_tokens, plain_t, _ = _virtual_run(model, None, a, b, PROMPTS, 48)
    always = SpecConfig(proposers=["ngram"], max_k=4, gate=False)
    tokens, always_t, _ = _virtual_run(model, always, a, b, PROMPTS, 48)
    gated = SpecConfig(proposers=["ngram"], max_k=4)
    gated_tokens, gated_t, stats = _virtual_run(model, gated, a, b, PROMPTS, 48)
    assert tokens == gated_tokens == plain_tokens
    assert always_t > 1.08 * plain_t  # ungated speculation is slower here ...
    assert gated_t < 1.02 * plain_t  # ... the gate keeps it off (slice probes cost little)
    assert stats["gating"]["gate_on_batch_sizes"] == []
    assert stats["gating"]["plain_steps"] > 4 * stats["gating"]["spec_steps"]


def test_engine_gate_keeps_speculation_where_it_pays(model):
    a, b = 10e-3, 1e-5  # latency-bound: k + 1 tokens cost about as much as one
    plain_tokens, plain_t, _ = _virtual_run(model, None, a, b, PROMPTS[:2], 48)
    gated = SpecConfig(proposers=["test-gating-oracle"], max_k=4)
    tokens, gated_t, stats = _virtual_run(model, gated, a, b, PROMPTS[:2], 48)
    assert tokens == plain_tokens
    assert 2 in stats["gating"]["gate_on_batch_sizes"]
    assert gated_t < 0.5 * plain_t


def test_engine_gate_turns_off_a_drafter_that_costs_more_than_it_saves(model):
    a, b = 10e-3, 1e-5  # latency-bound: free drafts would pay (previous test) ...
    always = SpecConfig(proposers=["test-gating-slow-oracle"], max_k=4, gate=False)
    _, always_t, _ = _virtual_run(model, always, a, b, PROMPTS[:8], draft_price=0.2)
    _, plain_t, _ = _virtual_run(model, None, a, b, PROMPTS[:8])
    gated = SpecConfig(proposers=["test-gating-slow-oracle"], max_k=4)
    _, gated_t, stats = _virtual_run(model, gated, a, b, PROMPTS[:8], draft_price=0.2)
    assert stats["spec"]["acceptance_rate"] == 1.0  # ... and every draft is right, but
    assert stats["gating"]["gate_on_batch_sizes"] == []  # a 0.2 s call costs more than it saves
    probes = stats["gating"]["spec_steps"]
    assert stats["gating"]["plain_steps"] > 10 * probes
    assert gated_t < 0.5 * always_t
    assert gated_t <= plain_t + 0.2 * probes  # what measuring the drafter cost, nothing more


def test_every_timed_decode_step_feeds_the_cost_curves(model):
    spec = SpecConfig(proposers=["ngram"], max_k=2)
    engine = RolloutEngine(model, max_batch_size=3, spec=spec, clock=VirtualClock(0, 0))
    engine.generate([Request(p, SamplingParams(max_tokens=10, temperature=0)) for p in PROMPTS[:7]])
    s = engine.stats()
    assert s["prefill_forwards"] > 1  # steps with admissions are measured too (prefill excluded)
    ctrl = engine.controller
    assert sum(c.observations for c in ctrl.costs.target.values()) == s["decode_forwards"]


def test_engine_static_table_speculates_only_where_it_says(model):
    spec = SpecConfig(proposers=["test-gating-oracle"], max_k=3, k_by_batch_size={1: 3, 3: 0})
    requests = [
        Request(p, SamplingParams(max_tokens=n, temperature=0))
        for p, n in zip(PROMPTS, (4, 8, 12, 16), strict=False)
    ]
    engine = RolloutEngine(model, max_batch_size=4, spec=spec, clock=VirtualClock(0, 0))
    out = engine.generate(requests)
    assert [r.tokens for r in out] == [r.tokens for r in RolloutEngine(model).generate(requests)]
    gating = engine.stats()["gating"]
    # batches of 4 and 3 decode plainly, of 2 and 1 with k = 3
    assert set(gating["selections"]) == {"test-gating-oracle/k=3"}
    assert gating["plain_steps"] >= 4 and gating["spec_steps"] > 0


def test_engine_decisions_are_deterministic_with_injected_timings(model):
    spec = SpecConfig(proposers=["ngram", "test-gating-oracle"], max_k=4)
    first = _virtual_run(model, spec, 1e-3, 1e-4, PROMPTS[:8])
    second = _virtual_run(model, spec, 1e-3, 1e-4, PROMPTS[:8])
    assert first[0] == second[0] and first[1] == second[1]
    assert first[2]["gating"] == second[2]["gating"]
    assert first[2]["spec"] == second[2]["spec"]


def test_a_plain_step_right_after_a_speculative_one_is_not_a_sample():
    """It runs with the draft's weights in the caches: not what decoding plainly costs."""
    ctrl = SpecController(SpecConfig(["p"], max_k=2), ["p"])
    for rows, seconds, mode in [(4, 1e-3, "plain"), (12, 2e-3, "coupled"), (4, 9e-3, "plain")]:
        ctrl.record_step(rows, seconds, mode)
    ctrl.record_step(4, 1e-3, "plain")
    assert ctrl.costs.target["plain"].count(4) == 2
    assert ctrl.costs.target["plain"].predict(4) == pytest.approx(1e-3)


def test_the_gate_measures_plain_at_a_batch_size_before_it_speculates_there():
    """Speculation pays at batch 1 (measured); at an unmeasured batch size 8 the gate first
    decodes plainly until plain steps of that size are samples, then speculates there."""
    ctrl = SpecController(SpecConfig(["p"], max_k=2, draft_lengths=[2], probe=0.0), ["p"])
    arm = Arm("p", 2)
    for _ in range(4):
        ctrl.record_step(1, 10e-3, "plain")
    for _ in range(20):
        ctrl.record_step(3, 10e-3, "coupled")
        ctrl.record_draft("p", 2, 1e-4)
        ctrl.record(arm, 2, 3)
    assert ctrl.plan(1) is not None  # on at batch 1: 3 tokens for one step's price
    plain_steps = 0
    while (arms := ctrl.plan(8)) is None:
        plain_steps += 1
        assert plain_steps <= 10
        ctrl.record_step(8, 11e-3, "plain")
    # the first plain step followed speculative ones (no sample); the others were samples
    assert plain_steps >= 2 and ctrl.costs.target["plain"].count(8) == plain_steps - 1
    assert all(a == arm for a in arms)
