"""Cost model, bandit and batch-size gate; the engine under injected (virtual) timings.

No wall-clock time is asserted: timings are synthetic, either fed to the controller directly or
produced by a virtual clock that a forward hook advances by a + b·tokens per target forward.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from specrl.models.decoder import Transformer
from specrl.models.generate import generate
from specrl.models.presets import preset_config
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig
from specrl.rollout.gating import (
    COST_MAX_AGE,
    COST_WINDOW,
    PLAIN_PROBE_STEPS,
    PLAIN_SAMPLES,
    PROBE_STEPS,
    SETTLE_STEPS,
    Arm,
    ChainAcceptance,
    CostModel,
    DraftCost,
    EpsilonGreedy,
    LengthModel,
    SpecController,
    SpeculationGate,
    k_choices,
)
from specrl.rollout.proposers import Draft, register_proposer
from specrl.rollout.state import restore, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------- pieces
def test_cost_model_fits_intercept_slope_and_padding():
    cm = CostModel(window=64)
    assert cm.coefficients() == (1.0, 0.0, 0.0)  # nothing measured: flat
    steps = [(64, 64), (128, 320), (100, 320), (90, 192), (64, 320), (8, 8), (30, 40)]
    for tokens, padded in steps:
        cm.observe(tokens, padded, 0.002 + 0.0005 * tokens + 0.00001 * padded)
    a, b, c = cm.coefficients()
    assert (a, b, c) == pytest.approx((0.002, 0.0005, 0.00001))
    assert cm.predict(100, 500) == pytest.approx(0.002 + 0.05 + 0.005)


def test_cost_model_degenerate_data_stays_sane():
    flat = CostModel()
    for _ in range(5):
        flat.observe(16, 16, 0.01)
    assert flat.coefficients() == pytest.approx((0.01, 0.0, 0.0))  # no spread: flat
    tied = CostModel()
    for t in (4, 8, 16, 32):  # T and P collinear (plain steps only): one of them is enough
        tied.observe(t, t, 0.001 + 0.0001 * t)
    assert tied.coefficients() == pytest.approx((0.001, 0.0001, 0.0))
    falling = CostModel()
    for t, s in ((1, 0.5), (2, 0.4), (3, 0.3)):
        falling.observe(t, t, s)
    assert falling.coefficients()[1:] == (0.0, 0.0)  # never a negative slope
    origin = CostModel()
    for t, s in ((10, 0.1), (20, 0.3), (30, 0.5)):
        origin.observe(t, t, s)
    a, b, c = origin.coefficients()
    assert a == 0.0 and b + c > 0  # never a negative intercept


def test_cost_model_window_forgets_old_steps():
    cm = CostModel(window=4)
    for t in range(1, 40):  # old regime: 1 ms per token
        cm.observe(t, t, 0.001 * t)
    for t in (10, 20, 30, 40):  # new regime: flat 5 ms
        cm.observe(t, t, 0.005)
    assert cm.num_observations == 4
    assert cm.coefficients() == pytest.approx((0.005, 0.0, 0.0), abs=1e-12)


def test_draft_cost_fits_per_call_chain_token_and_backlog_costs():
    """A chain drafter: 1 ms per call, 2 ms per chain position, 0.05 ms per drafted token and
    0.02 ms per queued position it catches up first; the fit recovers them from calls of mixed
    batch sizes, caps and backlogs, and predicts a full batch."""
    dc = DraftCost(window=64)
    assert dc.predict(128, 4, 64) == 0.0  # never called: free (optimistic)
    # (sequences, cap, backlog): steady state (≈ sequences × accepted) and after gate-off spells
    calls = [(3, 4, 12), (32, 4, 96), (8, 2, 400), (1, 1, 1), (16, 4, 40), (32, 1, 2048), (5, 2, 9)]
    for n, cap, backlog in calls:
        dc.observe(n * cap, cap, backlog, 0.001 + 0.002 * cap + 0.00005 * n * cap + 2e-5 * backlog)
    assert dc.coefficients() == pytest.approx((0.001, 0.00005, 0.002, 2e-5))
    assert dc.predict(32 * 4, 4, 64) == pytest.approx(0.001 + 0.008 + 0.0064 + 0.00128)
    assert dc.predict(32 * 4, 4) == pytest.approx(0.001 + 0.008 + 0.0064)  # no backlog given


def test_cost_model_split_window_keeps_the_rare_kind():
    """Split on the speculative flag, the fit still knows a speculative step's cost after 1000
    plain steps (one shared window of 64 would have dropped it: plain-only data at one batch
    size cannot separate the fixed cost from the per-token one)."""
    split, shared = CostModel(window=64, features=3, split=3), CostModel(window=64, features=3)
    for cm in (split, shared):
        for t in (4, 8, 16):
            cm.observe(t * 5, t * 5, 1, 0.002 + 0.0001 * t * 5 + 0.003)
        for _ in range(1000):
            cm.observe(32, 32, 0, 0.002 + 0.0001 * 32)
    assert split.num_observations == 64 + 3
    assert split.predict(160, 160, 1) == pytest.approx(0.002 + 0.016 + 0.003)
    assert shared.num_observations == 64
    assert shared.predict(160, 160, 1) != pytest.approx(0.002 + 0.016 + 0.003)
    with pytest.raises(ValueError, match="split"):
        CostModel(features=2, split=3)


def test_cost_model_refits_on_a_schedule_not_every_step():
    """Asked every step, the fit is re-solved after max(1, min(n/16, 32)) new observations: at
    once while the window is small, every 16th step once it holds 256, every 32nd from 512."""
    cm = CostModel(window=256)
    for t in range(1, 300):
        cm.observe(t, t, 0.001 * t)
        assert cm.predict(t, t) == pytest.approx(0.001 * t)  # one regime: the fit is exact
    cm.observe(10, 10, 5.0)  # an outlier
    stale = cm.coefficients()
    assert cm.predict(10, 10) == pytest.approx(0.01)  # 1 of the 16 observations it waits for
    for _ in range(15):
        cm.observe(10, 10, 0.01)
    assert cm.coefficients() != stale  # the 16th: re-solved

    big = CostModel(window=4096)  # n/16 would wait 62 observations at n = 1000: capped at 32
    for t in range(1000):
        big.observe(t % 7, t % 7, 0.001 * (t % 7))
    stale = big.coefficients()
    for i in range(CostModel.REFIT_MAX_WAIT):
        assert big.coefficients() == stale, i
        big.observe(3, 3, 1.0)
    assert big.coefficients() != stale


def test_length_model_expects_the_tail_of_finished_lengths():
    lm = LengthModel(window=4)
    assert lm.expected_remaining(10, 64) == 54  # nothing finished: the cap (optimistic)
    for n in (20, 30, 40, 50):
        lm.observe(n)
    assert lm.expected_remaining(10, 64) == pytest.approx(35 - 10)  # all four longer
    assert lm.expected_remaining(35, 64) == pytest.approx(45 - 35)  # 40 and 50
    assert lm.expected_remaining(35, 40) == 5  # capped by its own max_tokens
    assert lm.expected_remaining(60, 64) == 4  # longer than all: the cap
    lm.observe(100)  # the window drops 20
    assert lm.expected_remaining(10, 200) == pytest.approx((30 + 40 + 50 + 100) / 4 - 10)


def test_k_choices():
    assert k_choices(1) == (1,)
    assert k_choices(4) == (1, 2, 3, 4)
    assert k_choices(6) == (1, 2, 3, 4, 5, 6)
    with pytest.raises(ValueError):
        k_choices(0)


def test_bandit_plays_young_arms_round_robin_then_the_best():
    arms = [Arm("a", 1), Arm("a", 4), Arm("b", 2)]
    values = {arms[0]: 1.0, arms[1]: 3.0, arms[2]: 2.0}
    bandit = EpsilonGreedy(arms, epsilon=0.1, seed=0, min_samples=8)
    young = {arms[0]: 8, arms[1]: 3, arms[2]: 0}
    assert [bandit.choose(values, young) for _ in range(4)] == [arms[1], arms[2], arms[1], arms[2]]
    grown = {arm: 8 for arm in arms}
    picks = [bandit.choose(values, grown) for _ in range(2000)]
    # ε = 0.1: the best arm unless exploring; arms 0 and 2 fall 67 % and 33 % short, so an
    # exploration draw of them goes ahead with probability 0.1/0.67 and 0.1/0.33
    assert picks.count(arms[1]) > 0.95 * len(picks)
    again = EpsilonGreedy(arms, epsilon=0.1, seed=0, min_samples=8)
    [again.choose(values, young) for _ in range(4)]
    assert [again.choose(values, grown) for _ in range(2000)] == picks  # seeded: replayable


def test_bandit_exploration_costs_at_most_epsilon_times_gap():
    """Frequencies of exploring a near arm (always explored) and a far one (explored with
    probability gap/shortfall), each within 4.5 standard deviations of its binomial mean
    (two-sided α < 1e-5 per check); the resulting throughput loss is ≤ ε·gap."""
    arms = [Arm("best", 4), Arm("near", 2), Arm("far", 1)]
    values = {arms[0]: 1.0, arms[1]: 0.95, arms[2]: 0.2}
    eps, gap, n = 0.1, 0.1, 40_000
    bandit = EpsilonGreedy(arms, epsilon=eps, seed=7, min_samples=1, gap=gap)
    picks = [bandit.choose(values, {arm: 1 for arm in arms}) for _ in range(n)]
    expected = {arms[1]: eps / 3, arms[2]: eps / 3 * gap / 0.8}
    for arm, p in expected.items():
        sd = (n * p * (1 - p)) ** 0.5
        assert abs(picks.count(arm) - n * p) < 4.5 * sd, arm
    loss = sum(1 - values[arm] / values[arms[0]] for arm in picks) / n
    assert loss <= eps * gap
    with pytest.raises(ValueError):
        EpsilonGreedy(arms, gap=0.0)


def _verify(ctrl: SpecController, batch: int, emitted_of) -> Arm:
    """One speculative step at ``batch``: every sequence verifies under the planned arm."""
    arms = ctrl.plan(batch)
    assert arms is not None and len(set(arms)) == 1  # one arm per step
    for arm in arms:
        ctrl.record(arm, arm.k, emitted_of(arm))
    ctrl.record_step(batch * (arms[0].k + 1), batch * (arms[0].k + 1), 1.0, batch)
    return arms[0]


def test_controller_learns_every_k_from_the_longest_draft_before_trusting_one_unlucky_draw():
    """The young phase plays the longest draft (8 verifications teach every shorter k too);
    its first verification emits one token, the next ones five, and that first draw does not
    lock it out."""
    ctrl = SpecController(["x"], 4, gate=False, seed=0)
    seen = [0]

    def emitted(arm: Arm) -> int:
        seen[0] += 1
        return 1 if seen[0] == 1 else arm.k + 1

    young = [_verify(ctrl, 1, emitted) for _ in range(8)]
    assert young == [Arm("x", 4)] * 8
    assert [ctrl._accept["x"].samples(k) for k in (1, 2, 3, 4)] == [8] * 4
    picks = [_verify(ctrl, 1, emitted) for _ in range(40)]
    assert picks.count(Arm("x", 4)) > 0.85 * 40


def test_controller_draft_lengths_restrict_the_arms():
    ctrl = SpecController(["x", "y"], 8, ks=(8, 2, 4, 2, 1), gate=False)
    assert ctrl.arms == tuple(Arm(p, k) for p in "xy" for k in (1, 2, 4, 8))
    for ks in ((5,), (), (0, 1)):
        with pytest.raises(ValueError, match="draft_lengths"):
            SpecController(["x"], 4, ks=ks)


def test_arm_costs_are_the_fits_predictions():
    """The gate prices every arm in one pass over the fits' coefficients; each price must be
    what the fits predict feature by feature: the steady step t_s(B·f̂, B·(k+1)) +
    d(B·k, k, B·τ̂) and the ceiling's fully accepted step."""
    rng = random.Random(1)
    ctrl = SpecController(["x", "y"], 6, seed=0)
    for _ in range(64):  # every coefficient of both fits non-zero
        t, p, spec = rng.randint(1, 64), rng.randint(1, 64), rng.random() < 0.5
        ctrl.cost.observe(t, p, float(spec), 0.5 + 0.01 * t + 0.02 * p + 0.3 * spec)
        for name in ("x", "y"):
            n, k, r = rng.randint(1, 40), rng.randint(1, 6), rng.randint(0, 90)
            ctrl.draft_cost[name].observe(n, k, r, 0.1 + 0.01 * n + 0.05 * k + 0.002 * r)
    for _ in range(30):
        for name, p in (("x", 0.8), ("y", 0.3)):
            acc = next((j for j in range(6) if rng.random() > p), 6)
            ctrl.record(Arm(name, 6), 6, acc + 1)
    assert all(c > 0 for c in ctrl.cost.coefficients())
    assert all(c > 0 for m in ctrl.draft_cost.values() for c in m.coefficients())
    for batch in (1, 8):
        for arm in ctrl.arms:
            tau, fed = ctrl._acceptance(arm)
            n, draft = arm.k + 1, ctrl.draft_cost[arm.proposer]
            step = ctrl.spec_seconds(batch * fed, batch * n)
            step += draft.predict(batch * arm.k, arm.k, batch * tau)
            full = ctrl.spec_seconds(batch * n, batch * n)
            full += draft.predict(batch * arm.k, arm.k, batch * n)
            assert ctrl._step_seconds(batch, arm) == pytest.approx((tau, step), rel=1e-12)
            ceiling = n * ctrl.plain_seconds(batch) / full
            assert ctrl.ceiling(batch, arm) == pytest.approx(ceiling, rel=1e-12)


