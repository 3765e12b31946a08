"""Plain decoding in the rollout engine: the fused inference path vs the module forward, and
cache slices (compact slots) vs gathers, side by side with ``transformers``.

Two measurements on one target (default: the main job's toy-small):

1. **Engine** — tokens/s of plain decoding (sampled, T = 1) at batch 1, 8 and 32 for
   ``RolloutEngine(fused=True)`` (the default: fused q|k|v and gate|up projections),
   ``RolloutEngine(fused=False)`` (the module forward) and ``transformers`` ``generate``, all on
   the same prompts (P = max(B, 8) addition prompts per run, ≤ 64 tokens), interleaved in a
   rotated order, ``--repeats`` rounds; ratios are medians of per-round ratios.
2. **Attention over the cache** — one decode step's attention for B sequences at context L in
   every layer of the target: K/V read as a slice of slots 0..B−1 (what compact slots give)
   vs gathered from B scattered slots (what the engine did before), medians of timed calls.

One torch thread, thread CPU time (a shared machine's wait for a core is not counted).

    python -m benchmarks.engine_paths --target runs/toy/target

Writes ``benchmarks/results/engine_paths.json`` and prints both tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.rollout import HFRunner, prompt_set
from specrl.core.attention import CacheView, PackedLayout
from specrl.core.attention.kernels import cached_attention
from specrl.models.checkpoint import load_model
from specrl.models.decoder import KVCache
from specrl.models.tokenizer import TextCodec
from specrl.rollout import Request, RolloutEngine, SamplingParams

VARIANTS = ("engine fused", "engine module", "hf plain")


@dataclass
class Runner:
    """The variants of one batch size: two engines on one model, and ``transformers``."""

    codec: TextCodec
    hf: HFRunner
    engines: dict[str, RolloutEngine]
    batch: int
    max_tokens: int

    def run(self, name: str, seed: int) -> float:
        """Tokens/s of one variant on P = max(B, 8) fresh prompts (thread CPU time)."""
        prompts = prompt_set(self.codec, max(self.batch, 8), seed)
        t0 = time.thread_time()
        if name == "hf plain":
            out = self.hf.generate(prompts, self.batch, False, self.max_tokens, seed)
            tokens = sum(map(len, out))
        else:
            reqs = [
                Request(p, SamplingParams(self.max_tokens, 1.0, seed=seed * 1000 + i))
                for i, p in enumerate(prompts)
            ]
            tokens = sum(len(r.tokens) for r in self.engines[name].generate(reqs))
        return tokens / (time.thread_time() - t0)


def paired(rates: dict[str, list[float]], a: str, b: str) -> float:
    return round(statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True)), 2)


def engine_rows(target: Path, batches: list[int], repeats: int, max_tokens: int) -> list[dict]:
    model = load_model(target).eval()
    codec = TextCodec.from_checkpoint(target, model.config)
    hf = HFRunner(target, codec.eos_id, model.config.pad_token_id or 0)
    rows = []
    for batch in batches:
        engines = {
            name: RolloutEngine(
                model, codec=codec, max_batch_size=batch, seed=0, fused=name == "engine fused",
                clock=time.thread_time,
            )
            for name in VARIANTS[:2]
        }  # fmt: skip
        runner = Runner(codec, hf, engines, batch, max_tokens)
        for w in range(2):  # warm-up on other prompts
            for name in VARIANTS:
                runner.run(name, 10_000 + 100 * batch + w)
        rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for rep in range(repeats):
            for name in VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]:
                rates[name].append(runner.run(name, 1 + rep))
        row: dict = {"batch": batch}
        row.update({f"{n} tok_s": round(statistics.median(rates[n]), 1) for n in VARIANTS})
        row["fused / module"] = paired(rates, "engine fused", "engine module")
        row["fused / hf"] = paired(rates, "engine fused", "hf plain")
        row["module / hf"] = paired(rates, "engine module", "hf plain")
        row["runs"] = {n: [round(x, 1) for x in v] for n, v in rates.items()}
        rows.append(row)
    return rows


def time_attention(
    cache: KVCache, layers: list[int], q: torch.Tensor, slots: torch.Tensor, ctx: int,
    compact: bool,
) -> float:  # fmt: skip
    """Median µs of one decode step's cached attention over ``layers`` (k = v = q's first
    heads: the values do not matter, the memory traffic does)."""
    b = q.shape[0]
    layout = PackedLayout.from_lengths([1] * b)
    kv = q[:, : cache.k[layers[0]].shape[1]].contiguous()
    prefix = torch.full((b,), ctx - 1)

    def step() -> None:
        for i in layers:
            view = CacheView(cache.k[i], cache.v[i], slots, prefix, ctx, compact, None, True)
            cached_attention(q, kv, kv, layout, view)

    for _ in range(5):
        step()
    samples = []
    for _ in range(30):
        t0 = time.thread_time()
        step()
        samples.append(time.thread_time() - t0)
    return statistics.median(samples) * 1e6


def attention_rows(target: Path, batches: list[int], contexts: list[int]) -> list[dict]:
    """Decode attention (all layers) with K/V sliced from slots 0..B−1 vs gathered."""
    model = load_model(target).eval()
    cfg = model.config
    cache = model.new_cache(max(batches) * 2, max(contexts) + 1)
    gen = torch.Generator().manual_seed(0)
    for kv in (cache.k, cache.v):
        for t in kv.values():
            t.copy_(torch.randn(t.shape, generator=gen))
    rows = []
    for batch in batches:
        q = torch.randn(batch, cfg.num_attention_heads, cfg.head_dim, generator=gen)
        for ctx in contexts:
            # compact: slots 0..B−1; scattered: every other slot (what finished sequences leave)
            sliced = time_attention(cache, model.layer_ids, q, torch.arange(batch), ctx, True)
            odd = torch.arange(batch) * 2 + 1
            gathered = time_attention(cache, model.layer_ids, q, odd, ctx, False)
            rows.append(
                {
                    "batch": batch,
                    "context": ctx,
                    "slice_us": round(sliced, 1),
                    "gather_us": round(gathered, 1),
                    "gather / slice": round(gathered / sliced, 2),
                }
            )
    return rows


def render(rows: list[dict], title: str) -> None:
    table = Table(title=title)
    cols = [c for c in rows[0] if c != "runs"]
    for c in cols:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*(str(r[c]) for c in cols))
    Console().print(table)


def markdown(rows: list[dict]) -> str:
    cols = [c for c in rows[0] if c != "runs"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " ---: |" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("runs/toy/target"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="64,256")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_paths.json"))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    engine = engine_rows(args.target, batches, args.repeats, args.max_tokens)
    attn = attention_rows(args.target, batches, [int(c) for c in args.contexts.split(",")])
    render(engine, "plain decoding: fused inference path vs module forward vs transformers")
    render(attn, "decode attention over all layers: K/V slice (compact slots) vs gather (µs)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"engine": engine, "attention": attn}, indent=1))
    tmp.replace(args.out)
    if args.markdown:
        print(markdown(engine))
        print()
        print(markdown(attn))


if __name__ == "__main__":
    main()
