"""What the speculation policy measures, and what that says each way of drafting costs.

:class:`ChainAcceptance` (acceptance per draft position), :class:`CostCurve` (seconds by size)
and :class:`StepCosts` (both, for every proposer and target mode, priced per :class:`Arm`): plain
Python, deterministic and JSON-able (``state_dict`` / ``load_state_dict``), used by
:mod:`specrl.rollout.gating`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from specrl.rollout.bandit import MEMORY, RunningMean

MODES = ("plain", "coupled", "decoupled")


class Arm(NamedTuple):
    """Draft with ``proposer``, at most ``k`` tokens; ``ahead``: decoupled."""

    proposer: str
    k: int
    ahead: bool = False

    @property
    def mode(self) -> str:
        return MODES[1 + self.ahead]

    def __str__(self) -> str:
        return f"{self.proposer}/k={self.k}" + ("/ahead" if self.ahead else "")


class ChainAcceptance:
    """One proposer's acceptance per draft position, shared by all its draft lengths k.

    Whether the first j draft tokens are accepted does not depend on how many were drafted after
    them (verification walks the chain in order), and a drafter asked for fewer tokens drafts
    the same first ones.  So with A_j = P(≥ j accepted), D_j = P(≥ j drafted), each a running
    mean over the verifications whose cap reached j (weight max(1/n, ``rate``)), a draft capped
    at k emits τ̂(k) = 1 + Σ_{j≤k} A_j tokens and feeds f̂(k) = 1 + Σ_{j≤k} D_j.  Every
    verification teaches every shorter k.  Estimates are made non-increasing in j; a position
    never reached counts as its predecessor (optimistic: untried drafts count as accepted).
    """

    def __init__(self, max_k: int, rate: float = 1.0 / MEMORY) -> None:
        self.rate = rate
        self.counts = [0] * max_k
        self.accepted = [0.0] * max_k
        self.drafted = [0.0] * max_k
        self._estimates: dict[int, tuple[float, float]] = {}  # k → (τ̂, f̂) until the next add

    def add(self, cap: int, k_used: int, emitted: int) -> None:
        """One verification of a draft capped at ``cap``: ``k_used`` drafted, ``emitted``
        tokens emitted (accepted + 1)."""
        self._estimates.clear()
        for j in range(min(cap, len(self.counts))):
            self.counts[j] += 1
            w = max(1.0 / self.counts[j], self.rate)
            self.accepted[j] += (float(emitted - 1 > j) - self.accepted[j]) * w
            self.drafted[j] += (float(k_used > j) - self.drafted[j]) * w

    def samples(self, k: int) -> int:
        return self.counts[k - 1]

    def estimate(self, k: int) -> tuple[float, float]:
        """(τ̂, f̂): tokens emitted and fed per verification of a draft capped at ``k``."""
        if k not in self._estimates:
            tau = fed = a = d = 1.0
            for j in range(k):
                if self.counts[j]:
                    a, d = min(a, self.accepted[j]), min(d, self.drafted[j])
                tau, fed = tau + a, fed + d
            self._estimates[k] = (tau, fed)
        return self._estimates[k]

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts[:], "accepted": self.accepted[:], "drafted": self.drafted[:]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A state saved with another max_k keeps the positions both have."""
        n = len(self.counts)

        def fit(values: list, cast: type) -> list:
            return [cast(v) for v in values[:n]] + [cast(0)] * (n - len(values[:n]))

        self.counts = fit(state["counts"], int)
        self.accepted, self.drafted = fit(state["accepted"], float), fit(state["drafted"], float)
        self._estimates.clear()


