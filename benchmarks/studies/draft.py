"""Draft cost relative to the target, and TTT memory of the dense vs efficient attention paths.

Part 1 — **step cost ratio c = draft step / target step** (the speculation gain is
≈ E / (k·c + 1)).  Analytic FLOPs per decoded token at context ``--context`` (matmuls 2·params,
attention 4·ctx·Hq·D per layer) and measured CPU time of one batch-1 cached decode step, for the
toy presets and an 8B-shaped config.  An 8B target does not fit this machine, so its measured
target step is one real decoder layer × L plus the lm_head, each timed on real weights.

Part 2 — **TTT peak memory vs sequence length**: one forward+backward of ``ttt_forward`` with
K = 7 steps through the dense reference (materializes [H, S, S+K·S] scores per step: quadratic)
and through the efficient path (``core.attention.ttt``: causal blocks merged with closed-form
branch terms: linear), measured from the allocator's event stream
(``benchmarks.harness.peak_bytes``).

    python -m benchmarks.studies.draft            # table + benchmarks/results/studies/draft.json
    python -m benchmarks.studies.draft --quick
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks import harness
from benchmarks.harness import peak_bytes
from specrl.core.attention import PackedLayout
from specrl.models.config import ModelConfig
from specrl.models.decoder import CacheBatch, DecoderLayer, Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, init_draft_weights
from specrl.models.presets import preset_config


def target_flops(cfg: ModelConfig, ctx: int) -> float:
    """FLOPs of one decoded token: 2 × matmul params + attention scores/values."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer = 2 * (h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size)
    attn = 4 * ctx * q
    return cfg.num_hidden_layers * (layer + attn) + 2 * h * cfg.vocab_size


