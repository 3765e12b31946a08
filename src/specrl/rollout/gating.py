"""When to speculate, with which drafter, and how far: cost model, gate and bandit.

Speculation trades target compute for fewer sequential forwards.  Whether that pays depends on
the batch: a small batch leaves the target latency-bound (k + 1 tokens cost about as much as
one), a large one makes it compute-bound (k + 1 tokens cost about k + 1 times as much).  Three
small pieces decide, all online, all deterministic given a seed and the measured step times
(the clock is injected into the engine, so tests feed synthetic timings):

- :class:`CostModel`: the target's share of a decode step (step time minus the measured time of
  the proposers' ``propose`` calls) from the tokens fed T and the padded query rows
  P = B·max(k + 1), t = a + b·T + c·P, non-negative least squares over the last ``window``
  decode steps (P matters for attention kernels that pad every sequence to the longest one; a
  varlen kernel fits c ≈ 0).  Flat before the data has spread (optimistic: speculation is tried).
- :class:`DraftCost`: the same fit per proposer for its ``propose`` calls, from the tokens it
  drafted (Σ caps) and the length of its longest chain (max cap): a chain drafter runs one
  forward per position for the whole batch, so most of its cost is per call and per position,
  not per sequence.  Zero before the first call (optimistic).
- :class:`EpsilonGreedy`: per decode step, which arm (proposer, k) every request in it drafts
  with; ε-greedy (TLT's choice, ε = 0.1) whose exploration skips clearly worse arms most of the
  time, so it costs ≤ ε·gap on average.  An arm's value at batch size B is the throughput it
  would give the whole batch, B·τ̂ / (t(B·f̂, B·(k + 1)) + d(B·k, k)): τ̂ tokens emitted and f̂
  fed per verification, learned per arm over all batch sizes (acceptance does not depend on B),
  and d the proposer's drafting time for a call in which the whole batch drafts k tokens — so
  each arm is charged what it costs once exploited, not what a step that explored it happened
  to pay.  A long k wins in the latency-bound tail, a short one (or none, via the gate) in a
  full batch, and an expensive drafter only where its acceptance pays for it.
- :class:`SpeculationGate`: speculation on or off for the step, from the expected speedup
  S(B) = max over arms of τ̂·t(B, B) / (t(B·f̂, B·(k + 1)) + d(B·k, k)) (τ̂ tokens emitted and f̂
  fed per verification, d the proposer's drafting time) with hysteresis: off below 1, on again
  above 1 + h.  Probes keep both sides measured: while off, about one step in 1/probe still
  speculates (a whole step, not a few sequences: with a padding kernel one drafting sequence
  makes the whole batch pay for k + 1 query rows); while on, about one in 1/probe runs plain.

:class:`SpecController` ties them together for the engine.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Arm:
    """One choice of the bandit: draft with ``proposer``, at most ``k`` tokens."""

    proposer: str
    k: int

    def __str__(self) -> str:
        return f"{self.proposer}/k={self.k}"


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
    """Online fit of decode step time t = a + b·T + c·P.

    T is the number of tokens fed to the target, P the query rows after padding (batch × the
    longest sequence's new tokens), a the fixed cost of a step.  Non-negative least squares over
    the last ``window`` steps, solved exactly by trying every subset of the coefficients
    (preferring fewer on ties: with no spread in the data it stays flat).  Before any
    measurement it is flat, t = 1 (optimistic: speculation gets tried, and so measured).
    """

    _SUBSETS = ((0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2))

    def __init__(
        self, window: int = 256, prior: tuple[float, float, float] = (1.0, 0.0, 0.0)
    ) -> None:
        self._prior = prior
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)
        # running sums over the window: Σ x xᵀ, Σ x y, Σ y² with x = (1, T, P)
        self._gram = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._yy = 0.0
        self._since_rebuild = 0
        self._fit: tuple[float, float, float] | None = None

    def observe(self, tokens: int, padded: int, seconds: float) -> None:
        if len(self._obs) == self._obs.maxlen:
            self._accumulate(self._obs[0], -1.0)
        obs = (float(tokens), float(padded), max(float(seconds), 0.0))
        self._obs.append(obs)
        self._accumulate(obs, 1.0)
        self._since_rebuild += 1
        if self._since_rebuild >= (self._obs.maxlen or 1):  # bound rounding drift
            self._rebuild()
        self._fit = None

    def _accumulate(self, obs: tuple[float, float, float], sign: float) -> None:
        x = (1.0, obs[0], obs[1])
        y = obs[2]
        for i in range(3):
            self._xy[i] += sign * x[i] * y
            for j in range(3):
                self._gram[i][j] += sign * x[i] * x[j]
        self._yy += sign * y * y

    def _rebuild(self) -> None:
        self._gram = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._yy = 0.0
        for obs in self._obs:
            self._accumulate(obs, 1.0)
        self._since_rebuild = 0

    @property
    def num_observations(self) -> int:
        return len(self._obs)

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c): seconds, seconds per token fed, seconds per padded query row."""
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def predict(self, tokens: float, padded: float) -> float:
        a, b, c = self.coefficients()
        return a + b * tokens + c * padded

    def _solve(self) -> tuple[float, float, float]:
        if not self._obs:
            return self._prior
        gram, xy, yy = self._gram, self._xy, self._yy
        best, best_err = [0.0, 0.0, 0.0], yy  # all-zero coefficients: error Σy²
        for idx in self._SUBSETS:
            g = [[gram[i][j] for j in idx] for i in idx]
            coef = _solve_small(g, [xy[i] for i in idx])
            if coef is None or min(coef) < 0:
                continue  # collinear on this window, or infeasible: other subsets cover it
            fit = sum(c * xy[i] for c, i in zip(coef, idx, strict=True))
            err = yy - fit  # at the least-squares optimum, Σ(y − xᵀc)² = Σy² − cᵀ Σxy
            if err < best_err - 1e-9 * yy:  # strictly better, else keep the smaller subset
                best, best_err = [0.0, 0.0, 0.0], err
                for c, i in zip(coef, idx, strict=True):
                    best[i] = c
        return best[0], best[1], best[2]


def _solve_small(g: list[list[float]], h: list[float]) -> list[float] | None:
    """Solve g·c = h for n ≤ 3 by Cramer's rule; None when g is (nearly) singular."""
    n = len(h)
    scale = max(abs(v) for row in g for v in row) or 1.0

    def det(m: list[list[float]]) -> float:
        if len(m) == 1:
            return m[0][0]
        if len(m) == 2:
            return m[0][0] * m[1][1] - m[0][1] * m[1][0]
        return (
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )

    d = det(g)
    if abs(d) <= 1e-10 * scale**n:
        return None
    out = []
    for col in range(n):
        m = [[h[i] if j == col else g[i][j] for j in range(n)] for i in range(n)]
        out.append(det(m) / d)
    return out


class DraftCost(CostModel):
    """Seconds of one ``propose`` call, d = a + b·N + c·K: N tokens drafted (Σ caps), K the
    longest chain (max cap).  A chain drafter costs about K·(forward latency) + N·(per-row
    cost); a lookup drafter about N·(per-token cost).  Zero before the first call."""

    def __init__(self, window: int = 256) -> None:
        super().__init__(window, prior=(0.0, 0.0, 0.0))


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
    """ε-greedy choice among arms whose values the caller estimates, with exploration whose
    expected cost is bounded.

    Arms with fewer than ``min_samples`` observations go first (round-robin): one
    verification's outcome is noisy (1 … k + 1 tokens emitted), and a single unlucky first draw
    would otherwise leave the best arm behind a worse one until exploration happens to revisit
    it often enough to repair its estimate.

    Then, with probability ε, a uniformly drawn arm j is explored — if its value is within
    ``gap`` (relative) of the best, always; else only with probability gap/g_j, g_j = 1 − v_j/v*.
    Arms close to the best (whose order the noise may have swapped) are revisited at the full
    rate; a clearly worse arm is still revisited (the policy drifts; its value may recover), but
    so rarely that exploring costs at most ε·gap of the throughput on average, instead of ε times
    the worst arm's shortfall (exploring a drafter with a dear per-call cost in 10 % of a full
    batch's steps would cost more than any drafter saves).
    """

    def __init__(
        self,
        arms: Sequence[Arm],
        epsilon: float = 0.1,
        seed: int = 0,
        min_samples: int = 8,
        gap: float = 0.1,
    ) -> None:
        if not arms:
            raise ValueError("the bandit needs at least one arm")
        if min_samples < 1:
            raise ValueError(f"min_samples must be ≥ 1, got {min_samples}")
        if not 0 < gap <= 1:
            raise ValueError(f"gap must be in (0, 1], got {gap}")
        self.arms = tuple(arms)
        self.epsilon = epsilon
        self.min_samples = min_samples
        self.gap = gap
        self._rng = random.Random(seed)
        self._turn = -1

    def choose(self, values: Mapping[Arm, float], samples: Mapping[Arm, int]) -> Arm:
        """The arm to play given each arm's estimated value and number of observations."""
        young = [arm for arm in self.arms if samples.get(arm, 0) < self.min_samples]
        if young:  # round-robin
            self._turn += 1
            return young[self._turn % len(young)]
        best = max(self.arms, key=lambda arm: values[arm])
        if self._rng.random() < self.epsilon:
            arm = self.arms[self._rng.randrange(len(self.arms))]
            top = values[best]
            shortfall = 1.0 - values[arm] / top if top > 0 else 0.0
            if shortfall <= self.gap or self._rng.random() * shortfall < self.gap:
                return arm
        return best


class SpeculationGate:
    """On/off from the expected speedup, with hysteresis (probing is the controller's).

    Off as soon as speculation is expected to lose (speedup < 1): a neutral drafter (one that
    rarely finds a draft) must not keep a full batch speculating.  On again only for a clear
    win (speedup > 1 + h), so a batch size near the break-even point does not flap.
    """

    def __init__(self, hysteresis: float = 0.1) -> None:
        self.hysteresis = hysteresis
        self.on = True
        self.switches = 0

    def decide(self, speedup: float) -> bool:
        """Update the state from ``speedup``; True while speculation is on."""
        if self.on and speedup < 1:
            self.on, self.switches = False, self.switches + 1
        elif not self.on and speedup > 1 + self.hysteresis:
            self.on, self.switches = True, self.switches + 1
        return self.on


@dataclass
class _ArmShape:
    """Running means per verification under one arm (cases with k_used = 0 included)."""

    emitted: RunningMean  # tokens emitted: τ̂
    fed: RunningMean  # tokens fed, k_used + 1


ARM_MEMORY = 128  # verifications an arm's acceptance estimate averages over (then an EMA)


class SpecController:
    """The engine's speculation policy: gate the step, pick its arm, learn.

    The bandit's value of an arm at batch size B is the throughput it would give if the whole
    batch drafted with it, B·τ̂ / (t(B·f̂, B·(k + 1)) + d(B·k, k)): acceptance (τ̂, f̂) is learned
    per arm from every verification whatever the batch size (it does not depend on B), the cost
    comes from the fitted models.  So every batch size benefits from what any other measured,
    and the gate and the bandit agree on one estimate.
    """

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
        self.gate = SpeculationGate(hysteresis)
        self.gating = gate
        self.probe = probe
        self._plain_run = 0  # plain steps since the last speculative one
        self._spec_run = 0  # speculative steps since the last plain one
        self.spec_steps = 0
        self.plain_steps = 0
        self.selections: dict[str, int] = {str(a): 0 for a in self.arms}
        rate = 1.0 / ARM_MEMORY
        self._shape = {a: _ArmShape(RunningMean(rate), RunningMean(rate)) for a in self.arms}
        self.draft_cost = {p: DraftCost(cost_window) for p in proposers}

    def expected_rate(self, batch_size: int, arm: Arm) -> float:
        """Tokens per second if all ``batch_size`` sequences draft with ``arm``:
        B·τ̂ / (t(B·f̂, B·(k+1)) + d(B·k, k)), τ̂ tokens emitted and f̂ fed per verification (an
        untried arm counts as fully accepted), d the proposer's drafting time."""
        shape = self._shape[arm]
        if shape.emitted.count:
            tau, fed = shape.emitted.value, shape.fed.value
        else:
            tau = fed = arm.k + 1.0
        spec = self.cost.predict(batch_size * fed, batch_size * (arm.k + 1))
        spec += self.draft_seconds(arm, batch_size)
        return batch_size * tau / spec if spec > 0 else float("inf")

    def expected_speedup(self, batch_size: int, rates: Mapping[Arm, float] | None = None) -> float:
        """The best arm's expected rate over plain decoding's, B / t(B, B) (``rates``: the
        arms' :meth:`expected_rate` at this batch size, when already computed)."""
        if rates is None:
            rates = {arm: self.expected_rate(batch_size, arm) for arm in self.arms}
        return max(rates.values()) * self.cost.predict(batch_size, batch_size) / batch_size

    def draft_seconds(self, arm: Arm, batch_size: int) -> float:
        """Predicted time of one ``propose`` call in which ``batch_size`` sequences all draft
        ``arm.k`` tokens with ``arm.proposer`` (0 before its first call)."""
        return self.draft_cost[arm.proposer].predict(batch_size * arm.k, arm.k)

    def plan(self, batch_size: int) -> list[Arm] | None:
        """The arm of every sequence for a speculative step, or None for a plain step.

        One decision per step, shared by its sequences: a step that mixes arms pays every extra
        proposer's per-call cost and the longest chain (and, with a padding kernel, the longest
        k + 1 rows) for the whole batch, which per-sequence exploration would incur nearly every
        step at a large batch.  (The engine still reports acceptance per request and per
        proposer.)

        Probes keep both sides of the comparison measured.  While the gate is off, one step in
        ``max(1, (1 − S)/h) / probe`` speculates anyway (acceptance estimates stay fresh: a new
        epoch, new weights or a shrinking batch can make speculation pay again; rarer the
        clearer the loss).  While it is on, one step in ``1/probe`` runs plain, whatever S says:
        S itself depends on the plain step time t(B, B), which must be measured, not
        extrapolated from speculative steps.
        """
        if self.bandit is None:
            self.plain_steps += 1
            return None
        rates = {arm: self.expected_rate(batch_size, arm) for arm in self.arms}
        if self.gating:
            speedup = self.expected_speedup(batch_size, rates)
            h = max(self.gate.hysteresis, 1e-9)
            if self.gate.decide(speedup):
                self._spec_run += 1
                if self.probe > 0 and self._spec_run >= 1 / self.probe:
                    return self._plain()
            else:
                self._plain_run += 1
                wait = max(1.0, (1 - speedup) / h) / self.probe if self.probe > 0 else float("inf")
                if self._plain_run < wait:
                    return self._plain()
        self._plain_run = 0
        self.spec_steps += 1
        samples = {arm: shape.emitted.count for arm, shape in self._shape.items()}
        arm = self.bandit.choose(rates, samples)
        self.selections[str(arm)] += batch_size
        return [arm] * batch_size

    def _plain(self) -> None:
        self._spec_run = 0
        self.plain_steps += 1
        return None

    def record_draft(self, proposer: str, tokens: int, chain: int, seconds: float) -> None:
        """One ``propose`` call of ``proposer``: ``tokens`` asked in all (Σ caps), ``chain`` the
        longest cap, taking ``seconds``."""
        self.draft_cost[proposer].observe(tokens, chain, seconds)

    def record(self, arm: Arm, k_used: int, emitted: int) -> None:
        """One sequence's verification under ``arm``: it drafted ``k_used`` tokens and emitted
        ``emitted``."""
        shape = self._shape[arm]
        shape.emitted.add(emitted)
        shape.fed.add(k_used + 1)

    def record_step(self, tokens: int, padded: int, seconds: float) -> None:
        """Target time of one decode step (its prefill and drafting time taken out):
        ``tokens`` fed, ``padded`` query rows."""
        self.cost.observe(tokens, padded, seconds)

    def to_dict(self) -> dict:
        a, b, c = self.cost.coefficients()
        return {
            "gate_on": self.gate.on,
            "gate_switches": self.gate.switches,
            "spec_steps": self.spec_steps,  # speculative decode steps (probes included)
            "plain_steps": self.plain_steps,
            "cost_model": {
                "a_s": a,
                "b_s_per_token": b,
                "c_s_per_padded_row": c,
                "points": self.cost.num_observations,
            },
            "draft_cost": {
                name: {
                    "a_s": da,
                    "b_s_per_token": db,
                    "c_s_per_chain_position": dc,
                    "points": model.num_observations,
                }
                for name, model in self.draft_cost.items()
                for da, db, dc in [model.coefficients()]
            },
            "selections": {k: v for k, v in self.selections.items() if v},
        }
