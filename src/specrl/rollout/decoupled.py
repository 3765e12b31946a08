"""Decoupled drafting: the drafter drafts step t + 1 while the target verifies step t.

Serial (coupled) speculation alternates ``draft(t) → verify(t) → draft(t + 1) → …``: the
drafter and the target never run at the same time, so a draft pass costing c of a target step
caps the speedup at (1 + τ…) / (1 + k·c) however good the drafts are.  Decoupled, a
:class:`DraftWorker` of its own drafts ahead while the target verifies:

1. the engine plans step t and its drafts ``d_1 … d_k`` as usual;
2. before the target's verification forward it hands the worker the sequences *as they would
   be if every draft were accepted* (:meth:`Lookahead.launch`); the worker drafts ``k' + 1``
   tokens continuing ``tokens + d_1 … d_k``: the first is its guess ``g`` of the token the
   target emits after the accepted drafts (the bonus token), the others are step t + 1's
   draft;
3. after verification (:meth:`Lookahead.settle`) a sequence whose step appended exactly
   ``d_1 … d_k, g`` keeps its ahead draft for step t + 1 (:meth:`Lookahead.take`); any other
   outcome (a rejection, another bonus token, a stop) discards it, and step t + 1 drafts
   coupled from the corrected position.

Verification is untouched, so outputs are exactly what the target samples: an ahead draft is a
function of the sequence's past (the worker samples with a generator of its own, never the
sequence's, whose draws the verifier uses) and its ``q`` rows are those its tokens were drawn
from.  Greedy decoding is token-for-token plain decoding.

Proposers (:class:`~specrl.rollout.proposers.Proposer`) that declare ``ahead_safe`` draft
ahead: through ``propose_ahead(batch, drafts, ks)`` where they extend state of their own (an
EAGLE-3 chain), else (it returns None) with ``propose`` on *shadow* sequences whose tokens carry
the drafts (read-only views of the real ones, so only a proposer whose ``propose`` writes no
per-slot state may rely on that).  The worker only runs while the engine thread is inside the
target's forward and read-back, never while proposers are observed or sequences change.

Workers: :class:`DraftWorker` runs jobs on a thread of its own with its own intra-op thread
count (OpenMP thread counts are per calling thread), and on a GPU on a CUDA stream of its own
(the engine waits for the stream's event before reading a draft); a second device is the same
stream on that device.  A job that raises, a worker thread that died, or one that does not
answer within ``timeout`` seconds raises :class:`DrafterError` in the engine thread, which then
fails the ``generate`` call in bounded time instead of hanging; a broken worker stays broken.

**Which**: the speculation policy (:mod:`specrl.rollout.gating`) chooses per batch size between
plain decoding and its arms, decoupled ones included (``decoupled: true``: decoupled arms only;
``auto``: coupled and decoupled), by the measured cost of each mode's steps — decoupled pays
where the drafter has a core of its own and its guesses hold, coupled where the worker only
competes with the target for the same cores, plain where neither pays.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from specrl.rollout.metrics import SpecStats
from specrl.rollout.proposers import Proposer
from specrl.rollout.types import Draft, SeqState

__all__ = ["DraftWorker", "DrafterError", "Lookahead", "supports_ahead"]


class DrafterError(RuntimeError):
    """The decoupled drafter failed (raised, died or hung): the requests in flight fail."""


_STOP = object()


class DraftWorker:
    """Runs drafting jobs beside the engine thread: one worker thread (own intra-op threads),
    and on CUDA one stream of its own.

    ``threads``: intra-op threads of the worker (None: torch's default); ``timeout``: seconds
    :meth:`wait` waits for a job before declaring the worker hung.
    """

    def __init__(
        self,
        name: str = "drafter",
        *,
        threads: int | None = 1,
        timeout: float = 30.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"drafter timeout must be > 0 s, got {timeout}")
        self.name = name
        self.threads = threads
        self.timeout = timeout
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.broken: str | None = None  # why it no longer takes jobs
        self._busy = [0.0]  # seconds spent in jobs, written by the worker thread

    # ------------------------------------------------------------------ engine side
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)`` on the worker; :meth:`wait` for its result."""
        if self.broken is not None:
            raise DrafterError(f"drafter worker {self.name!r} is unusable: {self.broken}")
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=_serve,
                args=(self._jobs, self.threads, self.stream, self._busy),
                name=f"specrl-{self.name}",
                daemon=True,
            )
            self._thread.start()
            weakref.finalize(self, self._jobs.put, _STOP)
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def wait(self, fut: Future) -> Any:
        """The job's result, within ``timeout`` seconds of now; :class:`DrafterError` if it
        raised, the worker died, or it did not answer in time."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                value, event = fut.result(timeout=min(0.05, max(deadline - time.monotonic(), 0)))
                break
            except FutureTimeout:
                if self._thread is None or not self._thread.is_alive():
                    self.broken = "its thread died"
                    raise DrafterError(
                        f"drafter worker {self.name!r} died before answering; "
                        "the requests in flight fail"
                    ) from None
                if time.monotonic() >= deadline:
                    self.broken = f"it did not answer within {self.timeout:g} s"
                    raise DrafterError(
                        f"drafter worker {self.name!r} hung: no draft within "
                        f"{self.timeout:g} s; the requests in flight fail"
                    ) from None
            except DrafterError:
                raise
            except Exception as exc:
                self.broken = f"a job raised {type(exc).__name__}"
                raise DrafterError(
                    f"drafter worker {self.name!r} failed: {type(exc).__name__}: {exc}"
                ) from exc
        if event is not None:  # the draft's device work: ordered before the engine reads it
            torch.cuda.current_stream(self.device).wait_event(event)
        return value

    def close(self) -> None:
        """Stop the worker thread after the jobs queued so far (it is a daemon: a hung job
        does not keep the process alive).  A worker that is garbage collected closes too."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(_STOP)
        self._thread = None

    @property
    def busy_seconds(self) -> float:
        """Seconds the worker spent in jobs (the drafting the target's steps hid)."""
        return self._busy[0]


