"""``eagle3``: chain drafts from an EAGLE-3 draft head fed with the target's own taps.

State per sequence lives in the draft's slot KV cache (same slot as the target's):

- **main entries**: after every target forward the engine hands over the taps of the committed
  positions; they are queued and, when the sequence next drafts, each position t gets the
  draft's step-0 pass (feature ``fc(f_t)``, token x_{t+1}, RoPE position t) written at cache
  row t — one packed pass for everything queued, nothing while the gate keeps drafting off.
  The pre-norm output at the last committed position predicts the next token, d_1.
- **chain**: draft token j (j ≥ 1) feeds the previous pre-norm output and d_j at row/position
  ``last + j``; the chain is overwritten by the next round's main entries.  This is exactly the
  TTT branch mask the draft is trained with (tested: decode chain == ``ttt_forward``).

Greedy requests get argmax drafts (one-hot q); sampled requests draw d_j from
q = softmax(draft logits / (temperature · s)) with the sequence's generator and report q (over
the target vocabulary, zero outside the draft vocabulary; float32, or float64 for a float64
draft) so the verifier's ratio test stays exact.

**Draft temperature scale** s: the ratio test is lossless for any q, so q is free to be
sharper than the draft's own distribution.  A draft distilled with a cross-entropy to the
target's distribution is mass-covering: where it is unsure it spreads its mass, and its chain
positions (fed its own hidden state, not the target's) are unsure most often.  Drawing them
from a sharper q keeps the chain on the paths the target most likely takes: at s = 0.25
instead of 1 the toy drafts accept 0.94 / 0.77 / 0.72 / 0.59 → 0.95 / 0.84 / 0.80 / 0.69 at
chain positions 1–4 (16-layer target) and 0.77 / 0.47 / 0.38 / 0.30 → 0.86 / 0.59 / 0.52 /
0.40 (4-layer; docs/benchmarks.md, "Decisions").  A draft calibrated on a high-entropy target
would lose by it (q = p accepts everything; a sharp q only p's likely tokens), so by default
(``temperature_scale="auto"``) s is learned: an ε-greedy bandit over :data:`SCALES` whose
value is each scale's running mean of accepted / drafted tokens, one pick per drafting round
(every sampled sequence of the round drafts with it), updated as verifications come back.

**Drafting ahead** (decoupled drafting, :mod:`specrl.rollout.decoupled`): each round keeps its
chains' ends (the last draft token and the pre-norm output that drew it); while the target
verifies, :meth:`propose_ahead` continues a chain past its k tokens as if every draft were
accepted — the first token is the guess of the target's bonus token, the rest the next round's
draft — and keeps that chain's end in turn, so a run of right guesses drafts from one growing
chain until a miss sends the next round back to the target's taps.

**One drafting round** (:meth:`Eagle3Proposer._chains`) serves :meth:`propose` and
:meth:`propose_ahead`, eager or compiled: a start (d_1 from the last committed position), then
one pass per chain position — the draft layer over the KV, the logits, the token drawn on
device — with the round's rows and cache rows as data (:class:`_Round`) and the per-position
computations in :class:`DraftPasses`.  Eagerly a pass runs the draft's fused copies on the chains
still drafting; with ``ProposerContext.compile`` the same functions run under
``torch.compile`` on the whole batch (the start also writes the newest main entries), with the
drafts, q and generator draws of the eager round.  Either round keeps its chains' ends.

The draft shares the target's embedding by reference, so in-place policy updates reach it; new
draft weights arrive through ``load_weights`` (engine ``update_weights(draft=…)``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from specrl.core.attention import PackedLayout
from specrl.errors import CheckpointError, ConfigError
from specrl.models.decoder import CacheBatch, KVCache
from specrl.models.draft import Eagle3Draft
from specrl.models.draft_io import check_compatible, load_draft
from specrl.rollout.bandit import MEMORY, EpsilonGreedy, RunningMean
from specrl.rollout.compiled import Compiled
from specrl.rollout.proposers import (
    Draft,
    ProposerBase,
    ProposerContext,
    SeqState,
    register_proposer,
)
from specrl.rollout.weights import apply_update, check_vocab_map, plan_update


class _StepTaps:
    """One target forward's committed taps and whose rows they are.  Built lazily, when a
    catch-up first reads them (while the gate keeps drafting off, most never are): the taps
    concatenated ([T, 3·H_target]) and the sequences' row bounds (sequence i of the forward's
    batch has rows ``bounds[i]`` to ``bounds[i + 1]``)."""

    __slots__ = ("_bounds", "_committed", "_feats", "_index", "_layers", "_seqs", "_taps")

    def __init__(
        self,
        taps: dict[int, torch.Tensor],
        layers: tuple[int, ...],
        seqs: list[SeqState],
        committed: list[int],
    ) -> None:
        self._taps, self._layers = taps, layers
        self._feats: torch.Tensor | None = None
        self._seqs, self._committed = list(seqs), list(committed)
        self._index: dict[int, int] | None = None
        self._bounds: list[int] = []

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if self._feats is None:
            self._feats = Eagle3Draft.concat_taps(self._taps, self._layers)
            self._taps = {}
        return self._feats[rows]

    def bounds(self, seq_id: int) -> tuple[int, int]:
        """The rows of sequence ``seq_id`` (an empty range if it was not in the forward)."""
        if self._index is None:
            self._index = {s.seq_id: i for i, s in enumerate(self._seqs)}
            self._bounds = [0, *itertools.accumulate(self._committed)]
        i = self._index.get(seq_id)
        return (0, 0) if i is None else (self._bounds[i], self._bounds[i + 1])


class _Pending:
    """A sequence's committed positions whose taps its draft cache lacks, oldest first: slices
    ``(a step's taps, first row, end row)``, concatenated once a catch-up reads them."""

    __slots__ = ("_chunks",)

    def __init__(self) -> None:
        self._chunks: list[tuple[_StepTaps | torch.Tensor, int, int]] = []

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def add(self, taps: _StepTaps, start: int, end: int) -> None:
        self._chunks.append((taps, start, end))

    def rows(self) -> torch.Tensor:
        """Every queued row [n, 3·H_target], oldest first (still queued, now as one slice)."""
        chunks = [f[a:b] for f, a, b in self._chunks]
        rows = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        self._chunks = [(rows, 0, rows.shape[0])]
        return rows

    def drop(self, n: int) -> None:
        """The oldest ``n`` rows are in the draft cache now (after :meth:`rows`)."""
        rows, a, b = self._chunks[0]
        self._chunks = [(rows, a + n, b)] if a + n < b else []


class _TapLog:
    """The committed taps of the target's forwards, one :class:`_StepTaps` per forward.  A
    sequence's :class:`_Pending` takes its rows from the forwards it has not seen only when
    its queue is read, so a forward costs one entry (no object per sequence for the collector
    to track) while drafting is off.  Entries every live sequence has seen are dropped
    (:meth:`trim`)."""

    __slots__ = ("base", "entries")

    def __init__(self) -> None:
        self.entries: list[_StepTaps] = []
        self.base = 0  # the forward number of entries[0]

    @property
    def end(self) -> int:
        """The forward number the next entry gets."""
        return self.base + len(self.entries)

    def take(self, seq_id: int, seen: int, pending: _Pending) -> int:
        """Queue on ``pending`` the sequence's rows of the entries from forward ``seen`` on;
        returns the forward number it has seen up to now."""
        for taps in self.entries[max(seen - self.base, 0) :]:
            start, end = taps.bounds(seq_id)
            if end > start:
                pending.add(taps, start, end)
        return self.end

    def trim(self, oldest: int) -> None:
        """Drop the entries before forward ``oldest`` (every live sequence has seen them)."""
        oldest = min(oldest, self.end)
        if oldest > self.base:
            del self.entries[: oldest - self.base]
            self.base = oldest


class _ChainEnd(NamedTuple):
    """Where a sequence's last chain ends: drafting ahead continues it from here."""

    h: torch.Tensor  # [H] the pre-norm output that drew the chain's last token
    token: int  # that token
    length: int  # the chain's tokens
    kv_len: int  # the sequence's kv_len when the chain was drawn (its first token's row)

    @property
    def rows(self) -> int:
        """Draft-cache rows holding the sequence's entries and its chain's; the chain's last
        token goes to this row next."""
        return self.kv_len + self.length - 1

    def drew(self, draft: Draft, kv_len: int) -> bool:
        """Whether ``draft`` is this chain, drawn when the sequence was at ``kv_len``."""
        tokens = draft.tokens
        return bool(tokens) and (tokens[-1], len(tokens), kv_len) == self[1:]


@dataclass
class _SeqDraft:
    """One sequence's drafting state (its draft-cache rows live at its slot)."""

    h_last: torch.Tensor | None = None  # [H] pre-norm output at the last committed position
    main_len: int = 0  # draft cache rows holding step-0 entries
    pending: _Pending = field(default_factory=_Pending)  # committed positions to catch up …
    seen: int = 0  # … taken from the tap log's forwards before this one
    drafted: int = 0  # tokens of its sampled draft awaiting verification, drawn …
    scale: float = 1.0  # … with this temperature scale
    chain_end: _ChainEnd | None = None


class _OneTokenLayouts(dict):
    """n → the layout of n sequences of one token each (built once: every chain pass uses one)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __missing__(self, n: int) -> PackedLayout:
        layout = self[n] = PackedLayout.from_lengths([1] * n, device=self.device)
        return layout


class _Round:
    """The rows of one drafting round: what each row draws and where its passes write.

    Row r drafts ``steps[r]`` tokens; its chain pass i (the draft layer on its newest token)
    writes draft-cache row ``rows[r] + i``.  An eager round puts the longest chains first and
    runs each pass on the rows still drafting (a prefix: slices, no gathers).  A compiled round
    keeps the whole batch, in the engine's slot order, in every pass, so the batch and the
    graph class (``key``: one sequence or more, slots 0..B−1 or not, greedy only or some
    sampled) stay fixed; a shorter chain's extra tokens land in cache rows past the chain, like
    padding, and are dropped.
    """

    def __init__(
        self,
        seqs: list[SeqState],
        steps: list[int],
        rows: list[int],
        scale: float,
        device: torch.device,
        compiled: bool = False,
    ) -> None:
        self.seqs, self.steps, self.rows, self.device = seqs, steps, rows, device
        self.greedy = [s.params.temperature <= 0 for s in seqs]
        # the draft temperatures: the request's times the round's scale s (1 for greedy rows,
        # whose draws are argmax anyway)
        temps = [
            1.0 if g else s.params.temperature * scale
            for s, g in zip(seqs, self.greedy, strict=True)
        ]
        self.temps = torch.tensor(temps, device=device)
        self.slots, self.t_rows, t_greedy = _int_tensors(
            [s.slot for s in seqs], rows, self.greedy, device=device
        )
        self.t_greedy = t_greedy.bool()
        self.slots_are_prefix = all(s.slot == i for i, s in enumerate(seqs))
        self.key = (len(seqs) == 1, self.slots_are_prefix, not all(self.greedy))
        self.compiled = compiled

    def live(self, p: int) -> int:
        """The rows of the pass that draws token p: the chains that long (compiled: all)."""
        return len(self.seqs) if self.compiled else sum(1 for k in self.steps if k > p)

    def sampling(self, p: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first n rows' temperatures, uniforms and greedy mask for drawing token p: one
        uniform from its own generator for each sampled row whose chain draws it, 0 elsewhere
        (so eager and compiled rounds make the same draws)."""
        u = [
            torch.rand(1, generator=s.generator) if not g and p < k else torch.zeros(1)
            for s, g, k in zip(self.seqs[:n], self.greedy[:n], self.steps[:n], strict=True)
        ]
        return _head(self.temps, n), torch.cat(u).to(self.device), _head(self.t_greedy, n)

    def flags(self, n: int) -> tuple[bool, bool]:
        """Host flags of the first n rows: some sample, some are greedy."""
        greedy = self.greedy[:n]
        return not all(greedy), any(greedy)

    def cache(self, kv: KVCache, i: int, n: int) -> CacheBatch:
        """Chain pass i of the first n rows: each row's newest token at row ``rows[r] + i``."""
        rows = self.rows[:n]
        return CacheBatch(
            kv,
            _head(self.slots, n),
            _head(self.t_rows, n) + i,
            max(rows) + i + 1,
            slots_are_prefix=all(s.slot == j for j, s in enumerate(self.seqs[:n])),
            # one token each at one position; compiled, the flag follows the shape (same graph)
            full_rows=n == 1 if self.compiled else all(x == rows[0] for x in rows),
        )

    def chains(
        self, toks: list[torch.Tensor], qs: list[torch.Tensor | None], hs: list[torch.Tensor]
    ) -> list[tuple[Draft, torch.Tensor | None]]:
        """Per row, its draft (q rows for sampled rows) and the pre-norm output that drew its
        last token, from the passes' tokens, q and outputs (pass p: its rows, in order)."""
        if all(t.shape[0] == toks[0].shape[0] for t in toks):  # one transfer for the round
            host = torch.stack(toks, 1).tolist()
        else:
            per_pass = [t.tolist() for t in toks]
            host = [[per_pass[p][r] for p in range(k)] for r, k in enumerate(self.steps)]
        out = []
        for r, k in enumerate(self.steps):
            rows = [] if self.greedy[r] else [q[r : r + 1] for q in qs[:k] if q is not None]
            probs = None if not rows else rows[0] if len(rows) == 1 else torch.cat(rows)
            out.append((Draft(host[r][:k], probs), hs[k - 1][r] if k else None))
        return out


class DraftPasses:
    """The draft's computations for one chain position, every row at once and on device: what
    a round runs eagerly or, wrapped in :class:`~specrl.rollout.compiled.Compiled`, compiled."""

    def __init__(self, draft: Eagle3Draft, vocab: int) -> None:
        self.draft, self.vocab = draft, vocab
        self.to_target = draft.draft_to_target  # [Vd] target id of each draft id

    def draw(
        self,
        logits: torch.Tensor,  # [B, Vd]
        temps: torch.Tensor,  # [B] temperatures (1 for greedy rows)
        u: torch.Tensor,  # [B] uniforms (ignored for greedy rows)
        greedy: torch.Tensor,  # [B] bool
        sampled: bool,  # host flag: some row samples
        any_greedy: bool = True,  # host flag: some row is greedy (False skips their argmax)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token per row of draft-vocab logits: greedy rows take the argmax (one-hot
        q); sampled rows draw by inverse CDF from q = softmax(logits / temperature) with their
        uniform.  Returns target ids [B] and q [B, V] over the target vocabulary (None when
        every row is greedy; rows of greedy sequences hold an unused softmax)."""
        if not sampled:
            return self.to_target[logits.argmax(-1)], None
        q_d = torch.softmax(_wide(logits) / temps[:, None], dim=-1)
        cdf = q_d.cumsum(-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0]
        ids = pick.clamp_(max=q_d.shape[-1] - 1)
        if any_greedy:
            ids = torch.where(greedy, logits.argmax(-1), ids)
        q = q_d.new_zeros(logits.shape[0], self.vocab).index_copy_(1, self.to_target, q_d)
        return self.to_target[ids], q

    def start(
        self,
        feats: torch.Tensor,
        ids: torch.Tensor,
        layout: PackedLayout,
        cache: CacheBatch,
        last: torch.Tensor,
        temps: torch.Tensor,
        u: torch.Tensor,
        greedy: torch.Tensor,
        sampled: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Step-0 entries of the (padded) newest positions, then d_1 at each row's last one."""
        h = self.draft.decode(self.draft.project(feats), ids, layout, cache, fused=False)
        h = h.index_select(0, last)
        tok, q = self.draw(self.draft.logits(h), temps, u, greedy, sampled)
        return h, tok, q

    def chain(
        self,
        h: torch.Tensor,
        tok: torch.Tensor,
        layout: PackedLayout,
        cache: CacheBatch,
        temps: torch.Tensor,
        u: torch.Tensor,
        greedy: torch.Tensor,
        sampled: bool,
        any_greedy: bool = True,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A chain position: the draft layer on (h, d_j), the logits, the draft token d_{j+1}."""
        h = self.draft.decode(h, tok, layout, cache, fused=fused)
        tok, q = self.draw(self.draft.logits(h, fused=fused), temps, u, greedy, sampled, any_greedy)
        return h, tok, q


# draft temperature scales the "auto" bandit chooses from (1: the draft's own distribution)
SCALES = (1.0, 0.5, 0.25, 0.1)


class TemperatureScale:
    """The draft temperature scale s of each drafting round: fixed, or learned ("auto").

    Learned: an ε-greedy bandit (:class:`specrl.rollout.bandit.EpsilonGreedy`: each scale first
    gets ``min_samples`` rounds, then exploration whose expected cost is bounded) over
    :data:`SCALES`, valued by each scale's running mean of accepted / drafted tokens over the
    sampled drafts verified under it (an EMA after :data:`MEMORY` drafts: the policy and
    the draft drift).  The chain length k is chosen by the engine independently of s, so the
    scales' means compare like with like.
    """

    def __init__(self, scale: float | str = "auto", seed: int = 0, epsilon: float = 0.1) -> None:
        if scale == "auto":
            self.fixed: float | None = None
        elif isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0:
            self.fixed = float(scale)
        else:
            raise ConfigError(
                f"eagle3 temperature_scale must be 'auto' or a number > 0, got {scale!r}",
                hint="temperature_scale: auto (learned), 1 (the draft's own q), or e.g. 0.25",
            )
        self.bandit = EpsilonGreedy(SCALES, epsilon, seed)  # type: ignore[arg-type]
        self.acceptance = {s: RunningMean(1.0 / MEMORY) for s in SCALES}
        self.chosen = {s: 0 for s in SCALES}  # learned: rounds that drafted sampled tokens

    def pick(self) -> float:
        if self.fixed is not None:
            return self.fixed
        acc = self.acceptance
        return self.bandit.choose(
            {s: m.value for s, m in acc.items()}, {s: m.count for s, m in acc.items()}
        )

    def drafted(self, scale: float) -> None:
        """A round drafted sampled tokens with ``scale`` (counted for the stats)."""
        if scale in self.chosen:
            self.chosen[scale] += 1

    def record(self, scale: float, accepted: int, drafted: int) -> None:
        mean = self.acceptance.get(scale)
        if mean is not None:
            mean.add(accepted / drafted)

    def state_dict(self) -> dict[str, Any]:
        return {
            "bandit": self.bandit.state_dict(),
            "scales": [[s, m.state_dict(), self.chosen[s]] for s, m in self.acceptance.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.bandit.load_state_dict(state["bandit"])
        for scale, mean, chosen in state["scales"]:
            if float(scale) in self.acceptance:
                self.acceptance[float(scale)].load_state_dict(mean)
                self.chosen[float(scale)] = int(chosen)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": "auto" if self.fixed is None else "fixed",
            "scales": {
                str(s): {"rounds": self.chosen[s], "drafts": m.count, "acceptance": m.value}
                for s, m in self.acceptance.items()
            },
        }


class Eagle3Proposer(ProposerBase):
    name = "eagle3"
    ahead_safe = True  # :meth:`propose_ahead` continues its chain on the drafter worker

    def __init__(
        self,
        draft: Eagle3Draft,
        ctx: ProposerContext,
        max_k: int = 16,
        temperature_scale: float | str = "auto",
    ) -> None:
        check_compatible(draft.config, ctx.target.config, "eagle3 proposer")
        self.draft = draft.eval()
        self.draft.refresh_embedding(ctx.target.model.embed_tokens.weight, share=True)
        self.tap_layers = tuple(draft.config.tap_layers)
        self.cache = draft.new_cache(ctx.num_slots, ctx.max_model_len + max_k + 1)
        self.max_k = max_k
        self.vocab = ctx.target.config.vocab_size
        self.device = ctx.target.device
        self._state: dict[int, _SeqDraft] = {}
        self._log = _TapLog()
        self._awaiting: dict[int, _SeqDraft] = {}  # sampled drafts awaiting verification
        self.temperature_scale = TemperatureScale(temperature_scale, seed=ctx.seed)
        self.passes = DraftPasses(draft, self.vocab)
        self._ones = _OneTokenLayouts(self.device)
        self._compiled = self._compiled_start = None
        if ctx.compile:  # the round's passes under torch.compile (specrl.rollout.compiled)
            every = ctx.guard_check_every
            self._compiled = Compiled(
                self.passes.chain, self.device, "the eagle3 chain step", check_every=every
            )
            self._compiled_start = Compiled(
                self.passes.start, self.device, "the eagle3 catch-up step", check_every=every
            )

    @property
    def compiled_graphs(self) -> int:
        if self._compiled is None or self._compiled_start is None:
            return 0
        return self._compiled.graphs + self._compiled_start.graphs

    def stats(self) -> dict[str, Any]:
        """The draft temperature scale: mode, and per scale its rounds, drafts, acceptance."""
        return {"temperature_scale": self.temperature_scale.to_dict()}

    def state_dict(self) -> dict[str, Any]:
        return {"temperature_scale": self.temperature_scale.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.temperature_scale.load_state_dict(state["temperature_scale"])

    # ------------------------------------------------------------------ lifecycle
    def reset(self, seq: SeqState) -> None:
        self._state[seq.seq_id] = _SeqDraft(seen=self._log.end)

    def release(self, seq: SeqState) -> None:
        self._state.pop(seq.seq_id, None)
        self._awaiting.pop(seq.seq_id, None)
        if not self._state:
            self._log.trim(self._log.end)

    def move(self, moves: list[tuple[SeqState, int]]) -> None:
        """The engine moves sequences to other slots: copy their draft-cache rows (the main
        entries, and a chain that drafting ahead continues)."""
        states = [self._state[s.seq_id] for s, _ in moves if s.seq_id in self._state]
        rows = max(
            (max(st.main_len, st.chain_end.rows if st.chain_end else 0) for st in states),
            default=0,
        )
        self.cache.copy_slots([s.slot for s, _ in moves], [slot for _, slot in moves], rows)

    def check_weights(self, state: Mapping[str, torch.Tensor]) -> list:
        """The validated copies of a draft update (:mod:`specrl.rollout.weights`: names, shapes,
        dtypes, finite values, an in-range ``d2t``/``t2d``); the embedding is the target's."""
        own = {k: v for k, v in self.draft.state_dict().items() if not k.startswith("embed")}
        given = {k: v for k, v in state.items() if not k.startswith("embed")}
        copies = plan_update("draft", given, own)
        check_vocab_map("draft", given["d2t"], given["t2d"], self.vocab)
        return copies

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        apply_update(self.check_weights(state))  # nothing is copied unless all of it is valid
        self.passes.to_target = self.draft.draft_to_target

    # ------------------------------------------------------------------ main entries
    def observe(
        self,
        batch: list[SeqState],
        accepted: list[int],
        taps: dict[int, torch.Tensor] | None,
        committed: list[int],
    ) -> None:
        """Queue the committed positions' taps; the draft runs on them only when it drafts.

        While the gate keeps speculation off (large batches) the draft costs nothing: its main
        entries are caught up in one packed pass at the next :meth:`propose`.
        """
        if taps is None:
            raise RuntimeError("eagle3 proposer needs taps; the engine did not provide them")
        self._log.entries.append(_StepTaps(taps, self.tap_layers, batch, committed))
        if self._awaiting:  # sampled drafts just verified: value their temperature scale
            for seq, n_acc in zip(batch, accepted, strict=True):
                st = self._awaiting.pop(seq.seq_id, None)
                if st is not None:
                    self.temperature_scale.record(st.scale, n_acc, st.drafted)

    def _pending(self, seq: SeqState) -> _Pending:
        """The sequence's queued positions, with those of forwards since it last looked."""
        st = self._state[seq.seq_id]
        st.seen = self._log.take(seq.seq_id, st.seen, st.pending)
        return st.pending

    def backlog(self, batch: list[SeqState]) -> int:
        """Positions queued for ``batch``: those its draft cache lacks, the step-0 passes the
        next :meth:`propose` runs."""
        state = self._state
        return sum(s.kv_len - st.main_len for s in batch if (st := state.get(s.seq_id)) is not None)

    def _catch_up(self, seqs: list[SeqState], keep: int = 0) -> None:
        """Step-0 passes over the queued positions of ``seqs`` in one packed forward, all but
        each sequence's last ``keep`` (left queued for the compiled round's first pass)."""
        todo, feats, ids, lens, prefix = [], [], [], [], []
        for s in seqs:
            pending = self._pending(s)
            if not pending:
                continue
            rows = pending.rows()
            first = s.kv_len - rows.shape[0]  # positions first … kv_len − 1, next tokens known
            n = rows.shape[0] - keep  # the positions done here
            if n <= 0:
                continue
            pending.drop(n)
            todo.append(s)
            feats.append(rows[:n])
            ids.extend(s.tokens[first + 1 : first + n + 1])  # x_{t+1} for each position t
            lens.append(n)
            prefix.append(first)
        self._log.trim(min((st.seen for st in self._state.values()), default=self._log.end))
        if not todo:
            return
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        t_ids, t_cu, t_pos, t_seq, t_slots, t_prefix, t_last = _int_tensors(
            ids,
            cu,
            [j for n in lens for j in range(n)],
            [i for i, n in enumerate(lens) for _ in range(n)],
            [s.slot for s in todo],
            prefix,
            [c - 1 for c in cu[1:]],
            device=self.device,
        )
        layout = PackedLayout(t_cu, t_pos, max(lens), t_seq, t_pos)  # positions: offsets
        ends = [p + n for p, n in zip(prefix, lens, strict=True)]
        cache = CacheBatch(self.cache, t_slots, t_prefix, max(ends))
        h = self.draft.decode(self.draft.project(torch.cat(feats)), t_ids, layout, cache)
        for s, h_last, end in zip(todo, h.index_select(0, t_last), ends, strict=True):
            st = self._state[s.seq_id]
            st.h_last, st.main_len = h_last, end

    # ------------------------------------------------------------------ chain drafting
    @torch.no_grad()
    def propose(self, batch: list[SeqState], ks: list[int]) -> list[Draft]:
        """One drafting round: the queued positions caught up, d_1 from the last committed
        position, then one chain pass per further token (:meth:`_chains`).  Compiled
        (``ProposerContext.compile``) when every sequence has new taps queued (always after
        its first verification), else eager (a sequence the drafter never saw)."""
        out, state = [Draft([]) for _ in batch], self._state
        live = [
            b for b, (s, k) in enumerate(zip(batch, ks, strict=True)) if k > 0 and s.seq_id in state
        ]
        # one temperature scale for the round's sampled drafts (none drawn for greedy rounds)
        sampled = any(batch[b].params.temperature > 0 for b in live)
        scale = self.temperature_scale.pick() if sampled else 1.0
        compiled = (
            self._compiled is not None
            and bool(live)
            and all(s.seq_id in state and self._pending(s) for s in batch)
        )
        if compiled:  # every sequence, in slot order; older positions are caught up eagerly
            self._catch_up(batch, keep=self.max_k + 1)
            rows = list(range(len(batch)))
        else:
            self._catch_up([batch[b] for b in live])
            rows = [b for b in live if state[batch[b].seq_id].h_last is not None]
            rows.sort(key=lambda b: -min(ks[b], self.max_k))  # longest chains first
            if not rows:
                return out
        seqs = [batch[b] for b in rows]
        steps = [min(ks[b], self.max_k) for b in rows]
        rnd = _Round(seqs, steps, [s.kv_len for s in seqs], scale, self.device, compiled)
        chains = self._chains(rnd, *self._start(rnd), drawn=True)
        for b, s, (draft, h_end) in zip(rows, seqs, chains, strict=True):
            out[b] = draft
            state[s.seq_id].chain_end = (
                _ChainEnd(h_end, draft.tokens[-1], len(draft.tokens), s.kv_len)
                if h_end is not None
                else None
            )
        return self._drafted(batch, out, scale)

    @torch.no_grad()
    def propose_ahead(
        self, batch: list[SeqState], drafts: list[Draft], ks: list[int]
    ) -> list[Draft]:
        """Continue each sequence's last chain (``drafts[b]``, the round just drafted and now
        being verified) by ``ks[b]`` tokens as if it were all accepted (module docstring); a
        sequence whose last round was not this chain (or drew nothing) gets an empty draft.
        ``batch`` may be shadow sequences (their ``generator`` is the one sampled with; slot,
        ``kv_len`` and ``seq_id`` are the real sequence's)."""
        out, state = [Draft([]) for _ in batch], self._state
        ends: dict[int, _ChainEnd] = {}
        for b, (s, d, k) in enumerate(zip(batch, drafts, ks, strict=True)):
            end = st.chain_end if (st := state.get(s.seq_id)) is not None else None
            if k > 0 and end is not None and end.drew(d, s.kv_len):
                ends[b] = end
        rows = sorted(ends, key=lambda b: -min(ks[b], self.max_k + 1))  # longest first
        if not rows:
            return out
        seqs = [batch[b] for b in rows]
        steps = [min(ks[b], self.max_k + 1) for b in rows]
        scales = {state[s.seq_id].scale for s in seqs}
        scale = scales.pop() if len(scales) == 1 else 1.0
        rnd = _Round(seqs, steps, [ends[b].rows for b in rows], scale, self.device)
        h = torch.stack([ends[b].h for b in rows])
        # chain passes take target ids (the draft embeds with the target's table)
        tok = torch.tensor([ends[b].token for b in rows], device=self.device)
        chains = self._chains(rnd, h, tok)
        for b, s, (draft, h_end) in zip(rows, seqs, chains, strict=True):
            out[b], e = draft, ends[b]
            # the guess is the bonus token: the next round's chain is draft.tokens[1:], at the
            # sequence's kv_len once this round's drafts and the bonus are committed
            state[s.seq_id].chain_end = (
                _ChainEnd(h_end, draft.tokens[-1], len(draft.tokens) - 1, e.kv_len + e.length + 1)
                if h_end is not None and len(draft.tokens) > 1
                else None
            )
        return out

    def _start(self, rnd: _Round) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Token 0 of a round and the pre-norm outputs [B, H] that drew it: eager, the logits
        of each row's caught-up ``h_last``; compiled, one pass over each sequence's newest
        positions (their step-0 entries, then d_1; :func:`_newest_block`)."""
        n = len(rnd.seqs)
        if not rnd.compiled:
            h = torch.stack([self._state[s.seq_id].h_last for s in rnd.seqs])  # type: ignore[misc]
            logits = self.draft.logits(h, fused=True)
            return h, *self.passes.draw(logits, *rnd.sampling(0, n), *rnd.flags(n))
        tails = []
        for s in rnd.seqs:
            pending = self._pending(s)
            tails.append(pending.rows())
            pending.drop(tails[-1].shape[0])
        block = _newest_block(rnd, tails, self.cache)
        h, tok, q = self._compiled_start(  # type: ignore[misc]
            *block, *rnd.sampling(0, n), rnd.flags(n)[0], key=rnd.key
        )
        for s, h_last in zip(rnd.seqs, h.unbind(0), strict=True):
            st = self._state[s.seq_id]
            st.h_last, st.main_len = h_last, s.kv_len
        return h, tok, q

    def _chains(
        self,
        rnd: _Round,
        h: torch.Tensor,
        tok: torch.Tensor,
        q: torch.Tensor | None = None,
        drawn: bool = False,
    ) -> list[tuple[Draft, torch.Tensor | None]]:
        """The round's chain positions.  Each pass feeds every live row's newest token ``tok``
        and the pre-norm output ``h`` that drew it through the draft layer, at the row's next
        cache row, and draws the next token from the logits (:meth:`_pass`).  ``drawn``: ``tok``
        is token 0, drawn with ``q`` by the round's start (:meth:`propose`); else it is the
        chain end's token and the first pass draws token 0 (:meth:`propose_ahead`)."""
        toks, qs, hs = ([tok], [q], [h]) if drawn else ([], [], [])
        for i in range(max(rnd.steps) - len(toks)):
            p = len(toks)  # the token this pass draws
            n = rnd.live(p)
            h, tok, q = self._pass(rnd, i, n, _head(h, n), _head(tok, n), p)
            toks.append(tok)
            qs.append(q)
            hs.append(h)
        return rnd.chains(toks, qs, hs)  # type: ignore[arg-type]

    def _pass(
        self, rnd: _Round, i: int, n: int, h: torch.Tensor, tok: torch.Tensor, p: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Chain pass i of the round's first n rows, drawing token p: eager through the draft's
        fused copies, or compiled in the round's graph class — the same computation."""
        args = (h, tok, self._ones[n], rnd.cache(self.cache, i, n), *rnd.sampling(p, n))
        sampled, any_greedy = rnd.flags(n)
        if not rnd.compiled:
            return self.passes.chain(*args, sampled, any_greedy, fused=True)
        return self._compiled(*args, sampled, key=rnd.key)  # type: ignore[misc]

    def _drafted(self, batch: list[SeqState], drafts: list[Draft], scale: float) -> list[Draft]:
        """Note each sampled draft's length and scale: :meth:`observe` values the scale by the
        tokens its verification accepts."""
        noted = False
        for s, d in zip(batch, drafts, strict=True):
            if d.tokens and s.params.temperature > 0:
                st = self._awaiting[s.seq_id] = self._state[s.seq_id]
                st.drafted, st.scale, noted = len(d.tokens), scale, True
        if noted and self.temperature_scale.fixed is None:
            self.temperature_scale.drafted(scale)
        return drafts


def _newest_block(
    rnd: _Round, tails: list[torch.Tensor], kv: KVCache
) -> tuple[torch.Tensor, torch.Tensor, PackedLayout, CacheBatch, torch.Tensor]:
    """The compiled start's inputs: each row's newest positions (``tails``, at most max_k + 1
    after the eager catch-up) padded to a uniform [B, M ≥ 2] block like the target's decode
    steps (padded rows write cache rows past the committed length, which the chain overwrites
    before anything reads them), and the index of each row's last real position."""
    lens = [t.shape[0] for t in tails]
    width = max(2, *lens)  # M ≥ 2: no M = 1 graph class
    first = [s.kv_len - n for s, n in zip(rnd.seqs, lens, strict=True)]
    ids = []
    for s, a, n in zip(rnd.seqs, first, lens, strict=True):
        ids += s.tokens[a + 1 : a + n + 1] + [0] * (width - n)
    feats = torch.cat([x for t in tails for x in (t, t.new_zeros(width - t.shape[0], t.shape[1]))])
    size = len(tails)
    t_ids, t_cu, t_pos, t_seq, t_first, t_last = _int_tensors(
        ids,
        [b * width for b in range(size + 1)],
        [j for _ in range(size) for j in range(width)],
        [b for b in range(size) for _ in range(width)],
        first,
        [b * width + n - 1 for b, n in enumerate(lens)],
        device=rnd.device,
    )
    cache = CacheBatch(
        kv, rnd.slots, t_first, max(first) + width, slots_are_prefix=rnd.slots_are_prefix
    )
    return feats, t_ids, PackedLayout(t_cu, t_pos, width, t_seq), cache, t_last


def _head(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of ``t`` (``t`` itself when that is all of them)."""
    return t if t.shape[0] == n else t[:n]


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32 at least (float64 stays: the tests' exact references)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def _int_tensors(*parts: list[int], device: torch.device) -> list[torch.Tensor]:
    """Host int lists → int64 tensors on ``device``: one transfer, the results are views."""
    flat = torch.tensor([x for p in parts for x in p], dtype=torch.int64, device=device)
    return list(flat.split([len(p) for p in parts]))


@register_proposer("eagle3")
def _build(
    ctx: ProposerContext,
    *,
    draft: Eagle3Draft | None = None,
    path: str | None = None,
    max_k: int = 16,
    temperature_scale: float | str = "auto",
) -> Eagle3Proposer:
    """An EAGLE-3 proposer from a draft module or a specrl draft directory;
    ``temperature_scale``: "auto" (learned) or a fixed s > 0 (module docstring)."""
    if (draft is None) == (path is None):
        raise CheckpointError(
            "the eagle3 proposer needs exactly one of a draft or a draft path",
            hint="specrl rollout --draft DIR",
        )
    if draft is None:
        draft, _ = load_draft(path, ctx.target, dtype=ctx.target.dtype, share_embedding=True)
    return Eagle3Proposer(draft, ctx, max_k=max_k, temperature_scale=temperature_scale)
