"""A drafter in a process of its own: decoupled drafting on CPU without a shared interpreter lock.

On CPU the decoupled drafter thread (:class:`~specrl.rollout.decoupled.DraftWorker`) shares
the interpreter lock with the verifier.  Where much of a step is Python (small models, a few
hundred microseconds of arithmetic per forward) the two threads take turns instead of running
side by side, and drafting ahead is slower than drafting in turn.  :class:`ProcessProposer`
hosts a proposer in a spawned child process with its own intra-op threads and speaks the
:class:`~specrl.rollout.proposers.Proposer` protocol to it over a pipe:

- ``reset``, ``release``, ``move`` and ``observe`` are queued and travel with the next call
  that needs an answer (one message per decode step in the steady state), or unanswered once
  :data:`FLUSH_EVERY` are waiting (a gate that keeps drafting off sends no requests);
- ``propose``, ``propose_ahead``, ``backlog``, ``stats`` and the state and weight calls are
  request/response.  The drafter thread that runs ``propose_ahead`` blocks on the pipe without
  the interpreter lock, so the child drafts while the verifier runs.

**Sequences**: the child keeps a mirror :class:`~specrl.rollout.types.SeqState` per sequence;
every message carries, for the sequences it names, their slot, ``kv_len``, finish reason and
the tokens appended since the child last saw them.  A sampled sequence's drafts are drawn with
a generator of the child's, seeded by the engine seed and the sequence id: drafts are
reproducible and their q rows are the distributions they were drawn from, so verification is
exactly as lossless as with an in-process drafter (the verifier's generators never leave the
engine process).

**Weights**: the target is handed to the child in shared memory (``torch.multiprocessing``):
the policy's in-place weight updates are what the child reads (an EAGLE-3 draft embeds with
the target's table); draft updates (``check_weights``/``load_weights``) go over the pipe.
Tensors cross the pipe as NumPy arrays (pickled by value: no shared-memory segment per
message); the taps of the queued ``observe`` calls travel as one array per layer per message,
and only to a proposer that reads taps.

**Failures**: a call the child answers with an exception raises it in the engine process (a
:class:`~specrl.errors.SpecrlError` — a bad draft update, a missing draft — as itself, any
other as :class:`~specrl.rollout.decoupled.DrafterError` with the child's traceback); a child
that exits, or does not answer within ``timeout`` seconds, is a ``DrafterError`` in bounded
time and the child is killed.  The engine then fails the requests it holds and drafts in
process from then on (:class:`~specrl.rollout.drafting.Drafting`).

CPU only: on a GPU the drafter thread's own CUDA stream already runs beside the verifier.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import multiprocessing
import os
import threading
import time
import traceback
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # its reductions share the target's storages with the child

from specrl import errors
from specrl.errors import ConfigError
from specrl.rollout.decoupled import DrafterError, shadow
from specrl.rollout.metrics import SpecStats
from specrl.rollout.proposers import (
    ProposerBase,
    ProposerContext,
    SupportsWeights,
    build_proposer,
    proposer_module,
)
from specrl.rollout.types import Draft, SeqState

__all__ = ["ProcessProposer", "ThreadLender", "spawn_proposer"]

STARTUP_TIMEOUT = 120.0  # seconds a child may take to import torch and build its proposer
FLUSH_EVERY = 64  # queued calls sent unanswered once this many are waiting


def spawn_proposer(
    name: str,
    ctx: ProposerContext,
    options: Mapping[str, Any],
    *,
    threads: int | None,
    timeout: float,
) -> ProcessProposer:
    """``build_proposer(name, ctx, **options)`` in a child process, behind a proxy; a proposer
    with draft weights gets a proxy that forwards ``check_weights``/``load_weights``."""
    if ctx.target.device.type != "cpu":
        raise ConfigError(
            "speculation.drafter: process runs drafters on CPU only",
            hint="use drafter: thread on a GPU (the drafter runs on a CUDA stream of its own)",
        )
    proxy = ProcessProposer(name, ctx, options, threads=threads, timeout=timeout)
    if proxy.info["weights"]:
        proxy.__class__ = _WeightedProcessProposer
    return proxy


class ThreadLender:
    """The engine thread's torch threads, less the drafter process's while a decoupled step
    runs (the drafter drafts on them meanwhile); plain and coupled steps, where the drafter is
    idle or waited for, use them all.  ``enabled`` False: never lends."""

    def __init__(self, threads: int, *, enabled: bool) -> None:
        self.threads, self.enabled = threads, enabled
        self._full: int | None = None  # the engine's thread count while some are lent

    def lend(self, ahead: bool) -> None:
        """Before a decode step: lend for a decoupled one (``ahead``), else take them back."""
        if not self.enabled or ahead == (self._full is not None):
            return
        if ahead:
            self._full = torch.get_num_threads()
            torch.set_num_threads(max(1, self._full - self.threads))
        else:
            self.restore()

    def restore(self) -> None:
        """All the threads back (the end of a ``generate`` call)."""
        if self._full is not None:
            torch.set_num_threads(self._full)
            self._full = None


class ProcessProposer(ProposerBase):
    """The proxy of a proposer living in a child process (module docstring)."""

    def __init__(
        self,
        name: str,
        ctx: ProposerContext,
        options: Mapping[str, Any],
        *,
        threads: int | None,
        timeout: float,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"drafter timeout must be > 0 s, got {timeout}")
        self.name = name
        self.timeout = timeout
        self._embed = ctx.target.model.embed_tokens.weight
        ctx.target.share_memory()  # in place: the child maps the same pages
        self._embed_ptr = self._embed.data_ptr()
        fields = {
            "max_model_len": ctx.max_model_len,
            "num_slots": ctx.num_slots,
            "seed": ctx.seed,
            "compile": ctx.compile,
            "guard_check_every": ctx.guard_check_every,
        }
        mp = multiprocessing.get_context("spawn")
        self._conn, child = mp.Pipe()
        self._proc = mp.Process(
            target=_child_main,
            args=(child, name, dict(options), proposer_module(name), fields, ctx.target, threads),
            name=f"specrl-drafter-{name}",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, self._conn)
        self._lock = threading.Lock()
        self._outbox: list[tuple] = []
        self._sent: dict[int, int] = {}  # seq_id → tokens the child holds
        self._unsent: set[int] = set()  # sequences whose reset is still in the outbox
        self._dropped: set[int] = set()  # ... and that were released: never sent at all
        self.broken: str | None = None
        self._graphs = 0
        self.info = self._answer(max(timeout, STARTUP_TIMEOUT))
        self.tap_layers = tuple(self.info["tap_layers"])
        self.ahead_safe = bool(self.info["ahead_safe"])
        self.observes = bool(self.info["observes"])
        self._live: dict[int, SeqState] = {}  # for a proposer that observes nothing: ...
        self._stale = False  # ... whether their tokens moved on since the child saw them

    # ------------------------------------------------------------------ the protocol
    def reset(self, seq: SeqState) -> None:
        self._sent[seq.seq_id] = len(seq.tokens)
        self._unsent.add(seq.seq_id)
        self._live[seq.seq_id] = seq
        self._queue(("reset", _full(seq)))

    def release(self, seq: SeqState) -> None:
        """A sequence whose whole life is still queued (the gate kept drafting off) is dropped
        from the queue: the child never hears of it."""
        if seq.seq_id in self._unsent:
            self._dropped.add(seq.seq_id)
        else:
            self._queue(("release", self._sync([seq])))
        self._sent.pop(seq.seq_id, None)
        self._live.pop(seq.seq_id, None)

    def move(self, moves: list[tuple[SeqState, int]]) -> None:
        seqs = [s for s, _ in moves]
        self._queue(("move", self._sync(seqs), [slot for _, slot in moves]))

    def observe(
        self,
        batch: list[SeqState],
        accepted: list[int],
        taps: dict[int, torch.Tensor] | None,
        committed: list[int],
    ) -> None:
        if not self.observes:  # nothing per step: the tokens travel with the next request
            self._stale = True
            return
        # the taps by reference (the engine never writes into a step's taps); the child's
        # proposer gets the layers it reads, all queued steps' in one array per layer (_pack)
        mine = {k: taps[k] for k in self.tap_layers} if taps and self.tap_layers else None
        self._queue(("observe", self._sync(batch), list(accepted), mine, list(committed)))

    def propose(self, batch: list[SeqState], ks: list[int]) -> list[Draft]:
        self._refresh()
        return [_draft(d) for d in self._call("propose", self._sync(batch), list(ks))]

    def propose_ahead(
        self, batch: list[SeqState], drafts: list[Draft], ks: list[int]
    ) -> list[Draft]:
        """On the drafter thread: the child drafts while this thread waits on the pipe (the
        child samples with its own generators, whatever generators ``batch`` carries)."""
        self._refresh()
        sent = [[int(t) for t in d.tokens] for d in drafts]
        syncs = self._sync(batch, [len(d) for d in sent])  # ``batch`` may carry the drafts
        return [_draft(d) for d in self._call("ahead", syncs, sent, list(ks))]

    def backlog(self, batch: list[SeqState]) -> int:
        self._refresh()
        return int(self._call("backlog", self._sync(batch)))

    @property
    def compiled_graphs(self) -> int:
        return self._graphs  # as of the child's last answer

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._call("load_state_dict", dict(state))

    def close(self) -> None:
        """Stop the child (a proxy that is garbage collected stops it too)."""
        self.broken = self.broken or "it was closed"
        self._finalizer()

    # ------------------------------------------------------------------ the pipe
    def _queue(self, msg: tuple) -> None:
        """Queue a call that needs no answer; a long queue (the gate kept drafting off for
        many steps) goes to the child unanswered, so it never grows without bound."""
        self._outbox.append(msg)
        if len(self._outbox) >= FLUSH_EVERY and self.broken is None:
            with self._lock:
                msgs = self._pack([*self._outbox, ("flush",)])
                with contextlib.suppress(OSError, ValueError):  # gone: the next call says so
                    self._conn.send(msgs)

    def _refresh(self) -> None:
        """Before a request to a proposer that observes nothing: every live sequence's new
        tokens (it may read any, e.g. an n-gram drafter its siblings')."""
        if self._stale:
            self._stale = False
            self._outbox.append(("sync", self._sync(list(self._live.values()))))

    def _pack(self, msgs: list[tuple]) -> list[tuple]:
        """The outbox (emptied) as sent: the dropped sequences out, the taps packed."""
        dropped, self._outbox, self._unsent, self._dropped = self._dropped, [], set(), set()
        return _pack(_without(msgs, dropped) if dropped else msgs)

    def _sync(self, seqs: list[SeqState], extra: list[int] | None = None) -> list[tuple]:
        """Per sequence what changed since the child last saw it: (seq_id, slot, kv_len,
        finish_reason, first new token's index, the new tokens); ``extra[b]``: tokens at the
        end of ``seqs[b]`` that are not the sequence's (a shadow's drafts)."""
        out = []
        for b, s in enumerate(seqs):
            n = len(s.tokens) - (extra[b] if extra else 0)
            known = self._sent.get(s.seq_id, 0)
            if known > n:  # cut back (the engine never does): resend all of it
                known = 0
            out.append((s.seq_id, s.slot, s.kv_len, s.finish_reason, known, s.tokens[known:n]))
            if s.seq_id in self._sent:
                self._sent[s.seq_id] = n
        return out

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            if self.broken is not None:
                raise DrafterError(f"drafter process {self.name!r} is unusable: {self.broken}")
            if self._embed.data_ptr() != self._embed_ptr:
                self._fail("the target's embedding was replaced, not updated in place")
            msgs = self._pack([*self._outbox, (op, *args)])
            try:
                self._conn.send(msgs)
            except (OSError, ValueError) as exc:  # BrokenPipe: the child is gone
                self._fail(f"it could not be reached ({type(exc).__name__})")
            return self._answer(self.timeout)

    def _answer(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(min(0.05, max(deadline - time.monotonic(), 0))):
            if not self._proc.is_alive():
                self._fail(f"it died (exit code {self._proc.exitcode})")
            if time.monotonic() >= deadline:
                self._fail(f"it did not answer within {timeout:g} s")
        try:
            status, value, graphs = self._conn.recv()
        except (EOFError, OSError):  # the pipe closed: the child is exiting
            self._proc.join(timeout=1)
            self._fail(f"it died (exit code {self._proc.exitcode})")
        self._graphs = graphs
        if status == "ok":
            return value
        kind, message, trace, hint = value
        known = getattr(errors, kind, None)
        if isinstance(known, type) and issubclass(known, errors.SpecrlError):
            raise known(message, hint=hint)  # bad input (a draft update, a path): as itself
        raise DrafterError(f"drafter process {self.name!r} failed: {kind}: {message}\n{trace}")

    def _fail(self, why: str) -> None:
        self.broken = why
        if self._proc.is_alive():  # hung or half-broken: no graceful exit to wait for
            self._proc.kill()
        self._finalizer()
        raise DrafterError(
            f"drafter process {self.name!r} failed: {why}; the requests in flight fail"
        )


class _WeightedProcessProposer(ProcessProposer):
    """The proxy of a proposer with draft weights (``SupportsWeights``)."""

    def check_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        self._call("check_weights", {k: _array(v) for k, v in state.items()})

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        self._call("load_weights", {k: _array(v) for k, v in state.items()})


def _shutdown(proc: multiprocessing.process.BaseProcess, conn: Any) -> None:
    with contextlib.suppress(OSError, ValueError):
        conn.send(None)
    proc.join(timeout=2)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=2)
    conn.close()


# ---------------------------------------------------------------------- wire formats
def _array(t: torch.Tensor) -> tuple[bool, np.ndarray]:
    """(bfloat16?, the values): NumPy has no bfloat16, whose bits travel as int16."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return True, t.view(torch.int16).numpy().copy()
    return False, t.numpy().copy()


def _tensor(wire: tuple[bool, np.ndarray]) -> torch.Tensor:
    bf16, a = wire
    return torch.from_numpy(a).view(torch.bfloat16) if bf16 else torch.from_numpy(a)


def _without(msgs: list[tuple], dropped: set[int]) -> list[tuple]:
    """Queued lifecycle and observe calls with the sequences in ``dropped`` taken out (their
    taps' rows too); a call left about no sequence goes."""
    out = []
    for m in msgs:
        if m[0] == "reset":
            m = None if m[1][0] in dropped else m
        elif m[0] == "move":
            kept = [b for b, e in enumerate(m[1]) if e[0] not in dropped]
            m = ("move", [m[1][b] for b in kept], [m[2][b] for b in kept]) if kept else None
        elif m[0] == "observe":
            m = _observe_without(m, dropped)
        if m is not None:
            out.append(m)
    return out


def _observe_without(m: tuple, dropped: set[int]) -> tuple | None:
    _, syncs, accepted, taps, committed = m
    kept = [b for b, e in enumerate(syncs) if e[0] not in dropped]
    if len(kept) == len(syncs) or not kept:
        return m if kept else None
    if taps is not None:
        starts = [0, *itertools.accumulate(committed)]
        rows = [r for b in kept for r in range(starts[b], starts[b + 1])]
        index = torch.tensor(rows, dtype=torch.int64)
        taps = {k: t.index_select(0, index.to(t.device)) for k, t in taps.items()}
    syncs, accepted, committed = ([xs[b] for b in kept] for xs in (syncs, accepted, committed))
    return ("observe", syncs, accepted, taps, committed)


def _pack(msgs: list[tuple]) -> list[tuple]:
    """``msgs`` with their observed taps in one array per layer: a ``("taps", arrays)`` message
    first, each ``observe`` naming its rows (one copy and one pickled object per layer and
    send, not per step and layer)."""
    observed = [m[3] for m in msgs if m[0] == "observe" and m[3] is not None]
    if not observed:
        return msgs
    out, start = [], 0
    for m in msgs:
        if m[0] == "observe" and m[3] is not None:
            rows = next(iter(m[3].values())).shape[0]
            m = (*m[:3], (start, start + rows), *m[4:])
            start += rows
        out.append(m)
    arrays = {k: _array(torch.cat([t[k] for t in observed])) for k in observed[0]}
    return [("taps", arrays), *out]


def _full(seq: SeqState) -> tuple:
    return (
        seq.seq_id,
        seq.request_id,
        seq.index,
        list(seq.tokens),
        seq.prompt_len,
        seq.params,
        seq.generator is not None,
        seq.slot,
        seq.kv_len,
    )


def _wire(d: Draft) -> tuple[list[int], tuple[bool, np.ndarray] | None]:
    return [int(t) for t in d.tokens], None if d.probs is None else _array(d.probs)


def _draft(wire: tuple[list[int], tuple[bool, np.ndarray] | None]) -> Draft:
    tokens, probs = wire
    return Draft(tokens, None if probs is None else _tensor(probs))


# ---------------------------------------------------------------------- the child
def _child_main(conn, name, options, module, fields, target, threads) -> None:
    """The child: build the proposer, report what it is, then serve messages until None/EOF."""
    torch.set_num_threads(threads or 1)
    graphs = 0
    try:
        if module:
            importlib.import_module(module)  # registers the proposer (a test's, a plugin's)
        proposer = build_proposer(name, ProposerContext(target=target, **fields), **options)
        host = _Host(proposer, fields["seed"])
        info = {
            "tap_layers": list(proposer.tap_layers),
            "ahead_safe": bool(proposer.ahead_safe),
            "observes": bool(proposer.observes),
            "weights": isinstance(proposer, SupportsWeights),
            "pid": os.getpid(),
        }
        conn.send(("ok", info, graphs))
    except Exception as exc:
        conn.send(("err", _exc_wire(exc), graphs))
        return
    failed: BaseException | None = None  # an error in a queued call: the next answer says so
    while True:
        try:
            msgs = conn.recv()
        except (EOFError, OSError):
            return
        if msgs is None:
            return
        value = None
        answer = msgs[-1][0] != "flush"  # a flush of queued calls is not answered
        for op, *args in msgs[: None if answer else -1]:
            if failed is not None:
                break
            try:
                with torch.no_grad():
                    value = _OPS[op](host, *args)
            except Exception as exc:
                failed = exc
        graphs = proposer.compiled_graphs
        if not answer:
            continue
        if failed is not None:
            conn.send(("err", _exc_wire(failed), graphs))
            failed = None
        else:
            conn.send(("ok", value, graphs))


def _exc_wire(exc: BaseException) -> tuple[str, str, str, str | None]:
    trace = "".join(traceback.format_exception(exc))[-4000:]
    return type(exc).__name__, str(exc), trace, getattr(exc, "hint", None)


class _Host:
    """The child's side: the proposer and mirrors of the engine's sequences."""

    def __init__(self, proposer: Any, seed: int) -> None:
        self.proposer = proposer
        self.seed = seed
        self.seqs: dict[int, SeqState] = {}
        self.tapped: dict[int, torch.Tensor] = {}  # the taps of the message being served

    def _apply(self, syncs: list[tuple]) -> list[SeqState]:
        out = []
        for seq_id, slot, kv_len, finish, start, tokens in syncs:
            seq = self.seqs[seq_id]
            del seq.tokens[start:]
            seq.tokens.extend(tokens)
            seq.slot, seq.kv_len, seq.finish_reason = slot, kv_len, finish
            out.append(seq)
        return out

    def reset(self, full: tuple) -> None:
        seq_id, request_id, index, tokens, prompt_len, params, sampled, slot, kv_len = full
        gen = None
        if sampled:  # a stream of the child's own, reproducible from the engine seed
            gen = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + seq_id * 7_919 + 29) % 2**63
            )
        seq = SeqState(
            seq_id, request_id, index, tokens, prompt_len, params, gen, slot, kv_len,
            stats=SpecStats(),
        )  # fmt: skip
        self.seqs[seq_id] = seq
        self.proposer.reset(seq)

    def release(self, syncs: list[tuple]) -> None:
        for seq in self._apply(syncs):
            self.proposer.release(seq)
            del self.seqs[seq.seq_id]

    def move(self, syncs: list[tuple], slots: list[int]) -> None:
        seqs = self._apply(syncs)
        self.proposer.move(list(zip(seqs, slots, strict=True)))

    def sync(self, syncs: list[tuple]) -> None:
        self._apply(syncs)

    def taps(self, arrays) -> None:
        self.tapped = {k: _tensor(v) for k, v in arrays.items()}

    def observe(self, syncs, accepted, rows, committed) -> None:
        taps = None if rows is None else {k: t[rows[0] : rows[1]] for k, t in self.tapped.items()}
        self.proposer.observe(self._apply(syncs), accepted, taps, committed)

    def propose(self, syncs, ks) -> list[tuple]:
        return [_wire(d) for d in self.proposer.propose(self._apply(syncs), ks)]

    def ahead(self, syncs, drafts, ks) -> list[tuple]:
        batch = self._apply(syncs)
        got = self.proposer.propose_ahead(batch, [Draft(d) for d in drafts], ks)
        if got is None:  # no chain of its own: draft on copies carrying the drafts
            pairs = zip(batch, drafts, strict=True)
            shadows = [shadow(s, Draft(d), s.generator) for s, d in pairs]
            got = self.proposer.propose(shadows, ks)
        return [_wire(d) for d in got]

    def backlog(self, syncs) -> int:
        return self.proposer.backlog(self._apply(syncs))

    def stats(self) -> dict[str, Any]:
        return self.proposer.stats()

    def state_dict(self) -> dict[str, Any]:
        return self.proposer.state_dict()

    def load_state_dict(self, state) -> None:
        self.proposer.load_state_dict(state)

    def check_weights(self, state) -> None:
        self.proposer.check_weights({k: _tensor(v) for k, v in state.items()})

    def load_weights(self, state) -> None:
        self.proposer.load_weights({k: _tensor(v) for k, v in state.items()})


# the calls the engine process may make, by name (nothing else is reachable from the pipe)
_OPS = {
    "reset": _Host.reset,
    "release": _Host.release,
    "move": _Host.move,
    "sync": _Host.sync,
    "taps": _Host.taps,
    "observe": _Host.observe,
    "propose": _Host.propose,
    "ahead": _Host.ahead,
    "backlog": _Host.backlog,
    "stats": _Host.stats,
    "state_dict": _Host.state_dict,
    "load_state_dict": _Host.load_state_dict,
    "check_weights": _Host.check_weights,
    "load_weights": _Host.load_weights,
}