def draft_flops(cfg: DraftConfig, ctx: int) -> float:
    """FLOPs of one chained draft step (fc is paid once per verified position, not per step)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer = 2 * (2 * h * q + 2 * 2 * h * kv + q * h + 3 * h * cfg.intermediate_size)
    return layer + 4 * ctx * q + 2 * h * cfg.draft_vocab_size


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def measure_draft_step(draft: Eagle3Draft, ctx: int, repeats: int) -> float:
    cache = draft.new_cache(1, ctx + 2)
    h = torch.randn(1, draft.config.hidden_size, dtype=draft.fc.weight.dtype)
    tok = torch.tensor([3])
    one = PackedLayout.from_lengths([1])
    batch = lambda: CacheBatch(
        cache,
        torch.tensor([0]),
        torch.tensor([ctx]),
        ctx + 1,
        slots_are_prefix=True,
        full_rows=True,
    )
    return _median_time(lambda: draft.logits(draft.decode(h, tok, one, batch())), repeats)


@torch.no_grad()
def measure_target_step(model: Transformer, ctx: int, repeats: int) -> float:
    cache = model.new_cache(1, ctx + 2)
    tok = torch.tensor([3])
    one = PackedLayout.from_lengths([1])
    batch = lambda: CacheBatch(
        cache,
        torch.tensor([0]),
        torch.tensor([ctx]),
        ctx + 1,
        slots_are_prefix=True,
        full_rows=True,
    )
    return _median_time(lambda: model(tok, one, cache=batch()), repeats)


@torch.no_grad()
def measure_big_target_step(cfg: ModelConfig, ctx: int, repeats: int) -> float:
    """One real layer × L + lm_head (the full model does not fit in memory here)."""
    from specrl.models.decoder import KVCache, Rotary

    layer = DecoderLayer(cfg).to(torch.bfloat16)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).to(torch.bfloat16)
    cache = KVCache(cfg, 1, ctx + 2, layer_ids=[0], dtype=torch.bfloat16)
    x = torch.randn(1, cfg.hidden_size, dtype=torch.bfloat16)
    one = PackedLayout.from_lengths([1])
    cos, sin = Rotary(cfg).cos_sin(torch.tensor([ctx]), torch.bfloat16)
    batch = CacheBatch(
        cache,
        torch.tensor([0]),
        torch.tensor([ctx]),
        ctx + 1,
        slots_are_prefix=True,
        full_rows=True,
    )
    t_layer = _median_time(lambda: layer(x, cos, sin, one, batch.view(0)), repeats)
    t_head = _median_time(lambda: head(x), repeats)
    return cfg.num_hidden_layers * t_layer + t_head


def cost_rows(ctx: int, repeats: int, quick: bool) -> list[dict]:
    rows = []
    shapes = [("toy-tiny", 99), ("toy-small", 99)] + ([] if quick else [("llama-8b", None)])
    for name, vocab in shapes:
        cfg = preset_config(name, vocab_size=vocab) if vocab else preset_config(name)
        dcfg = DraftConfig.for_target(cfg, draft_vocab_size=min(cfg.vocab_size, 32000))
        draft = init_draft_weights(Eagle3Draft(dcfg))
        if vocab:
            target = Transformer(cfg).init_weights(0).eval()
            t_target = measure_target_step(target, ctx, repeats)
            method = "full model"
        else:
            draft = draft.to(torch.bfloat16)
            t_target = measure_big_target_step(cfg, ctx, repeats)
            method = "1 layer × L + head, bf16"
        t_draft = measure_draft_step(draft, ctx, repeats)
        fl_t, fl_d = target_flops(cfg, ctx), draft_flops(dcfg, ctx)
        rows.append(
            {
                "shape": name,
                "target_params_m": round(cfg.num_params / 1e6, 1),
                "draft_vocab": dcfg.draft_vocab_size,
                "context": ctx,
                "flops_ratio": round(fl_d / fl_t, 4),
                "target_ms": round(t_target * 1e3, 3),
                "draft_ms": round(t_draft * 1e3, 3),
                "time_ratio": round(t_draft / t_target, 4),
                "target_timing": method,
            }
        )
        print(rows[-1], flush=True)
    return rows


def memory_rows(lengths: list[int], steps: int) -> list[dict]:
    tcfg = preset_config("toy-small", vocab_size=99)
    dcfg = DraftConfig.for_target(tcfg, draft_vocab_size=32)
    draft = init_draft_weights(Eagle3Draft(dcfg))
    rows = []
    for s in lengths:
        gen = torch.Generator().manual_seed(s)
        taps = torch.randn(s, 3 * tcfg.hidden_size, generator=gen)
        step_ids = torch.randint(0, 99, (steps, s), generator=gen)
        layout = PackedLayout.from_lengths([s])
        row = {"seq_len": s, "ttt_steps": steps}
        for path in ("reference", "efficient"):

            def run(path=path, taps=taps, step_ids=step_ids, layout=layout):
                out = draft.ttt_forward(taps, step_ids, layout, attn=path)
                sum(lg.float().logsumexp(-1).sum() for lg in out.logits).backward()
                draft.zero_grad(set_to_none=True)

            row[f"{path}_mib"] = round(peak_bytes(run) / 2**20, 1)
        row["ratio"] = round(row["reference_mib"] / row["efficient_mib"], 2)
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    ap = harness.parser(__doc__, "studies/draft", repeats=20, clock=False)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    harness.configure(ap, args)
    torch.manual_seed(0)
    costs = cost_rows(args.context, 5 if args.quick else args.repeats, args.quick)
    lengths = [128, 256, 512] if args.quick else [256, 512, 1024, 2048]
    mem = memory_rows(lengths, 7)
    harness.report(
        args,
        [
            (
                f"draft step / target step, batch 1, context {args.context}, CPU",
                costs,
                list(costs[0]),
            ),
            ("TTT forward+backward peak memory (K = 7), toy-small draft", mem, list(mem[0])),
        ],
        {"cost": costs, "memory": mem},
    )


if __name__ == "__main__":
    main()
