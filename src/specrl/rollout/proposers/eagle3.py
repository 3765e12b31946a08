"""``eagle3``: chain drafts from an EAGLE-3 draft head fed with the target's own taps.

State per sequence lives in the draft's slot KV cache (same slot as the target's):

- **main entries**: after every target forward the engine hands over the taps of the committed
  positions; position t gets the draft's step-0 pass (feature ``fc(f_t)``, token x_{t+1}, RoPE
  position t) written at cache row t.  The pre-norm output at the last committed position
  predicts the next token — the first draft token.
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
from dataclasses import dataclass

import torch

from specrl.core.attention import PackedLayout
from specrl.errors import CheckpointError
from specrl.models.decoder import CacheBatch
from specrl.models.draft import Eagle3Draft
from specrl.models.draft_io import check_compatible, load_draft
from specrl.rollout.proposers import Draft, ProposerContext, SeqState, register_proposer


@dataclass
class _State:
    h_last: torch.Tensor | None = None  # [H] pre-norm output at the last committed position
    main_len: int = 0  # draft cache rows holding step-0 entries


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

    # ------------------------------------------------------------------ lifecycle
    def reset(self, seq: SeqState) -> None:
        self._state[seq.seq_id] = _State()

    def release(self, seq: SeqState) -> None:
        self._state.pop(seq.seq_id, None)

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
        if taps is None:
            raise RuntimeError("eagle3 proposer needs taps; the engine did not provide them")
        feats = Eagle3Draft.concat_taps(taps, self.tap_layers)  # [Σ committed, 3·H_target]
        rows, lens, seqs, ids = [], [], [], []
        start = 0
        for seq, c in zip(batch, committed, strict=True):
            if c > 0 and seq.finish_reason is None:
                first = seq.kv_len - c
                rows.append(torch.arange(start, start + c))
                ids.extend(seq.tokens[first + 1 : seq.kv_len + 1])  # x_{t+1} for each t
                lens.append(c)
                seqs.append(seq)
            start += c
        if not seqs:
            return
        index = torch.cat(rows).to(self.device)
        feat = self.draft.project(feats.index_select(0, index))
        layout = PackedLayout.from_lengths(lens, device=self.device)
        prefix = [s.kv_len - c for s, c in zip(seqs, lens, strict=True)]
        cache = CacheBatch(
            self.cache,
            torch.tensor([s.slot for s in seqs], device=self.device),
            torch.tensor(prefix, device=self.device),
            max(s.kv_len for s in seqs),
        )
        h = self.draft.decode(feat, torch.tensor(ids, device=self.device), layout, cache)
        last = layout.cu_seqlens[1:] - 1
        for j, seq in enumerate(seqs):
            st = self._state.setdefault(seq.seq_id, _State())
            st.h_last = h[last[j]]
            st.main_len = seq.kv_len

    # ------------------------------------------------------------------ chain drafting
    def _pick(self, logits: torch.Tensor, seq: SeqState) -> tuple[int, torch.Tensor | None]:
        """One draft token from draft-vocab logits [Vd]; q over the target vocab if sampled."""
        t = seq.params.temperature
        if t <= 0:
            return int(self._to_target[int(logits.argmax())]), None
        q_d = torch.softmax(logits.float() / t, dim=-1)
        i = int(torch.multinomial(q_d, 1, generator=seq.generator))
        q = q_d.new_zeros(self.vocab)
        q[self._to_target] = q_d
        return int(self._to_target[i]), q

    @torch.no_grad()
    def propose(self, batch: list[SeqState], ks: list[int]) -> list[Draft]:
        out = [Draft([]) for _ in batch]
        live = [
            b
            for b, (s, k) in enumerate(zip(batch, ks, strict=True))
            if k > 0
            and self._state.get(s.seq_id) is not None
            and self._state[s.seq_id].h_last is not None
        ]
        if not live:
            return out
        tokens: dict[int, list[int]] = {b: [] for b in live}
        probs: dict[int, list[torch.Tensor]] = {b: [] for b in live}
        h = torch.stack([self._state[batch[b].seq_id].h_last for b in live])  # [B, H]
        step = 0
        while live:
            logits = self.draft.logits(h)  # [B, Vd]
            for j, b in enumerate(live):
                tok, q = self._pick(logits[j], batch[b])
                tokens[b].append(tok)
                if q is not None:
                    probs[b].append(q)
            step += 1
            keep = [j for j, b in enumerate(live) if min(ks[b], self.max_k) > step]
            if not keep:
                break
            live = [live[j] for j in keep]
            h = h[keep]
            seqs = [batch[b] for b in live]
            prefix = torch.tensor([s.kv_len - 1 + step for s in seqs], device=self.device)
            one = PackedLayout.from_lengths([1] * len(live), device=self.device)
            ids = torch.tensor([tokens[b][-1] for b in live], device=self.device)
            cache = CacheBatch(
                self.cache,
                torch.tensor([s.slot for s in seqs], device=self.device),
                prefix,
                max(s.kv_len for s in seqs) + step,
            )
            h = self.draft.decode(h, ids, one, cache)
        for b in tokens:
            out[b] = Draft(tokens[b], torch.stack(probs[b]) if probs[b] else None)
        return out


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