def _serve(
    jobs: queue.SimpleQueue[Any],
    threads: int | None,
    stream: torch.cuda.Stream | None,
    busy: list[float],
) -> None:
    """The worker thread: run jobs until :data:`_STOP`.  It holds the queue, not the
    :class:`DraftWorker`, so a worker nobody references is collected (and stops its thread)."""
    if threads is not None:
        torch.set_num_threads(threads)  # this thread's OpenMP pool only
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        fut, fn, args = job
        if not fut.set_running_or_notify_cancel():
            continue
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                if stream is not None:
                    with torch.cuda.stream(stream):
                        value = fn(*args)
                        event = torch.cuda.Event()
                        event.record(stream)
                else:
                    value, event = fn(*args), None
        except Exception as exc:  # handed to the engine thread
            fut.set_exception(exc)
        except BaseException:  # SystemExit, KeyboardInterrupt: the thread ends here
            return  # (wait() finds it dead)
        else:
            fut.set_result((value, event))
        finally:
            busy[0] += time.perf_counter() - t0
        job = fut = fn = args = value = event = None  # a finished job's objects are freed


def supports_ahead(proposer: Proposer) -> bool:
    """Whether ``proposer`` can draft ahead (``Proposer.ahead_safe``: through its own
    ``propose_ahead``, or ``propose`` on shadow sequences carrying the drafts)."""
    return proposer.ahead_safe


def shadow(seq: SeqState, draft: Draft, generator: torch.Generator | None) -> SeqState:
    """``seq`` as it would be with every token of ``draft`` accepted: its own token list and
    counters (the real ones are not touched), sampling with the worker's ``generator``."""
    return dataclasses.replace(
        seq,
        tokens=[*seq.tokens, *draft.tokens],
        logprobs=[],
        policy_logprobs=[],
        generator=generator,
        stats=SpecStats(),
    )


def split_ahead(draft: Draft) -> tuple[int | None, Draft]:
    """An ahead draft → (its guess of the bonus token, the next step's draft): the first token
    and its q row go with the guess, the rest with the draft."""
    if not draft.tokens:
        return None, Draft([])
    probs = None if draft.probs is None else draft.probs[1 : len(draft.tokens)]
    return int(draft.tokens[0]), Draft(list(draft.tokens[1:]), probs)


@dataclass
class _Pending:
    """One sequence's ahead draft while its step is verified."""

    seq: SeqState
    proposer: str
    drafted: list[int]  # the step's drafts, assumed accepted
    guess: int | None
    draft: Draft  # the next step's draft if the assumption holds


