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
q = softmax(draft logits / temperature) with the sequence's generator and report q (over the
target vocabulary, zero outside the draft vocabulary) so the verifier's ratio test stays exact.

The draft shares the target's embedding by reference, so in-place policy updates reach it; new
draft weights arrive through ``load_weights`` (engine ``update_weights(draft=…)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from specrl.core.attention import PackedLayout
from specrl.errors import CheckpointError
from specrl.models.decoder import CacheBatch
from specrl.models.draft import Eagle3Draft
from specrl.models.draft_io import check_compatible, load_draft
from specrl.rollout.compiled import Compiled
from specrl.rollout.proposers import Draft, ProposerContext, SeqState, register_proposer


@dataclass
class _State:
    h_last: torch.Tensor | None = None  # [H] pre-norm output at the last committed position
    main_len: int = 0  # draft cache rows holding step-0 entries
    # tap rows not yet in the cache: (step's concatenated taps [T, 3·H_target], first, end row)
    pending: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)


class Eagle3Proposer:
    name = "eagle3"

    def __init__(self, draft: Eagle3Draft, ctx: ProposerContext, max_k: int = 16) -> None:
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
        self._one_layouts: dict[int, PackedLayout] = {}
        self._compiled = None
        if ctx.compile:  # the chain step under torch.compile (specrl.rollout.compiled)
            self._compiled = Compiled(self._chain_step, self.device, "the eagle3 chain step")

    @property
    def compiled_graphs(self) -> int:
        return 0 if self._compiled is None else self._compiled.graphs

    # ------------------------------------------------------------------ lifecycle
    def reset(self, seq: SeqState) -> None:
        self._state[seq.seq_id] = _State()

    def release(self, seq: SeqState) -> None:
        self._state.pop(seq.seq_id, None)

    def move(self, moves: list[tuple[SeqState, int]]) -> None:
        """The engine moves sequences to other slots: copy their draft-cache main entries."""
        states = [self._state[s.seq_id] for s, _ in moves if s.seq_id in self._state]
        rows = max((st.main_len for st in states), default=0)
        self.cache.copy_slots([s.slot for s, _ in moves], [slot for _, slot in moves], rows)

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        own = {k: v for k, v in self.draft.state_dict().items() if not k.startswith("embed")}
        given = {k: v for k, v in state.items() if not k.startswith("embed")}
        if set(own) != set(given):
            missing = sorted(set(own) - set(given))
            raise CheckpointError(
                f"draft weights do not match the eagle3 proposer's draft (missing {missing[:3]})"
            )
        with torch.no_grad():
            for k, v in own.items():
                if tuple(given[k].shape) != tuple(v.shape):
                    raise CheckpointError(
                        f"draft weight '{k}' has shape "
                        f"{tuple(given[k].shape)}, expected {tuple(v.shape)}"
                    )
                v.copy_(given[k])
        self._to_target = self.draft.draft_to_target

    # ------------------------------------------------------------------ main entries
    @torch.no_grad()
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
        feats = Eagle3Draft.concat_taps(taps, self.tap_layers)  # [Σ committed, 3·H_target]
        start = 0
        for seq, c in zip(batch, committed, strict=True):
            if c > 0 and seq.finish_reason is None:
                st = self._state.get(seq.seq_id)
                if st is None:
                    st = self._state[seq.seq_id] = _State()
                st.pending.append((feats, start, start + c))  # sliced when caught up
            start += c

    def _catch_up(self, seqs: list[SeqState]) -> None:
        """Step-0 passes over every queued position of ``seqs`` in one packed forward."""
        todo = [s for s in seqs if self._state[s.seq_id].pending]
        if not todo:
            return
        feats, ids, lens, prefix = [], [], [], []
        for s in todo:
            chunks = [f[a:b] for f, a, b in self._state[s.seq_id].pending]
            rows = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
            n = rows.shape[0]
            first = s.kv_len - n  # positions first … kv_len − 1, next tokens known
            feats.append(rows)
            ids.extend(s.tokens[first + 1 : s.kv_len + 1])  # x_{t+1} for each position t
            lens.append(n)
            prefix.append(first)
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
        layout = PackedLayout(t_cu, t_pos, max(lens), t_seq)
        cache = CacheBatch(self.cache, t_slots, t_prefix, max(s.kv_len for s in todo))
        h = self.draft.decode(self.draft.project(torch.cat(feats)), t_ids, layout, cache)
        for s, h_last in zip(todo, h.index_select(0, t_last), strict=True):
            st = self._state[s.seq_id]
            st.h_last, st.main_len, st.pending = h_last, s.kv_len, []

    # ------------------------------------------------------------------ chain drafting
    def _pick(
        self,
        logits: torch.Tensor,  # [B, Vd] draft-vocabulary logits
        seqs: list[SeqState],
        sampled: list[int],  # rows of sampled (temperature > 0) sequences
        temps: torch.Tensor | None,  # [len(sampled)] their temperatures
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token per row of draft-vocab logits [B, Vd], all rows at once.

        Greedy rows take the argmax (one-hot q); sampled rows draw by inverse CDF from
        q = softmax(logits / temperature) with one uniform from the sequence's own generator.
        Returns target ids [B] and q [B, V] over the target vocabulary (None when all greedy).
        """
        if not sampled:
            return self._to_target[logits.argmax(-1)], None
        every = len(sampled) == len(seqs)  # all rows sampled: no row selection needed
        rows = None if every else torch.tensor(sampled, device=logits.device)
        x = logits if rows is None else logits[rows]
        q_d = torch.softmax(x.float() / temps[:, None], dim=-1)  # [S, Vd]
        u = torch.cat([torch.rand(1, generator=seqs[i].generator) for i in sampled])
        cdf = q_d.cumsum(-1)
        pick = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None])[:, 0]
        pick = pick.clamp(max=q_d.shape[-1] - 1)
        q = logits.new_zeros(len(seqs), self.vocab, dtype=torch.float32)
        if rows is None:
            ids = pick
            q[:, self._to_target] = q_d
        else:
            ids = logits.argmax(-1)  # [B]
            ids[rows] = pick
            q[rows[:, None], self._to_target[None, :]] = q_d
        return self._to_target[ids], q

    @torch.no_grad()
    def propose(self, batch: list[SeqState], ks: list[int]) -> list[Draft]:
        out = [Draft([]) for _ in batch]
        live = [
            b
            for b, (s, k) in enumerate(zip(batch, ks, strict=True))
            if k > 0 and s.seq_id in self._state
        ]
        self._catch_up([batch[b] for b in live])
        live = [b for b in live if self._state[batch[b].seq_id].h_last is not None]
        if not live:
            return out
        # longest chains first: the rows still drafting at chain step j are a prefix, so every
        # step slices (views) instead of selecting rows
        live.sort(key=lambda b: -min(ks[b], self.max_k))
        seqs = [batch[b] for b in live]
        steps = [min(ks[b], self.max_k) for b in live]
        sampled = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
        temps = (
            torch.tensor([seqs[i].params.temperature for i in sampled], device=self.device)
            if sampled
            else None
        )
        slots, prefix = _int_tensors(
            [s.slot for s in seqs], [s.kv_len for s in seqs], device=self.device
        )
        h = torch.stack([self._state[s.seq_id].h_last for s in seqs])  # [B, H]
        toks: list[torch.Tensor] = []  # per chain step j: [n_j] target ids of the first n_j rows
        qs: list[torch.Tensor | None] = []
        n = len(seqs)
        logits = self.draft.logits(h)
        for step in range(steps[0]):
            tok, q = self._pick(logits, seqs[:n], sampled, temps)
            toks.append(tok)
            qs.append(q)
            n = sum(1 for k in steps if k > step + 1)
            if n == 0:
                break
            if n < len(toks[-1]):  # some chains ended: keep the first n rows
                h, tok = h[:n], tok[:n]
                sampled = [i for i in sampled if i < n]
                temps = None if temps is None else temps[: len(sampled)]
            kv = [s.kv_len for s in seqs[:n]]
            cache = CacheBatch(
                self.cache,
                slots[:n],
                prefix[:n] + step,
                max(kv) + step + 1,
                slots_are_prefix=all(s.slot == i for i, s in enumerate(seqs[:n])),
                # one token each at one position: no mask (compiled: for one sequence only, so
                # the flag follows the shape and aligned prefixes compile no extra graph)
                full_rows=n == 1 if self._compiled else all(x == kv[0] for x in kv),
            )
            if self._compiled is not None:
                key = (n == 1, cache.slots_are_prefix, cache.full_rows)  # the graph class
                h, logits = self._compiled(h, tok, self._ones(n), cache, key=key)
            else:
                h, logits = self._chain_step(h, tok, self._ones(n), cache, fused=True)
        host = [t.tolist() for t in toks]  # one transfer per chain step, after the loop
        for r, b in enumerate(live):
            out[b].tokens = [host[j][r] for j in range(min(steps[r], len(host)))]
            rows = [q[r : r + 1] for q in qs[: len(out[b].tokens)] if q is not None]
            if rows and batch[b].params.temperature > 0:
                out[b].probs = rows[0] if len(rows) == 1 else torch.cat(rows)
        return out

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
        return h, self.draft.logits(h)

    def _ones(self, n: int) -> PackedLayout:
        """The layout of n sequences of one token each (kept: chain steps reuse it)."""
        layout = self._one_layouts.get(n)
        if layout is None:
            layout = self._one_layouts[n] = PackedLayout.from_lengths([1] * n, device=self.device)
        return layout


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
) -> Eagle3Proposer:
    """An EAGLE-3 proposer from a draft module or a specrl draft directory."""
    if (draft is None) == (path is None):
        raise CheckpointError(
            "the eagle3 proposer needs exactly one of a draft or a draft path",
            hint="specrl rollout --draft DIR",
        )
    if draft is None:
        draft, _ = load_draft(path, ctx.target, dtype=ctx.target.dtype, share_embedding=True)
    return Eagle3Proposer(draft, ctx, max_k=max_k)
