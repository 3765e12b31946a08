"""When to speculate, with which drafter, and how far: cost model, gate and bandit.

Speculation trades target compute for fewer sequential forwards.  Whether that pays depends on
the batch: a small batch leaves the target latency-bound (k + 1 tokens cost about as much as
one), a large one makes it compute-bound (k + 1 tokens cost about k + 1 times as much).  Three
small pieces decide, all online, all deterministic given a seed and the measured step times
(the clock is injected into the engine, so tests feed synthetic timings):

- :class:`CostModel`: step time as a function of tokens in the target forward,
  t(T) = a + b·T, least squares over the last ``window`` decode steps (a ≥ 0, b ≥ 0).  With no
  spread in T yet it is flat (optimistic: speculation gets tried, and so measured).
- :class:`EpsilonGreedy`: per request and step, which arm (proposer, k) drafts, bucketed by
  batch size (buckets 1, 2–3, 4–7, …); ε-greedy (TLT's choice, ε = 0.1).  Reward of one
  verification = tokens emitted / its share of the step cost, a/B + b·(k_used + 1), so a long k
  wins in the latency-bound tail and a short one (or none, via the gate) in a full batch.
- :class:`SpeculationGate`: speculation on or off for the whole step, from the expected
  speedup S(B) = max over arms of τ̂·t(B) / t(B·(k̂+1)) (τ̂ tokens per verification, k̂ + 1 tokens
  fed, both running means per arm) with hysteresis: off below 1, on again above 1 + h.  While
  off it still probes speculation with probability ``probe`` so its estimates stay fresh.

:class:`SpecController` ties them together for the engine.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Arm:
    """One choice of the bandit: draft with ``proposer``, at most ``k`` tokens."""

    proposer: str
    k: int

    def __str__(self) -> str:
        return f"{self.proposer}/k={self.k}"


def batch_bucket(batch_size: int) -> int:
    """Power-of-two bucket of a batch size: 1 → 0, 2–3 → 1, 4–7 → 2, …"""
    return max(batch_size, 1).bit_length() - 1


def k_choices(max_k: int) -> tuple[int, ...]:
    """Draft lengths the bandit tries: powers of two below ``max_k``, and ``max_k`` itself."""
    if max_k < 1:
        raise ValueError(f"max k must be ≥ 1, got {max_k}")
    ks, k = [], 1
    while k < max_k:
        ks.append(k)
        k *= 2
    return (*ks, max_k)


class CostModel:
    """Online least-squares fit of decode step time t(T) = a + b·T (T = tokens in the forward)."""

    def __init__(self, window: int = 256) -> None:
        self._obs: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        self._obs.append((tokens, max(seconds, 0.0)))
        self._fit = None

    @property
    def num_observations(self) -> int:
        return len(self._obs)

    def coefficients(self) -> tuple[float, float]:
        """(a, b) in seconds and seconds per token; (1, 0) before any observation."""
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def predict(self, tokens: float) -> float:
        a, b = self.coefficients()
        return a + b * tokens

    def _solve(self) -> tuple[float, float]:
        n = len(self._obs)
        if n == 0:
            return 1.0, 0.0
        mx = sum(t for t, _ in self._obs) / n
        my = sum(s for _, s in self._obs) / n
        sxx = sum((t - mx) ** 2 for t, _ in self._obs)
        if sxx == 0:
            return my, 0.0  # no spread in T yet: flat
        b = sum((t - mx) * (s - my) for t, s in self._obs) / sxx
        a = my - b * mx
        if b < 0:
            return my, 0.0
        if a < 0:  # through the origin instead
            return 0.0, sum(t * s for t, s in self._obs) / sum(t * t for t, _ in self._obs)
        return a, b


class RunningMean:
    """Mean that turns into an exponential moving average after 1/``min_rate`` samples."""

    def __init__(self, min_rate: float = 0.05) -> None:
        self.count = 0
        self.value = 0.0
        self.min_rate = min_rate

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) * max(1.0 / self.count, self.min_rate)


class EpsilonGreedy:
    """ε-greedy over arms, one value table per batch-size bucket; untried arms go first."""

    def __init__(self, arms: Sequence[Arm], epsilon: float = 0.1, seed: int = 0) -> None:
        if not arms:
            raise ValueError("the bandit needs at least one arm")
        self.arms = tuple(arms)
        self.epsilon = epsilon
        self._rng = random.Random(seed)
        self._values: dict[tuple[int, Arm], RunningMean] = {}

    def choose(self, bucket: int) -> Arm:
        for arm in self.arms:
            if (bucket, arm) not in self._values:
                return arm
        if self._rng.random() < self.epsilon:
            return self.arms[self._rng.randrange(len(self.arms))]
        return max(self.arms, key=lambda arm: self._values[bucket, arm].value)

    def update(self, bucket: int, arm: Arm, reward: float) -> None:
        self._values.setdefault((bucket, arm), RunningMean()).add(reward)

    def value(self, bucket: int, arm: Arm) -> float | None:
        v = self._values.get((bucket, arm))
        return None if v is None else v.value


class SpeculationGate:
    """On/off from the expected speedup with hysteresis, plus occasional probes while off.

    Off as soon as speculation is expected to lose (speedup < 1): a neutral drafter (one that
    rarely finds a draft) must not keep a full batch speculating.  On again only for a clear
    win (speedup > 1 + h), so a batch size near the break-even point does not flap.
    """

    def __init__(self, hysteresis: float = 0.1, probe: float = 0.05, seed: int = 0) -> None:
        self.hysteresis = hysteresis
        self.probe = probe
        self.on = True
        self.switches = 0
        self._rng = random.Random(seed)

    def decide(self, speedup: float) -> bool:
        """Update the state from ``speedup`` and say whether this step speculates."""
        if self.on and speedup < 1:
            self.on, self.switches = False, self.switches + 1
        elif not self.on and speedup > 1 + self.hysteresis:
            self.on, self.switches = True, self.switches + 1
        return self.on or self._rng.random() < self.probe


@dataclass
class _ArmShape:
    emitted: RunningMean  # tokens emitted per verification (τ̂, including k_used = 0 cases)
    fed: RunningMean  # tokens fed per verification (k_used + 1)


class SpecController:
    """The engine's speculation policy: gate the step, pick an arm per sequence, learn."""

    def __init__(
        self,
        proposers: Sequence[str],
        max_k: int,
        *,
        epsilon: float = 0.1,
        hysteresis: float = 0.1,
        probe: float = 0.05,
        cost_window: int = 256,
        gate: bool = True,
        seed: int = 0,
    ) -> None:
        self.arms = tuple(Arm(p, k) for p in proposers for k in k_choices(max_k))
        self.cost = CostModel(cost_window)
        self.bandit = EpsilonGreedy(self.arms, epsilon, seed) if self.arms else None
        self.gate = SpeculationGate(hysteresis, probe, seed + 1)
        self.gating = gate
        self.spec_steps = 0
        self.plain_steps = 0
        self.selections: dict[str, int] = {str(a): 0 for a in self.arms}
        self._shape = {a: _ArmShape(RunningMean(), RunningMean()) for a in self.arms}

    def expected_speedup(self, batch_size: int) -> float:
        """max over arms of τ̂·t(B)/t(B·(k̂+1)); untried arms count as fully accepted."""
        plain = self.cost.predict(batch_size)
        best = 0.0
        for arm, shape in self._shape.items():
            if shape.emitted.count:
                tau, fed = shape.emitted.value, shape.fed.value
            else:
                tau = fed = arm.k + 1.0
            spec = self.cost.predict(batch_size * fed)
            best = max(best, tau * plain / spec if spec > 0 else float("inf"))
        return best

    def plan(self, batch_size: int) -> list[Arm] | None:
        """Arms for ``batch_size`` sequences this step, or None for a plain step."""
        speculate = self.bandit is not None and (
            not self.gating or self.gate.decide(self.expected_speedup(batch_size))
        )
        if not speculate:
            self.plain_steps += 1
            return None
        self.spec_steps += 1
        bucket = batch_bucket(batch_size)
        arms = [self.bandit.choose(bucket) for _ in range(batch_size)]
        for a in arms:
            self.selections[str(a)] += 1
        return arms

    def record(self, batch_size: int, arm: Arm, k_used: int, emitted: int) -> None:
        """One sequence's verification under ``arm``: it drafted ``k_used`` and emitted tokens."""
        a, b = self.cost.coefficients()
        share = a / batch_size + b * (k_used + 1)
        reward = emitted / share if share > 0 else float(emitted)
        self.bandit.update(batch_bucket(batch_size), arm, reward)
        shape = self._shape[arm]
        shape.emitted.add(emitted)
        shape.fed.add(k_used + 1)

    def record_step(self, tokens: int, seconds: float) -> None:
        """Time of one decode step (no prefill in it) that fed ``tokens`` to the target."""
        self.cost.observe(tokens, seconds)

    def to_dict(self) -> dict:
        a, b = self.cost.coefficients()
        return {
            "gate_on": self.gate.on,
            "gate_switches": self.gate.switches,
            "spec_steps": self.spec_steps,
            "plain_steps": self.plain_steps,
            "cost_model": {"a_s": a, "b_s_per_token": b, "points": self.cost.num_observations},
            "selections": {k: v for k, v in self.selections.items() if v},
        }