def test_chain_acceptance_serves_every_k_from_positions():
    """τ̂(k) = 1 + Σ_{j≤k} A_j and f̂(k) = 1 + Σ_{j≤k} D_j from the verifications whose cap
    reached each position; unseen positions take their predecessor's value, and the
    estimates are monotone in j."""
    acc = ChainAcceptance(6)
    assert acc.estimate(3) == (4.0, 4.0)  # untried: every draft accepted
    # caps 4: accepted 0, 2, 4 of 4 drafted; cap 2: drafted 1, accepted 1
    for cap, k_used, emitted in ((4, 4, 1), (4, 4, 3), (4, 4, 5), (2, 1, 2)):
        acc.add(cap, k_used, emitted)
    a = [3 / 4, 2 / 4, 1 / 3, 1 / 3]  # P(accepted >= j) over the caps reaching j
    # P(drafted >= j) is 1, 3/4, 1, 1: made monotone
    d_mono = [1.0, 3 / 4, 3 / 4, 3 / 4]
    for k in range(1, 7):
        tau, fed = acc.estimate(k)
        n = min(k, 4)
        extra = k - n  # positions 5, 6: unseen, as position 4
        assert tau == pytest.approx(1 + sum(a[:n]) + extra * a[3])
        assert fed == pytest.approx(1 + sum(d_mono[:n]) + extra * d_mono[3])
    assert [acc.samples(k) for k in range(1, 7)] == [4, 4, 3, 3, 0, 0]


