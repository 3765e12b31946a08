"""The embedded rollout engine: continuous batching over a slot KV cache, with speculation.

``RolloutEngine(model, …).generate(requests)`` returns one :class:`Result` per sample
(``n`` per request, request-major).  The engine holds the target, its KV cache, the
:class:`~specrl.rollout.scheduler.Scheduler` (sequences, slots, stops), the
:class:`~specrl.rollout.batch.BatchBuilder` (host plans → device tensors) and the
:class:`~specrl.rollout.drafting.Drafting` (proposers, gate, alarm, lookahead); docs/rollout.md
follows one step's data through them.  One engine **step**:

1. admit waiting sequences into free KV-cache slots (continuous batching: a finished sequence
   frees its slot at once);
2. decide speculation for the running batch (:class:`~specrl.rollout.gating.SpecController`:
   batch-size gate, then the step's drafter and k) and collect drafts from the proposers;
3. one packed **prefill** forward for all newly admitted prompts (the samples of one request
   share it: their slots get a copy of the prompt's KV), and one packed **verification**
   forward for the running sequences, each bringing ``[last token, d_1..d_k]`` with its own k
   (a plain step is k = 0 for everyone);
4. lossless verification on device (:func:`~specrl.rollout.verify.verify`), then **one** host
   transfer for the whole step (tokens, acceptance counts, logprobs);
5. append tokens, apply stop conditions (stop token ids incl. eos, stop strings, max_tokens),
   hand taps of the committed positions to the proposers, release finished sequences.

Timing (for the gate): the injected ``clock`` times each step and each ``propose`` call, and the
prefill forward (CUDA events on a GPU, read after the step's sync, so timing adds no sync); the
gate's cost curves see the target's decode share only.  The single host sync per step is the
engine's; a proposer that reads device values while drafting (eagle3 picks its tokens on the
host) adds its own.

Slots stay **compact**: after a step in which sequences finished, the sequences in the highest
slots move (their K/V rows, and each proposer's per-slot state through ``move``) into the freed
lower ones, and the running list is kept in slot order.  A decode step's sequences then hold slots
0..B−1, so attention reads the cache as a slice instead of gathering B slots' K/V in every layer
of every step; a move copies one sequence's K/V once.

``compile=True`` runs decode steps under ``torch.compile``, each padded to a uniform
[B, max k + 1] block so that a handful of graphs serve every step
(:mod:`specrl.rollout.compiled`); the padded rows' logits are dropped, their K/V written past the
sequence's committed length (the cache has ``max_k`` spare rows per slot for them).

Rejected drafts (and padded rows) leave stale K/V beyond a slot's committed length; attention
never looks past a query's own position, and the next step overwrites them.  Invariant once
prefilled: ``seq.kv_len == len(seq.tokens) - 1`` (the last emitted token is fed by the next
step).

Weights: ``update_weights(policy=…, draft=…, version=…)`` validates the whole update first
(:mod:`specrl.rollout.weights`; a refused one changes nothing), then copies tensors in place (shared
references, e.g. a draft sharing the target embedding, stay valid) and arms the stale-draft
alarm (:class:`~specrl.rollout.metrics.AcceptanceAlarm`) for proposers with weights.
Call it between ``generate`` calls or, in the server, between steps: sequences in flight keep
the K/V computed by the old weights (``Result.policy_versions`` says which versions decoded it).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from specrl.config.schema import SpeculationConfig
from specrl.errors import CheckpointError, ConfigError
from specrl.models.decoder import CacheBatch, Transformer
from specrl.models.tokenizer import TextCodec
from specrl.rollout.batch import (
    BatchBuilder,
    Launch,
    committed_taps,
    plan_prefill,
    read_back,
    shared_prefix,
)
from specrl.rollout.compiled import CHECK_EVERY, Compiled, CompiledDecode
from specrl.rollout.decoupled import DrafterError
from specrl.rollout.drafting import Drafting
from specrl.rollout.metrics import EngineCounters
from specrl.rollout.proposers import ProposerContext, with_weights
from specrl.rollout.sampling import SamplingParams, sampling_probs
from specrl.rollout.scheduler import Scheduler
from specrl.rollout.types import Request, Result, Results
from specrl.rollout.verify import decide, decide_greedy, decide_plain
from specrl.rollout.weights import apply_update, plan_update

__all__ = ["Request", "Result", "Results", "RolloutEngine", "SpecConfig"]

log = logging.getLogger("specrl.rollout")


# the recipe's speculation section is the engine's settings, passed straight through
SpecConfig = SpeculationConfig


class _Stopwatch:
    """Times queued device work without a host sync: the engine clock where work runs on the
    host (CPU), CUDA events on a GPU (read once the step's single sync has happened)."""

    def __init__(self, device: torch.device, clock: Callable[[], float]) -> None:
        self.events = device.type == "cuda"
        self.clock = clock

    def mark(self) -> Any:
        if not self.events:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, stop: Any) -> float:
        return start.elapsed_time(stop) / 1e3 if self.events else stop - start