class Lookahead:
    """The decoupled drafting state of one engine: ahead drafts in flight and ready.

    Per sequence at most one ahead draft is ready at a time, for the proposer that drafted it.
    Counters: ``launched`` sequences drafted ahead, ``hits`` whose assumption held (their next
    step used the ahead draft), ``misses`` discarded.
    """

    def __init__(self, worker: DraftWorker, seed: int = 0) -> None:
        self.worker = worker
        self.seed = seed
        self._gens: dict[int, torch.Generator] = {}  # seq_id → the worker's generator for it
        self._ready: dict[int, tuple[str, Draft]] = {}  # seq_id → (proposer, next draft)
        self._inflight: Future | None = None
        self._collected: list[_Pending] = []
        self.launched = self.hits = self.misses = 0

    def _generator(self, seq: SeqState) -> torch.Generator | None:
        if seq.generator is None:
            return None
        gen = self._gens.get(seq.seq_id)
        if gen is None:  # a stream of its own: the verifier draws from seq.generator
            gen = torch.Generator(device=seq.generator.device)
            gen.manual_seed((self.seed * 1_000_003 + seq.seq_id * 7_919 + 17) % 2**63)
            self._gens[seq.seq_id] = gen
        return gen

    def launch(
        self,
        proposers: dict[str, Proposer],
        seqs: list[SeqState],
        names: list[str | None],
        drafts: list[Draft],
        ks: list[int],
    ) -> None:
        """Start drafting ahead for ``seqs[b]`` with proposer ``names[b]`` (None: not this
        step), assuming ``drafts[b]`` all accepted, ``ks[b]`` tokens for the next step.  Runs
        on the worker until :meth:`settle`."""
        groups: dict[str, list[int]] = {}
        for b, (name, k) in enumerate(zip(names, ks, strict=True)):
            if name is not None and k > 0 and supports_ahead(proposers[name]):
                groups.setdefault(name, []).append(b)
        if not groups:
            return
        jobs = []
        for name, idx in groups.items():
            batch = [seqs[b] for b in idx]
            dr = [drafts[b] for b in idx]
            want = [ks[b] + 1 for b in idx]  # the bonus guess, then the next draft
            shadows = [shadow(s, d, self._generator(s)) for s, d in zip(batch, dr, strict=True)]
            jobs.append((name, proposers[name], batch, shadows, dr, want))
        self.launched += sum(len(j[2]) for j in jobs)
        self._inflight = self.worker.submit(_draft_ahead, jobs)

    def collect(self) -> None:
        """Wait (at most the worker's timeout) for the ahead drafts in flight: after the
        verification's read-back, before proposers observe the step."""
        fut, self._inflight = self._inflight, None
        self._collected = self.worker.wait(fut) if fut is not None else []

    def settle(self, seqs: list[SeqState], appended: list[list[int]]) -> None:
        """After the step: keep the collected ahead drafts whose assumption held, the step
        having appended exactly the drafts and the guess (``appended[b]``: the tokens the
        verification emitted for ``seqs[b]``)."""
        self._ready.clear()
        pending, self._collected = self._collected, []
        got = {id(s): a for s, a in zip(seqs, appended, strict=True)}
        for p in pending:
            tokens = got.get(id(p.seq))
            held = (
                tokens is not None
                and p.guess is not None
                and p.seq.finish_reason is None
                and tokens == [*p.drafted, p.guess]
                and bool(p.draft.tokens)
            )
            if held:
                self._ready[p.seq.seq_id] = (p.proposer, p.draft)
                self.hits += 1
            else:
                self.misses += 1

    def take(self, seq: SeqState, proposer: str) -> Draft | None:
        """The ready ahead draft of ``seq`` if ``proposer`` drafted it (once), else None."""
        ready = self._ready.pop(seq.seq_id, None)
        if ready is None or ready[0] != proposer:
            return None
        return ready[1]

    def release(self, seq: SeqState) -> None:
        self._ready.pop(seq.seq_id, None)
        self._gens.pop(seq.seq_id, None)

    def abandon(self) -> None:
        """Forget the job in flight (its step failed); the worker may still finish it."""
        self._inflight = None
        self._collected = []
        self._ready.clear()

    def to_dict(self) -> dict[str, Any]:
        return {
            "launched": self.launched,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / (self.hits + self.misses) if self.hits + self.misses else None,
            "worker_seconds": self.worker.busy_seconds,
        }


def _draft_ahead(
    jobs: list[tuple[str, Any, list[SeqState], list[SeqState], list[Draft], list[int]]],
):
    """Worker job: each proposer's ahead drafts, split into (bonus guess, next draft)."""
    out: list[_Pending] = []
    for name, proposer, batch, shadows, drafts, want in jobs:
        # shadows: the real sequences' slots and positions, the worker's generators (drawing
        # from a sequence's own generator here would race the verifier's draws)
        got = proposer.propose_ahead(shadows, drafts, want)
        if got is None:  # no chain of its own: ``propose`` on the shadows
            got = proposer.propose(shadows, want)
        if len(got) != len(batch):
            raise RuntimeError(f"proposer {name!r} returned {len(got)} drafts for {len(batch)}")
        for seq, d, ahead_draft in zip(batch, drafts, got, strict=True):
            guess, nxt = split_ahead(ahead_draft)
            out.append(_Pending(seq, name, [int(t) for t in d.tokens], guess, nxt))
    return out
