"""Speculation metrics: counters per request and per engine, and the stale-draft alarm.

Vocabulary (vLLM v1's, so numbers compare):

- a **verification** is one sequence's part in one decode forward of the target; it emits
  ``accepted + 1`` tokens (the accepted drafts, then one recovered or bonus token);
- a **draft** is a verification that carried k ≥ 1 draft tokens; ``draft_tokens`` = Σ k;
- **τ** (mean acceptance length) = 1 + accepted / drafts: tokens emitted per verification that
  carried a draft, bonus/recovered token included.  Verifications without a draft (plain steps,
  or a proposer that found nothing) are left out of τ, so τ = 1 means "drafts never accepted";
- **acceptance rate** α = accepted / draft_tokens (per drafted token);
- **per-position acceptance** at position i (1-based) = (drafts whose first i tokens were all
  accepted) / (drafts with k ≥ i).  With a fixed k this is vLLM's per-position rate.
- **target forwards per token** = target forwards / tokens emitted (prefill forward included).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("specrl.rollout")


@dataclass
class SpecStats:
    """Speculation counters (of one request, one proposer, or everything)."""

    verifications: int = 0  # decode verifications (with or without drafts)
    drafts: int = 0  # verifications with k ≥ 1
    draft_tokens: int = 0  # Σ k
    accepted: int = 0  # Σ accepted draft tokens
    emitted: int = 0  # tokens emitted by verifications (accepted + recovered/bonus)
    position_drafts: list[int] = field(default_factory=list)  # [i]: drafts with k ≥ i + 1
    position_accepted: list[int] = field(default_factory=list)  # [i]: first i + 1 all accepted
    selections: Counter[str] = field(default_factory=Counter)  # proposer name → drafts

    def record(self, k: int, accepted: int, proposer: str | None) -> None:
        """One verification with k draft tokens of which the first ``accepted`` were kept."""
        self.verifications += 1
        self.emitted += accepted + 1
        if k == 0:
            return
        self.drafts += 1
        self.draft_tokens += k
        self.accepted += accepted
        if len(self.position_drafts) < k:
            grow = k - len(self.position_drafts)
            self.position_drafts += [0] * grow
            self.position_accepted += [0] * grow
        for i in range(k):
            self.position_drafts[i] += 1
            self.position_accepted[i] += i < accepted
        if proposer is not None:
            self.selections[proposer] += 1

    def merge(self, other: SpecStats) -> None:
        self.verifications += other.verifications
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted
        self.emitted += other.emitted
        n = max(len(self.position_drafts), len(other.position_drafts))
        for name in ("position_drafts", "position_accepted"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(
                self,
                name,
                [
                    (mine[i] if i < len(mine) else 0) + (theirs[i] if i < len(theirs) else 0)
                    for i in range(n)
                ],
            )
        self.selections.update(other.selections)

    @property
    def tau(self) -> float | None:
        """1 + accepted / drafts (None before the first draft)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def per_position(self) -> list[float]:
        """Acceptance rate at draft positions 1..K (see module docstring)."""
        return [
            a / d for a, d in zip(self.position_accepted, self.position_drafts, strict=True) if d
        ]

    _COUNTS = ("verifications", "drafts", "draft_tokens", "accepted", "emitted")

    def state_dict(self) -> dict[str, Any]:
        return {
            **{name: getattr(self, name) for name in self._COUNTS},
            "position_drafts": list(self.position_drafts),
            "position_accepted": list(self.position_accepted),
            "selections": dict(self.selections),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SpecStats:
        return cls(
            *(int(state[name]) for name in cls._COUNTS),
            [int(x) for x in state["position_drafts"]],
            [int(x) for x in state["position_accepted"]],
            Counter({str(k): int(v) for k, v in state["selections"].items()}),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "verifications": self.verifications,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "per_position": self.per_position,
            "position_drafts": list(self.position_drafts),
            "position_accepted": list(self.position_accepted),
            "selections": dict(self.selections),
        }


@dataclass
class Counters:
    """What an engine counts: since construction (``stats()``) or over one ``generate`` call
    (``Results.stats``) — the same keys, so a caller never diffs one against the other."""

    proposers: dict[str, SpecStats]  # per proposer: its verifications
    steps: int = 0
    prefill_forwards: int = 0
    decode_forwards: int = 0
    tokens: int = 0  # tokens emitted
    seconds: float = 0.0  # wall time of the steps
    finished: int = 0  # samples finished
    alarms: int = 0  # stale-draft alarms raised
    spec: SpecStats = field(default_factory=SpecStats)  # every decode verification
    selections: Counter[str] = field(default_factory=Counter)  # arm → sequences it drafted for
    # per engine step, only for one ``generate`` call (the shape of its rollout wave): the live
    # batch (sequences prefilled or decoded in the step) and how many of them carried drafts
    wave: list[tuple[int, int]] | None = None

    _COUNTS = ("steps", "prefill_forwards", "decode_forwards", "tokens", "finished", "alarms")

    @classmethod
    def for_proposers(cls, names: Sequence[str], *, wave: bool = False) -> Counters:
        return cls({name: SpecStats() for name in names}, wave=[] if wave else None)

    def state_dict(self) -> dict[str, Any]:
        return {
            **{name: getattr(self, name) for name in self._COUNTS},
            "seconds": self.seconds,
            "spec": self.spec.state_dict(),
            "proposers": {name: s.state_dict() for name, s in self.proposers.items()},
            "selections": dict(self.selections),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Counters saved by an engine with the same proposers (others' are dropped)."""
        for name in self._COUNTS:
            setattr(self, name, int(state[name]))
        self.seconds = float(state["seconds"])
        self.spec = SpecStats.from_state(state["spec"])
        saved = state["proposers"]
        self.proposers = {
            name: SpecStats.from_state(saved[name]) if name in saved else SpecStats()
            for name in self.proposers
        }
        self.selections = Counter({str(k): int(v) for k, v in state["selections"].items()})

    def to_dict(self) -> dict[str, Any]:
        forwards = self.prefill_forwards + self.decode_forwards
        return {
            "steps": self.steps,
            "target_forwards": forwards,
            "prefill_forwards": self.prefill_forwards,
            "decode_forwards": self.decode_forwards,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else None,
            "forwards_per_token": forwards / self.tokens if self.tokens else None,
            "finished": self.finished,
            "alarms": self.alarms,
            "spec": self.spec.to_dict(),
            "proposers": {name: s.to_dict() for name, s in self.proposers.items()},
            "selections": {arm: n for arm, n in self.selections.items() if n},
            "wave": None if self.wave is None else [list(w) for w in self.wave],
        }


class EngineCounters:
    """The counters an engine step adds to: ``total`` since construction (``stats()``) and,
    while a ``generate`` call runs, that call's own (its ``Results.stats``).  ``active`` holds
    those that count now, so a step adds to each with one loop."""

    def __init__(self, proposers: Sequence[str]) -> None:
        self.proposers = list(proposers)
        self.total = Counters.for_proposers(self.proposers)
        self.active: tuple[Counters, ...] = (self.total,)

    def begin_call(self) -> Counters:
        """A ``generate`` call starts: its own counters (with its rollout wave) count too."""
        call = Counters.for_proposers(self.proposers, wave=True)
        self.active = (self.total, call)
        return call

    def end_call(self) -> None:
        self.active = (self.total,)

    def record_step(self, seconds: float, live: int, drafting: int) -> None:
        """One engine step of ``seconds``: ``live`` sequences prefilled or decoded in it, of
        which ``drafting`` carried drafts."""
        for c in self.active:
            c.steps += 1
            c.seconds += seconds
            if c.wave is not None:
                c.wave.append((live, drafting))

    def record_verification(self, k: int, accepted: int, proposer: str | None, alarm: bool):
        """One decode verification of k draft tokens (``proposer``'s) with ``accepted`` kept;
        ``alarm``: it completed a window that raised the stale-draft alarm."""
        for c in self.active:
            c.spec.record(k, accepted, proposer)
            if proposer is not None:
                c.proposers[proposer].record(k, accepted, proposer)
            c.alarms += alarm


@dataclass
class _Window:
    drafts: int = 0
    accepted: int = 0


class AcceptanceAlarm:
    """Flags a draft whose τ stays ≈ 1 after a weight update (stale or broken draft weights).

    ``arm()`` after every update; from then on each proposer's drafts are counted in windows of
    ``window`` drafts.  A window with τ ≤ ``tau_threshold`` raises an alarm (one warning line;
    :meth:`observe` returns True, the engine counts it) and the next window is watched; the
    first healthy window disarms that proposer.
    """

    def __init__(self, window: int = 32, tau_threshold: float = 1.05) -> None:
        self.window = window
        self.tau_threshold = tau_threshold
        self.last: dict[str, float] = {}  # proposer → τ of its last complete window
        self._armed: dict[str, _Window] = {}
        self._version: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "last": dict(self.last),
            "armed": {name: [w.drafts, w.accepted] for name, w in self._armed.items()},
            "version": self._version,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last = {str(k): float(v) for k, v in state["last"].items()}
        self._armed = {str(k): _Window(int(d), int(a)) for k, (d, a) in state["armed"].items()}
        self._version = state["version"]

    def arm(self, proposers: list[str], version: int) -> None:
        self._armed = {name: _Window() for name in proposers}
        self._version = version

    @property
    def armed(self) -> list[str]:
        return sorted(self._armed)

    def observe(self, proposer: str, drafts: int, accepted: int) -> bool:
        """Count ``drafts`` of ``proposer`` with ``accepted`` tokens; True if they completed a
        window that raised the alarm."""
        w = self._armed.get(proposer)
        if w is None or drafts == 0:
            return False
        w.drafts += drafts
        w.accepted += accepted
        if w.drafts < self.window:
            return False
        tau = 1.0 + w.accepted / w.drafts
        self.last[proposer] = tau
        if tau > self.tau_threshold:
            del self._armed[proposer]
            return False
        log.warning(
            "speculation alarm: proposer %r has tau %.3f over the last %d drafts after weight "
            "update to version %s; its draft weights look stale or broken",
            proposer,
            tau,
            w.drafts,
            self._version,
        )
        self._armed[proposer] = _Window()
        return True