class RolloutEngine:
    """Batched, speculative, continuous-batching decoding of one target model."""

    STATE_FORMAT = 2  # 1: the reflective snapshots of specrl < 0.2 (no "format" key)

    def __init__(
        self,
        model: Transformer,
        *,
        codec: TextCodec | None = None,
        max_batch_size: int = 16,
        max_model_len: int | None = None,
        spec: SpecConfig | None = None,  # None: plain decoding
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        eos_token_ids: Sequence[int] | None = None,
        fused: bool = True,
        compile: bool = False,
        guard_check_every: int = CHECK_EVERY,
    ) -> None:
        """``fused``: run the target's inference path with fused q|k|v and gate|up projections
        (:mod:`specrl.models.fused`; the copies cost those weights' memory once more), False for
        the module forward.  ``compile``: run decode steps through ``torch.compile`` on padded,
        shape-stable batches (:mod:`specrl.rollout.compiled`; the first steps of each shape
        class compile, about four graphs in all); prefill stays eager.
        ``guard_check_every``: every how many guard-free calls of a compiled graph class its
        guards are evaluated in full (:class:`~specrl.rollout.compiled.Compiled`; 1 in the
        tests, so that every call proves its class's key)."""
        self.model, self.codec, self.fused, self.clock = model, codec, fused, clock
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.eos_token_ids = _eos_ids(eos_token_ids, codec, model)
        self.scheduler = Scheduler(
            max_batch_size,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            codec=codec,
            device=self.device,
            seed=seed,
        )
        self.spec = spec = spec if spec is not None else SpecConfig(proposers=[])
        every = guard_check_every
        self._compiled = CompiledDecode(model, check_every=every) if compile else None
        # verification and logprobs (the processed p comes in: its flags follow the requests'
        # sampling parameters and would multiply the graph classes)
        self._compiled_decide = (
            Compiled(decide, self.device, "the verification step", check_every=every)
            if compile
            else None
        )
        # padded decode rows write K/V up to max_k positions past a sequence's last: spare rows
        spare = spec.max_k if compile and spec.proposers else 0
        self.cache = model.new_cache(max_batch_size, self.max_model_len + spare)
        ctx = ProposerContext(model, self.max_model_len, max_batch_size, seed, compile, every)
        self.drafting = Drafting(spec, ctx, padded=compile, clock=clock)
        self.proposers, self.controller = self.drafting.proposers, self.drafting.controller
        self.batches = BatchBuilder(self.device, self.vocab_size, model.dtype, compile)
        self.counters = EngineCounters(list(self.proposers))
        self._stopwatch = _Stopwatch(self.device, clock)
        self.policy_version = 0
        self.draft_version = 0

    # ---------------------------------------------------------------------- requests
    def add_requests(self, requests: Sequence[Request]) -> list[str]:
        """Queue requests (``n`` sequences each); returns their ids.

        All are validated before any is queued: a bad one raises ValueError and queues nothing.
        """
        return [group[0].request_id for group in self.scheduler.submit(requests)]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def queued_requests(self) -> set[str]:
        """Ids of the requests none of whose samples has been admitted yet (samples of a
        request are queued together and admitted in order, so sample 0 waits for all)."""
        return {s.request_id for s in self.scheduler.waiting if s.index == 0}

    def abort(self, request_ids: Sequence[str]) -> int:
        """Drop every unfinished sample of these requests, waiting or running, between steps:
        their slots and proposer state are freed and no result is produced.  Also the way back
        to a consistent engine after a failed :meth:`step` (abort the requests it held).
        Returns the samples dropped."""
        queued, running = self.scheduler.abort(request_ids)
        for seq in running:
            self.drafting.release(seq)
        # always: after a step that failed between releasing finished samples and compacting,
        # this is what puts the running samples back in slots 0..n−1 and the free list in order
        self._compact()
        return len(queued) + len(running)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def generate(
        self,
        requests: Sequence[Request],
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> Results:
        """Decode every request to completion; results request-major, then by sample index,
        with this call's own statistics (``Results.stats``).

        The engine must be idle (no requests queued through :meth:`add_requests`).
        ``progress(done, total)`` is called once the requests are validated and queued, then
        after each step that finished samples.
        """
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; drain add_requests() work first")
        seqs = [s for group in self.scheduler.submit(requests) for s in group]
        order = {(s.request_id, s.index): i for i, s in enumerate(seqs)}
        if progress is not None:
            progress(0, len(seqs))
        results: list[Result | None] = [None] * len(seqs)
        done = 0
        call = self.counters.begin_call()
        try:
            while self.has_unfinished():
                finished = self.step()
                for r in finished:
                    results[order[r.request_id, r.index]] = r
                done += len(finished)
                if finished and progress is not None:
                    progress(done, len(seqs))
        finally:
            self.counters.end_call()
            self.drafting.cores.restore()
        return Results([r for r in results if r is not None], call.to_dict())

    # ---------------------------------------------------------------------- one step
    @torch.no_grad()
    def step(self) -> list[Result]:
        """Admit, prefill, speculate/decode and verify once; returns the samples that finished."""
        t0 = self.clock()
        graphs = self.compiled_graphs
        decoding = [s for s in self.scheduler.running if s.kv_len > 0]
        admitted = self.scheduler.admit(self.policy_version)
        self.drafting.reset(admitted)
        try:
            decode = self.drafting.plan(decoding, self.counters.active) if decoding else None
        except DrafterError as exc:  # a drafter process failed: decoupled drafting is off now
            self._drafter_failed(exc)
            raise
        prefill = plan_prefill(admitted) if admitted else None
        launches = [launch for launch in (prefill, decode) if launch is not None]
        mode = None  # the decode step's drafting mode (specrl.rollout.decoupled)
        if decode is not None:  # host→device inputs before any forward is queued
            self.batches.prepare(decode)
            mode = self.drafting.draft_ahead(decode)  # decoupled: step t + 1's drafts, beside
        if prefill is not None:  # timed apart: the gate's cost curves see the decode share
            start = self._stopwatch.mark()
            self.batches.prepare(prefill)
            self._run(prefill)
            marks = (start, self._stopwatch.mark())
        if decode is not None:
            self._run(decode)
        host = read_back(launches)  # the step's only device→host transfer
        try:
            waited = self.drafting.collect() if decode is not None else 0.0
        except DrafterError as exc:  # decoupled drafting is off now
            self._drafter_failed(exc)
            raise
        finished: list[Result] = []
        for launch, values in zip(launches, host, strict=True):
            finished += self._apply(launch, values)
        if decode is not None:
            self.drafting.settle(decode, host[-1])
        if finished:
            self._compact()
        seconds = self.clock() - t0
        drafting = sum(1 for n in decode.num_rows if n > 1) if decode is not None else 0
        self.counters.record_step(seconds, len(decoding) + len(admitted), drafting)
        if decode is not None:
            target = None  # a step that compiled a graph took seconds of compiling: no sample
            if graphs == self.compiled_graphs:  # the target's decode share of the step
                target = seconds - sum(call[3] for call in decode.draft_calls) - waited
                target -= self._stopwatch.seconds(*marks) if prefill is not None else 0.0
            self.drafting.learn(decode, host[-1], mode, seconds, target)
        return finished

    def _drafter_failed(self, exc: DrafterError) -> None:
        """The decoupled drafter failed (raised, died or hung): fail what the engine holds."""
        held = {s.request_id for s in (*self.scheduler.running, *self.scheduler.waiting)}
        self.abort(sorted(held))
        log.warning("%s; later requests draft coupled (decoupled drafting is off)", exc)

    def _compact(self) -> None:
        """Move the sequences in the highest slots into the holes finished ones left (their
        K/V rows and each proposer's per-slot state), so the running hold slots 0..n−1."""
        moves = self.scheduler.compact()
        if moves:
            self.drafting.move(moves)
            rows = max(seq.kv_len for seq, _ in moves)
            self.cache.copy_slots([seq.slot for seq, _ in moves], [s for _, s in moves], rows)
        self.scheduler.moved(moves)

    def _run(self, launch: Launch) -> None:
        """The target forward and on-device verification (no host sync): ``launch.out``."""
        t = launch.tensors
        cache = CacheBatch(
            self.cache,
            t["slots"],
            t["prefix"],
            t["max_kv"],
            slots_are_prefix=t["slots_are_prefix"],
            full_rows=t["full_rows"],
        )
        taps = self.drafting.tap_layers
        if t["padded"]:
            out = self._compiled(t["ids"], t["layout"], cache, taps)  # type: ignore[misc]
            if t["logits_index"] is not None:  # drop the padded rows
                out.logits = out.logits.index_select(0, t["logits_index"])
        else:
            out = self.model(
                t["ids"],
                t["layout"],
                taps=taps,
                cache=cache,
                logits_index=t["logits_index"],
                fused=self.fused,
            )
        if launch.prefill and (copies := shared_prefix(launch)) is not None:
            self.cache.copy_slots(*copies)
        for c in self.counters.active:
            if launch.prefill:
                c.prefill_forwards += 1
            else:
                c.decode_forwards += 1
        tokens, num_accepted, sampled_lp, policy_lp = _decide(out.logits, t, self._compiled_decide)
        launch.out = {
            "tokens": tokens,  # [B, K+1]
            "num_accepted": num_accepted,  # [B]
            "logprobs": sampled_lp,  # [B, K+1]
            "policy_logprobs": policy_lp,  # [B, K+1]
            "taps": out.taps,  # layer → [T, H]
        }

    def _apply(self, launch: Launch, host: dict[str, list]) -> list[Result]:
        """A launch's read-back values into its sequences: tokens up to a stop, the verification
        counters and the alarm, the committed taps to the proposers; returns the results of the
        sequences it finished (their slots and proposer state released)."""
        accepted_all, committed = [], []
        for b, seq in enumerate(launch.seqs):
            n_acc = host["num_accepted"][b]
            accepted_all.append(n_acc)
            if not launch.prefill:
                k = launch.num_rows[b] - 1
                name, alarm = self.drafting.verified(launch.arms[b], k, n_acc)
                seq.stats.record(k, n_acc, name)
                self.counters.record_verification(k, n_acc, name, alarm)
            row = slice(0, n_acc + 1)
            appended = self.scheduler.commit(
                seq,
                host["tokens"][b][row],
                host["logprobs"][b][row],
                host["policy_logprobs"][b][row],
                self.policy_version,
            )
            for c in self.counters.active:
                c.tokens += appended
            # positions whose K/V are kept: the prompt, or the fed tokens that stay in the
            # sequence (a stop inside the accepted drafts drops the fed tokens after it)
            committed.append(seq.prompt_len if launch.prefill else appended)
            seq.kv_len += committed[-1]
        if self.proposers:
            taps = committed_taps(launch, committed, self.drafting.tap_layers)
            self.drafting.observe(launch.seqs, accepted_all, taps, committed)
        finished = []
        for seq in [s for s in launch.seqs if s.finish_reason is not None]:
            finished.append(self.scheduler.release(seq))
            self.drafting.release(seq)
            for c in self.counters.active:
                c.finished += 1
        return finished

    def warmup(self) -> int:
        """Compile the decode graphs now rather than in the first requests (``compile=True``;
        a server calls it before it reports healthy).  Decodes short synthetic requests — one
        alone (batch 1), then one with two samples (batch 2), greedy and sampled (a drafter's
        graphs differ) — once with the gate off (steps with drafts, M > 1) and once without
        speculation (M = 1), then restores the decision state and counters
        (:meth:`state_dict`): only the compiled graphs remain.  Returns the number of graphs
        compiled (0 for an eager engine)."""
        if self._compiled is None:
            return 0
        before = self.compiled_graphs or 0
        state = self.state_dict()
        ids = [t for t in range(self.vocab_size) if t not in self.eos_token_ids][:3]
        prompt = (ids * 3)[:8]  # repeats, so n-gram drafters find matches
        max_tokens = min(8, self.max_model_len - len(prompt) - 1)
        if max_tokens < 2 or len(ids) < 2:
            return 0
        try:
            for n, temperature in itertools.product((1, 2), (0.0, 1.0)):
                params = SamplingParams(max_tokens=max_tokens, temperature=temperature, n=n)
                # speculating steps (M > 1) where there are proposers, then plain ones (M = 1)
                for speculate in (True, False) if self.proposers else (False,):
                    self.controller.force(speculate)
                    self.generate([Request(prompt, params)])
        finally:
            self.controller.force(None)
            self.load_state_dict(state)
        return (self.compiled_graphs or 0) - before

    # ---------------------------------------------------------------------- weights, stats
    @property
    def compiled_graphs(self) -> int | None:
        """Graphs compiled so far for the decode steps and the proposers (None: eager)."""
        if self._compiled is None or self._compiled_decide is None:
            return None
        return self._compiled.graphs + self._compiled_decide.graphs + self.drafting.compiled_graphs

    @property
    def takes_draft_weights(self) -> bool:
        """Whether some proposer of this engine loads draft weights (:meth:`update_weights`)."""
        return bool(with_weights(self.drafting.proposers))

    def update_weights(
        self,
        policy: Mapping[str, torch.Tensor] | None = None,
        draft: Mapping[str, torch.Tensor] | None = None,
        version: int | None = None,
    ) -> None:
        """Load new policy and/or draft weights in place; ``version`` defaults to previous + 1.

        Everything given is validated before anything is copied
        (:func:`~specrl.rollout.weights.plan_update`): raises
        :class:`~specrl.errors.CheckpointError`, with every weight and version unchanged, when
        ``policy`` or ``draft`` does not match (names, shapes, dtypes, finite values, the
        draft's vocabulary map), and :class:`~specrl.errors.ConfigError` when ``draft`` is
        given but no proposer has weights.  Arms the stale-draft alarm for every proposer with
        weights.
        """
        if policy is None and draft is None:
            raise ValueError("update_weights needs policy and/or draft weights")
        if draft is not None and not self.takes_draft_weights:
            raise ConfigError(
                "draft weights given, but no proposer of this engine has weights "
                f"(proposers: {', '.join(self.proposers) or 'none'})"
            )
        # validated completely (names, shapes, dtypes, finite values, vocabulary maps) before
        # anything is replaced: a refused update leaves every weight and version as it was.
        # A tied lm_head.weight is the embedding: optional, and not copied.
        tied = ("lm_head.weight",) if self.model.config.tie_word_embeddings else ()
        if policy is not None:
            copies = plan_update("policy", policy, self.model.state_dict(), optional=tied)
        if draft is not None:
            self.drafting.check_weights(draft)
        if policy is not None:
            apply_update(copies)
            self.policy_version = version if version is not None else self.policy_version + 1
        if draft is not None:
            self.drafting.load_weights(draft)
            self.draft_version = version if version is not None else self.draft_version + 1
        self.drafting.alarm.arm(list(with_weights(self.drafting.proposers)), self.policy_version)

    def stats(self) -> dict[str, Any]:
        """Counters since construction (:class:`~specrl.rollout.metrics.Counters`; a
        ``generate`` call's own are its ``Results.stats``) and the engine's state."""
        return {
            "policy_version": self.policy_version,
            "draft_version": self.draft_version,
            **self.counters.total.to_dict(),
            "compiled_graphs": self.compiled_graphs,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            **self.drafting.stats(),  # drafters, gating, alarm, decoupled
        }

    # ---------------------------------------------------------------------- resumable state
    def state_dict(self) -> dict[str, Any]:
        """JSON-able decision state (speculation policy, alarm, counters, sampling seeds,
        proposers' own) so a resumed run replays speculation exactly.  Needs an idle engine."""
        if self.has_unfinished():
            raise RuntimeError("state_dict() needs an idle engine")
        return {
            "format": self.STATE_FORMAT,
            "policy_version": self.policy_version,
            "draft_version": self.draft_version,
            **self.scheduler.state_dict(),  # next_seq, next_request, rng
            **self.drafting.state_dict(),  # controller, alarm, proposers
            "counters": self.counters.total.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output.  A state of the older reflective format keeps
        its versions, request counters and sampling seed; the speculation policy, alarm, counters
        and proposer histories then start fresh (one warning)."""
        legacy = "format" not in state
        try:
            if legacy:
                state = _from_legacy(state)
            else:  # proposers first: one this engine lacks is refused before any restore
                self.drafting.load_state_dict(state)
                self.counters.total.load_state_dict(state["counters"])
            self.policy_version = int(state["policy_version"])
            self.draft_version = int(state["draft_version"])
            self.scheduler.load_state_dict(state)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if legacy:
                raise CheckpointError(
                    "saved engine state is in no format this specrl reads",
                    hint="resume with the specrl version that wrote it",
                ) from None
            raise CheckpointError(
                f"saved engine state is malformed ({type(exc).__name__}: {str(exc)[:80]})",
                hint="resume from an unaltered checkpoint",
            ) from None
        if legacy:
            log.warning(
                "engine state in the older format: versions and sampling seed restored; the "
                "speculation policy, alarm, counters and proposer histories start fresh"
            )


def _eos_ids(
    given: Sequence[int] | None, codec: TextCodec | None, model: Transformer
) -> frozenset[int]:
    """The stop token ids: those given, else the codec's eos ids, else the model config's."""
    if given is None:
        eos = codec.eos_ids if codec is not None else model.config.eos_token_id
        given = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    return frozenset(int(t) for t in given)


def _decide(
    logits: torch.Tensor, t: Mapping[str, Any], compiled: Compiled | None
) -> tuple[torch.Tensor, ...]:
    """The one verification call of a launch (:mod:`specrl.rollout.verify`) on its logits
    [R, V]: (tokens [B, K+1], accepted [B], sampled logprobs, policy logprobs [B, K+1])."""
    rows, q = t["row_index"], t.get("draft_probs")
    args = (t["draft_tokens"], q, t["uniforms"], rows, t["num_drafts"])
    if t.get("plain") and t["params"].all_greedy:  # argmax rows: no distribution to build
        return decide_greedy(logits)
    probs = sampling_probs(logits, t["params"])  # [R, V]
    if t["padded"]:  # graph class: one sequence; drafts in the step; q given or one-hot
        key = (rows.shape[0] == 1, rows.shape[1] == 1, q is None)
        return compiled(probs, logits, *args, key=key)  # type: ignore[misc]
    if t.get("plain"):  # BatchBuilder._prepare_plain: row b is sequence b's only row
        return decide_plain(probs, logits, t["uniforms"])
    return decide(probs, logits, *args)


def _from_legacy(state: Mapping[str, Any]) -> dict[str, Any]:
    """What a state of the older reflective format (no "format" key) still tells: versions,
    request counters and the sampling seed generator."""
    version, internal, gauss = state["_rng"]["__random__"]
    return {
        "policy_version": state["policy_version"],
        "draft_version": state["draft_version"],
        "next_seq": state["_next_seq"],
        "next_request": state["_next_request"],
        "rng": [version, internal, gauss],
    }
