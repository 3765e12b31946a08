"""The slot scheduler: which sequences wait, which run in which KV-cache slot, when they stop.

Data and bookkeeping only (no model work): :class:`~specrl.rollout.engine.RolloutEngine` asks it
to register validated requests, admit waiting sequences into free slots (continuous batching),
compact the running ones into slots 0..B−1 after some finished (it returns the moves; the engine
copies the K/V and tells the proposers), release finished or aborted ones, and check each
appended token against the stop conditions (:func:`stopped`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence

from specrl.models.tokenizer import TextCodec
from specrl.rollout.types import SeqState

__all__ = ["Scheduler", "stop_string_hit", "stopped"]


class Scheduler:
    """Waiting queue, running list (kept in slot order), free slots, open request ids."""

    def __init__(self, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be ≥ 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.free_slots = list(range(max_batch_size - 1, -1, -1))  # pop() → lowest slot first
        self.open: dict[str, int] = {}  # request id → samples not finished yet

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

    def admit(self) -> list[SeqState]:
        """Move waiting sequences into free slots, lowest first; returns them."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

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

    def release(self, seq: SeqState) -> None:
        """A running sequence finished: its slot is free, its request one sample closer."""
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.open[seq.request_id] -= 1
        if not self.open[seq.request_id]:
            del self.open[seq.request_id]

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
