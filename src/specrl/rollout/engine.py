"""The embedded rollout engine: continuous batching over a slot KV cache, with speculation.

``RolloutEngine(model, …).generate(requests)`` returns one :class:`Result` per sample
(``n`` per request, request-major).  One engine **step**:

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
import random
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
    checked_draft,
    committed_taps,
    plan_prefill,
    read_back,
    shared_prefix,
)
from specrl.rollout.compiled import Compiled, CompiledDecode
from specrl.rollout.decoupled import DrafterError, DraftWorker, Lookahead, supports_ahead
from specrl.rollout.gating import SpecController
from specrl.rollout.metrics import AcceptanceAlarm, Counters
from specrl.rollout.proposers import Proposer, ProposerContext, SupportsWeights, build_proposer
from specrl.rollout.sampling import (
    SamplingParams,
    sampling_probs,
    sequence_generator,
)
from specrl.rollout.scheduler import Scheduler, stopped
from specrl.rollout.types import Draft, Request, Result, Results, SeqState
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
    ) -> None:
        """``fused``: run the target's inference path with fused q|k|v and gate|up projections
        (:mod:`specrl.models.fused`; the copies cost those weights' memory once more), False for
        the module forward.  ``compile``: run decode steps through ``torch.compile`` on padded,
        shape-stable batches (:mod:`specrl.rollout.compiled`; the first steps of each shape
        class compile, about four graphs in all); prefill stays eager."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be ≥ 1, got {max_batch_size}")
        self.model = model
        self.fused = fused
        self.codec = codec
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.clock = clock
        self._stopwatch = _Stopwatch(self.device, clock)
        if eos_token_ids is None:
            eos = codec.eos_ids if codec is not None else model.config.eos_token_id
            eos_token_ids = (
                eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
            )
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.spec = spec = spec if spec is not None else SpecConfig(proposers=[])
        self._compiled = CompiledDecode(model) if compile else None
        # verification and logprobs (the processed p comes in: its flags follow the requests'
        # sampling parameters and would multiply the graph classes)
        self._compiled_decide = (
            Compiled(decide, model.device, "the verification step") if compile else None
        )
        # padded decode rows write K/V up to max_k positions past a sequence's last: spare rows
        spare = spec.max_k if compile and spec.proposers else 0
        self.cache = model.new_cache(max_batch_size, self.max_model_len + spare)
        ctx = ProposerContext(model, self.max_model_len, max_batch_size, seed, compile)
        self.proposers: dict[str, Proposer] = {
            name: build_proposer(name, ctx, **dict(spec.proposer_options.get(name, {})))
            for name in spec.proposers
        }
        self.tap_layers = tuple(sorted({t for p in self.proposers.values() for t in p.tap_layers}))
        self.alarm = AcceptanceAlarm(spec.alarm_window, spec.alarm_tau)
        self.lookahead: Lookahead | None = None
        if spec.decoupled not in (False, True, "auto"):
            raise ConfigError(f"decoupled must be true, false or 'auto', got {spec.decoupled!r}")
        if spec.decoupled and self.proposers:
            try:
                worker = DraftWorker(
                    threads=spec.drafter_threads, timeout=spec.drafter_timeout, device=self.device
                )
            except ValueError as e:
                raise ConfigError(f"speculation settings: {e}") from None
            self.lookahead = Lookahead(worker, seed)
        ahead = [n for n, p in self.proposers.items() if self.lookahead and supports_ahead(p)]
        self.controller = SpecController(
            spec, list(self.proposers), seed=seed, padded=self._compiled is not None, ahead=ahead
        )
        self.policy_version = 0
        self.draft_version = 0
        self._rng = random.Random(seed)
        self.scheduler = Scheduler(max_batch_size)
        self.batches = BatchBuilder(
            self.device, self.vocab_size, model.dtype, self._compiled is not None
        )
        self._next_seq = 0
        self._next_request = 0
        # counters behind stats(), and those of the generate() call under way
        self._total = Counters.for_proposers(list(self.proposers))
        self._call: Counters | None = None

    # ---------------------------------------------------------------------- requests
    def add_requests(self, requests: Sequence[Request]) -> list[str]:
        """Queue requests (``n`` sequences each); returns their ids.

        All are validated before any is queued: a bad one raises ValueError and queues nothing.
        """
        seqs = self._make_all(requests)
        return [group[0].request_id for group in seqs]

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
            for p in self.proposers.values():
                p.release(seq)
            if self.lookahead is not None:
                self.lookahead.release(seq)
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
        seqs = [s for group in self._make_all(requests) for s in group]
        order = {(s.request_id, s.index): i for i, s in enumerate(seqs)}
        if progress is not None:
            progress(0, len(seqs))
        results: list[Result | None] = [None] * len(seqs)
        done = 0
        self._call = call = Counters.for_proposers(list(self.proposers), wave=True)
        try:
            while self.has_unfinished():
                finished = self.step()
                for r in finished:
                    results[order[r.request_id, r.index]] = r
                done += len(finished)
                if finished and progress is not None:
                    progress(done, len(seqs))
        finally:
            self._call = None
        return Results([r for r in results if r is not None], call.to_dict())

    def _make_all(self, requests: Sequence[Request]) -> list[list[SeqState]]:
        seqs = []
        for r in requests:
            try:
                seqs.append(self._make_seqs(r))
            except ValueError as exc:
                raise ValueError(f"{r.request_id}: {exc}" if r.request_id else str(exc)) from None
        self.scheduler.register(seqs)
        return seqs

    def _make_seqs(self, request: Request) -> list[SeqState]:
        params = request.params
        params.validate(self.vocab_size)
        if isinstance(request.prompt, str):
            if self.codec is None:
                raise ValueError("text prompts need an engine built with a codec (tokenizer)")
            prompt = self.codec.encode_prompt(request.prompt)
        else:
            prompt = [int(t) for t in request.prompt]
        if not prompt:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"engine's max_model_len ({self.max_model_len})"
            )
        if params.stop and self.codec is None:
            raise ValueError("stop strings need an engine built with a codec (tokenizer)")
        rid = request.request_id or f"req-{self._next_request}"
        self._next_request += 1
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seqs = []
        for j in range(params.n):
            gen = None if params.greedy else sequence_generator(seed, j, self.device)
            seqs.append(SeqState(self._next_seq, rid, j, list(prompt), len(prompt), params, gen))
            self._next_seq += 1
        return seqs

    # ---------------------------------------------------------------------- one step
    @torch.no_grad()
    def step(self) -> list[Result]:
        """Admit, prefill, speculate/decode and verify once; returns the samples that finished."""
        t0 = self.clock()
        graphs = self.compiled_graphs
        decoding = [s for s in self.scheduler.running if s.kv_len > 0]
        admitted = self._admit()
        decode = self._plan_decode(decoding) if decoding else None  # proposers run (timed) here
        prefill = plan_prefill(admitted) if admitted else None
        launches = [launch for launch in (prefill, decode) if launch is not None]
        mode = "plain"  # the decode step's mode (specrl.rollout.gating.MODES)
        if decode is not None:  # host→device inputs before any forward is queued
            self.batches.prepare(decode)
            mode = self._mode(decode)
            if mode == "decoupled":  # step t + 1's drafts, beside this verification
                self._launch_ahead(decode)
        if prefill is not None:
            start = self._stopwatch.mark()
            self.batches.prepare(prefill)
            self._run(prefill)
            stop = self._stopwatch.mark()
        if decode is not None:
            self._run(decode)
        host = read_back(launches)  # the step's only device→host transfer
        waited = 0.0
        if self.lookahead is not None and decode is not None:
            t_wait = self.clock()
            try:
                self.lookahead.collect()  # the worker is done before proposers observe
            except DrafterError as exc:
                self._drafter_failed(exc)
                raise
            waited = self.clock() - t_wait
        finished: list[Result] = []
        for launch, values in zip(launches, host, strict=True):
            finished += self._apply(launch, values)
        if self.lookahead is not None and decode is not None:
            appended = [
                toks[: n + 1]
                for toks, n in zip(host[-1]["tokens"], host[-1]["num_accepted"], strict=True)
            ]
            self.lookahead.settle(decode.seqs, appended)
        if finished:
            self._compact()
        seconds = self.clock() - t0
        live = len(decode.seqs) if decode is not None else 0
        live += len(admitted)
        drafting = sum(1 for n in decode.num_rows if n > 1) if decode is not None else 0
        for c in self._counting():
            c.steps += 1
            c.seconds += seconds
            if c.wave is not None:
                c.wave.append((live, drafting))
        if decode is not None:
            # a step that compiled a graph took seconds of compilation: no timing sample
            timed = graphs == self.compiled_graphs
            target = None
            if timed:
                # the target's decode share of the step: without the prefill and the drafting
                target = seconds - sum(call[3] for call in decode.draft_calls) - waited
                if prefill is not None:
                    target -= self._stopwatch.seconds(start, stop)
            tokens = sum(decode.num_rows)
            rows = len(decode.seqs) * max(decode.num_rows) if decode.tensors["padded"] else tokens
            self.controller.record_step(
                rows, target, mode if tokens > len(decode.seqs) else "plain"
            )
            self._learn(decode, host[-1], timed, mode, waited)
        return finished

    def _compact(self) -> None:
        """Move the sequences in the highest slots into the holes finished ones left (their
        K/V rows and each proposer's per-slot state), so the running hold slots 0..n−1."""
        moves = self.scheduler.compact()
        if moves:
            for p in self.proposers.values():
                p.move(moves)
            rows = max(seq.kv_len for seq, _ in moves)
            self.cache.copy_slots([seq.slot for seq, _ in moves], [s for _, s in moves], rows)
        self.scheduler.moved(moves)

    def _admit(self) -> list[SeqState]:
        admitted = self.scheduler.admit()
        for seq in admitted:
            seq.policy_versions = (self.policy_version, self.policy_version)
            for p in self.proposers.values():
                p.reset(seq)
        return admitted

    def _plan_decode(self, seqs: list[SeqState]) -> Launch:
        arms = self.controller.plan(len(seqs))
        drafts = [Draft([]) for _ in seqs]
        caps = [0] * len(seqs)
        draft_calls = []
        if arms is not None:
            for c in self._counting():
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
                if not any(caps[b] for b in idx):
                    continue
                batch = [seqs[b] for b in idx]
                queued = self.proposers[name].backlog(batch)
                t0 = self.clock()
                got = self.proposers[name].propose(batch, [caps[b] for b in idx])
                spent = self.clock() - t0
                if len(got) != len(idx):
                    raise RuntimeError(
                        f"proposer {name!r} returned {len(got)} drafts for {len(idx)}"
                    )
                for b, draft in zip(idx, got, strict=True):
                    drafts[b] = checked_draft(name, draft, caps[b], self.vocab_size)
                want = [caps[b] for b in idx]
                draft_calls.append((name, sum(want), max(want), spent, queued))
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

    def _mode(self, decode: Launch) -> str:
        """The step's mode: plain, or its arm's (one arm per step: the gate's choice)."""
        arm = next((a for a in decode.arms if a is not None), None)
        if arm is None:
            return "plain"
        return "decoupled" if arm.ahead and self.lookahead is not None else "coupled"

    def _launch_ahead(self, decode: Launch) -> None:
        """Hand the worker this step's sequences with their drafts assumed accepted; each asks
        the arm's k for the next step, within max_tokens."""
        assert self.lookahead is not None
        names: list[str | None] = []
        ks: list[int] = []
        for seq, arm, d in zip(decode.seqs, decode.arms, decode.drafts, strict=True):
            left = seq.params.max_tokens - seq.num_output - len(d.tokens) - 1
            k = min(arm.k, left - 1) if arm is not None and d.tokens else 0
            names.append(arm.proposer if k > 0 else None)
            ks.append(max(k, 0))
        self.lookahead.launch(self.proposers, decode.seqs, names, decode.drafts, ks)

    def _drafter_failed(self, exc: DrafterError) -> None:
        """The decoupled drafter raised, died or hung: fail the requests the engine holds
        (:meth:`abort`) and decode coupled from now on (a warning says so)."""
        assert self.lookahead is not None
        self.lookahead.abandon()
        self.lookahead.worker.close()
        self.lookahead = None
        self.controller.drop_ahead()
        held = {s.request_id for s in (*self.scheduler.running, *self.scheduler.waiting)}
        self.abort(sorted(held))
        log.warning("%s; later requests draft coupled (decoupled drafting is off)", exc)

    def _run(self, launch: Launch) -> None:
        """The target forward and on-device verification (no host sync)."""
        t = launch.tensors
        cache = CacheBatch(
            self.cache,
            t["slots"],
            t["prefix"],
            t["max_kv"],
            slots_are_prefix=t["slots_are_prefix"],
            full_rows=t["full_rows"],
        )
        if t["padded"]:
            out = self._compiled(t["ids"], t["layout"], cache, self.tap_layers)
            if t["logits_index"] is not None:  # drop the padded rows
                out.logits = out.logits.index_select(0, t["logits_index"])
        else:
            out = self.model(
                t["ids"],
                t["layout"],
                taps=self.tap_layers,
                cache=cache,
                logits_index=t["logits_index"],
                fused=self.fused,
            )
        if launch.prefill:
            copies = shared_prefix(launch)
            if copies is not None:
                self.cache.copy_slots(*copies)
            for c in self._counting():
                c.prefill_forwards += 1
        else:
            for c in self._counting():
                c.decode_forwards += 1
        logits = out.logits  # [R, V]
        rows, q = t["row_index"], t.get("draft_probs")
        args = (t["draft_tokens"], q, t["uniforms"], rows, t["num_drafts"])
        if t.get("plain") and t["params"].all_greedy:  # argmax rows: no distribution to build
            decided = decide_greedy(logits)
        elif t["padded"]:  # graph class: one sequence; drafts in the step; q given or one-hot
            probs = sampling_probs(logits, t["params"])  # [R, V]
            key = (rows.shape[0] == 1, rows.shape[1] == 1, q is None)
            decided = self._compiled_decide(probs, logits, *args, key=key)  # type: ignore[misc]
        elif t.get("plain"):  # _prepare_plain: row b is sequence b's only row
            decided = decide_plain(sampling_probs(logits, t["params"]), logits, t["uniforms"])
        else:
            decided = decide(sampling_probs(logits, t["params"]), logits, *args)
        tokens, num_accepted, sampled_lp, policy_lp = decided
        launch.out = {
            "tokens": tokens,  # [B, K+1]
            "num_accepted": num_accepted,  # [B]
            "logprobs": sampled_lp,  # [B, K+1]
            "policy_logprobs": policy_lp,  # [B, K+1]
            "taps": out.taps,  # layer → [T, H]
        }

    # ---------------------------------------------------------------------- bookkeeping
    def _apply(self, launch: Launch, host: dict[str, list]) -> list[Result]:
        accepted_all, committed = [], []
        counting = self._counting()
        for b, seq in enumerate(launch.seqs):
            n_acc = host["num_accepted"][b]
            k = launch.num_rows[b] - 1
            accepted_all.append(n_acc)
            seq.forwards += 1
            seq.policy_versions = (seq.policy_versions[0], self.policy_version)
            if not launch.prefill:
                arm = launch.arms[b]
                name = arm.proposer if arm is not None and k > 0 else None
                seq.stats.record(k, n_acc, name)
                alarm = name is not None and self.alarm.observe(name, 1, n_acc)
                for c in counting:
                    c.spec.record(k, n_acc, name)
                    if name is not None:
                        c.proposers[name].record(k, n_acc, name)
                    c.alarms += alarm
            appended = 0
            for j in range(n_acc + 1):
                tok = host["tokens"][b][j]
                seq.tokens.append(tok)
                seq.logprobs.append(host["logprobs"][b][j])
                seq.policy_logprobs.append(host["policy_logprobs"][b][j])
                appended += 1
                if stopped(seq, tok, self.eos_token_ids, self.codec):
                    break
            for c in counting:
                c.tokens += appended
            # positions whose K/V are kept: the prompt, or the fed tokens that stay in the
            # sequence (a stop inside the accepted drafts drops the fed tokens after it)
            committed.append(seq.prompt_len if launch.prefill else appended)
            seq.kv_len += committed[-1]
        if self.proposers:
            taps = committed_taps(launch, committed, self.tap_layers)
            for p in self.proposers.values():
                p.observe(launch.seqs, accepted_all, taps, committed)
        return [self._finish(s) for s in launch.seqs if s.finish_reason is not None]

    def _finish(self, seq: SeqState) -> Result:
        self.scheduler.release(seq)
        for p in self.proposers.values():
            p.release(seq)
        if self.lookahead is not None:
            self.lookahead.release(seq)
        for c in self._counting():
            c.finished += 1
        if seq.text is None:
            seq.text = self.codec.decode(seq.output) if self.codec is not None else ""
        stats = seq.stats.to_dict()
        stats["forwards"] = seq.forwards
        stats["forwards_per_token"] = seq.forwards / max(len(seq.output), 1)
        return Result(
            request_id=seq.request_id,
            index=seq.index,
            prompt_tokens=seq.prompt,
            tokens=seq.output,
            text=seq.text,
            logprobs=seq.logprobs,
            policy_logprobs=seq.policy_logprobs,
            finish_reason=seq.finish_reason or "length",
            stop_reason=seq.stop_reason,
            spec=stats,
            policy_versions=seq.policy_versions,
        )

    def _learn(
        self, launch: Launch, host: dict[str, list], timed: bool, mode: str, waited: float
    ) -> None:
        """Feed the drafting cost models (``timed``: the step's times are samples; decoupled:
        what the target waited for, the worker's lag and the redrafts), then the acceptance
        estimates: one verification per sequence that was allowed to draft."""
        calls = launch.draft_calls if timed else []
        if timed and mode == "decoupled":
            arm = next(a for a in launch.arms if a is not None)
            spent, queued = sum(c[3] for c in calls) + waited, sum(c[4] for c in calls)
            self.controller.record_draft(arm.proposer, sum(launch.caps), spent, queued, True)
            calls = []
        for name, tokens, _, seconds, queued in calls:
            self.controller.record_draft(name, tokens, seconds, queued)
        for b, arm in enumerate(launch.arms):
            if arm is None or launch.caps[b] <= 0:
                continue
            k_used = launch.num_rows[b] - 1
            emitted = host["num_accepted"][b] + 1
            self.controller.record(arm, k_used, emitted, launch.caps[b])

    def warmup(self) -> int:
        """Compile the decode graphs now rather than in the first requests (``compile=True``;
        a server calls it before it reports healthy).  Decodes short synthetic requests — one
        alone (batch 1), then one with two samples (batch 2), greedy and sampled (a drafter's
        graphs differ) — once with the gate off (steps with drafts, M > 1) and once without
        speculation (M = 1), then restores
        the decision state and counters (:meth:`state_dict`): only the compiled graphs remain.
        Returns the number of graphs compiled (0 for an eager engine)."""
        if self._compiled is None:
            return 0
        before = self.compiled_graphs or 0
        state = self.state_dict()
        stop = self.eos_token_ids
        ids = [t for t in range(self.vocab_size) if t not in stop][:3]
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
        if self._compiled is None:
            return None
        extra = sum(p.compiled_graphs for p in self.proposers.values())
        return self._compiled.graphs + self._compiled_decide.graphs + extra  # type: ignore[union-attr]

    @property
    def takes_draft_weights(self) -> bool:
        """Whether some proposer of this engine loads draft weights (:meth:`update_weights`)."""
        return any(isinstance(p, SupportsWeights) for p in self.proposers.values())

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
        weighted = [p for p in self.proposers.values() if isinstance(p, SupportsWeights)]
        if draft is not None and not self.takes_draft_weights:
            raise ConfigError(
                "draft weights given, but no proposer of this engine has weights "
                f"(proposers: {', '.join(self.proposers) or 'none'})"
            )
        # validated completely (names, shapes, dtypes, finite values, vocabulary maps) before
        # anything is replaced: a refused update leaves every weight and version as it was
        copies = self._policy_copies(policy) if policy is not None else []
        if draft is not None:
            for p in weighted:
                p.check_weights(draft)
        if policy is not None:
            apply_update(copies)
            self.policy_version = version if version is not None else self.policy_version + 1
        if draft is not None:
            for p in weighted:
                p.load_weights(draft)
            self.draft_version = version if version is not None else self.draft_version + 1
        self.alarm.arm(
            [name for name, p in self.proposers.items() if isinstance(p, SupportsWeights)],
            self.policy_version,
        )

    def _policy_copies(self, state: Mapping[str, torch.Tensor]) -> list:
        """The validated copies of a policy update (:func:`~specrl.rollout.weights.plan_update`;
        a tied ``lm_head.weight`` is the embedding, so it is optional and not copied)."""
        tied = self.model.config.tie_word_embeddings
        optional = ("lm_head.weight",) if tied else ()
        return plan_update("policy", state, self.model.state_dict(), optional=optional)

    def _counting(self) -> tuple[Counters, ...]:
        """The counters a step adds to: the engine's, and the ``generate`` call's if one runs."""
        return (self._total,) if self._call is None else (self._total, self._call)

    def stats(self) -> dict[str, Any]:
        """Counters since construction (:class:`~specrl.rollout.metrics.Counters`; a
        ``generate`` call's own are its ``Results.stats``) and the engine's state."""
        return {
            "policy_version": self.policy_version,
            "draft_version": self.draft_version,
            **self._total.to_dict(),
            "compiled_graphs": self.compiled_graphs,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            # a proposer's own state (EAGLE-3: its draft temperature scale), where it has any
            "drafters": {name: stats for name, p in self.proposers.items() if (stats := p.stats())},
            "gating": self.controller.to_dict(),
            "alarm_tau": dict(self.alarm.last),
            "alarm_armed": self.alarm.armed,
            "decoupled": None if self.lookahead is None else self.lookahead.to_dict(),
        }

    # ---------------------------------------------------------------------- resumable state
    STATE_FORMAT = 2  # 1: the reflective snapshots of specrl < 0.2 (no "format" key)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able decision state (speculation policy, alarm, counters, sampling seeds,
        proposers' own) so a resumed run replays speculation exactly.  Needs an idle engine."""
        if self.has_unfinished():
            raise RuntimeError("state_dict() needs an idle engine")
        version, internal, gauss = self._rng.getstate()
        return {
            "format": self.STATE_FORMAT,
            "policy_version": self.policy_version,
            "draft_version": self.draft_version,
            "next_seq": self._next_seq,
            "next_request": self._next_request,
            "rng": [version, list(internal), gauss],
            "controller": self.controller.state_dict(),
            "alarm": self.alarm.state_dict(),
            "counters": self._total.state_dict(),
            "proposers": {name: p.state_dict() for name, p in self.proposers.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output.  A state of the older reflective format keeps
        its versions, request counters and sampling seed; the speculation policy, alarm, counters
        and proposer histories then start fresh (one warning)."""
        if "format" not in state:
            self._load_legacy_state(state)
            return
        unknown = sorted(set(state["proposers"]) - set(self.proposers))
        if unknown:
            raise ConfigError(
                f"saved engine state has proposer {unknown[0]!r}, which this engine lacks",
                hint="resume with the recipe the run was started with",
            )
        try:
            self.policy_version = int(state["policy_version"])
            self.draft_version = int(state["draft_version"])
            self._next_seq, self._next_request = int(state["next_seq"]), int(state["next_request"])
            version, internal, gauss = state["rng"]
            self._rng.setstate((version, tuple(internal), gauss))
            self.controller.load_state_dict(state["controller"])
            self.alarm.load_state_dict(state["alarm"])
            self._total.load_state_dict(state["counters"])
            for name, saved in state["proposers"].items():
                self.proposers[name].load_state_dict(saved)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(
                f"saved engine state is malformed ({type(exc).__name__}: {str(exc)[:80]})",
                hint="resume from an unaltered checkpoint",
            ) from None

    def _load_legacy_state(self, state: Mapping[str, Any]) -> None:
        try:
            version, internal, gauss = state["_rng"]["__random__"]
            self._rng.setstate((version, tuple(internal), gauss))
            self.policy_version, self.draft_version = (
                state["policy_version"],
                state["draft_version"],
            )
            self._next_seq, self._next_request = state["_next_seq"], state["_next_request"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                "saved engine state is in no format this specrl reads",
                hint="resume with the specrl version that wrote it",
            ) from None
        log.warning(
            "engine state in the older format: versions and sampling seed restored; the "
            "speculation policy, alarm, counters and proposer histories start fresh"
        )