def test_controller_reuses_acceptance_learned_at_other_batch_sizes():
    """Acceptance does not depend on the batch size: arms measured at batch 1 are not young
    at batch 32, and the choice there follows their measured acceptance."""
    ctrl = SpecController(["x"], 4, gate=False, seed=0, epsilon=0.0)
    for _ in range(40):
        _verify(ctrl, 1, lambda arm: min(arm.k, 1) + 1)  # only the first draft token lands
    assert all(ctrl._accept["x"].samples(arm.k) >= 8 for arm in ctrl.arms)
    # flat cost model (1 s a step): every arm emits 2 tokens, the shortest k feeds the least
    picks = {str(_verify(ctrl, 32, lambda arm: 2)) for _ in range(5)}
    assert picks == {"x/k=1"}


def test_gate_hysteresis():
    gate = SpeculationGate(hysteresis=0.1)
    decisions = [gate.decide(s) for s in (1.5, 1.01, 0.99, 1.05, 1.09, 1.11, 1.0, 0.95)]
    assert decisions == [True, True, False, False, False, True, True, False]
    assert gate.switches == 3


def test_gate_state_is_kept_per_batch_size():
    """A shrinking batch's tail may turn speculation on; the next full wave must start from
    the full batch's own state, not the tail's.  An unseen batch size starts from the nearest
    one seen (the very first: on), so the hysteresis holds along a shrinking batch."""
    gate = SpeculationGate(hysteresis=0.1)
    assert not gate.decide(0.8, 32)  # full batch: off
    assert not gate.decide(1.05, 31)  # unseen, as 32: stays off (1.05 < 1 + h)
    assert gate.decide(1.5, 4)  # the tail: a clear win turns it on
    assert not gate.decide(1.05, 32)  # the next wave: still off ...
    assert gate.decide(1.05, 4)  # ... while the tail's state stays on
    assert gate.decide(1.02, 12)  # unseen, nearest is 4: on until it loses
    assert gate.switches == 2


def test_controller_predicts_plain_steps_at_their_own_fixed_cost():
    """Speculative steps cost a fixed 3 ms more than plain ones of the same size (drafts, q,
    the ratio test).  The joint fit keeps the slope and separates the fixed costs, so a plain
    step of a full batch is not predicted at the speculative steps' intercept."""
    ctrl = SpecController(["x"], 4, seed=0)
    for batch in (32, 24, 16, 8, 4, 1):
        for _ in range(2):  # the first step after a switch of kind is no sample
            ctrl.record_step(batch, batch, 0.004 + 1e-5 * batch, batch)
        for k in (1, 1, 4):
            rows = batch * (k + 1)
            ctrl.record_step(rows, rows, 0.007 + 1e-5 * rows, batch)
    assert ctrl.plain_seconds(32) == pytest.approx(0.004 + 32e-5)
    assert ctrl.spec_seconds(160, 160) == pytest.approx(0.007 + 160e-5)
    assert ctrl.to_dict()["cost_model"]["s_s_per_speculative_step"] == pytest.approx(0.003)


