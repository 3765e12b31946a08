"""Zigzag sharding of packed batches for context parallelism (docs/parallelism.md).

With ``cp`` ranks, every packed sequence b of length L_b is padded at its end to
P_b = 2·cp·c_b tokens (c_b = ⌈L_b / 2cp⌉) and cut into 2·cp chunks of c_b tokens; rank r holds
chunk r followed by chunk 2cp−1−r::

    sequence:  | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |        cp = 4
    rank 0:    | 0 | 7 |      rank 1: | 1 | 6 |      rank 2: | 2 | 5 |      rank 3: | 3 | 4 |

so each rank holds one early and one late chunk and does the same causal work.  Pads are tokens of
their sequence (at its end, so causal attention of real tokens never sees them); callers give them
loss mask 0.  The local packed layout has the same B sequences with lengths 2·c_b, i.e. local
``cu_seqlens`` = padded global ``cu_seqlens`` / cp, and carries the **global** position ids
(RoPE), pads continuing their sequence's positions.

Everything per token is sharded with the same index (:meth:`ZigzagPlan.shard`): hidden states,
ids, positions, loss masks and the TTT-shifted ids/masks — which must be shifted *before* sharding
(:func:`shift_within_sequences`), because a shift crosses chunk (and so rank) borders.

All index tensors are built on the layout's device; the only host values are the padded total
(one ``int``) and the padded maximum length, derived from ``layout.max_seqlen``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specrl.core.attention.layout import PackedLayout


def _bcast(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[T] mask → [T, 1, ...] matching ``x``'s rank."""
    return mask.view(-1, *([1] * (x.dim() - 1)))


@dataclass
class ZigzagPlan:
    """Where every token of a packed batch lives under zigzag context parallelism, for one rank."""

    cp: int
    rank: int
    lengths: torch.Tensor  # [B] int64 global (unpadded) lengths
    padded_lengths: torch.Tensor  # [B] int64, multiples of 2·cp
    chunk: torch.Tensor  # [B] int64 chunk length c_b = padded / (2·cp)
    num_padded: int  # host: Σ padded lengths (local tokens = num_padded / cp)
    source: torch.Tensor  # [T_local] int64 global row of each local token (pads: last real row)
    valid: torch.Tensor  # [T_local] bool, False on pads
    gather_index: torch.Tensor  # [T] row of each global token in the rank-major shard concat
    local: PackedLayout  # local layout: cu_seqlens = padded cu / cp, global position ids

    @classmethod
    def build(cls, layout: PackedLayout, cp: int, rank: int) -> ZigzagPlan:
        """The plan of ``rank`` for the packed ``layout`` (global, unpadded) over ``cp`` ranks."""
        if cp < 1 or not 0 <= rank < cp:
            raise ValueError(f"need 0 ≤ rank < cp, got rank={rank}, cp={cp}")
        dev = layout.cu_seqlens.device
        lengths = layout.lengths
        chunk = (lengths + 2 * cp - 1) // (2 * cp)  # [B]
        padded = 2 * cp * chunk
        cu_padded = torch.zeros_like(layout.cu_seqlens)
        cu_padded[1:] = torch.cumsum(padded, 0)
        num_padded = int(cu_padded[-1])  # the one host sync
        n_local = num_padded // cp
        cu_local = cu_padded // cp

        # Local token → (sequence, offset o in the local sequence of 2·c tokens) → global offset.
        t = torch.arange(n_local, device=dev)
        seq = torch.searchsorted(cu_local[1:], t, right=True)
        o = t - cu_local[seq]
        c = chunk[seq]
        back = o >= c  # second chunk (2cp−1−r)
        pos = torch.where(back, (2 * cp - 1 - rank) * c + o - c, rank * c + o)
        valid = pos < lengths[seq]
        last_real = (lengths[seq] - 1).clamp(min=0)
        source = layout.cu_seqlens[seq] + torch.minimum(pos, last_real)
        position_ids = layout.position_ids[source] + (pos - torch.minimum(pos, last_real))
        padded_max = -(-layout.max_seqlen // (2 * cp)) * 2 * cp
        local = PackedLayout(cu_local, position_ids, padded_max // cp, seq)

        # Global token → chunk j and offset w → its owner rank and row there.
        g_seq, g_off = layout.seq_ids, layout.token_offsets
        gc = chunk[g_seq]
        j, w = g_off // gc, g_off % gc
        front = j < cp
        owner = torch.where(front, j, 2 * cp - 1 - j)
        row = cu_local[g_seq] + torch.where(front, w, gc + w)
        gather_index = owner * n_local + row
        return cls(cp, rank, lengths, padded, chunk, num_padded, source, valid, gather_index, local)

    @property
    def num_local(self) -> int:
        """Tokens held by each rank (the same on every rank)."""
        return self.num_padded // self.cp

    def shard(self, x: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """Rows of a global per-token tensor ([T, ...]) held by this rank; pads get ``fill``."""
        y = x.index_select(0, self.source)
        return y.masked_fill(~_bcast(self.valid, y), fill)

    def unshard(self, shards: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Global per-token tensor from every rank's shard (a list in rank order, or their
        rank-major concatenation [cp·T_local, ...]); pads are dropped."""
        full = shards if isinstance(shards, torch.Tensor) else torch.cat(list(shards))
        return full.index_select(0, self.gather_index)


def shift_within_sequences(
    x: torch.Tensor,  # [T, ...] per-token values of a packed batch
    layout: PackedLayout,
    k: int,
    fill: float | bool = 0,
) -> torch.Tensor:
    """``y[t] = x[t + k]`` when t + k lies in the same sequence, else ``fill``.

    The TTT shift of step k (docs/draft.md): ids, teacher rows and loss masks of index t come from
    index t + k of the *same* sequence; the last k tokens of every sequence get ``fill`` (loss mask
    0).  Apply it to global tensors before :meth:`ZigzagPlan.shard`.
    """
    if k < 0:
        raise ValueError(f"shift must be ≥ 0, got {k}")
    n = x.shape[0]
    if k == 0 or n == 0:
        return x
    t = torch.arange(n, device=x.device)
    ok = layout.token_offsets + k < layout.lengths[layout.seq_ids]
    y = x.index_select(0, (t + k).clamp(max=n - 1))
    return y.masked_fill(~_bcast(ok, y), fill)


def shifted_steps(
    x: torch.Tensor,  # [T, ...]
    layout: PackedLayout,
    steps: int,
    fill: float | bool = 0,
) -> torch.Tensor:  # [steps, T, ...]
    """``shift_within_sequences`` for k = 0..steps−1, stacked (ids or loss masks of every step)."""
    return torch.stack([shift_within_sequences(x, layout, k, fill) for k in range(steps)])
