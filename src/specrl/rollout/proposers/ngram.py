"""``ngram``: suffix-match drafts from the request itself, its siblings and earlier responses.

The drafter looks for the longest suffix of the sequence (n tokens, from ``max_n`` down to
``min_n``) that occurred before, and proposes the tokens that followed it.  It searches, in
this order of preference on equal match length:

1. the sequence's own prompt + output (the most recent earlier occurrence);
2. the live **siblings**: other running sequences with the same prompt (a GRPO group's n
   samples, or repeated prompts), whose outputs often share long spans;
3. the **history** of finished responses to the same prompt, kept across ``generate()`` calls
   (RL revisits prompts every epoch), bounded per prompt and in number of prompts (LRU).

For 2 and 3 the occurrence nearest to the sequence's own position is preferred (responses to
one prompt tend to stay aligned).  Drafts are one-hot (``probs=None``): a wrong guess costs one
verified position, never changes the output.

Index: per token list, the end positions of every ``min_n``-gram (:class:`_TokenIndex`, ints
only); a candidate's match length is extended backwards up to ``max_n`` by direct comparison,
so memory is one entry per token.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specrl.rollout.proposers import (
    Draft,
    ProposerBase,
    ProposerContext,
    SeqState,
    register_proposer,
)


class _TokenIndex:
    """End positions of each ``min_n``-gram of a token list, extended incrementally.

    Only ints, no object per n-gram (a rollout indexes every sequence it drafts for, and the
    history keeps them: tuples and lists would all be tracked by the garbage collector): an
    n-gram is keyed by its tokens packed into one int, ``last`` maps it to its latest end and
    ``prev[end − (n − 1)]`` chains each end to the previous one of the same n-gram (−1: none).
    """

    __slots__ = ("indexed", "last", "min_n", "prev", "tokens")

    def __init__(self, tokens: list[int], min_n: int) -> None:
        self.tokens = tokens  # the sequence's own token list (final once it finished)
        self.min_n = min_n
        self.last: dict[int, int] = {}
        self.prev: list[int] = []
        self.indexed = 0  # n-grams ending before this position are indexed

    def update(self) -> None:
        """Index n-grams that have at least one following token (end ≤ len − 2)."""
        toks, last, prev = self.tokens, self.last, self.prev
        start, stop = max(self.indexed, self.min_n - 1), len(toks) - 1
        if start < stop:
            get = last.get
            for end, key in enumerate(_keys(toks, start, stop, self.min_n), start):
                prev.append(get(key, -1))
                last[key] = end
            self.indexed = stop

    def ends(self, key: int, most: int) -> list[int]:
        """The latest ``most`` ends of the n-gram ``key``, oldest first."""
        out, end, first = [], self.last.get(key, -1), self.min_n - 1
        while end >= 0 and len(out) < most:
            out.append(end)
            end = self.prev[end - first]
        return out[::-1]


def _keys(tokens: list[int], start: int, stop: int, n: int) -> list[int]:
    """The n-grams ending at ``start`` … ``stop − 1``, each packed into one int (token ids
    are below 2³²): one pass over shifted slices per token of the n-gram."""
    first = start - n + 1
    keys = tokens[first : stop - n + 1]
    for j in range(1, n):
        keys = [
            k << 32 | t for k, t in zip(keys, tokens[first + j : stop - n + 1 + j], strict=True)
        ]
    return keys


def _match_length(a: list[int], a_end: int, b: list[int], max_n: int) -> int:
    """Length of the common run ending at a[a_end] and at b[-1], capped at ``max_n``."""
    m, b_end = 0, len(b) - 1
    while m < max_n and m <= a_end and m <= b_end and a[a_end - m] == b[b_end - m]:
        m += 1
    return m


@dataclass
class _Live:
    index: _TokenIndex
    key: tuple[int, ...]  # the prompt


class NgramProposer(ProposerBase):
    """Longest-suffix-match drafts over own context, siblings and per-prompt history."""

    name = "ngram"
    # propose only reads the indexes and the sequence's tokens: decoupled drafting may call it
    # on shadow sequences carrying drafts not yet verified (specrl.rollout.decoupled)
    ahead_safe = True
    observes = False

    def __init__(
        self,
        *,
        min_n: int = 2,
        max_n: int = 8,
        history_per_prompt: int = 8,
        history_prompts: int = 1024,
        max_candidates: int = 16,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 ≤ min_n ≤ max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.history_per_prompt = history_per_prompt
        self.history_prompts = history_prompts
        self.max_candidates = max_candidates  # most recent occurrences examined per source
        self._live: dict[int, _Live] = {}
        self._groups: dict[tuple[int, ...], set[int]] = {}
        self._history: OrderedDict[tuple[int, ...], deque[_TokenIndex]] = OrderedDict()

    # ------------------------------------------------------------------ lifecycle
    def reset(self, seq: SeqState) -> None:
        key = tuple(seq.prompt)
        self._live[seq.seq_id] = _Live(_TokenIndex(seq.tokens, self.min_n), key)
        self._groups.setdefault(key, set()).add(seq.seq_id)
        if key in self._history:
            self._history.move_to_end(key)

    def release(self, seq: SeqState) -> None:
        live = self._live.pop(seq.seq_id, None)
        if live is None:
            return
        group = self._groups[live.key]
        group.discard(seq.seq_id)
        if not group:
            del self._groups[live.key]
        if self.history_per_prompt <= 0 or not seq.output:
            return
        done = live.index  # its tokens no longer change: the index (completed when a draft
        # first reads it, as every source is) stays valid for later responses to the prompt
        hist = self._history.get(live.key)
        if hist is None:
            hist = self._history[live.key] = deque(maxlen=self.history_per_prompt)
        hist.append(done)
        self._history.move_to_end(live.key)
        while len(self._history) > self.history_prompts:
            self._history.popitem(last=False)

    def observe(
        self,
        batch: list[SeqState],
        accepted: list[int],
        taps: dict[int, torch.Tensor] | None,
        committed: list[int],
    ) -> None:
        """Nothing to do: the indexes read the sequences' token lists lazily (``observes``)."""

    def state_dict(self) -> dict[str, Any]:
        """The history of finished responses (per prompt, oldest first; prompts LRU order):
        what a resumed run needs to draft as the interrupted one would have."""
        return {
            "history": [
                [list(key), [list(idx.tokens) for idx in responses]]
                for key, responses in self._history.items()
            ]
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._history = OrderedDict()
        for key, responses in state["history"]:
            hist = deque(maxlen=self.history_per_prompt)
            hist.extend(_TokenIndex([int(t) for t in toks], self.min_n) for toks in responses)
            self._history[tuple(int(t) for t in key)] = hist

    # ------------------------------------------------------------------ drafting
    def propose(self, batch: list[SeqState], ks: list[int]) -> list[Draft]:
        return [Draft(self._draft(seq, k)) for seq, k in zip(batch, ks, strict=True)]

    def _sources(self, seq: SeqState) -> list[_TokenIndex]:
        live = self._live[seq.seq_id]
        siblings = [self._live[s].index for s in sorted(self._groups[live.key]) if s != seq.seq_id]
        return [live.index, *siblings, *self._history.get(live.key, ())]

    def _draft(self, seq: SeqState, k: int) -> list[int]:
        toks = seq.tokens
        if k <= 0 or len(toks) < self.min_n:
            return []
        here = len(toks) - 1
        key = _keys(toks, here, here + 1, self.min_n)[0]
        best: tuple[int, int, _TokenIndex, int] | None = None  # (length, −distance, src, end)
        for rank, src in enumerate(self._sources(seq)):
            src.update()
            for end in src.ends(key, self.max_candidates):
                m = _match_length(src.tokens, end, toks, self.max_n)
                # own context (rank 0): prefer the most recent; others: the aligned occurrence
                closeness = end if rank == 0 else -abs(end - here)
                # longer match wins; on a tie the earlier source keeps it, within a source the
                # closer/more recent occurrence
                if (
                    best is None
                    or m > best[0]
                    or (m == best[0] and best[2] is src and closeness > best[1])
                ):
                    best = (m, closeness, src, end)
            if best is not None and best[0] == self.max_n:
                break
        if best is None:
            return []
        _, _, src, end = best
        # the own source's continuation reads the sequence's own list: the same list for a real
        # sequence, and for a shadow carrying drafts (decoupled drafting) its longer one, so a
        # match near the end continues into the drafts instead of stopping where the index does
        own = src is self._live[seq.seq_id].index
        return (toks if own else src.tokens)[end + 1 : end + 1 + k]


@register_proposer("ngram")
def _build(ctx: ProposerContext, **options) -> NgramProposer:
    return NgramProposer(**options)
