"""The slot scheduler: which sequences wait, which run in which KV-cache slot, when they stop.

Data and bookkeeping only (no model work): :class:`~specrl.rollout.engine.RolloutEngine` asks it
to turn requests into validated sequences and queue them (:meth:`Scheduler.submit`), admit
waiting sequences into free slots (continuous batching), append each verification's tokens
against the stop conditions (:meth:`Scheduler.commit`, :func:`stopped`), compact the running
ones into slots 0..B−1 after some finished (it returns the moves; the engine copies the K/V and
tells the proposers), and release finished (as a :class:`~specrl.rollout.types.Result`) or
aborted ones.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from specrl.models.tokenizer import TextCodec
from specrl.rollout.sampling import sequence_generator
from specrl.rollout.types import Request, Result, SeqState

__all__ = ["Scheduler", "stop_string_hit", "stopped"]


class Scheduler:
    """Waiting queue, running list (kept in slot order), free slots, open request ids — and
    what a request becomes a sequence with: ids, validation, each sample's generator."""

    def __init__(
        self,
        max_batch_size: int,
        *,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        codec: TextCodec | None = None,
        device: torch.device | None = None,
        seed: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be ≥ 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.eos_token_ids, self.codec = eos_token_ids, codec
        self.device = device if device is not None else torch.device("cpu")
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.free_slots = list(range(max_batch_size - 1, -1, -1))  # pop() → lowest slot first
        self.open: dict[str, int] = {}  # request id → samples not finished yet
        self.next_seq = 0  # sequence ids
        self.next_request = 0  # default request ids ("req-<n>")
        self.rng = random.Random(seed)  # a request's sampling seed when it names none

    # ---------------------------------------------------------------------- requests in
    def submit(self, requests: Sequence[Request]) -> list[list[SeqState]]:
        """Validate every request, then queue the samples of all (one group per request); a bad
        one raises ValueError (naming its id) and queues nothing."""
        groups = []
        for r in requests:
            try:
                groups.append(self._sequences(r))
            except ValueError as exc:
                raise ValueError(f"{r.request_id}: {exc}" if r.request_id else str(exc)) from None
        self.register(groups)
        return groups

    def _sequences(self, request: Request) -> list[SeqState]:
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
        rid = request.request_id or f"req-{self.next_request}"
        self.next_request += 1
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        seqs = []
        for j in range(params.n):
            gen = None if params.greedy else sequence_generator(seed, j, self.device)
            seqs.append(SeqState(self.next_seq, rid, j, list(prompt), len(prompt), params, gen))
            self.next_seq += 1
        return seqs

    def register(self, groups: list[list[SeqState]]) -> None:
        """Claim the request ids of ``groups`` (one per request) and queue their samples; a
        clash with each other or with an open request raises ValueError and queues nothing."""
        ids = [group[0].request_id for group in groups]
        clash = sorted({i for i, c in Counter(ids).items() if c > 1 or i in self.open})
        if clash:
            raise ValueError(f"request id {clash[0]!r} is already in use")
        for group in groups:
            self.open[group[0].request_id] = len(group)
            self.waiting.extend(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, policy_version: int) -> list[SeqState]:
        """Move waiting sequences into free slots, lowest first (decoded by ``policy_version``
        from now on); returns them."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.policy_versions = (policy_version, policy_version)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    # ---------------------------------------------------------------------- tokens in
    def commit(
        self,
        seq: SeqState,
        tokens: list[int],
        logprobs: list[float],
        policy_logprobs: list[float],
        policy_version: int,
    ) -> int:
        """Append one verification's emitted tokens (the accepted drafts, then the recovered or
        bonus token) up to the first that stops the sequence; returns how many were appended."""
        seq.forwards += 1
        seq.policy_versions = (seq.policy_versions[0], policy_version)
        appended = 0
        for tok, lp, plp in zip(tokens, logprobs, policy_logprobs, strict=True):
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.policy_logprobs.append(plp)
            appended += 1
            if stopped(seq, tok, self.eos_token_ids, self.codec):
                break
        return appended

    def compact(self) -> list[tuple[SeqState, int]]:
        """The moves (sequence, new slot) that bring the running sequences into slots 0..n−1,
        in list order; the caller copies their state, then :meth:`moved` records them."""
        n = len(self.running)
        holes = sorted(slot for slot in self.free_slots if slot < n)
        movers = sorted((s for s in self.running if s.slot >= n), key=lambda s: s.slot)
        return list(zip(movers, holes, strict=True))

    def moved(self, moves: list[tuple[SeqState, int]]) -> None:
        for seq, slot in moves:
            seq.slot = slot
        n = len(self.running)
        self.running.sort(key=lambda s: s.slot)
        self.free_slots = list(range(self.max_batch_size - 1, n - 1, -1))

    def release(self, seq: SeqState) -> Result:
        """A running sequence finished: its slot is free, its request one sample closer;
        returns its result."""
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.open[seq.request_id] -= 1
        if not self.open[seq.request_id]:
            del self.open[seq.request_id]
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

    def abort(self, request_ids: Sequence[str]) -> tuple[list[SeqState], list[SeqState]]:
        """Drop every unfinished sample of these requests: (those waiting, those running — out
        of their slots; the caller frees their proposer state and compacts)."""
        ids = set(request_ids)
        queued = [s for s in self.waiting if s.request_id in ids]
        if queued:
            self.waiting = deque(s for s in self.waiting if s.request_id not in ids)
        running = [s for s in self.running if s.request_id in ids]
        for seq in running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
        for rid in ids:
            self.open.pop(rid, None)
        return queued, running

    # ---------------------------------------------------------------------- resumable state
    def state_dict(self) -> dict[str, Any]:
        """The id counters and the seed generator (JSON-able; the queues must be empty)."""
        version, internal, gauss = self.rng.getstate()
        return {
            "next_seq": self.next_seq,
            "next_request": self.next_request,
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.next_seq, self.next_request = int(state["next_seq"]), int(state["next_request"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


def stopped(
    seq: SeqState, token: int, eos_token_ids: frozenset[int], codec: TextCodec | None
) -> bool:
    """Mark ``seq`` finished if ``token`` (just appended) ends it: a stop or eos token id, a
    stop string in its text, or its ``max_tokens``."""
    p = seq.params
    if token in eos_token_ids or token in p.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
    elif p.stop:
        assert codec is not None
        hit = stop_string_hit(codec.decode, seq.tokens, seq.prompt_len, p.stop)
        if hit is not None:
            seq.finish_reason, seq.stop_reason, seq.text = "stop", hit[1], hit[0]
    if seq.finish_reason is None and seq.num_output >= p.max_tokens:
        seq.finish_reason = "length"
    return seq.finish_reason is not None


# characters past a stop string that a tail decode covers: a window that starts inside a
# multi-byte character decodes a replacement character or two at its start
STOP_TAIL_MARGIN = 16


def stop_string_hit(
    decode: Callable[[list[int]], str],
    tokens: list[int],
    prompt_len: int,
    stops: Sequence[str],
) -> tuple[str, str] | None:
    """(output text before the stop string, the stop string) if the output ``tokens[prompt_len:]``
    contains one of ``stops`` (the earliest occurrence; on a tie the smallest string), else
    None.

    Called after every appended token, when no stop string was in the text before it: a new
    occurrence ends in the text's last characters, so only a tail of the tokens is decoded
    (enough for the longest stop string plus :data:`STOP_TAIL_MARGIN` characters), and the
    whole output only when the tail holds a stop string, to cut the text there.  Per token
    this costs the tail, not the output so far (a full decode per token is quadratic in the
    length of long rollouts)."""
    need = max(len(s) for s in stops) + STOP_TAIL_MARGIN
    width = need
    while True:
        start = max(prompt_len, len(tokens) - width)
        tail = decode(tokens[start:])
        if start == prompt_len or len(tail) >= need:
            break
        width *= 2  # tokens that decode to few characters (bytes, special tokens)
    if not any(s in tail for s in stops):
        return None
    text = tail if start == prompt_len else decode(tokens[prompt_len:])
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return None
    i, s = min(hits)
    return text[:i], s
