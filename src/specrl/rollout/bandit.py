"""Bandit primitives: a running mean and an ε-greedy chooser with bounded exploration cost.

Used by the speculation policy (:mod:`specrl.rollout.gating`: which drafter, which k) and by
proposers that learn a setting of their own (EAGLE-3's draft temperature scale), so neither
imports the other.  Both are plain Python and deterministic given their seed; their state is
JSON-able (``state_dict`` / ``load_state_dict``) so a resumed run replays the same choices.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

# observations a running mean averages over before it becomes an exponential moving average
MEMORY = 128


class RunningMean:
    """The mean of the first 1/``rate`` samples, then an exponential moving average with weight
    ``rate`` (x̄ ← x̄ + (x − x̄)·max(1/n, rate)): exact while young, tracking drift once old."""

    def __init__(self, rate: float = 1.0 / MEMORY) -> None:
        self.rate = rate
        self.count = 0
        self.value = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) * max(1.0 / self.count, self.rate)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.count, self.value = int(state["count"]), float(state["value"])


class EpsilonGreedy:
    """ε-greedy choice among arms whose values the caller estimates.

    Arms with fewer than ``min_samples`` observations go first, round-robin: one outcome is
    noisy, and a single unlucky first draw would otherwise leave the best arm behind.

    Then, with probability ε, a uniformly drawn arm j is explored — always if its value is
    within ``gap`` (relative) of the best v*, else with probability gap/g_j, g_j = 1 − v_j/v*.
    Close arms (whose order noise may swap) are revisited at the full rate, a clearly worse one
    rarely: exploring then costs at most ε·gap of the value on average instead of ε times the
    worst arm's shortfall.
    """

    def __init__(
        self,
        arms: Sequence[Hashable],
        epsilon: float = 0.1,
        seed: int = 0,
        min_samples: int = 8,
        gap: float = 0.1,
    ) -> None:
        if not arms:
            raise ValueError("the bandit needs at least one arm")
        if not 0 <= epsilon <= 1:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        if min_samples < 1 or not 0 < gap <= 1:
            raise ValueError(f"need min_samples ≥ 1 and gap in (0, 1], got {min_samples}, {gap}")
        self.arms = tuple(arms)
        self.epsilon, self.min_samples, self.gap = epsilon, min_samples, gap
        self._rng = random.Random(seed)
        self._turn = -1

    def choose(self, values: Mapping[Any, float], samples: Mapping[Any, int]) -> Any:
        """The arm to play, among the arms of ``values`` (in the order of :attr:`arms`), given
        each one's estimated value and number of observations."""
        arms = [a for a in self.arms if a in values]
        young = [a for a in arms if samples.get(a, 0) < self.min_samples]
        if young:
            self._turn += 1
            return young[self._turn % len(young)]
        best = max(arms, key=values.__getitem__)
        if self._rng.random() < self.epsilon:
            arm = arms[self._rng.randrange(len(arms))]
            top = values[best]
            shortfall = 1.0 - values[arm] / top if top > 0 else 0.0
            if shortfall <= self.gap or self._rng.random() * shortfall < self.gap:
                return arm
        return best

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {"rng": [version, list(internal), gauss], "turn": self._turn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._turn = int(state["turn"])
