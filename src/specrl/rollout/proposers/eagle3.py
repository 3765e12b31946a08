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

With ``ProposerContext.compile`` a round runs as compiled passes (:meth:`_propose_compiled`):
one for the newest main entries and d_1, one per further chain position, each picking its
tokens on device — the drafts, q and generator draws of the eager round.

The draft shares the target's embedding by reference, so in-place policy updates reach it; new
draft weights arrive through ``load_weights`` (engine ``update_weights(draft=…)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from specrl.core.attention import PackedLayout
from specrl.errors import CheckpointError, ConfigError
from specrl.models.decoder import CacheBatch
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
    """One target forward's committed taps, concatenated ([T, 3·H_target]) only when a
    catch-up first reads them: while the gate keeps drafting off, most never are."""

    __slots__ = ("_feats", "_layers", "_taps")

    def __init__(self, taps: dict[int, torch.Tensor], layers: tuple[int, ...]) -> None:
        self._taps, self._layers = taps, layers
        self._feats: torch.Tensor | None = None

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if self._feats is None:
            self._feats = Eagle3Draft.concat_taps(self._taps, self._layers)
            self._taps = {}
        return self._feats[rows]


@dataclass
class _State:
    h_last: torch.Tensor | None = None  # [H] pre-norm output at the last committed position
    main_len: int = 0  # draft cache rows holding step-0 entries
    # tap rows not yet in the cache: (a step's taps, first row, end row)
    pending: list[tuple[_StepTaps | torch.Tensor, int, int]] = field(default_factory=list)
    # its sampled draft awaiting verification: tokens drafted, the temperature scale used
    drafted: int = 0
    scale: float = 1.0
    # the end of its last chain, for drafting ahead: (pre-norm output that drew the last token,
    # that token, the chain's length, the sequence's kv_len when it was drawn)
    chain_end: tuple[torch.Tensor, int, int, int] | None = None


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
        self._to_target = draft.draft_to_target
        self._state: dict[int, _State] = {}
        self.temperature_scale = TemperatureScale(temperature_scale, seed=ctx.seed)
        self._one_layouts: dict[int, PackedLayout] = {}
        self._compiled = self._compiled_start = None
        if ctx.compile:  # the round's passes under torch.compile (specrl.rollout.compiled)
            every = ctx.guard_check_every
            self._compiled = Compiled(
                self._chain_draw, self.device, "the eagle3 chain step", check_every=every
            )
            self._compiled_start = Compiled(
                self._start_draw, self.device, "the eagle3 catch-up step", check_every=every
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
        self._state[seq.seq_id] = _State()

    def release(self, seq: SeqState) -> None:
        self._state.pop(seq.seq_id, None)

    def move(self, moves: list[tuple[SeqState, int]]) -> None:
        """The engine moves sequences to other slots: copy their draft-cache main entries."""
        states = [self._state[s.seq_id] for s, _ in moves if s.seq_id in self._state]
        # main entries, and a chain that drafting ahead continues (rows kv_len … + k − 2)
        rows = max(
            (
                max(st.main_len, st.chain_end[3] + st.chain_end[2] - 1 if st.chain_end else 0)
                for st in states
            ),
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
        self._to_target = self.draft.draft_to_target

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
        feats = _StepTaps(taps, self.tap_layers)  # [Σ committed, 3·H_target] when first read
        start, state, scale = 0, self._state, self.temperature_scale
        for seq, c, n_acc in zip(batch, committed, accepted, strict=True):
            st = state.get(seq.seq_id)
            if st is not None and st.drafted:  # its sampled draft was just verified
                scale.record(st.scale, n_acc, st.drafted)
                st.drafted = 0
            if c > 0 and seq.finish_reason is None:
                if st is None:
                    st = state[seq.seq_id] = _State()
                st.pending.append((feats, start, start + c))  # sliced when caught up
            start += c

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
            st = self._state[s.seq_id]
            if not st.pending:
                continue
            chunks = [f[a:b] for f, a, b in st.pending]
            rows = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
            first = s.kv_len - rows.shape[0]  # positions first … kv_len − 1, next tokens known
            n = rows.shape[0] - keep  # the positions done here
            if n <= 0:
                continue
            st.pending = [(rows, n, rows.shape[0])] if keep else []
            todo.append(s)
            feats.append(rows[:n])
            ids.extend(s.tokens[first + 1 : first + n + 1])  # x_{t+1} for each position t
            lens.append(n)
            prefix.append(first)
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
        out = [Draft([]) for _ in batch]
        live = [
            b
            for b, (s, k) in enumerate(zip(batch, ks, strict=True))
            if k > 0 and s.seq_id in self._state
        ]
        # one temperature scale for the round's sampled drafts (none drawn for greedy rounds)
        sampled = any(batch[b].params.temperature > 0 for b in live)
        scale = self.temperature_scale.pick() if sampled else 1.0
        # compiled passes when every sequence has new taps queued (always after its first
        # verification); otherwise (a sequence the drafter never saw) the eager round below
        pending = all(self._state.get(s.seq_id, _State()).pending for s in batch)
        if self._compiled is not None and live and pending:
            return self._drafted(batch, self._propose_compiled(batch, ks, scale), scale)
        self._catch_up([batch[b] for b in live])
        live = [b for b in live if self._state[batch[b].seq_id].h_last is not None]
        if not live:
            return out
        # longest chains first: the rows still drafting at chain step j are a prefix, so every
        # step slices (views) instead of selecting rows
        live.sort(key=lambda b: -min(ks[b], self.max_k))
        seqs = [batch[b] for b in live]
        steps = [min(ks[b], self.max_k) for b in live]
        greedy = [s.params.temperature <= 0 for s in seqs]
        temps = self._temperatures(seqs, greedy, scale)
        slots, prefix, t_greedy = _int_tensors(
            [s.slot for s in seqs], [s.kv_len for s in seqs], greedy, device=self.device
        )
        t_greedy = t_greedy.bool()
        h = torch.stack([self._state[s.seq_id].h_last for s in seqs])  # [B, H]
        toks: list[torch.Tensor] = []  # per chain step j: [n_j] target ids of the first n_j rows
        qs: list[torch.Tensor | None] = []
        ends: list[torch.Tensor | None] = [None] * len(seqs)  # h that drew each chain's last
        n = len(seqs)
        logits = self.draft.logits(h, fused=True)
        for step in range(steps[0]):
            u = self._uniforms(seqs[:n], greedy[:n], steps[:n], step)
            live_greedy = greedy[:n]
            tok, q = self._draw(
                logits, temps[:n], u, t_greedy[:n], not all(live_greedy), any(live_greedy)
            )
            toks.append(tok)
            qs.append(q)
            for r in range(n):
                if steps[r] == step + 1:
                    ends[r] = h[r]
            n = sum(1 for k in steps if k > step + 1)
            if n == 0:
                break
            if n < len(toks[-1]):  # some chains ended: keep the first n rows
                h, tok = h[:n], tok[:n]
            kv = [s.kv_len for s in seqs[:n]]
            cache = CacheBatch(
                self.cache,
                slots[:n],
                prefix[:n] + step,
                max(kv) + step + 1,
                slots_are_prefix=all(s.slot == i for i, s in enumerate(seqs[:n])),
                full_rows=all(x == kv[0] for x in kv),  # one token each at one position
            )
            h, logits = self._chain_step(h, tok, self._ones(n), cache, fused=True)
        host = [t.tolist() for t in toks]  # one transfer per chain step, after the loop
        for r, b in enumerate(live):
            out[b].tokens = [host[j][r] for j in range(min(steps[r], len(host)))]
            rows = [q[r : r + 1] for q in qs[: len(out[b].tokens)] if q is not None]
            if rows and batch[b].params.temperature > 0:
                out[b].probs = rows[0] if len(rows) == 1 else torch.cat(rows)
            end = ends[r]
            self._state[seqs[r].seq_id].chain_end = (
                None
                if end is None or not out[b].tokens
                else (end, out[b].tokens[-1], len(out[b].tokens), seqs[r].kv_len)
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
        out = [Draft([]) for _ in batch]
        live = []
        for b, (s, d, k) in enumerate(zip(batch, drafts, ks, strict=True)):
            st = self._state.get(s.seq_id)
            end = st.chain_end if st is not None else None
            if (
                k > 0
                and end is not None
                and d.tokens
                and (end[1], end[2], end[3]) == (d.tokens[-1], len(d.tokens), s.kv_len)
            ):
                live.append(b)
        if not live:
            return out
        live.sort(key=lambda b: -min(ks[b], self.max_k + 1))
        seqs = [batch[b] for b in live]
        steps = [min(ks[b], self.max_k + 1) for b in live]
        ends = [self._state[s.seq_id].chain_end for s in seqs]
        # the row each chain's last token goes to: kv_len + len(chain) − 1
        base = [e[3] + e[2] - 1 for e in ends]  # type: ignore[index]
        greedy = [s.params.temperature <= 0 for s in seqs]
        scales = {self._state[s.seq_id].scale for s in seqs}
        temps = self._temperatures(seqs, greedy, scales.pop() if len(scales) == 1 else 1.0)
        slots, t_base, t_tok, t_greedy = _int_tensors(
            [s.slot for s in seqs], base, [e[1] for e in ends], greedy,  # type: ignore[index]
            device=self.device,
        )  # fmt: skip
        t_greedy = t_greedy.bool()
        h = torch.stack([e[0] for e in ends])  # type: ignore[index]
        tok = t_tok  # chain steps take target ids (the draft embeds with the target's table)
        toks: list[torch.Tensor] = []
        qs: list[torch.Tensor | None] = []
        chain_ends: list[torch.Tensor | None] = [None] * len(seqs)
        n = len(seqs)
        for step in range(steps[0]):
            n = sum(1 for k in steps if k > step)
            h, tok = h[:n], tok[:n]
            rows = base[:n]
            cache = CacheBatch(
                self.cache,
                slots[:n],
                t_base[:n] + step,
                max(rows) + step + 1,
                slots_are_prefix=all(s.slot == i for i, s in enumerate(seqs[:n])),
                full_rows=all(x == rows[0] for x in rows),
            )
            h, logits = self._chain_step(h, tok, self._ones(n), cache, fused=True)
            u = self._uniforms(seqs[:n], greedy[:n], steps[:n], step)
            tok, q = self._draw(
                logits, temps[:n], u, t_greedy[:n], not all(greedy[:n]), any(greedy[:n])
            )
            toks.append(tok)
            qs.append(q)
            for r in range(n):
                if steps[r] == step + 1:
                    chain_ends[r] = h[r]
        host = [t.tolist() for t in toks]
        for r, b in enumerate(live):
            d = out[b]
            d.tokens = [host[j][r] for j in range(steps[r])]
            rows_q = [q[r : r + 1] for q in qs[: steps[r]] if q is not None]
            if rows_q and not greedy[r]:
                d.probs = rows_q[0] if len(rows_q) == 1 else torch.cat(rows_q)
            # the guess is the bonus token: the next round's chain is d.tokens[1:], at the
            # sequence's kv_len once this round's drafts and the bonus are committed
            e, kept = chain_ends[r], len(d.tokens) - 1
            self._state[seqs[r].seq_id].chain_end = (
                None
                if e is None or kept < 1
                else (e, d.tokens[-1], kept, ends[r][3] + ends[r][2] + 1)  # type: ignore[index]
            )
        return out

    def _drafted(self, batch: list[SeqState], drafts: list[Draft], scale: float) -> list[Draft]:
        """Note each sampled draft's length and scale: :meth:`observe` values the scale by the
        tokens its verification accepts."""
        noted = False
        for s, d in zip(batch, drafts, strict=True):
            if d.tokens and s.params.temperature > 0:
                st = self._state[s.seq_id]
                st.drafted, st.scale, noted = len(d.tokens), scale, True
        if noted and self.temperature_scale.fixed is None:
            self.temperature_scale.drafted(scale)
        return drafts

    def _propose_compiled(
        self, batch: list[SeqState], ks: list[int], scale: float = 1.0
    ) -> list[Draft]:
        """One drafting round in compiled passes (``ProposerContext.compile``).

        Every sequence of the batch takes part, in batch order (the engine's slots 0..B−1),
        for the longest chain asked; shorter chains' extra tokens are dropped (their cache rows
        lie past the committed length, like padding), so the batch, and the graph class, stay
        fixed through the round.  First pass: the step-0 entries of each sequence's newest
        positions (at most max_k + 1; older ones, after a prefill or while the gate was off,
        are caught up eagerly first), padded to a uniform [B, M ≥ 2] block like the target's
        decode steps (padded rows write cache rows past the committed length, which the chain
        overwrites before anything reads them), then the draft logits at the last real position
        and d_1.  Then one pass per chain position.  Tokens are picked on device (uniforms
        drawn on the host from each sequence's generator, one per pass, as the eager path
        draws them).  Graph classes: one sequence or more, slots 0..B−1 or not, greedy only or
        some sampled.
        """
        out = [Draft([]) for _ in batch]
        steps = [min(k, self.max_k) for k in ks]
        self._catch_up(batch, keep=self.max_k + 1)  # older positions (prefill, gate-off spells)
        tails = []
        for s in batch:
            st = self._state[s.seq_id]
            chunks = [f[a:b] for f, a, b in st.pending]
            tails.append(chunks[0] if len(chunks) == 1 else torch.cat(chunks))
            st.pending = []
        lens = [t.shape[0] for t in tails]
        width = max(2, *lens)  # M ≥ 2: no M = 1 graph class
        first = [s.kv_len - n for s, n in zip(batch, lens, strict=True)]
        ids = []
        for s, a, n in zip(batch, first, lens, strict=True):
            ids += s.tokens[a + 1 : a + n + 1] + [0] * (width - n)
        feats = torch.cat(
            [x for t in tails for x in (t, t.new_zeros(width - t.shape[0], t.shape[1]))]
        )
        size = len(batch)
        slots_are_prefix = all(s.slot == i for i, s in enumerate(batch))
        greedy = [s.params.temperature <= 0 for s in batch]
        t_ids, t_cu, t_pos, t_seq, t_slots, t_first, t_last, t_kv, t_greedy = _int_tensors(
            ids,
            [b * width for b in range(size + 1)],
            [j for _ in batch for j in range(width)],
            [b for b in range(size) for _ in range(width)],
            [s.slot for s in batch],
            first,
            [b * width + n - 1 for b, n in enumerate(lens)],
            [s.kv_len for s in batch],
            greedy,
            device=self.device,
        )
        t_greedy = t_greedy.bool()
        temps = self._temperatures(batch, greedy, scale)
        sampled = not all(greedy)
        key = (size == 1, slots_are_prefix, sampled)  # the graph class of every pass
        cache = CacheBatch(
            self.cache, t_slots, t_first, max(first) + width, slots_are_prefix=slots_are_prefix
        )
        h, tok, q = self._compiled_start(  # type: ignore[misc]
            feats, t_ids, PackedLayout(t_cu, t_pos, width, t_seq), cache, t_last, temps,
            self._uniforms(batch, greedy, steps, 0), t_greedy, sampled, key=key,
        )  # fmt: skip
        for s, h_last in zip(batch, h.unbind(0), strict=True):
            st = self._state[s.seq_id]
            st.h_last, st.main_len = h_last, s.kv_len
        toks, qs = [tok], [q]
        kv = max(s.kv_len for s in batch)
        for j in range(1, max(steps)):  # chain position j: d_j in, d_{j+1} out
            cache = CacheBatch(
                self.cache,
                t_slots,
                t_kv + (j - 1),
                kv + j,
                slots_are_prefix=slots_are_prefix,
                full_rows=size == 1,  # the flag follows the shape: aligned prefixes, same graph
            )
            h, tok, q = self._compiled(  # type: ignore[misc]
                h, tok, self._ones(size), cache, temps, self._uniforms(batch, greedy, steps, j),
                t_greedy, sampled, key=key,
            )  # fmt: skip
            toks.append(tok)
            qs.append(q)
        host = torch.stack(toks, 1).tolist()  # [B, K]: one transfer for the round
        for s in batch:  # compiled rounds keep no chain end: they are not drafted ahead
            self._state[s.seq_id].chain_end = None
        probs = None if qs[0] is None else torch.stack(qs, 1)  # [B, K, V]
        for r, d in enumerate(out):
            d.tokens = host[r][: steps[r]]
            if probs is not None and not greedy[r] and d.tokens:
                d.probs = probs[r, : steps[r]]
        return out

    def _temperatures(
        self, seqs: list[SeqState], greedy: list[bool], scale: float = 1.0
    ) -> torch.Tensor:
        """[B] draft temperatures: the request's times the round's scale s (1 for greedy rows,
        whose draws are argmax anyway)."""
        temps = [
            1.0 if g else s.params.temperature * scale for s, g in zip(seqs, greedy, strict=True)
        ]
        return torch.tensor(temps, device=self.device)

    def _uniforms(
        self, seqs: list[SeqState], greedy: list[bool], steps: list[int], j: int
    ) -> torch.Tensor:
        """[B] uniforms of pass j: one from its own generator for each sampled sequence whose
        chain reaches d_{j+1} (as many draws as the eager path makes), 0 elsewhere."""
        return torch.cat(
            [
                torch.rand(1, generator=s.generator) if not g and j < k else torch.zeros(1)
                for s, g, k in zip(seqs, greedy, steps, strict=True)
            ]
        ).to(self.device)

    def _draw(
        self,
        logits: torch.Tensor,  # [B, Vd]
        temps: torch.Tensor,  # [B] temperatures (1 for greedy rows)
        u: torch.Tensor,  # [B] uniforms (ignored for greedy rows)
        greedy: torch.Tensor,  # [B] bool
        sampled: bool,  # host flag: some row samples
        any_greedy: bool = True,  # host flag: some row is greedy (False skips their argmax)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token per row of draft-vocab logits [B, Vd], all rows at once, on device:
        greedy rows take the argmax (one-hot q); sampled rows draw by inverse CDF from
        q = softmax(logits / temperature) with their uniform.  Returns target ids [B] and q
        [B, V] over the target vocabulary (None when every row is greedy; rows of greedy
        sequences hold an unused softmax)."""
        if not sampled:
            return self._to_target[logits.argmax(-1)], None
        q_d = torch.softmax(_wide(logits) / temps[:, None], dim=-1)
        cdf = q_d.cumsum(-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0]
        ids = pick.clamp_(max=q_d.shape[-1] - 1)
        if any_greedy:
            ids = torch.where(greedy, logits.argmax(-1), ids)
        q = q_d.new_zeros(logits.shape[0], self.vocab).index_copy_(1, self._to_target, q_d)
        return self._to_target[ids], q

    def _start_draw(
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
        """Compiled: step-0 entries of the padded newest positions, then d_1 at the last ones."""
        h = self.draft.decode(self.draft.project(feats), ids, layout, cache, fused=False)
        h = h.index_select(0, last)
        tok, q = self._draw(self.draft.logits(h), temps, u, greedy, sampled)
        return h, tok, q

    def _chain_draw(
        self,
        h: torch.Tensor,
        tok: torch.Tensor,
        layout: PackedLayout,
        cache: CacheBatch,
        temps: torch.Tensor,
        u: torch.Tensor,
        greedy: torch.Tensor,
        sampled: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Compiled: chain position j → j + 1 and the draft token d_{j+1}."""
        h, logits = self._chain_step(h, tok, layout, cache)
        tok, q = self._draw(logits, temps, u, greedy, sampled)
        return h, tok, q

    def _chain_step(
        self,
        h: torch.Tensor,
        tok: torch.Tensor,
        layout: PackedLayout,
        cache: CacheBatch,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain position j → j + 1: the draft layer on (h, d_j), then the logits of d_{j+1}."""
        h = self.draft.decode(h, tok, layout, cache, fused=fused)
        return h, self.draft.logits(h, fused=fused)

    def _ones(self, n: int) -> PackedLayout:
        """The layout of n sequences of one token each (kept: chain steps reuse it)."""
        layout = self._one_layouts.get(n)
        if layout is None:
            layout = self._one_layouts[n] = PackedLayout.from_lengths([1] * n, device=self.device)
        return layout


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
