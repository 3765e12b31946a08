"""When to speculate, with which drafter and how far: the engine's speculation policy.

Speculation trades target compute for fewer sequential forwards.  A small batch leaves the
target latency-bound (k + 1 tokens cost about as much as one), a large one compute-bound (about
k + 1 times as much), so whether it pays depends on the batch size B.  Four small pieces decide,
online and deterministically given a seed and the step times the engine's clock measured:

- :class:`~specrl.rollout.estimates.ChainAcceptance`: per proposer, the probability that draft
  position j is accepted, giving the tokens emitted τ̂(k) and fed f̂(k) for every k at once;
- :class:`~specrl.rollout.estimates.CostCurve`: measured seconds as a function of a size (the
  target's plain and speculative steps by rows computed, each drafter's calls by rows drafted);
- :class:`SpeculationGate`: on/off per batch size from the expected speedup S(B), with
  hysteresis; :class:`SpecController` adds the probes that keep S measured;
- the drafter/k bandit (:class:`specrl.rollout.bandit.EpsilonGreedy`) over arms (proposer, k),
  valued by the throughput each would give the whole batch.

A static table (``k_by_batch_size``, k by batch size, 0 = plain) replaces gate and k choice
where a deployment has measured its own break-even; the bandit then only picks the proposer.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from specrl.config.schema import SpeculationConfig
from specrl.rollout.bandit import EpsilonGreedy
from specrl.rollout.estimates import ChainAcceptance, CostCurve


class Arm(NamedTuple):
    """One choice of the bandit: draft with ``proposer``, at most ``k`` tokens."""

    proposer: str
    k: int

    def __str__(self) -> str:
        return f"{self.proposer}/k={self.k}"


class SpeculationGate:
    """On/off per batch size from the expected speedup S, with hysteresis.

    Off as soon as speculation is expected to lose (S < 1): never slower than plain at a large
    batch.  On again only for a clear win (S > 1 + h), so a batch size at its break-even does
    not flap.  Each batch size keeps its own state (a shrinking batch's tail may speculate while
    the next full wave must not); an unseen one starts as the nearest seen, the first one off
    (a cold engine decodes plainly until measurements say speculation pays).
    """

    def __init__(self, hysteresis: float = 0.1) -> None:
        if hysteresis < 0:
            raise ValueError(f"hysteresis must be ≥ 0, got {hysteresis}")
        self.hysteresis = hysteresis
        self.states: dict[int, bool] = {}
        self.switches = 0

    def state(self, batch_size: int) -> bool:
        if batch_size in self.states or not self.states:
            return self.states.get(batch_size, False)
        near = min(self.states, key=lambda b: (abs(b - batch_size), b))
        return self.states[near]

    def decide(self, batch_size: int, speedup: float) -> bool:
        """Update the state of ``batch_size`` from ``speedup``; True while speculation is on."""
        on = self.state(batch_size)
        flip = speedup < 1 if on else speedup > 1 + self.hysteresis
        self.switches += flip
        self.states[batch_size] = on = on != flip
        return on

    def state_dict(self) -> dict[str, Any]:
        return {"states": [[b, on] for b, on in self.states.items()], "switches": self.switches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.states = {int(b): bool(on) for b, on in state["states"]}
        self.switches = int(state["switches"])


class SpecController:
    """The engine's speculation policy: gate each decode step, pick its arm, learn.

    An arm's value at batch size B is the throughput it would give if the whole batch drafted
    with it: v = B·τ̂ / (t_s(rows) + d(B·k + B·τ̂·[defers])), rows = B·f̂ (B·(k + 1) when the
    engine pads every sequence to the longest), t_s the speculative steps' target curve, d the
    proposer's drafting curve (an EAGLE-3 draft also catches up the τ̂ positions each sequence
    committed).  The expected speedup is S(B) = max_arm v · t_p(B) / B, t_p the plain steps'
    curve, both priced conservatively (speculation dear, plain cheap where unmeasured).

    Probes keep S measured, about a ``probe`` share of the time: while a batch size is off,
    one step speculates — a slice of ⌈B/8⌉ sequences when even an optimistic S could not turn
    the gate on (acceptance stays fresh, new weights may pay), else the whole batch with the arm
    an optimistic pricing ranks first (the measurement lands where the upside is) — spaced by
    its price (:meth:`_priced`); while on, one step runs plain.  A batch at least twice as wide
    as any that drafted so far is probed whole at once where it might pay: a slice's one
    sequence cannot tell what eight cost (a drafter's cost is mostly per pass, not per row) and
    the conservative extrapolation from it would keep the gate off.  A cold engine measures one
    plain step, then probes a slice.
    """

    def __init__(
        self,
        config: SpeculationConfig,
        proposers: Sequence[str],
        *,
        seed: int = 0,
        padded: bool = False,
    ) -> None:
        max_k = config.max_k
        if max_k < 1:
            raise ValueError(f"max_k must be ≥ 1, got {max_k}")
        ks = set(config.draft_lengths or range(1, max_k + 1))
        table = dict(config.k_by_batch_size or {})
        if not all(1 <= k <= max_k for k in ks):
            raise ValueError(f"draft_lengths must lie in 1 … max_k = {max_k}, got {sorted(ks)}")
        if not all(b >= 1 and 0 <= k <= max_k for b, k in table.items()):
            raise ValueError(f"k_by_batch_size needs batch sizes ≥ 1 and k in 0 … {max_k}")
        self.config, self.padded = config, padded
        self._table = sorted(table.items())
        ks |= {k for _, k in self._table if k}
        self.arms = tuple(Arm(p, k) for p in proposers for k in sorted(ks))
        self.bandit = EpsilonGreedy(self.arms, config.epsilon, seed) if self.arms else None
        self.gate = SpeculationGate(config.hysteresis)
        self.accept = {p: ChainAcceptance(max_k) for p in proposers}
        self.target = {False: CostCurve(), True: CostCurve()}  # plain / speculative steps
        self.drafting = {p: CostCurve() for p in proposers}
        self.defers = dict.fromkeys(proposers, False)  # proposer has queued positions to catch up
        self._spacing = 1.0 / config.probe if config.probe > 0 else math.inf
        self._forced: bool | None = None
        self._last_batch = 1
        # speculative measurements so far (acceptance, drafting, speculative steps): the arms'
        # prices change only with them (:meth:`_priced`)
        self._measured = 0
        self._prices_key: tuple[int, int] | None = None
        self._prices: tuple[dict[Arm, float], float, bool] = ({}, 1.0, False)
        self._hopeful_arm: Arm | None = None
        self.widest = 0  # most sequences that drafted in one step so far
        self.counts = {"spec_steps": 0, "plain_steps": 0, "probe_steps": 0, "since_probe": 0}
        self.selections = {str(a): 0 for a in self.arms}

    def force(self, speculate: bool | None) -> None:
        """Every step speculative (True), plain (False), or decided by the policy (None)."""
        self._forced = speculate

    # ------------------------------------------------------------------ deciding
    def plan(self, batch_size: int) -> list[Arm | None] | None:
        """The arm of every sequence of a decode step (None: that one does not draft), or None
        for a plain step."""
        self._last_batch = batch_size
        if not self.arms or self._forced is False:
            return self._plain()
        if self._table:
            at = bisect.bisect_right(self._table, (batch_size, math.inf)) - 1
            k = self._table[max(at, 0)][1]
            return (
                self._spec(batch_size, [a for a in self.arms if a.k == k]) if k else self._plain()
            )
        if self._forced or not self.config.gate:
            return self._spec(batch_size, self.arms)
        if not self.target[False].observations:
            return self._plain()  # a plain step first: the baseline
        if not self.target[True].observations:
            self.counts["probe_steps"] += 1
            return self._probe(batch_size)
        rates, price, whole = self._priced(batch_size)
        on = self.gate.decide(batch_size, self._speedup(batch_size, rates))
        self.counts["since_probe"] += 1
        # a batch twice as wide as any that drafted yet, which might pay: probe it at once
        early = not on and whole and batch_size >= 2 * self.widest
        if not early and self.counts["since_probe"] < self._spacing * (1.0 if on else price):
            return self._spec(batch_size, self.arms, rates) if on else self._plain()
        self.counts["since_probe"] = 0
        self.counts["probe_steps"] += 1
        if on:
            return self._plain()
        if whole:  # the arm an optimistic pricing ranks first, on the whole batch
            return self._spec(batch_size, [self._hopeful_arm], rates)
        return self._probe(batch_size)

    def _priced(self, batch_size: int) -> tuple[dict[Arm, float], float, bool]:
        """(:meth:`_rates`, the next gate-off probe's price in plain steps, whether it takes
        the whole batch), kept until a speculative measurement changes them: while the gate is
        off a step costs a lookup, not a pricing.

        The probe takes the whole batch where the optimistic S could turn the gate on, with the
        arm the optimistic pricing ranks first (the measurement lands where the upside
        is); else a slice.  Its price p is what it costs beyond the plain steps its
        tokens replace, in plain steps (≥ 1): probes spaced p times wider cost about a
        ``probe`` share of the time."""
        key = (batch_size, self._measured)
        if self._prices_key != key:
            rates = self._rates(batch_size)
            hopeful = self._rates(batch_size, True)
            whole = self._speedup(batch_size, hopeful, True) > 1 + self.gate.hysteresis
            plain = self.target[False].predict(batch_size) or 0.0
            if whole:
                best = max(hopeful, key=hopeful.__getitem__)
                tau = self.accept[best.proposer].estimate(best.k)[0]
                seconds = batch_size * tau / rates[best] if rates[best] > 0 else 0.0
                saved = tau  # plain steps its tokens replace
            else:
                best, seconds, saved = None, self._slice_seconds(batch_size), 1.0
            price = max(1.0, seconds / plain - saved) if plain > 0 else 1.0
            self._prices = (rates, price, whole)
            self._hopeful_arm = best
            self._prices_key = key
        return self._prices

    def _slice_seconds(self, batch_size: int) -> float:
        """Predicted seconds of a slice probe with its dearest arm."""
        m, worst = -(-batch_size // 8), 0.0
        for arm in self.arms:
            rows = batch_size + m * arm.k
            draft = self.drafting[arm.proposer].predict(m * arm.k) or 0.0
            worst = max(worst, (self.target[True].predict(rows) or 0.0) + draft)
        return worst

    def _rates(self, batch_size: int, optimistic: bool = False) -> dict[Arm, float]:
        """Each arm's value v (tokens per second of the whole batch, class docstring)."""
        out, b = {}, batch_size
        for arm in self.arms:
            tau, fed = self.accept[arm.proposer].estimate(arm.k)
            rows = b * (arm.k + 1) if self.padded else b * fed
            drafted = b * arm.k + b * tau * self.defers[arm.proposer]
            target = self.target[True].predict(rows, optimistic)
            if target is None:  # no speculative step yet: as plain
                target = self.target[False].predict(rows, optimistic) or 0.0
            seconds = target + (self.drafting[arm.proposer].predict(drafted, optimistic) or 0.0)
            out[arm] = b * tau / seconds if seconds > 0 else math.inf
        return out

    def _speedup(self, batch_size: int, rates: Mapping[Arm, float], optimistic=False) -> float:
        """S(B) = best arm's value · t_p(B) / B (plain priced the other way round)."""
        plain = self.target[False].predict(batch_size, not optimistic) or 0.0
        return max(rates.values()) * plain / batch_size

    def _spec(
        self, batch_size: int, arms: Sequence[Arm], rates: Mapping[Arm, float] | None = None
    ) -> list[Arm | None]:
        """Every sequence drafts with the bandit's arm."""
        return self._drafting(batch_size, batch_size, arms, rates)

    def _probe(self, batch_size: int) -> list[Arm | None]:
        """A slice probe: ⌈B/8⌉ sequences (rotating) draft with the bandit's arm, the others
        plain."""
        m = -(-batch_size // 8)
        arms = self._drafting(batch_size, m, self.arms)
        start = self.counts["spec_steps"] * m % batch_size
        picked = {(start + i) % batch_size for i in range(m)}
        return [a if b in picked else None for b, a in enumerate(arms)]

    def _drafting(
        self, batch_size: int, drafting: int, arms: Sequence[Arm], rates=None
    ) -> list[Arm]:
        """The bandit's arm for a step in which ``drafting`` of ``batch_size`` sequences draft;
        young proposers try their longest k first (its verifications teach every shorter k)."""
        assert self.bandit is not None
        rates = rates if rates is not None else self._rates(batch_size)
        samples = {a: self.accept[a.proposer].samples(a.k) for a in arms}
        young = {a.proposer: a for a in arms if samples[a] < self.bandit.min_samples}
        pool = list(young.values()) or arms  # arms ascend in k: the longest young one stays
        arm = self.bandit.choose({a: rates[a] for a in pool}, samples)
        self.counts["spec_steps"] += 1
        self.selections[str(arm)] += drafting
        self.widest = max(self.widest, drafting)
        return [arm] * batch_size

    def _plain(self) -> None:
        self.counts["plain_steps"] += 1
        return None

    # ------------------------------------------------------------------ learning
    def record_step(self, rows: int, seconds: float | None, speculative: bool) -> None:
        """Target seconds of one decode step (prefill and drafting taken out; None: no sample,
        e.g. it compiled a graph) that computed ``rows`` query rows."""
        if seconds is not None:
            self.target[speculative].observe(rows, seconds)
            self._measured += speculative

    def record_draft(self, proposer: str, rows: int, seconds: float, backlog: int = 0) -> None:
        """One ``propose`` call: ``rows`` tokens asked (Σ caps) after ``backlog`` queued
        positions caught up, in ``seconds``."""
        self.drafting[proposer].observe(rows + backlog, seconds)
        self.defers[proposer] |= backlog > 0
        self._measured += 1

    def record(self, arm: Arm, k_used: int, emitted: int, cap: int | None = None) -> None:
        """One verification under ``arm``: capped at ``cap`` (default k), ``k_used`` drafted,
        ``emitted`` tokens emitted."""
        self.accept[arm.proposer].add(arm.k if cap is None else cap, k_used, emitted)
        self._measured += 1

    # ------------------------------------------------------------------ reporting, state
    def to_dict(self) -> dict[str, Any]:
        on = sorted(b for b, state in self.gate.states.items() if state)
        return {
            "gate_on": self.gate.state(self._last_batch) if self.config.gate else True,
            "gate_on_batch_sizes": on,
            "gate_switches": self.gate.switches,
            **{k: v for k, v in self.counts.items() if k != "since_probe"},
            "target_cost": {
                kind: [[round(x, 3), t] for x, t in self.target[spec].points]
                for kind, spec in (("plain", False), ("speculative", True))
            },
            "draft_cost": {
                p: [[round(x, 3), t] for x, t in c.points] for p, c in self.drafting.items()
            },
            "selections": {k: v for k, v in self.selections.items() if v},
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "accept": {p: a.state_dict() for p, a in self.accept.items()},
            "target": [self.target[False].state_dict(), self.target[True].state_dict()],
            "drafting": {p: c.state_dict() for p, c in self.drafting.items()},
            "defers": dict(self.defers),
            "gate": self.gate.state_dict(),
            "bandit": None if self.bandit is None else self.bandit.state_dict(),
            "counts": dict(self.counts),
            "selections": dict(self.selections),
            "widest": self.widest,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A state saved by an engine with the same proposers (others are ignored)."""
        for p, a in self.accept.items():
            if p in state["accept"]:
                a.load_state_dict(state["accept"][p])
                self.drafting[p].load_state_dict(state["drafting"][p])
                self.defers[p] = bool(state["defers"][p])
        self.target[False].load_state_dict(state["target"][0])
        self.target[True].load_state_dict(state["target"][1])
        self.gate.load_state_dict(state["gate"])
        if self.bandit is not None and state["bandit"] is not None:
            self.bandit.load_state_dict(state["bandit"])
        self.counts.update(state["counts"])
        self.widest = int(state.get("widest", 0))
        self._prices_key = None
        self.selections.update(
            {k: v for k, v in state["selections"].items() if k in self.selections}
        )
