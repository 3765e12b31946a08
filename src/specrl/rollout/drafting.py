"""The engine's speculation side: its proposers, the gate, the stale-draft alarm and, with
decoupled drafting, the lookahead worker.

:class:`~specrl.rollout.engine.RolloutEngine` owns the target, the KV cache, the scheduler and
the batch builder; once per decode step it asks :class:`Drafting` for the step's plan — the
gate's arm (drafter and k) per sequence and the drafts (:meth:`Drafting.plan`, a
:class:`~specrl.rollout.batch.Launch`) — and after the verification hands back what was
accepted (:meth:`Drafting.observe`, the committed taps for the proposers' state) and what the
step cost (:meth:`Drafting.learn`, the gate's cost and acceptance models).  Per sequence it
keeps every proposer's state in step with the scheduler's slots (:meth:`Drafting.reset`,
:meth:`Drafting.release`, :meth:`Drafting.move`).

Decoupled drafting (``speculation.decoupled``): while the target verifies step t, the
:class:`~specrl.rollout.decoupled.Lookahead` worker drafts step t + 1 assuming step t's drafts
are accepted (:meth:`Drafting.draft_ahead`); the next plan takes those drafts where the guess
held (:meth:`Drafting.settle` tells the lookahead what was emitted).  A drafter that fails,
dies or hangs turns decoupled drafting off for good (:meth:`Drafting.collect` raises once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from specrl.config.schema import SpeculationConfig
from specrl.errors import ConfigError
from specrl.rollout.batch import Launch, checked_draft
from specrl.rollout.decoupled import DrafterError, DraftWorker, Lookahead, supports_ahead
from specrl.rollout.drafter_process import ProcessProposer, ThreadLender, spawn_proposer
from specrl.rollout.gating import Arm, SpecController
from specrl.rollout.metrics import AcceptanceAlarm, Counters
from specrl.rollout.proposers import Proposer, ProposerContext, build_proposer, with_weights
from specrl.rollout.types import Draft, SeqState

__all__ = ["Drafting"]


class Drafting:
    """Proposers, gate (:class:`~specrl.rollout.gating.SpecController`), alarm and lookahead of
    one engine (module docstring).  ``padded``: the engine's decode steps are compiled, padded
    to uniform blocks (the gate prices their rows so)."""

    def __init__(
        self,
        spec: SpeculationConfig,
        ctx: ProposerContext,
        *,
        padded: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.clock = clock
        self.vocab_size = ctx.target.config.vocab_size
        self._ctx, self._spec = ctx, spec
        if spec.decoupled not in (False, True, "auto"):
            raise ConfigError(f"decoupled must be true, false or 'auto', got {spec.decoupled!r}")
        if spec.drafter not in ("thread", "process"):
            raise ConfigError(f"drafter must be thread or process, got {spec.drafter!r}")
        process = bool(spec.decoupled) and spec.drafter == "process"
        self.proposers: dict[str, Proposer] = {
            name: _build(spec, ctx, name, process=process) for name in spec.proposers
        }
        self.tap_layers = tuple(sorted({t for p in self.proposers.values() for t in p.tap_layers}))
        self.alarm = AcceptanceAlarm(spec.alarm_window, spec.alarm_tau)
        self.lookahead: Lookahead | None = None
        self._waited = 0.0  # seconds the last collect waited for the worker
        # a drafter process takes drafter_threads of the engine's cores in decoupled steps only
        self.cores = ThreadLender(spec.drafter_threads or 1, enabled=process)
        if spec.decoupled and self.proposers:
            try:
                worker = DraftWorker(
                    threads=spec.drafter_threads,
                    # a drafter process reports its own hang (and is killed); this is the backstop
                    timeout=spec.drafter_timeout + (1.0 if process else 0.0),
                    device=ctx.target.device,
                )
            except ValueError as e:
                raise ConfigError(f"speculation settings: {e}") from None
            self.lookahead = Lookahead(worker, ctx.seed)
        # the gate chooses plain, coupled or decoupled arms (specrl.rollout.gating)
        ahead = [n for n, p in self.proposers.items() if self.lookahead and supports_ahead(p)]
        self.controller = SpecController(
            spec, list(self.proposers), seed=ctx.seed, padded=padded, ahead=ahead
        )

    def _drafter_failed(self) -> None:
        """Decoupled drafting off for good: the lookahead's worker stopped, and proposers
        that lived in drafter processes rebuilt in this one (fresh: the engine fails the
        requests it holds)."""
        self.cores.restore()
        self.cores.enabled = False
        if self.lookahead is not None:
            self.lookahead.abandon()
            self.lookahead.worker.close()
            self.lookahead = None
            self.controller.drop_ahead()
        for name, p in list(self.proposers.items()):
            if isinstance(p, ProcessProposer):
                p.close()
                self.proposers[name] = _build(self._spec, self._ctx, name, process=False)

    # ---------------------------------------------------------------------- per sequence
    def reset(self, seqs: Sequence[SeqState]) -> None:
        """Sequences admitted into slots: every proposer starts their state afresh."""
        for seq in seqs:
            for p in self.proposers.values():
                p.reset(seq)

    def release(self, seq: SeqState) -> None:
        """A sequence left its slot (finished or aborted)."""
        for p in self.proposers.values():
            p.release(seq)
        if self.lookahead is not None:
            self.lookahead.release(seq)

    def move(self, moves: list[tuple[SeqState, int]]) -> None:
        """Sequences about to move to new slots (compaction): their per-slot state follows."""
        for p in self.proposers.values():
            p.move(moves)

    # ---------------------------------------------------------------------- one decode step
    def plan(self, seqs: list[SeqState], counting: Sequence[Counters]) -> Launch:
        """The decode launch of ``seqs``: the gate's arm per sequence (None: plain), each
        capped by what ``max_tokens`` leaves, and the drafts — ahead drafts where the
        lookahead has them, else from the proposers (each call timed, for the gate)."""
        arms = self.controller.plan(len(seqs), lambda name: self.proposers[name].backlog(seqs))
        drafts = [Draft([]) for _ in seqs]
        caps = [0] * len(seqs)
        draft_calls = []
        if arms is not None:
            for c in counting:
                c.selections.update(str(arm) for arm in arms if arm is not None)
            asked: dict[str, list[int]] = {}
            for b, (seq, arm) in enumerate(zip(seqs, arms, strict=True)):
                if arm is None:
                    continue
                # never draft past max_tokens: k + 1 tokens can be emitted
                caps[b] = min(arm.k, seq.params.max_tokens - seq.num_output - 1)
                asked.setdefault(arm.proposer, []).append(b)
            for name, idx in asked.items():  # cap 0 included: a proposer may batch them along
                if self.lookahead is not None:  # drafted ahead during the previous step
                    idx = self._take_ahead(name, seqs, idx, caps, drafts)
                if any(caps[b] for b in idx):
                    draft_calls.append(self._propose(name, seqs, idx, caps, drafts))
        return Launch(
            prefill=False,
            seqs=seqs,
            fed=seqs,
            feeder=list(range(len(seqs))),
            inputs=[[s.tokens[-1], *d.tokens] for s, d in zip(seqs, drafts, strict=True)],
            drafts=drafts,
            arms=list(arms) if arms is not None else [None] * len(seqs),
            caps=caps,
            num_rows=[len(d.tokens) + 1 for d in drafts],
            draft_calls=draft_calls,
        )

    def _propose(
        self, name: str, seqs: list[SeqState], idx: list[int], caps: list[int], drafts: list[Draft]
    ) -> tuple[str, int, int, float, int]:
        """One timed ``propose`` call of ``name`` for the sequences at ``idx``; fills
        ``drafts``, returns the call's record for the gate (``Launch.draft_calls``)."""
        proposer = self.proposers[name]
        batch = [seqs[b] for b in idx]
        try:
            queued = proposer.backlog(batch)
            t0 = self.clock()
            got = proposer.propose(batch, [caps[b] for b in idx])
            spent = self.clock() - t0
        except DrafterError:  # a drafter process failed
            self._drafter_failed()
            raise
        if len(got) != len(idx):
            raise RuntimeError(f"proposer {name!r} returned {len(got)} drafts for {len(idx)}")
        for b, draft in zip(idx, got, strict=True):
            drafts[b] = checked_draft(name, draft, caps[b], self.vocab_size)
        want = [caps[b] for b in idx]
        return name, sum(want), max(want), spent, queued

    def _take_ahead(
        self, name: str, seqs: list[SeqState], idx: list[int], caps: list[int], drafts: list[Draft]
    ) -> list[int]:
        """Fill ``drafts`` from the ahead drafts ``name`` made for these sequences; returns the
        indices still to draft (coupled)."""
        assert self.lookahead is not None
        rest = []
        for b in idx:
            ahead = self.lookahead.take(seqs[b], name) if caps[b] > 0 else None
            if ahead is None:
                rest.append(b)
            else:
                drafts[b] = checked_draft(name, ahead, caps[b], self.vocab_size)
        return rest

    def draft_ahead(self, decode: Launch) -> str | None:
        """This decode step's drafting mode (None for a plain step, or without a worker); when
        "decoupled", hand the worker the step's sequences with their drafts assumed accepted,
        each asking its arm's k for the next step within ``max_tokens``."""
        arm = next((a for a in decode.arms if a is not None), None)  # one arm per step
        ahead = arm is not None and arm.ahead and self.lookahead is not None
        self.cores.lend(ahead)
        if arm is None:
            return None
        if not ahead:
            return "coupled"
        mode = "decoupled"
        names: list[str | None] = []
        ks: list[int] = []
        for seq, arm, d in zip(decode.seqs, decode.arms, decode.drafts, strict=True):
            left = seq.params.max_tokens - seq.num_output - len(d.tokens) - 1
            k = min(arm.k, left - 1) if arm is not None and d.tokens else 0
            names.append(arm.proposer if k > 0 else None)
            ks.append(max(k, 0))
        self.lookahead.launch(self.proposers, decode.seqs, names, decode.drafts, ks)
        return mode

    def collect(self) -> float:
        """Wait for the worker's ahead drafts (before proposers observe the step); returns the
        seconds waited.  A drafter that raised, died or hung turns decoupled drafting off and
        its :class:`~specrl.rollout.decoupled.DrafterError` is raised (the engine fails the
        requests it holds)."""
        if self.lookahead is None:
            return 0.0
        t0 = self.clock()
        try:
            self.lookahead.collect()
        except DrafterError:
            self._drafter_failed()
            raise
        self._waited = self.clock() - t0
        return self._waited

    def settle(self, decode: Launch, host: Mapping[str, list]) -> None:
        """Tell the lookahead what each sequence emitted (its ahead drafts hold or not)."""
        if self.lookahead is None:
            return
        appended = [
            toks[: n + 1] for toks, n in zip(host["tokens"], host["num_accepted"], strict=True)
        ]
        self.lookahead.settle(decode.seqs, appended)

    def verified(self, arm: Arm | None, k: int, accepted: int) -> tuple[str | None, bool]:
        """One sequence's verification of k drafts: (the proposer that drafted them or None,
        whether it completed a window that raised the stale-draft alarm)."""
        name = arm.proposer if arm is not None and k > 0 else None
        return name, name is not None and self.alarm.observe(name, 1, accepted)

    def observe(
        self,
        seqs: list[SeqState],
        accepted: list[int],
        taps: dict[int, torch.Tensor] | None,
        committed: list[int],
    ) -> None:
        """The step's outcome for the proposers: accepted drafts, the taps of the committed
        positions (sequences in batch order) and how many positions each committed."""
        for p in self.proposers.values():
            p.observe(seqs, accepted, taps, committed)

    def learn(
        self,
        decode: Launch,
        host: Mapping[str, list],
        mode: str | None,
        seconds: float,
        target: float | None,
    ) -> None:
        """Feed the gate one decode step: ``seconds`` in all, ``target`` of them the target's
        decode share (None: the step compiled a graph, no timing sample); the drafting cost
        models with the step's propose calls; then the acceptance estimates, one verification
        per sequence that was allowed to draft."""
        tokens = sum(decode.num_rows)
        padded = decode.tensors["padded"]
        rows = len(decode.seqs) * max(decode.num_rows) if padded else tokens
        self.controller.record_step(
            rows, target, (mode or "plain") if tokens > len(decode.seqs) else "plain"
        )
        calls = decode.draft_calls if target is not None else []
        if calls is decode.draft_calls and mode == "decoupled":  # what the target waited for
            arm = next(a for a in decode.arms if a is not None)
            spent = sum(c[3] for c in calls) + self._waited
            self.controller.record_draft(
                arm.proposer, sum(decode.caps), spent, sum(c[4] for c in calls), True
            )
            calls = []
        for name, asked, _, spent, queued in calls:
            self.controller.record_draft(name, asked, spent, queued)
        for b, arm in enumerate(decode.arms):
            if arm is None or decode.caps[b] <= 0:
                continue
            k_used = decode.num_rows[b] - 1
            self.controller.record(arm, k_used, host["num_accepted"][b] + 1, decode.caps[b])

    # ---------------------------------------------------------------------- weights, state
    @property
    def compiled_graphs(self) -> int:
        return sum(p.compiled_graphs for p in self.proposers.values())

    def check_weights(self, draft: Mapping[str, torch.Tensor]) -> None:
        for p in with_weights(self.proposers).values():
            p.check_weights(draft)

    def load_weights(self, draft: Mapping[str, torch.Tensor]) -> None:
        for p in with_weights(self.proposers).values():
            p.load_weights(draft)

    def stats(self) -> dict[str, Any]:
        la = self.lookahead
        return {
            # a proposer's own state (EAGLE-3: its draft temperature scale), where it has any
            "drafters": {name: stats for name, p in self.proposers.items() if (stats := p.stats())},
            "gating": self.controller.to_dict(),
            "alarm_tau": dict(self.alarm.last),
            "alarm_armed": self.alarm.armed,
            "decoupled": None if la is None else la.to_dict(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "controller": self.controller.state_dict(),
            "alarm": self.alarm.state_dict(),
            "proposers": {name: p.state_dict() for name, p in self.proposers.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """:meth:`state_dict`'s output; a proposer this engine lacks is a ConfigError (checked
        before anything is restored)."""
        unknown = sorted(set(state["proposers"]) - set(self.proposers))
        if unknown:
            raise ConfigError(
                f"saved engine state has proposer {unknown[0]!r}, which this engine lacks",
                hint="resume with the recipe the run was started with",
            )
        self.controller.load_state_dict(state["controller"])
        self.alarm.load_state_dict(state["alarm"])
        for name, saved in state["proposers"].items():
            self.proposers[name].load_state_dict(saved)


def _build(spec: SpeculationConfig, ctx: ProposerContext, name: str, *, process: bool) -> Proposer:
    """Proposer ``name`` in this process, or in a drafter process of its own."""
    options = dict(spec.proposer_options.get(name, {}))
    if not process:
        return build_proposer(name, ctx, **options)
    return spawn_proposer(
        name, ctx, options, threads=spec.drafter_threads, timeout=spec.drafter_timeout
    )