def test_cost_model_ages_observations_out_down_to_min_keep_per_kind():
    """With ``max_age``, an observation leaves its window once it is that far behind the
    newest one (on the caller's clock), every kind's window, but each keeps ``min_keep``."""
    model = CostModel(window=256, features=1, split=1, max_age=100, min_keep=3)
    for t in range(10):  # kind 1 at times 0..9: 5 s each
        model.observe(1.0, 5.0, at=t)
    for t in range(10, 200):  # then only kind 0: 2 s, then 3 s from time 150 on
        model.observe(0.0, 2.0 if t < 150 else 3.0, at=t)
    assert model.observations_of(1.0) == 3  # aged out, but min_keep stay
    assert model.observations_of(0.0) == 101  # times 99 … 199
    assert model.num_observations == 104
    # kind 0's window: 51 at 2 s and 50 at 3 s; kind 1 kept its last three 5 s samples
    assert model.predict(0.0) == pytest.approx((51 * 2.0 + 50 * 3.0) / 101)
    assert model.predict(1.0) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="max_age"):
        CostModel(max_age=0)


def _drifting_machine(ctrl: SpecController):
    """A controller with one arm ("x", k = 1) on a simulated machine at batch 1: a plain step
    takes 1.0 × speed, a speculative one 1.6 × speed, and a draft is accepted with probability
    ``accept``; ``run(steps, speed, accept)`` plans, times and verifies that many steps."""
    arm = Arm("x", 1)
    rng = random.Random(0)

    def run(steps: int, speed: float, accept: float) -> None:
        for _ in range(steps):
            arms = ctrl.plan(1)
            if arms is None:
                ctrl.record_step(1, 1, 1.0 * speed, 1)
            else:
                ctrl.record_step(2, 2, 1.6 * speed, 1)
                ctrl.record(arm, 1, 2 if rng.random() < accept else 1)

    return run


@pytest.mark.parametrize("max_age", [COST_MAX_AGE, None])
def test_gate_compares_plain_and_speculative_costs_measured_on_the_same_machine(max_age):
    """A machine's speed drifts (a shared host: ±30 % between minutes).  With the gate on,
    plain steps are measured only by probes, 2 per 126 steps: 256 of them span ~16 000 steps.
    Here the machine runs 1.5× slower for 3000 steps, then at full speed while the drafts'
    acceptance drops so that speculation loses (S = τ·t_p / t_s = 1.5 · 1.0 / 1.6 = 0.94).
    Aged out after COST_MAX_AGE steps, the slow plain samples leave the fit and the gate turns
    off; kept (max_age None), they inflate t_p by ~25 % and the gate stays on.  (Windows of the
    last 256 samples, as the fits had before :data:`COST_WINDOW`: the next test.)"""
    ctrl = SpecController(["x"], 1, probe=0.05, seed=0, cost_window=256, cost_max_age=max_age)
    run = _drifting_machine(ctrl)
    run(3000, 1.5, 1.0)  # slow machine, every draft accepted: S = 2 · 1.0 / 1.6 = 1.25
    assert ctrl.gate.on
    run(3000, 1.0, 0.5)  # full speed, τ = 1.5: S = 0.94
    assert ctrl.gate.on is (max_age is None)
    if max_age is not None:
        assert ctrl.plain_seconds(1) == pytest.approx(1.0)


@pytest.mark.parametrize("window", [COST_WINDOW, 256])
def test_gate_averages_both_kinds_of_step_over_the_same_steps(window):
    """Drift within COST_MAX_AGE: the machine runs 1.5× slower for 1500 steps while speculation
    wins (S = 1.25), then at full speed for 1000 while it loses (S = 0.94 at any one speed).
    With windows larger than the samples COST_MAX_AGE steps hold, t_p and t_s both average over
    the last COST_MAX_AGE steps, so their ratio is the machine-independent one and the gate
    turns off.  With a window of the last 256 samples, t_s comes from the last ~270 steps (fast)
    and t_p from the probes of the whole 2000 (half slow): S looks like 1.17 and the gate stays
    on."""
    ctrl = SpecController(["x"], 1, probe=0.05, seed=0, cost_window=window)
    run = _drifting_machine(ctrl)
    run(1500, 1.5, 1.0)
    assert ctrl.gate.on
    run(1000, 1.0, 0.5)
    assert ctrl.gate.on is (window == 256)
    speedup = ctrl._steady(1)[2]
    if window == COST_WINDOW:
        assert speedup < 1
    else:
        assert speedup > 1.1


def test_steps_settling_after_a_switch_of_kind_are_no_timing_sample():
    """Right after speculative steps plain steps run slower for a while (caches cold after the
    other kind's forwards; measured on CPU: four steps) and a speculative step after plain ones
    pays its drafter's catch-up: their times are the switch's.  A step feeds the fit once its
    run of one kind is longer than SETTLE_STEPS[kind] (the engine's very first steps switch
    nothing)."""
    assert SETTLE_STEPS == {True: 1, False: 4}
    ctrl = SpecController(["x"], 4, seed=0)
    runs = [(False, 2), (True, 3), (False, 6), (True, 1), (False, 3), (True, 2)]
    settling = 0
    for r, (speculative, length) in enumerate(runs):
        for i in range(length):
            rows = 32 * (5 if speculative else 1)
            slow = r > 0 and i < SETTLE_STEPS[speculative]  # the first run switched nothing
            settling += slow
            seconds = (0.01 if speculative else 0.002) * (1.5 if slow else 1.0)
            ctrl.record_step(rows, rows, seconds, 32)
    # settling: spec 1 + plain 4 + spec 1 + plain 3 + spec 1
    assert ctrl.switch_steps == settling == 10
    assert ctrl.cost.num_observations == sum(n for _, n in runs) - 10
    assert ctrl.cost.observations_of(0.0) == 2 + 2  # the first run, then 2 of 6
    assert ctrl.plain_seconds(32) == pytest.approx(0.002)  # not dragged up by the settling
    assert ctrl.spec_seconds(160, 160) == pytest.approx(0.01)


