"""When to speculate, how, with which drafter and how far: the engine's speculation policy.

Speculation trades target compute for fewer sequential forwards: it pays at a small batch
(latency-bound: k + 1 tokens cost about one) and not at a large one (compute-bound: about
k + 1).  Each decode step runs plain or with an :class:`Arm` — proposer, draft length k, and
mode *coupled* (draft, then verify) or *decoupled* (drafted during the previous verification,
:mod:`specrl.rollout.decoupled`).  Measured costs decide, deterministically given a seed and
the measured step times: :class:`~specrl.rollout.estimates.StepCosts` (every arm's price, from
τ̂(k), f̂(k) per proposer and seconds by rows of the target's steps per mode and of each
drafter's drafting), :class:`SpeculationGate` (on/off per batch size) and the bandit
(:class:`~specrl.rollout.bandit.EpsilonGreedy`, which arm).  A static table
(``k_by_batch_size``, 0 = plain) replaces gate and k choice where a deployment measured its
own break-even; the bandit then only picks the proposer.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specrl.config.schema import SpeculationConfig
from specrl.rollout.bandit import EpsilonGreedy
from specrl.rollout.estimates import Arm, StepCosts, Stretches

__all__ = ["Arm", "SpecController", "SpeculationGate"]

PLAIN_FIRST = 3  # plain steps measured at a batch size before speculating there


class SpeculationGate:
    """On/off per batch size from the expected speedup S, with hysteresis.

    Off as soon as speculation is expected to lose (S < 1): never slower than plain at a large
    batch.  On again only for a clear win (S > 1 + h), so a batch size at its break-even does
    not flap.  Each batch size keeps its own state (a shrinking batch's tail may speculate while
    the next full wave must not); an unseen one starts as the nearest seen, the first one off.
    """

    def __init__(self, hysteresis: float = 0.1) -> None:
        self.hysteresis = hysteresis
        self.states: dict[int, bool] = {}
        self.switches = 0

    def state(self, batch_size: int) -> bool:
        if batch_size in self.states or not self.states:
            return self.states.get(batch_size, False)
        return self.states[min(self.states, key=lambda b: (abs(b - batch_size), b))]

    def decide(self, batch_size: int, speedup: float) -> bool:
        """Update the state of ``batch_size`` from ``speedup``; True while speculation is on."""
        on = self.state(batch_size)
        flip = speedup < 1 if on else speedup > 1 + self.hysteresis
        self.switches += flip
        self.states[batch_size] = on != flip
        return on != flip


class SpecController:
    """The engine's speculation policy: gate each decode step, pick its arm, learn.

    Every arm is priced by :class:`~specrl.rollout.estimates.StepCosts`; the expected speedup S(B)
    is priced conservatively (speculation dear, plain cheap where unmeasured), so a batch size
    where every arm loses stays plain.

    Probes keep S measured, about a ``probe`` share of the time, spaced by their price (what a
    probe costs beyond the plain steps its tokens replace, ≥ 1 plain step; a gate-off probe's
    drafter first catches up the positions of the plain stretch, as many as at past probes:
    EAGLE-3's probe at batch 1 on toy-small costs 6–9 plain steps, not 3).  While off, one
    step speculates: the whole batch with the arm an optimistic pricing ranks first where that
    could turn the gate on, else a slice of ⌈B/8⌉ sequences (acceptance stays fresh, new
    weights may pay).  While on, two steps run plain (the first, after speculative ones, runs
    with the draft's weights in the caches and is no sample).  A batch twice as wide as any
    that drafted yet is probed whole at once where it might pay: a drafter's cost is mostly per
    pass, and extrapolating from one sequence would keep the gate off.

    A batch size is speculated only once :data:`PLAIN_FIRST` plain steps of it were measured:
    plain costs nothing against plain, and S priced against one noisy plain step turns the gate
    on where it loses.  Speculating after a plain stretch pays the same catch-up as a probe,
    once: where the gate is on, it starts only if the batch is expected to keep its size long
    enough to earn that back (a tail batch size that lasts a step or two stays plain).  While
    off, the steps up to the next probe are plain without pricing: S is priced again when the
    batch size changes, a speculative step is measured, or the probe is due.
    """

    def __init__(
        self,
        config: SpeculationConfig,
        proposers: Sequence[str],
        *,
        seed: int = 0,
        padded: bool = False,
        ahead: Sequence[str] = (),
    ) -> None:
        """``ahead``: the proposers the drafter worker drafts ahead with (decoupled arms; with
        ``config.decoupled`` true they have no coupled ones)."""
        ks = set(config.draft_lengths or range(1, config.max_k + 1))
        self._table = sorted((config.k_by_batch_size or {}).items())
        ks |= {k for _, k in self._table if k}
        self.config = config
        modes = [(p, False) for p in proposers if config.decoupled is not True or p not in ahead]
        modes += [(p, True) for p in proposers if p in ahead]
        self.arms = tuple(Arm(p, k, a) for p, a in modes for k in sorted(ks))
        self.bandit = EpsilonGreedy(self.arms, config.epsilon, seed) if self.arms else None
        self.gate = SpeculationGate(config.hysteresis)
        self.costs = StepCosts(config.max_k, proposers, ahead, padded)
        self._spacing = 1.0 / config.probe if config.probe > 0 else math.inf
        self._forced: bool | None = None
        self._plain_left = 0  # plain steps still due (a gate-on probe runs two)
        # while off at (batch size, costs.measured): the steps until a probe is due are plain
        self._idle: tuple[int, int] | None = None
        self._due = 0.0  # ``since_probe`` count at which that probe is due
        self.stretches = Stretches()
        self._caught_up = False  # every sequence drafted in the last step
        self._probing = 0  # sequences drafting in this step if it is a gate-off probe
        self.widest = 0  # most sequences that drafted in one step so far
        self._rated: tuple[Any, ...] = (None,)  # (key, every arm's value)
        self._prices: tuple[Any, ...] = (None,)  # (key, gate-off probe price, its arm or None)
        self.counts = {"spec_steps": 0, "plain_steps": 0, "probe_steps": 0, "since_probe": 0}
        self.selections = {str(a): 0 for a in self.arms}

    def force(self, speculate: bool | None) -> None:
        """Every step speculative (True), plain (False), or decided by the policy (None)."""
        self._forced = speculate

    def drop_ahead(self) -> None:
        """No decoupled arms from now on (the engine's drafter worker failed)."""
        self.arms = tuple(a for a in self.arms if not a.ahead)

    # ------------------------------------------------------------------ deciding
    def plan(
        self, batch_size: int, backlog: Callable[[str], int] | None = None
    ) -> list[Arm | None] | None:
        """The arm of every sequence of a decode step (None: that one does not draft), or None
        for a plain step; ``backlog(proposer)``: the positions that proposer has queued for the
        step's sequences (default: as many per sequence as at past probes)."""
        b = batch_size
        self.stretches.step(b)
        if not self.arms or self._forced is False:
            return self._plain()
        if self._table:
            k = self._table[max(bisect.bisect_right(self._table, (b, math.inf)) - 1, 0)][1]
            return self._draft(b, b, [a for a in self.arms if a.k == k]) if k else self._plain()
        if self._forced or not self.config.gate:
            return self._draft(b, b, self.arms)
        if self._plain_left:
            self._plain_left -= 1
            return self._plain()
        idle, self._idle = self._idle, None
        if idle == (b, self.costs.measured) and self.counts["since_probe"] + 1 < self._due:
            self.counts["since_probe"] += 1  # off, no probe due, nothing new measured: plain
            self._idle = idle
            return self._plain()
        target = self.costs.target
        if not target["plain"].observations:
            return self._plain()  # a plain step first: the baseline
        if not (target["coupled"].observations or target["decoupled"].observations):
            return self._probe(b)
        rates = self._rates(b)
        speedup = self.costs.speedup(b, rates)
        on = self.gate.decide(b, speedup)
        # after a plain stretch: on only where the drafter's catch-up would be earned back
        wait = on and not self._caught_up and not self._repays(b, rates, speedup, backlog)
        price, hopeful = (1.0, None) if on else self._probe_price(b)
        early = not on and hopeful is not None and b >= 2 * self.widest
        if (on or early) and target["plain"].count(b) < PLAIN_FIRST:
            return self._plain()  # the baseline at this size first: free, and S is trusted
        self.counts["since_probe"] += 1
        if not early and self.counts["since_probe"] < self._spacing * price:
            if on:
                return self._draft(b, b, self.arms, rates) if not wait else self._plain()
            self._idle, self._due = (b, self.costs.measured), self._spacing * price
            return self._plain()
        self.counts["since_probe"] = 0
        if on:  # two plain steps: the first pays the draft's cache footprint, unrecorded
            self.counts["probe_steps"] += 1
            self._plain_left = 1
            return self._plain()
        return self._draft(b, b, [hopeful], rates, probe=True) if hopeful else self._probe(b)

    def _rates(self, b: int) -> dict[Arm, float]:
        """Every arm's value at ``b``, kept until a speculative measurement changes it."""
        if self._rated[0] != (b, self.costs.measured):
            self._rated = ((b, self.costs.measured), self.costs.rates(self.arms, b))
        return self._rated[1]

    def _repays(
        self, b: int, rates: Mapping[Arm, float], speedup: float, backlog: Callable | None
    ) -> bool:
        """Whether speculating at ``b`` after a plain stretch earns back its first step: the
        drafter first catches up the positions the stretch committed (its backlog), once;
        speculating then saves t_plain(B)·(1 − 1/S) per step for as long as the batch keeps
        this size (:meth:`Stretches.expected <specrl.rollout.estimates.Stretches.expected>`)."""
        arm = max(rates, key=rates.__getitem__)
        queued = backlog(arm.proposer) if backlog is not None and not arm.ahead else None
        first = self.costs.seconds(arm, b, b, probe=True, backlog=queued)
        switch = first - self.costs.seconds(arm, b, b)
        gain = self.costs.plain(b) * (1 - 1 / speedup)
        return self.stretches.expected(b) * gain >= switch

    def _probe_price(self, b: int) -> tuple[float, Arm | None]:
        """:meth:`~specrl.rollout.estimates.StepCosts.probe_price` (whole batch where it might
        turn the gate on), kept until a speculative measurement changes it."""
        if self._prices[0] != (b, self.costs.measured):
            price = self.costs.probe_price(self.arms, b, 1 + self.gate.hysteresis)
            self._prices = ((b, self.costs.measured), *price)
        return self._prices[1:]

    def _probe(self, b: int) -> list[Arm | None]:
        """A slice probe: ⌈B/8⌉ sequences (rotating) draft with the bandit's arm."""
        m = -(-b // 8)
        start = self.counts["spec_steps"] * m % b
        arms = self._draft(b, m, self.arms, probe=True)
        return [a if (i - start) % b < m else None for i, a in enumerate(arms)]

    def _draft(
        self, b: int, n: int, arms: Sequence[Arm], rates=None, probe: bool = False
    ) -> list[Arm]:
        """The bandit's arm for a step of ``b`` sequences of which ``n`` draft; young proposers
        try their longest k first (its verifications teach every shorter k)."""
        assert self.bandit is not None
        rates = rates if rates is not None else self._rates(b)
        samples = {a: self.costs.accept[a.proposer].samples(a.k) for a in arms}
        young = {(a.proposer, a.ahead): a for a in arms if samples[a] < self.bandit.min_samples}
        pool = list(young.values()) or arms  # arms ascend in k: the longest young one stays
        arm = self.bandit.choose({a: rates[a] for a in pool}, samples)
        self.counts["spec_steps"] += 1
        self.counts["probe_steps"] += probe
        self._probing = n if probe else 0
        self._caught_up = n == b
        self.selections[str(arm)] += n
        self.widest = max(self.widest, n)
        return [arm] * b

    def _plain(self) -> None:
        self.counts["plain_steps"] += 1
        self._probing = 0
        self._caught_up = False

    # ------------------------------------------------------------------ learning
    def record_step(self, rows: int, seconds: float | None, mode: str) -> None:
        """Target seconds of a decode step of ``mode`` over ``rows`` rows (prefill and drafting
        taken out; None: no sample)."""
        steps = self.counts["spec_steps"] + self.counts["plain_steps"]
        self.costs.record_step(rows, seconds, mode, steps)

    def record_draft(
        self, proposer: str, rows: int, seconds: float, backlog: int = 0, ahead: bool = False
    ) -> None:
        """See :meth:`StepCosts.record_draft <specrl.rollout.estimates.StepCosts.record_draft>`."""
        self.costs.record_draft(proposer, rows, seconds, backlog, ahead, self._probing)

    def record(self, arm: Arm, k_used: int, emitted: int, cap: int | None = None) -> None:
        """See :meth:`StepCosts.record <specrl.rollout.estimates.StepCosts.record>`."""
        self.costs.record(arm, k_used, emitted, cap)

    # ------------------------------------------------------------------ reporting, state
    def to_dict(self) -> dict[str, Any]:
        points = lambda c: [[round(x, 3), t] for x, t in c.points]
        costs = self.costs
        return {
            "gate_on": self.gate.state(self.stretches.batch) if self.config.gate else True,
            "gate_on_batch_sizes": sorted(b for b, on in self.gate.states.items() if on),
            "gate_switches": self.gate.switches,
            **{k: v for k, v in self.counts.items() if k != "since_probe"},
            "target_cost": {m: points(c) for m, c in costs.target.items()},
            "draft_cost": {p: points(c) for p, c in costs.drafting.items()}
            | {p + "/ahead": points(c) for p, c in costs.exposed.items()},
            "selections": {k: v for k, v in self.selections.items() if v},
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "costs": self.costs.state_dict(),
            "gate": [[b, on] for b, on in self.gate.states.items()],
            "switches": self.gate.switches,
            "bandit": None if self.bandit is None else self.bandit.state_dict(),
            "counts": dict(self.counts),
            "selections": dict(self.selections),
            "widest": self.widest,
            "plain_left": self._plain_left,
            "stretches": self.stretches.state_dict(),
            "caught_up": self._caught_up,
            "idle": None if self._idle is None else [*self._idle, self._due],
            # the cached pricing (plain steps do not refresh it): a resumed run probes alike
            "priced": None if self._prices[0] is None else [*self._prices[0], *self._prices[1:]],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A state saved by an engine with the same proposers (others are ignored)."""
        self.costs.load_state_dict(state["costs"])
        self.gate.states = {int(b): bool(on) for b, on in state["gate"]}
        self.gate.switches = int(state["switches"])
        if self.bandit is not None and state["bandit"] is not None:
            self.bandit.load_state_dict(state["bandit"])
        self.counts.update(state["counts"])
        self.widest, self._plain_left = int(state["widest"]), int(state["plain_left"])
        self.stretches.load_state_dict(state["stretches"])
        self._caught_up = bool(state["caught_up"])
        idle = state["idle"]
        self._idle = None if idle is None else (int(idle[0]), int(idle[1]))
        self._due = 0.0 if idle is None else float(idle[2])
        self._rated = self._prices = (None,)
        if state["priced"] is not None:
            b, measured, price, arm = state["priced"]
            hopeful = None if arm is None else Arm(arm[0], int(arm[1]), bool(arm[2]))
            self._prices = ((b, int(measured)), price, hopeful)
        self.selections.update(
            (k, v) for k, v in state["selections"].items() if k in self.selections
        )
