"""What the speculation policy measures: acceptance per draft position, costs by size.

Both are plain Python, deterministic and JSON-able (``state_dict`` / ``load_state_dict``), used by
:mod:`specrl.rollout.gating`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

from specrl.rollout.bandit import MEMORY


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

    def add(self, cap: int, k_used: int, emitted: int) -> None:
        """One verification of a draft capped at ``cap``: ``k_used`` drafted, ``emitted``
        tokens emitted (accepted + 1)."""
        for j in range(min(cap, len(self.counts))):
            self.counts[j] += 1
            w = max(1.0 / self.counts[j], self.rate)
            self.accepted[j] += (float(emitted - 1 > j) - self.accepted[j]) * w
            self.drafted[j] += (float(k_used > j) - self.drafted[j]) * w

    def samples(self, k: int) -> int:
        return self.counts[k - 1]

    def estimate(self, k: int) -> tuple[float, float]:
        """(τ̂, f̂): tokens emitted and fed per verification of a draft capped at ``k``."""
        tau = fed = a = d = 1.0
        for j in range(k):
            if self.counts[j]:
                a, d = min(a, self.accepted[j]), min(d, self.drafted[j])
            tau, fed = tau + a, fed + d
        return tau, fed

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts[:], "accepted": self.accepted[:], "drafted": self.drafted[:]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A state saved with another max_k keeps the positions both have."""
        n = len(self.counts)

        def fit(values: list, cast: type) -> list:
            return [cast(v) for v in values[:n]] + [cast(0)] * (n - len(values[:n]))

        self.counts = fit(state["counts"], int)
        self.accepted, self.drafted = fit(state["accepted"], float), fit(state["drafted"], float)


class CostCurve:
    """Seconds as a non-decreasing piecewise-linear function t(x) of a size x, measured.

    Observations fall in buckets of x spaced by a factor √2; each keeps running means (x̄, t̄)
    (weight max(1/n, ``rate``): the machine and the model drift).  t(x) interpolates linearly
    between the buckets' points, made non-increasing from the right (never cheaper at a larger
    size).  Outside them it extrapolates conservatively above, as compute-bound (t̄·x/x̄, the
    steepest a cost with a fixed part can grow), and flat below — or, ``optimistic``, flat above
    and proportional below.  A GPU's step is flat while latency-bound and linear once
    compute-bound; the points follow that knee wherever it lies, where one global line cannot.
    """

    def __init__(self, rate: float = 1.0 / 32) -> None:
        self.rate = rate
        self._buckets: dict[int, list[float]] = {}  # bucket → [count, x̄, t̄]
        self._points: list[tuple[float, float]] | None = None  # cache of :attr:`points`

    @staticmethod
    def _bucket(x: float) -> int:
        return round(2 * math.log2(max(x, 1.0)))

    def count(self, x: float) -> int:
        """Observations in the bucket of size ``x``."""
        b = self._buckets.get(self._bucket(x))
        return 0 if b is None else int(b[0])

    def observe(self, x: float, seconds: float) -> None:
        b = self._buckets.setdefault(self._bucket(x), [0, 0.0, 0.0])
        b[0] += 1
        w = max(1.0 / b[0], self.rate)
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
            self._points = pts
        return self._points

    @property
    def observations(self) -> int:
        return int(sum(b[0] for b in self._buckets.values()))

    def predict(self, x: float, optimistic: bool = False) -> float | None:
        """t(x), None before any observation."""
        pts = self.points
        if not pts:
            return None
        i = bisect.bisect_left(pts, (x, -math.inf))
        if 0 < i < len(pts):
            (x0, t0), (x1, t1) = pts[i - 1], pts[i]
            return t0 + (t1 - t0) * (x - x0) / (x1 - x0)
        x0, t0 = pts[0] if i == 0 else pts[-1]
        scaled = t0 * x / x0 if x0 > 0 else t0
        return min(t0, scaled) if optimistic else max(t0, scaled)

    def state_dict(self) -> dict[str, Any]:
        return {"buckets": [[k, *v] for k, v in sorted(self._buckets.items())]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._buckets = {int(k): [int(n), float(x), float(t)] for k, n, x, t in state["buckets"]}
        self._points = None