@pytest.mark.parametrize("settle", [None, 10])
def test_gate_on_plain_probes_settle_then_time_two_steps(settle):
    """With the gate on, plain probes come as runs of PLAIN_PROBE_STEPS = SETTLE_STEPS[plain]
    + 2 plain steps, so each run times two steps past its settling: one run per PROBE_STEPS /
    probe speculative steps until the fit holds PLAIN_SAMPLES timed plain steps, then one per
    PLAIN_PROBE_STEPS / probe (the same share of plain steps as before).  A controller's own
    settling and probe length (``settle_steps``, ``plain_probe_steps``) behave alike."""
    assert PLAIN_PROBE_STEPS == SETTLE_STEPS[False] + 2 == 6 and PROBE_STEPS == 2
    ctrl = SpecController(["x"], 4, probe=0.05, seed=0)
    if settle is not None:
        ctrl.settle_steps[False], ctrl.plain_probe_steps = settle, settle + 2
    probe_steps = ctrl.plain_probe_steps
    kinds = []
    for _ in range(1400):
        arms = ctrl.plan(1)
        if arms is None:
            ctrl.record_step(1, 1, 0.010, 1)
        else:
            ctrl.record_step(arms[0].k + 1, arms[0].k + 1, 0.012, 1)
            ctrl.record(arms[0], arms[0].k, arms[0].k + 1)  # every draft accepted
        kinds.append("s" if arms else "p")
    kinds = "".join(kinds)
    assert ctrl.gate.on and ctrl.gate.switches == 0
    spec_runs = [len(run) for run in kinds.split("p") if run]
    plain_runs = [run for run in kinds.split("s") if run]
    assert plain_runs == ["p" * probe_steps] * len(plain_runs)
    early = PLAIN_SAMPLES // 2  # probes (two timed steps each) until PLAIN_SAMPLES are timed
    assert spec_runs[:early] == [round(PROBE_STEPS / 0.05) - 1] * early  # the probe is the 40th
    assert spec_runs[early:-1] == [round(probe_steps / 0.05) - 1] * (len(spec_runs) - early - 1)
    assert ctrl.cost.observations_of(0.0) == 2 * len(plain_runs)


def test_gate_off_probe_clock_runs_per_batch_size():
    """Waves of 50 steps at batch 32 (where speculation could not pay even fully accepted: no
    probes), each followed by a shrinking tail of 2 steps at batch 3, 2 and 1 (where it loses
    now, α = 0.1, but could pay).  A tail size is probed after 40 gate-off steps at that size,
    about once in 20 waves; one clock for all sizes would run out every wave and probe every
    tail."""
    a, b, alpha = 1.0, 0.2, 0.1
    ctrl = SpecController(["ngram"], 2, probe=0.05, seed=0)
    _simulate(ctrl, 32, 200, a, b, alpha)
    assert not ctrl.gate.on and ctrl.spec_steps < 20
    waves_probed, full_batch_spec = 0, 0
    for _ in range(40):
        before = ctrl.spec_steps
        _simulate(ctrl, 32, 50, a, b, alpha)
        full_batch_spec += ctrl.spec_steps - before
        before = ctrl.spec_steps
        for batch in (3, 2, 1):
            _simulate(ctrl, batch, 2, a, b, alpha)
        waves_probed += ctrl.spec_steps > before
    assert full_batch_spec == 0
    assert not any(ctrl.gate.states[size] for size in (1, 2, 3))
    assert 1 <= waves_probed <= 10


@pytest.mark.parametrize("lookup", [False, True])
def test_a_probe_continued_at_another_batch_size_takes_that_sizes_arms(lookup):
    """A gate-off probe begun in a batch's tail (batch 1, where a chain drafter could pay)
    whose second step falls on the next full batch (32, where it could not even with every
    draft accepted) drafts only with arms that could pay at 32: a free lookup drafter if there
    is one, else none (the probe ends, plain step)."""
    ctrl = SpecController(["chain", "lookup"] if lookup else ["chain"], 2, probe=0.05, seed=0)
    for batch in (1, 2, 8, 32):  # t = 1 s + 10 ms per token, plain and speculative steps
        for k in (0, 0, 1, 2, 2):
            rows = batch * (k + 1)
            ctrl.record_step(rows, rows, 1.0 + 0.01 * rows, batch)
    for n, k in ((1, 1), (1, 2), (8, 2), (32, 1), (2, 2)):  # chain: 0.5 s + 50 ms per token
        ctrl.record_draft("chain", n * k, k, 0.5 + 0.05 * n * k)
        if lookup:
            ctrl.record_draft("lookup", n * k, k, 0.0)
    for arm in ctrl.arms:  # drafts never accepted: the gate goes off everywhere
        for _ in range(8):
            ctrl.record(arm, arm.k, 1)
    chain = [arm for arm in ctrl.arms if arm.proposer == "chain"]
    assert all(ctrl.ceiling(1, arm) > 1 + ctrl.gate.hysteresis for arm in chain)
    assert all(ctrl.ceiling(32, arm) < 1 for arm in chain)
    for _ in range(2000):  # plain steps at batch 1 until a probe begins
        arms = ctrl.plan(1)
        if arms is not None:
            break
    assert arms is not None and not ctrl.gate.states[1]
    nxt = ctrl.plan(32)  # the probe's second step, in a new batch
    if lookup:
        assert nxt is not None and {arm.proposer for arm in nxt} == {"lookup"}
    else:
        assert nxt is None
        assert ctrl.plan(32) is None  # and the probe is over


