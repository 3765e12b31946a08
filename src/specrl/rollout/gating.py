"""When to speculate, with which drafter, and how far: cost model, gate and bandit.

Speculation trades target compute for fewer sequential forwards.  Whether that pays depends on
the batch: a small batch leaves the target latency-bound (k + 1 tokens cost about as much as
one), a large one makes it compute-bound (k + 1 tokens cost about k + 1 times as much).  A few
small pieces decide, all online, all deterministic given a seed and the measured step times
(the clock is injected into the engine, so tests feed synthetic timings):

- :class:`CostModel`: the target's share of a decode step (step time minus the measured time of
  the proposers' ``propose`` calls) from the tokens fed T, the padded query rows
  P = B·max(k + 1) and whether the step verified drafts: t = a + b·T + c·P + s·[speculative],
  non-negative least squares over the last ``window`` decode steps (P matters for attention
  kernels that pad every sequence to the longest one; a varlen kernel fits c ≈ 0; s keeps a
  plain step from being predicted at the speculative steps' fixed cost).  Flat before the data
  has spread (optimistic: speculation is tried).
- :class:`DraftCost`: the same fit per proposer for its ``propose`` calls, from the tokens it
  drafted (Σ caps), the length of its longest chain (max cap) and the positions it had queued
  (``backlog``: an EAGLE-3 draft catches up on every position committed while it did not
  draft): a chain drafter runs one forward per position for the whole batch, so most of its
  cost is per call and per position, not per sequence.  Zero before the first call.
- :class:`LengthModel`: the tokens a running sequence is still expected to generate, from the
  lengths of recently finished ones: the horizon over which a drafter's catch-up is repaid.
- :class:`EpsilonGreedy`: per decode step, which arm (proposer, k) every request in it drafts
  with; ε-greedy (TLT's choice, ε = 0.1) whose exploration skips clearly worse arms most of the
  time, so it costs ≤ ε·gap on average.  An arm's value at batch size B is the throughput it
  would give the whole batch, B·τ̂ / (t_s(B·f̂, B·(k + 1)) + d(B·k, k, B·τ̂) + X/n): τ̂ tokens
  emitted and f̂ fed per verification, from the proposer's acceptance per draft position
  (:class:`ChainAcceptance`: one estimate serves every k) learned over all batch sizes
  (acceptance does not depend on B), d the proposer's drafting time for a call in which the
  whole batch drafts k tokens, X the one-off catch-up of its backlog spread over the n steps
  the batch's remaining tokens last — so each arm is charged what it costs once exploited,
  not what a step that explored it happened to pay.  A long k wins in the latency-bound tail,
  a short one (or none, via the gate) in a full batch, and an expensive drafter only where its
  acceptance pays for it.
- :class:`SpeculationGate`: speculation on or off for the step, from the expected speedup
  S(B) = max over arms of the arm's value · t_p(B) / B (t_p the plain step's predicted time)
  with hysteresis, one state per batch size: off below 1, on again above 1 + h.  Probes keep
  both sides measured: while off, about one step in 1/probe still speculates (a whole step, not
  a few sequences: with a padding kernel one drafting sequence makes the whole batch pay for
  k + 1 query rows); while on, about one in 1/probe runs plain.

:class:`SpecController` ties them together for the engine.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple


class Arm(NamedTuple):
    """One choice of the bandit: draft with ``proposer``, at most ``k`` tokens (a tuple: the
    controller hashes arms dozens of times a step)."""

    proposer: str
    k: int

    def __str__(self) -> str:
        return f"{self.proposer}/k={self.k}"


def k_choices(max_k: int) -> tuple[int, ...]:
    """Draft lengths the bandit chooses from: every k in 1 … ``max_k`` (one acceptance estimate
    per draft position serves them all, :class:`ChainAcceptance`)."""
    if max_k < 1:
        raise ValueError(f"max k must be ≥ 1, got {max_k}")
    return tuple(range(1, max_k + 1))


class CostModel:
    """Online fit of a step time t = c₀ + c₁·x₁ + … + cₙ·xₙ from measured steps.

    For decode steps (``features=2``, the default) x = (T, P): T tokens fed to the target, P
    the query rows after padding (batch × the longest sequence's new tokens); c₀ is the fixed
    cost of a step.  Non-negative least squares over the last ``window`` observations, solved
    exactly by trying every subset of the coefficients (preferring fewer on ties: with no
    spread in the data it stays flat).  Before any measurement it is ``prior`` (default flat,
    t = 1: optimistic, speculation gets tried, and so measured).

    The fit is solved when asked for, and then again only after max(1, min(n/16, 32)) new
    observations (n in the windows): the coefficients move slowly once the window is full, and
    the engine asks every step; a rare kind's new samples (probes) still count within 32.
    ``observe``/``predict`` take the features in order; trailing features left out count as 0.

    ``split``: the index (1-based, as in c₁ … cₙ) of a feature whose values partition the
    window, one window of the last ``window`` observations per value.  The steps of a rare
    kind then keep their samples while the common kind streams past: the decode fit (x₃ = 1 for
    a speculative step) still knows what a speculative step costs after any number of plain
    steps with the gate off, where one shared window would forget it (and, with only plain
    steps left to fit, could not tell the fixed cost from the per-token one at a constant
    batch size).

    ``max_age``: observations more than ``max_age`` older than the newest one (on the clock
    ``observe(at=...)`` gives; by default the count of observations of any kind) leave their
    window, down to ``min_keep`` per window.  A rare kind's window would otherwise span a far
    longer time than the common kind's (with the gate on, 256 plain samples from probes are
    ~16 000 steps), and a shared machine's speed drifts over such spans (here by tens of
    percent between minutes): the fit would then compare one kind's cost on today's machine
    with the other's averaged over a long past — a drift-sized error in the speedup, which at
    break-even decides the gate.  The same holds within ``max_age`` unless age alone bounds
    every window: with ``window`` above the samples ``max_age`` steps can hold, both kinds
    average over the same stretch of steps (:data:`COST_WINDOW`).
    """

    REFIT_DIVISOR = 16
    REFIT_MAX_WAIT = 32  # new observations at most between solves, however full the window

    def __init__(
        self,
        window: int = 256,
        prior: tuple[float, ...] | None = None,
        features: int = 2,
        split: int | None = None,
        max_age: int | None = None,
        min_keep: int = 8,
    ) -> None:
        self.features = features
        n = features + 1
        self._prior = tuple(prior) if prior is not None else (1.0,) + (0.0,) * features
        if len(self._prior) != n:
            raise ValueError(f"prior needs {n} coefficients, got {len(self._prior)}")
        if split is not None and not 1 <= split <= features:
            raise ValueError(f"split must name a feature 1..{features}, got {split}")
        if max_age is not None and max_age < 1:
            raise ValueError(f"max_age must be ≥ 1, got {max_age}")
        self.window = window
        self.max_age = max_age
        self.min_keep = min_keep
        self._split = split
        # per value of the split feature: (time observed, observation), oldest first
        self._windows: dict[float, deque[tuple[int, tuple[float, ...]]]] = {}
        self._seen = 0  # observations ever made (their default times)
        self._count = 0  # observations in all windows
        # running sums over the window: Σ x xᵀ, Σ x y, Σ y² with x = (1, x₁, …, xₙ)
        self._gram = [[0.0] * n for _ in range(n)]
        self._xy = [0.0] * n
        self._yy = 0.0
        self._since_rebuild = 0
        self._since_fit = 0
        self._fit: tuple[float, ...] | None = None
        self.solves = 0  # fits computed so far: predictions change only when this does
        # coefficient subsets, fewer first: ties go to the simpler model
        self._subsets = sorted(
            (tuple(i for i in range(n) if mask >> i & 1) for mask in range(1, 1 << n)),
            key=len,
        )

    def observe(self, *features_and_seconds: float, at: int | None = None) -> None:
        """One step: its features x₁ … (as many as given, the rest 0), then its seconds.

        ``at``: the observation's time on the caller's clock for ``max_age`` (a count that
        never decreases, e.g. decode steps, so that a model observed only now and then ages
        with the steps between); default: the number of observations made."""
        *xs, seconds = features_and_seconds
        if len(xs) > self.features:
            raise ValueError(f"{len(xs)} features given, the model has {self.features}")
        obs = (*map(float, xs), *(0.0,) * (self.features - len(xs)), max(float(seconds), 0.0))
        kind = 0.0 if self._split is None else obs[self._split - 1]
        obs_window = self._windows.get(kind)
        if obs_window is None:
            obs_window = self._windows[kind] = deque(maxlen=self.window)
        if len(obs_window) == obs_window.maxlen:
            self._accumulate(obs_window[0][1], -1.0)
        else:
            self._count += 1
        now = self._seen if at is None else at
        obs_window.append((now, obs))
        self._seen += 1
        self._accumulate(obs, 1.0)
        if self.max_age is not None:
            oldest = now - self.max_age  # times below this are too old
            for other in self._windows.values():
                while len(other) > self.min_keep and other[0][0] < oldest:
                    self._accumulate(other.popleft()[1], -1.0)
                    self._count -= 1
        self._since_rebuild += 1
        if self._since_rebuild >= 4 * max(self.window, 1):  # bound rounding drift
            self._rebuild()
        self._since_fit += 1

    def _accumulate(self, obs: tuple[float, ...], sign: float) -> None:
        y = obs[-1]
        nonzero = [(0, 1.0), *((i, xi) for i, xi in enumerate(obs[:-1], 1) if xi)]
        xy, gram = self._xy, self._gram
        for i, xi in nonzero:
            si = sign * xi
            xy[i] += si * y
            row = gram[i]
            for j, xj in nonzero:
                row[j] += si * xj
        self._yy += sign * y * y

    def _rebuild(self) -> None:
        n = self.features + 1
        self._gram = [[0.0] * n for _ in range(n)]
        self._xy = [0.0] * n
        self._yy = 0.0
        for obs_window in self._windows.values():
            for _, obs in obs_window:
                self._accumulate(obs, 1.0)
        self._since_rebuild = 0

    @property
    def num_observations(self) -> int:
        return self._count

    def observations_of(self, kind: float) -> int:
        """Observations in the window of one value of the ``split`` feature."""
        return len(self._windows.get(float(kind), ()))

    def coefficients(self) -> tuple[float, ...]:
        """(c₀, c₁, …): seconds, then seconds per unit of each feature (for decode steps:
        per token fed, per padded query row)."""
        due = max(1, min(self._count // self.REFIT_DIVISOR, self.REFIT_MAX_WAIT))
        if self._fit is None or self._since_fit >= due:
            self._fit = self._solve()
            self._since_fit = 0
            self.solves += 1
        return self._fit

    def predict(self, *features: float) -> float:
        coef = self.coefficients()
        return coef[0] + sum(c * x for c, x in zip(coef[1:], features, strict=False))

    def _solve(self) -> tuple[float, ...]:
        if not self._windows:
            return self._prior
        gram, xy, yy = self._gram, self._xy, self._yy
        n = self.features + 1
        best, best_err = [0.0] * n, yy  # all-zero coefficients: error Σy²
        for idx in self._subsets:
            coef = _solve_small([[gram[i][j] for j in idx] for i in idx], [xy[i] for i in idx])
            if coef is None or min(coef) < 0:
                continue  # collinear on this window, or infeasible: other subsets cover it
            fit = sum(c * xy[i] for c, i in zip(coef, idx, strict=True))
            err = yy - fit  # at the least-squares optimum, Σ(y − xᵀc)² = Σy² − cᵀ Σxy
            if err < best_err - 1e-9 * yy:  # strictly better, else keep the smaller subset
                best, best_err = [0.0] * n, err
                for c, i in zip(coef, idx, strict=True):
                    best[i] = c
        return tuple(best)


def _solve_small(g: list[list[float]], h: list[float]) -> list[float] | None:
    """Solve g·c = h (n ≤ 4, g symmetric positive semi-definite) by Gaussian elimination with
    partial pivoting; None when g is (nearly) singular."""
    n = len(h)
    scale = max(abs(v) for row in g for v in row) or 1.0
    a = [[*row, rhs] for row, rhs in zip(g, h, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, n + 1):
                    a[r][c] -= f * a[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out


class DraftCost(CostModel):
    """Seconds of one ``propose`` call, d = a + b·N + c·K + e·R: N tokens drafted (Σ caps), K
    the longest chain (max cap), R the queued positions the proposer had to catch up first
    (:meth:`Proposer.backlog`; an EAGLE-3 draft runs its step-0 pass over every position the
    target committed since its last call).  A chain drafter costs about K·(forward latency) +
    N·(per-row cost) + R·(catch-up per row); a lookup drafter about N·(per-token cost).  Zero
    before the first call."""

    def __init__(self, window: int = 256, max_age: int | None = None) -> None:
        super().__init__(window, prior=(0.0, 0.0, 0.0, 0.0), features=3, max_age=max_age)


class LengthModel:
    """Expected tokens still to come for a running sequence, from the output lengths of the
    last ``window`` finished ones: E[ℓ − L | ℓ > L] over those longer than its current length
    L, capped by its own ``max_tokens``; its cap when none was that long (or none finished
    yet: optimistic, the long tail is where speculation pays)."""

    def __init__(self, window: int = 512) -> None:
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []
        self._suffix: list[int] | None = None  # Σ of _sorted[i:], built when asked

    def observe(self, length: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._recent[0])]
        self._recent.append(length)
        bisect.insort(self._sorted, length)
        self._suffix = None

    def expected_remaining(self, length: int, max_tokens: int) -> float:
        cap = max(max_tokens - length, 0)
        i = bisect.bisect_right(self._sorted, length)
        longer = len(self._sorted) - i
        if not longer:
            return float(cap)
        if self._suffix is None:  # Σ of _sorted[j:] for every j
            self._suffix = list(itertools.accumulate(reversed(self._sorted)))[::-1]
        return min(self._suffix[i] / longer - length, float(cap))


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
        """The arm to play given each arm's estimated value and number of observations (the
        arms of ``values`` only, in the order of :attr:`arms`)."""
        arms = self.arms if len(values) == len(self.arms) else [a for a in self.arms if a in values]
        young = [arm for arm in arms if samples.get(arm, 0) < self.min_samples]
        if young:  # round-robin
            self._turn += 1
            return young[self._turn % len(young)]
        best = max(arms, key=lambda arm: values[arm])
        if self._rng.random() < self.epsilon:
            arm = arms[self._rng.randrange(len(arms))]
            top = values[best]
            shortfall = 1.0 - values[arm] / top if top > 0 else 0.0
            if shortfall <= self.gap or self._rng.random() * shortfall < self.gap:
                return arm
        return best


class SpeculationGate:
    """On/off from the expected speedup, with hysteresis, one state per batch size (probing is
    the controller's).

    Off as soon as speculation is expected to lose (speedup < 1): a neutral drafter (one that
    rarely finds a draft) must not keep a full batch speculating.  On again only for a clear
    win (speedup > 1 + h), so a batch size near the break-even point does not flap.  The state
    is kept per batch size: the on state of a shrinking batch's tail must not carry over to the
    next full wave.  A batch size not seen yet starts in the state of the nearest one seen (so
    a shrinking batch keeps the hysteresis along the way), the very first one on
    (optimistic: speculation gets measured).
    """

    def __init__(self, hysteresis: float = 0.1) -> None:
        self.hysteresis = hysteresis
        self.states: dict[int, bool] = {}
        self.on = True  # the state of the batch size decided last
        self.switches = 0

    def decide(self, speedup: float, batch_size: int = 0) -> bool:
        """Update the state of ``batch_size`` from ``speedup``; True while speculation is on."""
        on = self.states.get(batch_size)
        if on is None:  # unseen: as the nearest batch size seen (S(B) is smooth in B), else on
            near = min(self.states, key=lambda b: (abs(b - batch_size), b), default=None)
            on = True if near is None else self.states[near]
        if on and speedup < 1:
            on, self.switches = False, self.switches + 1
        elif not on and speedup > 1 + self.hysteresis:
            on, self.switches = True, self.switches + 1
        self.states[batch_size] = self.on = on
        return on


ARM_MEMORY = 128  # verifications an acceptance estimate averages over (then an EMA)


class ChainAcceptance:
    """One proposer's acceptance per draft position, shared by all its draft lengths k.

    A draft is verified token by token: whether its first j tokens are accepted does not depend
    on how many were drafted after them (greedy stops at the first mismatch, the ratio test at
    position j sees only the prefix), and a drafter asked for fewer tokens drafts the same first
    ones (a chain stops, it does not change course).  So with A_j = P(at least j tokens
    accepted) and D_j = P(at least j drafted), each over the verifications whose cap reached j,
    a draft capped at k emits τ̂(k) = 1 + Σ_{j≤k} A_j tokens and feeds f̂(k) = 1 + Σ_{j≤k} D_j:
    every verification teaches every shorter k, so the bandit can offer every k, and exploring
    the longest teaches them all.  (Estimated per arm, with k limited to powers of two, toy-deep's
    best-of-N at batches 1 and 8 split its steps between k = 4 and 8 and ran 3–6 % slower than
    with every k, where it drafts mostly 5–7: docs/benchmarks.md, "Every draft length k".)

    Running means per position (EMAs after :data:`ARM_MEMORY` verifications: the policy and the
    draft drift), made monotone (A_j ≤ A_{j−1}: their windows differ); a position no
    verification reached yet counts as its predecessor (optimistic, the first as accepted).
    """

    def __init__(self, max_k: int, rate: float = 1.0 / ARM_MEMORY) -> None:
        # per position j (0-based): verifications that reached it, running means of
        # [accepted > j] and [drafted > j] (RunningMean's rule; plain lists: the engine records
        # every sequence of every speculative step, up to max_k positions each)
        self.counts = [0] * max_k
        self.accepted = [0.0] * max_k
        self.drafted = [0.0] * max_k
        self.rate = rate
        self.version = 0  # verifications recorded: the estimates change with each
        self._table: list[tuple[float, float]] = []  # (τ̂, f̂) per k, rebuilt when stale
        self._table_version = -1

    def add(self, cap: int, k_used: int, emitted: int) -> None:
        """One verification of a draft capped at ``cap`` tokens: ``k_used`` drafted,
        ``emitted`` tokens emitted (accepted + 1)."""
        accepted = emitted - 1
        counts, acc, drf, rate = self.counts, self.accepted, self.drafted, self.rate
        for j in range(min(cap, len(counts))):
            n = counts[j] = counts[j] + 1
            w = max(1.0 / n, rate)
            acc[j] += ((1.0 if accepted > j else 0.0) - acc[j]) * w
            drf[j] += ((1.0 if k_used > j else 0.0) - drf[j]) * w
        self.version += 1

    def samples(self, k: int) -> int:
        """Verifications that reached position k (how well τ̂(k) is known)."""
        return self.counts[k - 1]

    def estimate(self, k: int) -> tuple[float, float]:
        """(τ̂, f̂): tokens emitted and fed per verification of a draft capped at ``k``."""
        if self._table_version != self.version:
            self._table, self._table_version = self._build(), self.version
        return self._table[k - 1]

    def _build(self) -> list[tuple[float, float]]:
        table, tau, fed, a_prev, d_prev = [], 1.0, 1.0, 1.0, 1.0
        for n, a, d in zip(self.counts, self.accepted, self.drafted, strict=True):
            if n:
                a_prev, d_prev = min(a, a_prev), min(d, d_prev)
            tau, fed = tau + a_prev, fed + d_prev
            table.append((tau, fed))
        return table


# Steps right after a switch between plain and speculative steps are no timing sample: they pay
# the switch.  A speculative step after plain ones pays its drafter's catch-up (and cold caches)
# once; plain steps after speculative ones can run slower for several steps
# (measured on CPU, toy targets at batch 1, plain steps after 40
# speculative ones against a plain engine's step: the 1st +2 to +31 %, the 2nd to 4th −4 to
# +11 % depending on the run, from the 5th on within the noise).  So a step is a sample once its
# run of one kind is longer than SETTLE_STEPS[kind], and a probe runs past its settling.
SETTLE_STEPS = {True: 1, False: 4}  # speculative?: steps of a run after a switch not timed
PROBE_STEPS = SETTLE_STEPS[True] + 1  # a gate-off (speculative) probe
PLAIN_PROBE_STEPS = SETTLE_STEPS[False] + 2  # a gate-on (plain) probe: two timed steps
# timed plain steps the fit needs before gate-on plain probes space out to PLAIN_PROBE_STEPS /
# probe speculative steps (until then every PROBE_STEPS / probe): an engine starts speculating
# (the gate starts on), and S without a measured plain step is a guess
PLAIN_SAMPLES = 2
# decode steps after which a timing sample leaves the cost fits (down to their min_keep per
# kind): with the gate on, ~32 plain samples from probes; see CostModel's max_age
COST_MAX_AGE = 2000
# timing samples each window of the fits may hold: more than COST_MAX_AGE, so that age alone
# bounds every window and both kinds of step average over the same last COST_MAX_AGE steps.  A
# window of the last 256 samples spans ~270 steps of the kind the gate plays and the whole
# COST_MAX_AGE of the other (probes): t_p and t_s then come from different stretches of a
# machine whose speed drifts within minutes, and at break-even the gate followed the drift
# (docs/benchmarks.md, "Matched windows")
COST_WINDOW = 4096


class SpecController:
    """The engine's speculation policy: gate the step, pick its arm, learn.

    The bandit's value of an arm at batch size B is the throughput it would give if the whole
    batch drafted with it, B·τ̂ / (t_s(B·f̂, B·(k + 1)) + d(B·k, k, B·τ̂) + X/n): acceptance
    (τ̂, f̂) comes from the proposer's acceptance per draft position, learned from every
    verification whatever its k and batch size (:class:`ChainAcceptance`; it does not depend
    on B), the costs come from the fitted models, X is the one-off catch-up of the
    proposer's backlog beyond its steady state (the positions an EAGLE-3 draft has not seen
    since the gate turned it off) spread over the n speculative steps the running sequences'
    remaining tokens are expected to last (:class:`LengthModel`).  So every batch size
    benefits from what any other measured, a drafter's backlog is paid only where the tokens
    still to come repay it, and the gate and the bandit agree on one estimate.

    Plain steps (one query row per sequence) and speculative ones share the step-time fit
    but not its fixed cost: t = a + b·T + c·P + s·[speculative] (drafts, their q and the
    ratio test cost a speculative step more whatever its size); one line through both would
    predict a plain step at the speculative steps' intercept.
    """

    def __init__(
        self,
        proposers: Sequence[str],
        max_k: int,
        *,
        ks: Sequence[int] | None = None,
        epsilon: float = 0.1,
        hysteresis: float = 0.1,
        probe: float = 0.05,
        cost_window: int = COST_WINDOW,
        cost_max_age: int | None = COST_MAX_AGE,
        gate: bool = True,
        seed: int = 0,
    ) -> None:
        if ks is not None and (not ks or not all(1 <= k <= max_k for k in ks)):
            raise ValueError(f"draft_lengths must lie in 1 … max_k = {max_k}, got {ks}")
        ks = k_choices(max_k) if ks is None else sorted(set(ks))
        self.arms = tuple(Arm(p, k) for p in proposers for k in ks)
        # (T, P, speculative) → seconds; the speculative steps keep a window of their own
        self.cost = CostModel(cost_window, features=3, split=3, max_age=cost_max_age)
        self.lengths = LengthModel()
        self.bandit = EpsilonGreedy(self.arms, epsilon, seed) if self.arms else None
        self.gate = SpeculationGate(hysteresis)
        self.gating = gate
        self.probe = probe
        # gate-off plain steps at each batch size since it last speculated (its probe clock)
        self._plain_runs: dict[int, int] = {}
        self._spec_run = 0  # speculative steps since the last plain one
        self._probe_left = 0  # further steps of the probe under way
        self._probe_plain = False  # its kind
        self._last_speculative: bool | None = None  # the kind of the last decode step
        self._run_length = 0  # decode steps of that kind in a row
        self._after_switch = False  # that run began with a switch of kind
        self.switch_steps = 0  # decode steps settling after a switch of kind (no timing sample)
        self.spec_steps = 0
        self.plain_steps = 0
        self.selections: dict[str, int] = {str(a): 0 for a in self.arms}
        self._accept = {p: ChainAcceptance(max_k) for p in proposers}
        self.draft_cost = {p: DraftCost(cost_window, cost_max_age) for p in proposers}
        self._decode_steps = 0  # the cost models' clock (CostModel.max_age)
        # steps of a run after a switch of kind that are no timing sample, and a gate-on plain
        # probe's length (the module's values; per controller for comparisons)
        self.settle_steps = dict(SETTLE_STEPS)
        self.plain_probe_steps = PLAIN_PROBE_STEPS
        # cache of _steady: the fits it was computed with, each arm's step time and the
        # acceptance samples it saw, the probe arms, the result
        self._fits_key: tuple = ()
        self._secs: dict[Arm, tuple[float, float]] = {}
        self._secs_seen: dict[Arm, int] = {}
        self._probe_arms: tuple[Arm, ...] = ()
        self._steady_value: tuple = ()
        self._recorded = 0  # verifications recorded (any arm): _steady's acceptance check
        self._recorded_seen = -1
        # per batch size: the gate-off wait its last probe check asked for, and the fits then
        self._probe_wait: dict[int, tuple[float, tuple]] = {}

    @staticmethod
    def upgrade_state(attrs: dict) -> dict:
        """A snapshot's attributes made current (:func:`specrl.rollout.state.restore`): states
        saved before acceptance was estimated per draft position kept one estimate per arm
        (``_shape``), which is dropped — the restored controller keeps its arms, gate and cost
        fits and learns acceptance anew."""
        attrs.pop("_shape", None)
        return attrs

    def plain_seconds(self, batch_size: int) -> float:
        """Predicted time of a plain decode step of ``batch_size`` sequences."""
        return self.cost.predict(batch_size, batch_size, 0.0)

    def spec_seconds(self, tokens: float, padded: float) -> float:
        """Predicted target time of a speculative step feeding ``tokens`` in ``padded`` query
        rows."""
        return self.cost.predict(tokens, padded, 1.0)

    def _acceptance(self, arm: Arm) -> tuple[float, float]:
        """(τ̂, f̂): tokens emitted and fed per verification (untried: fully accepted)."""
        return self._accept[arm.proposer].estimate(arm.k)

    def catch_up_seconds(self, arm: Arm, batch_size: int, backlog: int) -> float:
        """One-off cost of the ``backlog`` positions ``arm.proposer`` has queued for the batch,
        beyond the B·τ̂ of a step in steady state (already in :meth:`draft_seconds`)."""
        excess = backlog - batch_size * self._acceptance(arm)[0]
        if excess <= 0:
            return 0.0
        return self.draft_cost[arm.proposer].coefficients()[3] * excess

    def _step_seconds(self, batch_size: int, arm: Arm) -> tuple[float, float]:
        """(τ̂, predicted seconds of a steady-state step in which all ``batch_size`` sequences
        draft with ``arm``: target plus drafting)."""
        _, tau, t = self._arm_costs(batch_size, (arm,))[arm]
        return tau, t

    def ceiling(self, batch_size: int, arm: Arm) -> float:
        """The speedup ``arm`` would give at ``batch_size`` in steady state if every draft were
        accepted (τ̂ = f̂ = k + 1): no acceptance it may reach lifts S above this."""
        return self._arm_costs(batch_size, (arm,))[arm][0]

    def _arm_costs(
        self, batch_size: int, arms: Sequence[Arm]
    ) -> dict[Arm, tuple[float, float, float]]:
        """Per arm: (:meth:`ceiling`, τ̂, predicted seconds of its steady-state step) — the
        step fit t_s(T, P) = a + b·T + c·P + s and each drafter's d(tokens, chain, backlog),
        their coefficients read once (the gate re-prices every arm when a fit changes or the
        batch size does, a few dozen arms)."""
        a, b_tok, c_row, s_spec = self.cost.coefficients()
        fixed = a + s_spec
        t_plain = self.plain_seconds(batch_size)
        drafts = {p: m.coefficients() for p, m in self.draft_cost.items()}
        out = {}
        for arm in arms:
            d0, d_tok, d_chain, d_back = drafts[arm.proposer]
            k, n = arm.k, arm.k + 1
            base = fixed + c_row * batch_size * n + d0 + d_tok * batch_size * k + d_chain * k
            full = base + (b_tok + d_back) * batch_size * n  # every draft accepted
            ceiling = n * t_plain / full if full > 0 else float("inf")
            tau, fed = self._acceptance(arm)
            out[arm] = (ceiling, tau, base + b_tok * batch_size * fed + d_back * batch_size * tau)
        return out

    def _steady(
        self, batch_size: int
    ) -> tuple[dict[Arm, tuple[float, float]], float, float, Arm, tuple[Arm, ...]]:
        """(:meth:`_step_seconds` of every arm, the plain step's predicted time, the best
        steady-state speedup, its arm, the arms a probe may measure: those whose
        :meth:`ceiling` clears the gate's 1 + h).  Cached: an arm's step time is recomputed
        when a fit was re-solved or its own acceptance estimate changed (one arm a step while
        speculating, none while the gate is off)."""
        for model in (self.cost, *self.draft_cost.values()):
            model.coefficients()  # refit if due
        fits = (batch_size, self.cost.solves, *(m.solves for m in self.draft_cost.values()))
        if fits != self._fits_key:
            self._fits_key = fits  # every arm priced anew
            bar = 1 + self.gate.hysteresis  # ceilings need no acceptance estimate
            costs = self._arm_costs(batch_size, self.arms)
            self._probe_arms = tuple(a for a in self.arms if costs[a][0] > bar)
            self._secs = {arm: (tau, t) for arm, (_, tau, t) in costs.items()}
            self._secs_seen = {arm: self._accept[arm.proposer].version for arm in self.arms}
            self._recorded_seen = self._recorded
            self._steady_value = ()
        secs, seen = self._secs, self._secs_seen
        if self._recorded != self._recorded_seen:  # some acceptance estimate changed
            self._recorded_seen = self._recorded
            stale = [a for a in self.arms if seen.get(a) != self._accept[a.proposer].version]
            if stale:
                for arm, (_, tau, t) in self._arm_costs(batch_size, stale).items():
                    secs[arm] = (tau, t)
                    seen[arm] = self._accept[arm.proposer].version
                self._steady_value = ()
        if not self._steady_value:
            t_plain = self.plain_seconds(batch_size)

            def rate(arm: Arm) -> float:
                tau, t = secs[arm]
                return tau / t if t > 0 else float("inf")

            best = max(self.arms, key=rate)
            self._steady_value = (secs, t_plain, rate(best) * t_plain, best, self._probe_arms)
        return self._steady_value

    def expected_rate(self, batch_size: int, arm: Arm) -> float:
        """Tokens per second if all ``batch_size`` sequences draft with ``arm`` in steady state:
        B·τ̂ / (t_s(B·f̂, B·(k+1)) + d(B·k, k, B·τ̂)), τ̂ tokens emitted and f̂ fed per
        verification (an untried arm counts as fully accepted), d the proposer's drafting time
        (:meth:`plan` adds a backlog's catch-up where it matters)."""
        tau, spec = self._step_seconds(batch_size, arm)
        return batch_size * tau / spec if spec > 0 else float("inf")

    def draft_seconds(self, arm: Arm, batch_size: int) -> float:
        """Predicted time of one ``propose`` call in which ``batch_size`` sequences all draft
        ``arm.k`` tokens with ``arm.proposer``, in steady state (B·τ̂ positions to catch up;
        0 before its first call)."""
        tau = self._acceptance(arm)[0]
        return self.draft_cost[arm.proposer].predict(batch_size * arm.k, arm.k, batch_size * tau)

    def plan(
        self,
        batch_size: int,
        backlog: Mapping[str, int] | Callable[[], Mapping[str, int]] | None = None,
        remaining: Callable[[], float] | None = None,
    ) -> list[Arm] | None:
        """The arm of every sequence for a speculative step, or None for a plain step.

        ``backlog``: positions each proposer has queued for these sequences
        (:meth:`Proposer.backlog`), or a callable returning them (asked only where the catch-up
        is priced); ``remaining``: the batch's expected remaining tokens (asked only when some
        proposer has a backlog to pay for).

        One decision per step, shared by its sequences: a step that mixes arms pays every extra
        proposer's per-call cost and the longest chain (and, with a padding kernel, the longest
        k + 1 rows) for the whole batch, which per-sequence exploration would incur nearly every
        step at a large batch.  (The engine still reports acceptance per request and per
        proposer.)

        Probes keep both sides of the comparison measured, in runs of :data:`PROBE_STEPS`
        speculative or :data:`PLAIN_PROBE_STEPS` plain steps (the steps that settle after a
        switch of kind are no timing sample, :data:`SETTLE_STEPS`).  While the
        gate is off, a probe speculates once in ``PROBE_STEPS · max(1, (1 − S₁)/h) / probe``
        steps at that batch size (each size keeps its own count, as it keeps its own gate
        state: the few steps a shrinking batch spends at each tail size add up slowly, so the
        tails are not probed every wave), S₁ the speedup of its first step (the whole catch-up
        included): acceptance estimates stay fresh (new weights can make speculation pay
        again), rarer the clearer the loss.  It measures only arms whose :meth:`ceiling` (every
        draft accepted) clears 1 + h: where not even that would turn the gate on, its outcome
        could not change the decision (an EAGLE-3 draft at a large batch, which would pay its
        whole catch-up for nothing), and with no such arm there is no probe.  While it is on,
        a probe runs plain once in ``PLAIN_PROBE_STEPS / probe`` steps (every ``PROBE_STEPS /
        probe`` until the fit holds :data:`PLAIN_SAMPLES` timed plain steps), whatever S says:
        S itself depends on the plain step time t_p(B), which must be measured, not
        extrapolated from speculative steps.  Either way about ``probe`` of the steps, at most
        (a few more until plain steps are measured).
        """
        if self.bandit is None:
            self.plain_steps += 1
            return None
        if self.gating and self._probe_left > 0 and self._probe_plain:
            # a plain probe's further steps, planned as cheaply as a gated-off plain step: its
            # timed steps must cost what plain decoding costs, not what pricing a speculative
            # step costs (the backlog and horizon calls; the gate's state waits for the probe)
            self._probe_left -= 1
            return self._plain()
        secs, t_plain, speedup, best, probe_arms = self._steady(batch_size)
        allowed: tuple[Arm, ...] | None = None  # a gate-off probe's arms
        rates: dict[Arm, float] | None = None  # with the catch-up, where it was priced
        catch_up: dict[Arm, float] = {}
        # a backlog only lowers S: it and its horizon matter only where S would turn (or keep)
        # the gate on: S ≥ 1 + h while this batch size is off, S ≥ 1 otherwise
        off = self.gating and self.gate.states.get(batch_size) is False
        priced = speedup >= (1 + self.gate.hysteresis if off else 1)
        if priced and callable(backlog):
            backlog = backlog()
        if priced and backlog:
            catch_up = {
                arm: self.catch_up_seconds(arm, batch_size, backlog.get(arm.proposer, 0))
                for arm in self.arms
            }
            if remaining is not None and any(catch_up.values()):
                left = remaining()
                rates = {}
                for arm, x in catch_up.items():
                    tau, t = secs[arm]
                    t += x * batch_size * tau / max(left, batch_size * tau)  # X over n steps
                    rates[arm] = batch_size * tau / t if t > 0 else float("inf")
                best = max(rates, key=rates.__getitem__)
                speedup = rates[best] * t_plain / batch_size
        if self.gating:
            h = max(self.gate.hysteresis, 1e-9)
            on = self.gate.decide(speedup, batch_size)
            if self._probe_left > 0:  # a speculative probe's further steps
                self._probe_left -= 1
                if not on:  # the batch may have shrunk (or a new one begun): its own arms
                    if not probe_arms:
                        self._probe_left = 0
                        return self._plain()
                    allowed = probe_arms
            elif on:
                self._spec_run += 1
                measured = self.cost.observations_of(0.0) >= PLAIN_SAMPLES
                probe_steps = self.plain_probe_steps if measured else PROBE_STEPS
                spacing = probe_steps / max(self.probe, 1e-9)
                if self.probe > 0 and self._spec_run >= spacing:
                    self._probe_left, self._probe_plain = self.plain_probe_steps - 1, True
                    return self._plain()
            else:
                waited = self._plain_runs[batch_size] = self._plain_runs.get(batch_size, 0) + 1
                if self.probe <= 0 or not probe_arms:
                    return self._plain()
                # the shortest wait whatever S₁ is, or the one the last check asked for while
                # the fits stay as they were: then S₁ only falls (the backlog grows; no
                # acceptance is learned while off), so the check (a backlog count, its
                # catch-up) could not start a probe before
                wait, fits = self._probe_wait.get(batch_size, (0.0, None))
                if waited < (wait if fits == self._fits_key else PROBE_STEPS / self.probe):
                    return self._plain()
                arm = max(probe_arms, key=lambda a: secs[a][0] / secs[a][1])  # best steady rate
                tau, t = secs[arm]
                if callable(backlog):
                    backlog = backlog()
                if backlog:  # a probe pays the whole catch-up
                    t += catch_up.get(arm) or self.catch_up_seconds(
                        arm, batch_size, backlog.get(arm.proposer, 0)
                    )
                s1 = tau * t_plain / t if t > 0 else float("inf")
                wait = PROBE_STEPS * max(1.0, (1 - s1) / h) / self.probe
                if waited < wait:
                    self._probe_wait[batch_size] = (wait, self._fits_key)
                    return self._plain()
                self._probe_wait.pop(batch_size, None)
                self._probe_left, self._probe_plain = PROBE_STEPS - 1, False
                allowed = probe_arms
        self._plain_runs[batch_size] = 0
        self._probe_wait.pop(batch_size, None)
        self.spec_steps += 1
        if rates is None:
            rates = {
                arm: batch_size * tau / t if t > 0 else float("inf")
                for arm, (tau, t) in secs.items()
            }
        if allowed is not None:  # a gate-off probe: the arms that could turn the gate on
            rates = {arm: rates[arm] for arm in allowed}
        accept = self._accept
        samples = {arm: accept[arm.proposer].samples(arm.k) for arm in rates}
        young = self.bandit.min_samples
        if any(n < young for n in samples.values()):
            # the longest young draft of each proposer first: it teaches every shorter k
            longest: dict[str, Arm] = {}
            for arm, n in samples.items():
                if n < young and arm.k > longest.get(arm.proposer, Arm("", 0)).k:
                    longest[arm.proposer] = arm
            rates = {arm: rates[arm] for arm in longest.values()}
        arm = self.bandit.choose(rates, samples)
        self.selections[str(arm)] += batch_size
        return [arm] * batch_size

    def _plain(self) -> None:
        self._spec_run = 0
        self.plain_steps += 1
        return None

    def record_draft(
        self, proposer: str, tokens: int, chain: int, seconds: float, backlog: int = 0
    ) -> None:
        """One ``propose`` call of ``proposer``: ``tokens`` asked in all (Σ caps), ``chain`` the
        longest cap, ``backlog`` positions it had queued, taking ``seconds``."""
        self.draft_cost[proposer].observe(tokens, chain, backlog, seconds, at=self._decode_steps)

    def record(self, arm: Arm, k_used: int, emitted: int, cap: int | None = None) -> None:
        """One sequence's verification under ``arm``: allowed ``cap`` draft tokens (default
        ``arm.k``; fewer near its max_tokens), it drafted ``k_used`` and emitted ``emitted``."""
        self._accept[arm.proposer].add(arm.k if cap is None else cap, k_used, emitted)
        self._recorded += 1

    def record_step(self, tokens: int, padded: int, seconds: float | None, batch_size: int) -> None:
        """Target time of one decode step of ``batch_size`` sequences (its prefill and
        drafting time taken out; None: no timing sample, e.g. it compiled a graph): ``tokens``
        fed, ``padded`` query rows.  A step with one query row per sequence
        (``padded == batch_size``) is a plain step, whether or not it was planned as
        speculative (no proposer found a draft).  The first steps of a run of one kind after
        a switch of kind are no sample either: they pay the switch (:data:`SETTLE_STEPS`)."""
        speculative = padded != batch_size
        last, self._last_speculative = self._last_speculative, speculative
        if last == speculative:
            self._run_length += 1
        else:
            self._run_length, self._after_switch = 1, last is not None
        settling = self._after_switch and self._run_length <= self.settle_steps[speculative]
        self.switch_steps += settling
        self._decode_steps += 1
        if seconds is not None and not settling:
            self.cost.observe(tokens, padded, float(speculative), seconds, at=self._decode_steps)

    def record_finished(self, output_tokens: int) -> None:
        """A sequence finished with ``output_tokens`` generated (the length model)."""
        self.lengths.observe(output_tokens)

    def to_dict(self) -> dict:
        def fit(model: CostModel, names: Sequence[str]) -> dict:
            out = dict(zip(names, model.coefficients(), strict=True))
            out["points"] = model.num_observations
            return out

        step_names = ("a_s", "b_s_per_token", "c_s_per_padded_row", "s_s_per_speculative_step")
        return {
            "gate_on": self.gate.on,
            "gate_switches": self.gate.switches,
            "gate_on_batch_sizes": sorted(b for b, on in self.gate.states.items() if on),
            "spec_steps": self.spec_steps,  # speculative decode steps (probes included)
            "plain_steps": self.plain_steps,
            "switch_steps": self.switch_steps,  # settling after a switch of kind (not timed)
            "cost_model": fit(self.cost, step_names),
            "draft_cost": {
                name: fit(
                    model,
                    ("a_s", "b_s_per_token", "c_s_per_chain_position", "e_s_per_backlog_row"),
                )
                for name, model in self.draft_cost.items()
            },
            "selections": {k: v for k, v in self.selections.items() if v},
        }