class CostCurve:
    """Seconds as a non-decreasing piecewise-linear function t(x) of a size x, measured.

    Observations fall in buckets of x spaced by a factor √2; each keeps running means (x̄, t̄)
    forgetting at ``rate`` (the machine and the model drift): per observation, or per step of
    the caller's clock where it passes one (weight max(1/n, 1 − (1 − rate)^Δ), Δ the steps since
    the bucket's last observation: a rarely measured bucket forgets in time as fast as one
    measured every step).  t(x) interpolates linearly between the buckets' points, made
    non-increasing from the right (never cheaper at a larger size).  Outside them it extrapolates
    conservatively above, as compute-bound (t̄·x/x̄, the steepest a cost with a fixed part can
    grow), and flat below — or, ``optimistic``, flat above and proportional below.  A GPU's step
    is flat while latency-bound and linear once compute-bound; the points follow that knee
    wherever it lies, where one global line cannot.
    """

    def __init__(self, rate: float = 1.0 / 32) -> None:
        self.rate = rate
        self._buckets: dict[int, list[float]] = {}  # bucket → [count, x̄, t̄, last step]
        self._points: list[tuple[float, float]] | None = None  # cache of :attr:`points`
        self._xs: list[float] = []  # their sizes
        self.observations = 0

    @staticmethod
    def _bucket(x: float) -> int:
        return round(2 * math.log2(max(x, 1.0)))

    def count(self, x: float) -> int:
        """Observations in the bucket of size ``x``."""
        b = self._buckets.get(self._bucket(x))
        return 0 if b is None else int(b[0])

    def observe(self, x: float, seconds: float, step: int | None = None) -> None:
        """One measurement at the caller's ``step`` (None: one step after the last one)."""
        b = self._buckets.setdefault(self._bucket(x), [0, 0.0, 0.0, 0])
        b[0] += 1
        self.observations += 1
        last, b[3] = b[3], b[3] + 1 if step is None else step
        w = max(1.0 / b[0], 1.0 - (1.0 - self.rate) ** max(b[3] - last, 1))
        b[1] += (x - b[1]) * w
        b[2] += (max(seconds, 0.0) - b[2]) * w
        self._points = None

    @property
    def points(self) -> list[tuple[float, float]]:
        """(x̄, t̄) per bucket, by size, t̄ non-increasing from the right."""
        if self._points is None:
            pts = [(b[1], b[2]) for _, b in sorted(self._buckets.items())]
            for i in range(len(pts) - 2, -1, -1):
                pts[i] = (pts[i][0], min(pts[i][1], pts[i + 1][1]))
            self._points, self._xs = pts, [x for x, _ in pts]
        return self._points

    def predict(self, x: float, optimistic: bool = False) -> float | None:
        """t(x), None before any observation."""
        pts = self.points
        if not pts:
            return None
        i = bisect.bisect_left(self._xs, x)
        if 0 < i < len(pts):
            (x0, t0), (x1, t1) = pts[i - 1], pts[i]
            return t0 + (t1 - t0) * (x - x0) / (x1 - x0)
        x0, t0 = pts[0] if i == 0 else pts[-1]
        scaled = t0 * x / x0 if x0 > 0 else t0
        return min(t0, scaled) if optimistic else max(t0, scaled)

    def state_dict(self) -> dict[str, Any]:
        return {"buckets": [[k, *v] for k, v in sorted(self._buckets.items())]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._buckets = {
            int(k): [int(n), float(x), float(t), int(s)] for k, n, x, t, s in state["buckets"]
        }
        self._points = None
        self.observations = int(sum(b[0] for b in self._buckets.values()))


def _predict(curves: Iterable[CostCurve], x: float, optimistic: bool) -> float:
    """The first measured curve's t(x); 0 if none is measured."""
    for c in curves:
        if c.observations:
            return c.predict(x, optimistic) or 0.0
    return 0.0


class Stretches:
    """How long the batch keeps its size: the decode steps of the current stretch at one batch
    size, and per size the running mean of its past stretches."""

    def __init__(self) -> None:
        self.batch, self.steps = 1, 0
        self.past: dict[int, RunningMean] = {}

    def step(self, b: int) -> None:
        """One decode step of ``b`` sequences."""
        if b != self.batch and self.steps:
            self.past.setdefault(self.batch, RunningMean()).add(self.steps)
            self.steps = 0
        self.batch, self.steps = b, self.steps + 1

    def expected(self, b: int) -> float:
        """Steps a stretch at ``b`` is expected to last: as long as past ones lasted, or as long
        as the current one has lasted already (a tail that has lasted tends to last)."""
        past = self.past.get(b)
        return max(self.steps if b == self.batch else 0, past.value if past is not None else 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "current": [self.batch, self.steps],
            "past": [[b, m.state_dict()] for b, m in self.past.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batch, self.steps = (int(v) for v in state["current"])
        self.past = {int(b): RunningMean() for b, _ in state["past"]}
        for b, mean in state["past"]:
            self.past[int(b)].load_state_dict(mean)


class StepCosts:
    """The price of a decode step for every arm, from what was measured.

    A step of B sequences of which n draft with arm (p, k, mode) takes t_mode(rows) +
    d_p(n·k + n·τ̂·[p defers]) seconds, rows = B + n·(f̂ − 1) (B·(k + 1) padded): t_mode the
    target's curve of that mode (an unmeasured one priced as decoupled → coupled → plain), d_p
    the drafting curve (EAGLE-3 also catches up the τ̂ committed positions; decoupled: only what
    the target waited for).  An arm's value is v = B·τ̂ / t(n = B) tokens per second, and the
    expected speedup S(B) = max v · t_plain(B) / B.  A probe after a plain stretch catches up
    more than τ̂ positions: q̂, the mean queued per drafting sequence at past probes.

    The plain cost is the baseline of every S, and while speculation is on only probes sample
    it: it ages by steps (a probe after a long stretch stands for it), or a machine that got
    faster keeps S above 1 for as many probes as a busy curve needs steps.  Speculative costs
    age by observations: while off only probes sample them, and averaging those keeps one noisy
    probe from turning the gate on (a stale one that does is measured again every step).  A
    plain step right after a speculative one is no sample: the draft's weights are in the
    caches (1.3–2.5× a plain run's step on toy-small).
    """

    def __init__(
        self, max_k: int, proposers: Sequence[str], ahead: Sequence[str] = (), padded: bool = False
    ) -> None:
        self.accept = {p: ChainAcceptance(max_k) for p in proposers}
        self.target = {m: CostCurve() for m in MODES}
        self.drafting = {p: CostCurve() for p in proposers}  # coupled drafting
        self.exposed = {p: CostCurve() for p in ahead}  # decoupled: what the target waited for
        self.defers = dict.fromkeys(proposers, False)  # proposer has queued positions to catch up
        self.queued = {p: RunningMean() for p in proposers}  # q̂: per sequence, at probes
        self.padded = padded
        self.measured = 0  # speculative measurements: the prices change only with them
        self.last_mode = "plain"  # of the last step recorded

    # ------------------------------------------------------------------ pricing
    def plain(self, b: int, optimistic: bool = False) -> float:
        """t_plain(B), 0 before any plain step (``optimistic``: cheap where unmeasured)."""
        return _predict([self.target["plain"]], b, optimistic)

    def seconds(
        self,
        arm: Arm,
        b: int,
        n: int,
        optimistic: bool = False,
        probe: bool = False,
        backlog: int | None = None,
    ) -> float:
        """Predicted seconds of a step of ``b`` sequences of which ``n`` draft with ``arm``
        (``probe``: after a plain stretch; ``backlog``: the positions its drafter has queued
        for them, where known)."""
        tau, fed = self.accept[arm.proposer].estimate(arm.k)
        rows = b * (arm.k + 1) if self.padded else b + n * (fed - 1)
        modes = ("decoupled", "coupled", "plain") if arm.ahead else ("coupled", "plain")
        target = _predict([self.target[m] for m in modes], rows, optimistic)
        curves = [self.exposed[arm.proposer]] if arm.ahead else []
        queued = self.queued[arm.proposer]
        catch_up = queued.value if probe and queued.count else tau * self.defers[arm.proposer]
        drafted = n * (arm.k + catch_up) if backlog is None else n * arm.k + backlog
        return target + _predict([*curves, self.drafting[arm.proposer]], drafted, optimistic)

    def rates(self, arms: Iterable[Arm], b: int, optimistic: bool = False) -> dict[Arm, float]:
        """Each arm's value v when the whole batch drafts with it."""
        seconds = {arm: self.seconds(arm, b, b, optimistic) for arm in arms}
        tau = {arm: self.accept[arm.proposer].estimate(arm.k)[0] for arm in seconds}
        return {a: b * tau[a] / t if t > 0 else math.inf for a, t in seconds.items()}

    def speedup(self, b: int, rates: Mapping[Arm, float], optimistic: bool = False) -> float:
        """S(B) of the best arm (plain priced the other way round: S is never flattered)."""
        return max(rates.values()) * self.plain(b, not optimistic) / b

    def probe_price(self, arms: Sequence[Arm], b: int, bar: float) -> tuple[float, Arm | None]:
        """A gate-off probe at ``b``: (its price in plain steps — what it costs beyond the plain
        steps its tokens replace, ≥ 1 —, the arm of a whole-batch probe where an optimistic
        pricing of it clears ``bar``, else None: a slice of ⌈B/8⌉ sequences)."""
        hopes = self.rates(arms, b, True)
        hopeful = max(hopes, key=hopes.__getitem__)
        if self.speedup(b, hopes, True) > bar:
            tau = self.accept[hopeful.proposer].estimate(hopeful.k)[0]
            seconds, saved = self.seconds(hopeful, b, b, probe=True), tau
        else:
            hopeful, saved = None, 1.0
            seconds = max(self.seconds(a, b, -(-b // 8), probe=True) for a in arms)
        plain = self.plain(b)
        return max(1.0, seconds / plain - saved) if plain > 0 else 1.0, hopeful

    # ------------------------------------------------------------------ measuring
    def record_step(self, rows: int, seconds: float | None, mode: str, step: int) -> None:
        """The target's seconds of decode step ``step`` in ``mode`` over ``rows`` rows (None: no
        sample, e.g. it compiled a graph)."""
        after_plain, self.last_mode = self.last_mode == "plain", mode
        if seconds is not None and (mode != "plain" or after_plain):
            self.target[mode].observe(rows, seconds, step if mode == "plain" else None)
            self.measured += mode != "plain"

    def record_draft(
        self,
        proposer: str,
        rows: int,
        seconds: float,
        backlog: int = 0,
        ahead: bool = False,
        probe: int = 0,
    ) -> None:
        """A step's drafting: ``rows`` tokens asked (Σ caps) after ``backlog`` queued positions
        caught up, in ``seconds`` (``ahead``: the seconds the target waited for drafts;
        ``probe``: the step was a probe in which that many sequences drafted)."""
        (self.exposed if ahead else self.drafting)[proposer].observe(rows + backlog, seconds)
        self.defers[proposer] |= backlog > 0
        if probe:
            self.queued[proposer].add(backlog / probe)
        self.measured += 1

    def record(self, arm: Arm, k_used: int, emitted: int, cap: int | None = None) -> None:
        """One verification under ``arm``: capped at ``cap`` (default k), ``k_used`` drafted,
        ``emitted`` tokens emitted."""
        self.accept[arm.proposer].add(arm.k if cap is None else cap, k_used, emitted)
        self.measured += 1

    # ------------------------------------------------------------------ state
    def _tables(self) -> dict[str, Mapping[str, Any]]:
        tables = (self.accept, self.target, self.drafting, self.exposed, self.queued)
        return dict(zip(("accept", "target", "drafting", "exposed", "queued"), tables, strict=True))

    def state_dict(self) -> dict[str, Any]:
        tables = {k: {n: e.state_dict() for n, e in d.items()} for k, d in self._tables().items()}
        return tables | {
            "defers": dict(self.defers),
            "measured": self.measured,
            "last_mode": self.last_mode,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A state saved with other proposers keeps the ones both have."""
        for key, mine in self._tables().items():
            for name, saved in state[key].items():
                if name in mine:
                    mine[name].load_state_dict(saved)
        self.defers.update({p: bool(d) for p, d in state["defers"].items() if p in self.defers})
        self.measured, self.last_mode = int(state["measured"]), str(state["last_mode"])