def _trained_chain_controller() -> SpecController:
    """A latency-bound target (t = 1 s + 10 ms per token), a chain drafter costing 0.1 s a
    call plus 1 ms per queued position it catches up, every draft accepted."""
    ctrl = SpecController(["chain"], 2, seed=0)
    for batch in (1, 4, 8, 16):
        for _ in range(2):  # the first step after a switch of kind is no sample
            ctrl.record_step(batch, batch, 1.0 + 0.01 * batch, batch)
        for arm in (ctrl.arms[0], *ctrl.arms):
            rows = batch * (arm.k + 1)
            ctrl.record_step(rows, rows, 1.0 + 0.01 * rows, batch)
    for n, k, backlog in ((8, 2, 24), (1, 1, 2), (16, 2, 900), (4, 1, 40), (8, 2, 3000)):
        ctrl.record_draft("chain", n * k, k, 0.1 + 0.001 * backlog, backlog)
    for arm in ctrl.arms:
        for _ in range(8):
            ctrl.record(arm, arm.k, arm.k + 1)
    return ctrl


def test_a_drafters_backlog_is_charged_over_the_tokens_left_to_repay_it():
    """8 sequences that spent 500 steps with the gate off: catching the drafter up costs ≈ 4 s
    (4000 positions at 1 ms), against a steady-state step of ≈ 1.36 s for 24 tokens where plain
    decoding takes 3.24 s.  Worth it when 4000 tokens remain, not when 24 do."""
    ctrl = _trained_chain_controller()
    asked = []

    def left(n: float):
        return lambda: asked.append(n) or n

    assert ctrl.plan(8) is not None  # no backlog: speculation pays (S ≈ 2.4)
    assert ctrl.plan(8, {"chain": 4000}, left(8 * 3)) is None  # one step left: S ≈ 0.6
    assert ctrl.plan(8, {"chain": 4000}, left(8 * 500)) is not None  # 167 steps: S ≈ 2.3
    assert asked == [24, 4000]
    steady = _trained_chain_controller()
    # steady state: what one verification commits (≤ B·τ̂ of every arm) is no extra charge
    assert steady.plan(8, {"chain": 8 * 2}, left(1.0)) is not None
    assert asked == [24, 4000]  # … and the horizon was not even asked for


