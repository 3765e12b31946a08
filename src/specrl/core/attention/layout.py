"""Packed-sequence layouts: the one description of "which tokens are which sequence".

A packed batch is ``T`` tokens of ``B`` sequences laid end to end.  ``cu_seqlens`` ([B+1], int64)
are the boundaries, ``position_ids`` ([T]) the *global* RoPE position of each token (under
context parallelism a rank holds non-contiguous chunks, so positions are carried explicitly), and
``max_seqlen`` is a host-side int so kernels can size buffers without a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PackedLayout:
    """Boundaries and positions of a packed batch of variable-length sequences."""

    cu_seqlens: torch.Tensor  # [B+1] int64, cu_seqlens[0] == 0, cu_seqlens[-1] == T
    position_ids: torch.Tensor  # [T] int64, global RoPE positions
    max_seqlen: int  # host int: max(cu_seqlens[1:] - cu_seqlens[:-1])
    _seq_ids: torch.Tensor | None = field(default=None, repr=False)
    _offsets: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_lengths(
        cls, lengths: list[int] | tuple[int, ...], device: torch.device | str | None = None
    ) -> PackedLayout:
        """Layout of sequences of the given lengths, positions 0..len−1 each."""
        if any(n < 0 for n in lengths):
            raise ValueError(f"negative sequence length in {lengths}")
        lens = torch.tensor(list(lengths), dtype=torch.int64, device=device)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=device)
        cu[1:] = torch.cumsum(lens, 0)
        total = int(sum(lengths))
        seq = torch.repeat_interleave(
            torch.arange(len(lengths), device=device), lens, output_size=total
        )
        pos = torch.arange(total, device=device) - cu[:-1][seq]
        return cls(cu, pos, max(lengths, default=0), seq)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.position_ids.numel()

    @property
    def lengths(self) -> torch.Tensor:  # [B]
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def seq_ids(self) -> torch.Tensor:
        """[T] index of the sequence each token belongs to (computed on device, no sync)."""
        if self._seq_ids is None:
            t = torch.arange(self.num_tokens, device=self.cu_seqlens.device)
            self._seq_ids = torch.searchsorted(self.cu_seqlens[1:], t, right=True)
        return self._seq_ids

    @property
    def token_offsets(self) -> torch.Tensor:
        """[T] index of each token inside its own sequence (0-based; computed once)."""
        if self._offsets is None:
            t = torch.arange(self.num_tokens, device=self.cu_seqlens.device)
            self._offsets = t - self.cu_seqlens[:-1][self.seq_ids]
        return self._offsets

    def to(self, device: torch.device | str) -> PackedLayout:
        return PackedLayout(
            self.cu_seqlens.to(device),
            self.position_ids.to(device),
            self.max_seqlen,
            None if self._seq_ids is None else self._seq_ids.to(device),
            None if self._offsets is None else self._offsets.to(device),
        )


@dataclass
class CacheView:
    """One layer's view of a slot-based KV cache for cached decoding.

    The packed new tokens of sequence ``b`` (segment b of the layout) are appended to cache slot
    ``slots[b]`` after its ``prefix_lens[b]`` cached tokens; queries attend to the cached prefix
    and causally to the new tokens.  ``max_kv_len`` (host int) bounds prefix + new length.
    """

    k: torch.Tensor  # [num_slots, Hkv, max_len, D] (head-major)
    v: torch.Tensor  # [num_slots, Hkv, max_len, D] (head-major)
    slots: torch.Tensor  # [B] int64
    prefix_lens: torch.Tensor  # [B] int64
    max_kv_len: int
    slots_are_prefix: bool = False  # host flag: slots == arange(B) → slice the cache, no gather
    # [B, 1, M, max_kv_len], shared by all layers: bool (True: attend) or additive (0 / −inf)
    mask: torch.Tensor | None = None
    full_rows: bool = False  # host flag: one new token each and prefix+1 == max_kv_len for all
    # (slot, position) [T] of each new token's cache row, shared by all layers (None: derived)
    rows: tuple[torch.Tensor, torch.Tensor] | None = None
