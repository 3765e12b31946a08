"""Plain (non-speculative) batched decoding with the slot KV cache.

The simplest correct decoder: prefill every prompt in one packed forward, then one token per
active sequence per step; finished sequences leave the batch.  It is the reference the
speculative engine is tested against and what ``benchmarks/decode.py`` times.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specrl.core.attention import PackedLayout
from specrl.models.decoder import CacheBatch, Transformer


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Greedy (``temperature == 0``) or sampled completions, one token list per prompt."""
    device = model.device
    b = len(prompts)
    if b == 0:
        return []
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
        raise ValueError("every prompt needs at least one token")
    cache = model.new_cache(b, max(lens) + max_new_tokens)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
    layout = PackedLayout.from_lengths(lens, device=device)
    slots = torch.arange(b, device=device)
    prefix = torch.zeros(b, dtype=torch.int64, device=device)
    last = layout.cu_seqlens[1:] - 1
    out = model(
        ids,
        layout,
        cache=CacheBatch(cache, slots, prefix, max(lens), slots_are_prefix=True),
        logits_index=last,
    )
    lengths = torch.tensor(lens, dtype=torch.int64, device=device)
    done = [False] * b
    results: list[list[int]] = [[] for _ in range(b)]
    active = list(range(b))
    logits = out.logits
    one = PackedLayout.from_lengths([1] * b, device=device)
    for step in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1)
        toks = nxt.tolist()
        keep = []
        for j, i in enumerate(active):
            results[i].append(toks[j])
            if (eos_id is not None and toks[j] == eos_id) or step == max_new_tokens - 1:
                done[i] = True
            else:
                keep.append(j)
        if not keep:
            break
        if len(keep) != len(active):
            sel = torch.tensor(keep, device=device)
            nxt = nxt[sel]
            active = [active[j] for j in keep]
            one = PackedLayout.from_lengths([1] * len(active), device=device)
        slot_t = torch.tensor(active, device=device)
        pre = lengths[slot_t]
        max_kv = max(lens[i] + len(results[i]) for i in active)
        full = all(lens[i] + len(results[i]) == max_kv for i in active)
        batch = CacheBatch(
            cache, slot_t, pre, max_kv, slots_are_prefix=len(active) == b, full_rows=full
        )
        logits = model(nxt, one, cache=batch).logits
        lengths[slot_t] += 1
    return results