# ------------------------------------------------------------------------- simulated controller
def _simulate(
    ctrl: SpecController,
    batch: int,
    steps: int,
    a: float,
    b: float,
    alpha: float | dict[str, float],
    draft: dict[str, tuple[float, float]] | None = None,
):
    """Drive the controller with t = a + b·T, per-token acceptance α (per proposer when a dict)
    and drafting costs ``draft[proposer] = (seconds per call, per token asked)``; over the last
    half of the steps returns (tokens emitted, simulated seconds, share of speculative steps)."""
    rng = random.Random(0)
    draft = draft or {}
    tokens = seconds = spec = 0.0
    for step in range(steps):
        arms = ctrl.plan(batch)
        drafting = 0.0
        if arms is None:
            fed = emitted = padded = batch
        else:
            fed = emitted = 0
            calls: dict[str, list[int]] = {}
            for arm in arms:
                calls.setdefault(arm.proposer, []).append(arm.k)
            for name, ks in calls.items():
                per_call, per_token = draft.get(name, (0.0, 0.0))
                cost = per_call + per_token * sum(ks)
                ctrl.record_draft(name, sum(ks), max(ks), cost)
                drafting += cost
            for arm in arms:
                p = alpha[arm.proposer] if isinstance(alpha, dict) else alpha
                acc = 0
                while acc < arm.k and rng.random() < p:
                    acc += 1
                ctrl.record(arm, arm.k, acc + 1)
                fed += arm.k + 1
                emitted += acc + 1
            padded = batch * max(arm.k + 1 for arm in arms)
        cost = a + b * fed
        ctrl.record_step(fed, padded, cost, batch)
        if step >= steps // 2:
            tokens, spec = tokens + emitted, spec + (arms is not None)
            seconds += cost + drafting
    return tokens, seconds, spec / (steps - steps // 2)


def _single_rate(batch: int, a: float, b: float, alpha: float, cost: tuple[float, float]):
    """Best expected tokens/s over k of one proposer drafting for the whole batch (or plain)."""
    rates = [batch / (a + b * batch)]
    for k in k_choices(8):
        emitted = (1 - alpha ** (k + 1)) / (1 - alpha)
        step = a + b * batch * (k + 1) + cost[0] + cost[1] * batch * k
        rates.append(batch * emitted / step)
    return max(rates)


def test_gate_speculates_in_the_latency_bound_tail_and_not_in_a_full_batch():
    a, b, alpha = 1.0, 0.2, 0.6
    tail = SpecController(["ngram"], 8, seed=0)
    tokens, seconds, spec = _simulate(tail, batch=1, steps=600, a=a, b=b, alpha=alpha)
    assert spec > 0.9
    assert tokens / seconds > 1.25 * (1 / (a + b))  # clearly faster than plain decoding
    best = max(tail.arms, key=lambda arm: tail.expected_rate(1, arm))

    def rate(k: int) -> float:  # expected tokens per second of drafting k at batch 1
        return (1 - alpha ** (k + 1)) / (1 - alpha) / (a + b * (k + 1))

    # k = 1, 2 and 4 are within 7 % of each other here (k = 8: 28 % worse): the bandit must
    # exploit a near-optimal draft length, not a particular one
    assert rate(best.k) >= 0.9 * max(rate(arm.k) for arm in tail.arms)

    full = SpecController(["ngram"], 8, probe=0.05, seed=0)
    tokens, seconds, spec = _simulate(full, batch=64, steps=600, a=a, b=b, alpha=alpha)
    assert not full.gate.on
    # compute-bound: not even every draft accepted would clear 1 + h, so no probe either
    assert max(full.ceiling(64, arm) for arm in full.arms) < 1 + full.gate.hysteresis
    assert spec == 0
    assert tokens / seconds == pytest.approx(64 / (a + b * 64))  # exactly plain decoding


def test_a_gated_off_step_does_not_ask_for_the_backlog():
    """Counting a proposer's backlog walks the batch; while the gate is off and no probe is due
    the controller has no use for it and must not ask (the engine passes it lazily)."""
    ctrl = SpecController(["ngram"], 8, probe=0.05, seed=0)
    _simulate(ctrl, batch=64, steps=300, a=1.0, b=0.2, alpha=0.6)
    assert not ctrl.gate.on
    asked = []
    for _ in range(100):
        assert ctrl.plan(64, lambda: asked.append(1) or {"ngram": 64}) is None
    assert not asked


def test_gate_off_probes_rarely_where_higher_acceptance_could_pay():
    """A latency-bound batch (t = 10 s + 0.05 s per token at 64 sequences) with drafts rarely
    accepted (α = 0.1): speculation loses now, but would win at high acceptance (ceiling ≈ 3),
    so the gate-off probes go on, rarer than 1 step in 20, and cost under 5 %."""
    a, b = 10.0, 0.05
    ctrl = SpecController(["ngram"], 8, probe=0.05, seed=0)
    tokens, seconds, spec = _simulate(ctrl, batch=64, steps=600, a=a, b=b, alpha=0.1)
    assert not ctrl.gate.on
    assert max(ctrl.ceiling(64, arm) for arm in ctrl.arms) > 2
    assert 0 < spec < 0.05
    assert tokens / seconds > 0.95 * 64 / (a + b * 64)


def test_gate_off_probes_skip_drafters_that_cannot_pay_at_the_batch_size():
    """At batch 32 a chain drafter costing 8 s a call cannot pay even if every draft were
    accepted, a free lookup drafter could: the gate-off probes draft with the lookup only (the
    chain drafter's acceptance is learned where it pays, and its catch-up is never spent on a
    probe that could not turn the gate on)."""
    batch, a, b = 32, 1.0, 0.01
    ctrl = SpecController(["chain", "lookup"], 8, probe=0.05, seed=3)
    alpha = {"chain": 0.9, "lookup": 0.2}
    draft = {"chain": (8.0, 0.0), "lookup": (0.0, 0.0)}
    _simulate(ctrl, batch, 300, a, b, alpha, draft)  # learn both
    assert not ctrl.gate.on
    ceilings = {arm: ctrl.ceiling(batch, arm) for arm in ctrl.arms}
    assert all(c < 1 for arm, c in ceilings.items() if arm.proposer == "chain")
    assert all(c > 1.5 for arm, c in ceilings.items() if arm.proposer == "lookup")
    before = dict(ctrl.selections)
    _, _, spec = _simulate(ctrl, batch, 1000, a, b, alpha, draft)
    assert 0 < spec < 0.05 + PROBE_STEPS / 500  # over 500 steps: one probe more at an edge
    drafted = {arm: n - before[arm] for arm, n in ctrl.selections.items() if n > before[arm]}
    assert drafted and all(arm.startswith("lookup/") for arm in drafted)


@pytest.mark.parametrize("per_call", [0.5, 8.0])
def test_best_of_n_keeps_up_with_the_best_single_drafter_at_a_full_batch(per_call):
    """A chain drafter (cost per call, high acceptance) and a free lookup drafter (low
    acceptance) at batch 32.  Cheap calls (0.5 s): the chain drafter is the best single
    proposer, and best-of-N must get within 5 % of it — which needs the call's cost charged as
    the whole batch would pay it, not split over the few sequences of a step that explored it.
    Dear calls (8 s): every drafter loses to plain decoding here, and exploring the chain
    drafter must not cost more than 5 % either."""
    batch, a, b = 32, 1.0, 0.01
    alpha = {"chain": 0.9, "lookup": 0.2}
    draft = {"chain": (per_call, 0.0), "lookup": (0.0, 0.0)}
    ctrl = SpecController(["chain", "lookup"], 8, seed=3)
    tokens, seconds, spec = _simulate(ctrl, batch, 2000, a, b, alpha, draft)
    singles = {p: _single_rate(batch, a, b, alpha[p], draft[p]) for p in alpha}
    plain = batch / (a + b * batch)
    assert tokens / seconds >= 0.95 * max(*singles.values(), plain)
    exploited = max(ctrl.arms, key=lambda arm: ctrl.expected_rate(batch, arm))
    if per_call < 1:
        assert singles["chain"] > 1.5 * max(singles["lookup"], plain)
        assert exploited.proposer == "chain" and ctrl.gate.on and spec > 0.9
    else:
        assert max(singles.values()) <= plain
        assert not ctrl.gate.on and spec <= 0.05 + 1e-9  # probes: at most 1 step in 1/probe


def test_probes_bring_speculation_back_when_it_starts_to_pay():
    ctrl = SpecController(["ngram"], 4, probe=0.05, seed=2)
    _simulate(ctrl, batch=64, steps=200, a=10.0, b=0.2, alpha=0.2)  # drafts rarely accepted
    assert not ctrl.gate.on
    _simulate(ctrl, batch=64, steps=100, a=10.0, b=0.2, alpha=0.999)  # a new epoch: they are
    assert ctrl.gate.on


def test_controller_is_deterministic_given_seed_and_timings():
    runs = []
    for _ in range(2):
        ctrl = SpecController(["ngram", "eagle"], 4, seed=11)
        _simulate(ctrl, batch=8, steps=200, a=1.0, b=0.1, alpha=0.7)
        runs.append(ctrl.to_dict())
    assert runs[0] == runs[1]


def test_controller_state_round_trips_through_json():
    """A trained controller saved as JSON (the training checkpoint's engine state) and restored
    into a fresh one decides exactly as the original from there on; its arms stay arms (an older
    state that stored them as objects restores too)."""
    trained = SpecController(["ngram", "eagle"], 4, seed=11)
    _simulate(trained, batch=8, steps=150, a=1.0, b=0.1, alpha=0.7)
    fresh = SpecController(["ngram", "eagle"], 4, seed=0)
    restore(json.loads(json.dumps(snapshot(trained))), fresh)
    assert all(type(arm) is Arm for arm in fresh.arms)
    for ctrl in (trained, fresh):
        _simulate(ctrl, batch=8, steps=100, a=1.0, b=0.1, alpha=0.7)
    assert fresh.to_dict() == trained.to_dict()
    old = {"__obj__": "specrl.rollout.gating.Arm", "attrs": {"proposer": "ngram", "k": 2}}
    assert restore(old) == Arm("ngram", 2) and type(restore(old)) is Arm


def test_controller_state_from_before_per_position_acceptance_restores():
    """A state saved when acceptance was kept per arm (``_shape``: arm → running means, a class
    since removed) and the arms were powers of two restores: arms, gate and fits as saved, the
    acceptance learned anew (and playable at once)."""
    old = SpecController(["ngram"], 8, seed=2)
    _simulate(old, batch=4, steps=60, a=1.0, b=0.1, alpha=0.6)
    state = json.loads(json.dumps(snapshot(old)))
    arms = [Arm("ngram", k) for k in (1, 2, 4, 8)]
    mean = {"__obj__": "specrl.rollout.gating.RunningMean", "attrs": {"count": 3, "value": 2.0}}
    shape = {"__obj__": "specrl.rollout.gating._ArmShape", "attrs": {"emitted": mean, "fed": mean}}
    attrs = state["attrs"]
    attrs["arms"] = snapshot(tuple(arms))
    attrs["_shape"] = {"__map__": [[snapshot(a), shape] for a in arms], "kind": "dict"}
    del attrs["_accept"]
    fresh = SpecController(["ngram"], 8, seed=0)
    restore(state, fresh)
    assert fresh.arms == tuple(arms) and not hasattr(fresh, "_shape")
    assert fresh.gate.states == old.gate.states
    assert fresh.cost.coefficients() == old.cost.coefficients()
    assert fresh._accept["ngram"].samples(1) == 0
    before = dict(fresh.selections)
    _simulate(fresh, batch=4, steps=40, a=1.0, b=0.1, alpha=0.6)
    played = {arm for arm, n in fresh.selections.items() if n > before.get(arm, 0)}
    assert played and played <= {str(a) for a in arms}


# ------------------------------------------------------------------------- the engine, virtual time
class VirtualClock:
    """Time that only target forwards advance: a + b·tokens each."""

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b, self.now = a, b, 0.0

    def __call__(self) -> float:
        return self.now

    def hook(self, _module, args, _out) -> None:
        self.now += self.a + self.b * args[0].numel()


class Oracle:
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
    always = SpecConfig(proposers=("ngram",), max_k=4, gate=False)
    tokens, always_t, _ = _virtual_run(model, always, a, b, PROMPTS, 48)
    gated = SpecConfig(proposers=("ngram",), max_k=4)
    gated_tokens, gated_t, stats = _virtual_run(model, gated, a, b, PROMPTS, 48)
    assert tokens == gated_tokens == plain_tokens
    assert always_t > 1.08 * plain_t  # ungated speculation is slower here ...
    assert gated_t < 1.03 * plain_t  # ... the gate turns it off (probes cost a little)
    assert not stats["gating"]["gate_on"]
    assert stats["gating"]["plain_steps"] > 4 * stats["gating"]["spec_steps"]


def test_engine_gate_keeps_speculation_where_it_pays(model):
    a, b = 10e-3, 1e-5  # latency-bound: k + 1 tokens cost about as much as one
    plain_tokens, plain_t, _ = _virtual_run(model, None, a, b, PROMPTS[:2])
    gated = SpecConfig(proposers=("test-gating-oracle",), max_k=4)
    tokens, gated_t, stats = _virtual_run(model, gated, a, b, PROMPTS[:2])
    assert tokens == plain_tokens
    assert stats["gating"]["plain_steps"] == 0
    assert gated_t < 0.5 * plain_t


def test_engine_gate_turns_off_a_drafter_that_costs_more_than_it_saves(model):
    a, b = 10e-3, 1e-5  # latency-bound: free drafts would pay (previous test) ...
    always = SpecConfig(proposers=("test-gating-slow-oracle",), max_k=4, gate=False)
    _, always_t, _ = _virtual_run(model, always, a, b, PROMPTS[:8], draft_price=0.2)
    _, plain_t, _ = _virtual_run(model, None, a, b, PROMPTS[:8])
    gated = SpecConfig(proposers=("test-gating-slow-oracle",), max_k=4)
    _, gated_t, stats = _virtual_run(model, gated, a, b, PROMPTS[:8], draft_price=0.2)
    assert stats["spec"]["acceptance_rate"] == 1.0  # ... and every draft is right, but
    assert not stats["gating"]["gate_on"]  # drafting at 0.2 s a call costs more than it saves
    probes = stats["gating"]["spec_steps"]
    assert stats["gating"]["plain_steps"] > 10 * probes
    assert gated_t < 0.5 * always_t
    assert gated_t <= plain_t + 0.2 * probes  # what measuring the drafter cost, nothing more


def test_every_decode_step_feeds_the_cost_model(model):
    spec = SpecConfig(proposers=("ngram",), max_k=2)
    engine = RolloutEngine(model, max_batch_size=3, spec=spec, clock=VirtualClock(0, 0))
    engine.generate([Request(p, SamplingParams(max_tokens=10, temperature=0)) for p in PROMPTS[:7]])
    s = engine.stats()
    assert s["prefill_forwards"] > 1  # steps with admissions are measured too (prefill excluded)
    # every decode step is a sample, but those that switched between plain and speculative
    gating = s["gating"]
    assert gating["switch_steps"] > 0
    assert gating["cost_model"]["points"] + gating["switch_steps"] == s["decode_forwards"]


def test_engine_decisions_are_deterministic_with_injected_timings(model):
    spec = SpecConfig(proposers=("ngram", "test-gating-oracle"), max_k=4)
    first = _virtual_run(model, spec, 1e-3, 1e-4, PROMPTS[:8])
    second = _virtual_run(model, spec, 1e-3, 1e-4, PROMPTS[:8])
    assert first[0] == second[0] and first[1] == second[1]
    assert first[2]["gating"] == second[2]["gating"]
    assert first[2]["spec"] == second[2]["spec"]
