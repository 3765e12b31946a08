"""Attention in the rollout engine's decode steps: the KV cache's layout and the compiled form.

Two measurements on one target (default: toy-deep, 16 layers):

1. **Cache layout** — one decode step's cached attention in every layer, eager SDPA (the
   default engine's path), K/V read from a position-major cache ([slot, position, Hkv, D], the
   layout before head-major; SDPA gets transposed views) vs a head-major one ([slot, Hkv,
   position, D], the engine's layout).  Attention only, the cache write included.
2. **Compiled decoding step** — the target's whole cached forward (all layers) for B sequences
   bringing one new token each at context L: eager (fused inference path, the default engine),
   compiled with SDPA, and compiled with
   :func:`~specrl.core.attention.kernels.grouped_decode_attention` (the compiled engine's form).
   Both compiled forms are built first, then called alternately (fully guarded: same call
   overhead).

Medians of timed calls, one torch thread, thread CPU time.

    python -m benchmarks.decode_attention --target runs/toy-deep/target

Writes ``benchmarks/results/decode_attention.json`` and prints both tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.engine_paths import markdown, render
from specrl.core.attention import PackedLayout, kernels
from specrl.models.checkpoint import load_model
from specrl.models.decoder import CacheBatch, KVCache, Transformer


def median_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(calls):
        t0 = time.thread_time()
        fn()
        samples.append(time.thread_time() - t0)
    return statistics.median(samples) * 1e6


def eager_attention(
    caches: list[torch.Tensor], head_major: bool, q: torch.Tensor, new: torch.Tensor, ctx: int
) -> None:
    """One decode step's cache writes and SDPA in every layer (K, V alternate in ``caches``)."""
    b = q.shape[0]
    idx, pos = torch.arange(b), torch.full((b,), ctx - 1)
    for kc, vc in zip(caches[::2], caches[1::2], strict=True):
        if head_major:  # [slot, Hkv, position, D]
            kc.transpose(1, 2).index_put_((idx, pos), new)
            vc.transpose(1, 2).index_put_((idx, pos), new)
            kp, vp = kc[:b, :, :ctx], vc[:b, :, :ctx]
        else:  # [slot, position, Hkv, D]
            kc.index_put_((idx, pos), new)
            vc.index_put_((idx, pos), new)
            kp, vp = kc[:b, :ctx].transpose(1, 2), vc[:b, :ctx].transpose(1, 2)
        F.scaled_dot_product_attention(q, kp, vp, enable_gqa=q.shape[1] != kp.shape[1])


def layout_rows(model: Transformer, batches: list[int], contexts: list[int]) -> list[dict]:
    """Eager SDPA decode attention over all layers: position-major vs head-major cache."""
    cfg = model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    slots, max_len = max(batches), max(contexts) + 1
    gen = torch.Generator().manual_seed(0)
    layers = len(model.layer_ids)
    head_major = [torch.randn(slots, hkv, max_len, d, generator=gen) for _ in range(2 * layers)]
    pos_major = [t.transpose(1, 2).contiguous() for t in head_major]
    rows = []
    for b in batches:
        q = torch.randn(b, hq, 1, d, generator=gen)
        new = torch.randn(b, hkv, d, generator=gen)
        for ctx in contexts:
            pm = median_us(partial(eager_attention, pos_major, False, q, new, ctx), 30)
            hm = median_us(partial(eager_attention, head_major, True, q, new, ctx), 30)
            rows.append(
                {
                    "batch": b,
                    "context": ctx,
                    "position-major us": round(pm, 1),
                    "head-major us": round(hm, 1),
                    "position / head": round(pm / hm, 2),
                }
            )
    return rows


def forward(fn: Callable, form: str, cache: KVCache, ids: torch.Tensor, ctx: int) -> object:
    """One decoding forward of B = len(ids) sequences at context ``ctx`` in slots 0..B−1."""
    kernels.COMPILED_CPU_ATTENTION = form
    b = ids.shape[0]
    prefix = torch.full((b,), ctx - 1)
    batch = CacheBatch(cache, torch.arange(b), prefix, ctx, slots_are_prefix=True, full_rows=True)
    layout = PackedLayout.from_lengths([1] * b)
    if isinstance(fn, nn.Module):  # the eager engine's path
        return fn(ids, layout, cache=batch, fused=True)
    return fn(ids, layout, cache=batch)  # the compiled engine's call


def step_rows(model: Transformer, batches: list[int], contexts: list[int], calls: int) -> list:
    """The whole decoding forward: eager vs compiled (SDPA) vs compiled (grouped)."""
    cache = model.new_cache(max(batches), max(contexts) + 1)
    gen = torch.Generator().manual_seed(1)
    for kv in (cache.k, cache.v):
        for t in kv.values():
            t.copy_(torch.randn(t.shape, generator=gen))
    saved = kernels.COMPILED_CPU_ATTENTION
    rows = []
    try:
        for b in batches:
            for ctx in contexts:
                ids = torch.randint(0, model.config.vocab_size, (b,), generator=gen)
                # a fresh compile per size: only the two forms' graphs in dynamo's cache, so
                # each call's guard check costs what the engine's would
                torch._dynamo.reset()
                compiled = torch.compile(model.forward, dynamic=True)
                with torch.no_grad():
                    eager = median_us(partial(forward, model, "sdpa", cache, ids, ctx), calls)
                    sdpa = partial(forward, compiled, "sdpa", cache, ids, ctx)
                    grouped = partial(forward, compiled, "grouped", cache, ids, ctx)
                    sdpa(), grouped()  # compile both before timing either
                    times: dict[str, list[float]] = {"sdpa": [], "grouped": []}
                    for _ in range(3):  # alternate: the machine's drift hits both
                        times["sdpa"].append(median_us(sdpa, calls // 3))
                        times["grouped"].append(median_us(grouped, calls // 3))
                cs, cg = (statistics.median(times[k]) for k in ("sdpa", "grouped"))
                rows.append(
                    {
                        "batch": b,
                        "context": ctx,
                        "eager us": round(eager, 1),
                        "compiled sdpa us": round(cs, 1),
                        "compiled grouped us": round(cg, 1),
                        "eager / compiled grouped": round(eager / cg, 2),
                        "sdpa / grouped": round(cs / cg, 2),
                    }
                )
    finally:
        kernels.COMPILED_CPU_ATTENTION = saved
        torch._dynamo.reset()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("runs/toy-deep/target"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="64,256")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_attention.json"))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    model = load_model(args.target).eval()
    layout = layout_rows(model, batches, contexts)
    steps = step_rows(model, batches, contexts, args.calls)
    render(layout, "eager decode attention over all layers: cache layout (µs)")
    render(steps, "decoding forward of the whole target: eager vs compiled forms (µs)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    meta = {"command": "python -m benchmarks.decode_attention " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("markdown",)
    ), "torch": torch.__version__, "threads": 1, "clock": "thread cpu"}  # fmt: skip
    tmp.write_text(json.dumps({"meta": meta, "layout": layout, "steps": steps}, indent=1))
    tmp.replace(args.out)
    if args.markdown:
        print(markdown(layout))
        print()
        print(markdown(steps))


if __name__ == "__main__":
    main()
