"""Which draft lengths the bandit may choose: every k in 1 … max_k against powers of two.

The rollout engine's bandit picks a draft length k per decode step (``specrl.rollout.gating``).
With acceptance estimated per draft position (``ChainAcceptance``) every k in 1 … max_k can be
offered; before, the arms were powers of two and max_k.  This script decodes the same prompts
with three engines per (mode, batch size): specrl plain, best-of-N (``eagle3`` and ``ngram``)
choosing any k, and best-of-N restricted to powers of two (``SpecConfig.draft_lengths``), and
reports tokens/s, the ratio to plain (median of per-repeat ratios, interleaved in a rotated
order) and which k each engine played.  Protocol as ``benchmarks/rollout.py``: P = max(B, 8)
addition prompts per run, ≤ 64 tokens, two warm-up runs, one torch thread, thread CPU time.

    python -m benchmarks.draft_lengths --target runs/toy-deep/target --draft runs/toy-deep/draft \
        --batches 1 --repeats 25 --markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.rollout import MAX_K, paired_ratio, prompt_set
from specrl.config.loader import atomic_write_text
from specrl.models.checkpoint import load_model
from specrl.models.decoder import Transformer
from specrl.models.tokenizer import TextCodec
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig

VARIANTS = ("plain", "best-of-N, every k", "best-of-N, k a power of two")


def powers_of_two(max_k: int) -> tuple[int, ...]:
    """The draft lengths the bandit chose from before: powers of two below max_k, and max_k."""
    ks, k = [], 1
    while k < max_k:
        ks.append(k)
        k *= 2
    return (*ks, max_k)


def engines(
    model: Transformer, codec: TextCodec, draft: Path, batch: int, max_k: int
) -> dict[str, RolloutEngine]:
    eagle = {"eagle3": {"path": str(draft)}}
    specs = {
        VARIANTS[0]: None,
        VARIANTS[1]: SpecConfig(("eagle3", "ngram"), max_k=max_k, proposer_options=eagle),
        VARIANTS[2]: SpecConfig(
            ("eagle3", "ngram"),
            max_k=max_k,
            draft_lengths=powers_of_two(max_k),
            proposer_options=eagle,
        ),
    }
    return {
        name: RolloutEngine(
            model, codec=codec, max_batch_size=batch, spec=spec, seed=0, clock=time.thread_time
        )
        for name, spec in specs.items()
    }


def decode(engine: RolloutEngine, prompts: list[list[int]], seed: int, greedy: bool) -> int:
    temperature = 0.0 if greedy else 1.0
    reqs = [
        Request(p, SamplingParams(64, temperature, seed=seed * 1000 + i))
        for i, p in enumerate(prompts)
    ]
    return sum(len(r.tokens) for r in engine.generate(reqs))


def played_k(selections: Counter[str]) -> dict[int, int]:
    """Sequence-steps per draft length (both proposers) from the controller's selections
    ("proposer/k=K" → sequence-steps)."""
    out: Counter[int] = Counter()
    for arm, n in selections.items():
        out[int(arm.rsplit("=", 1)[1])] += n
    return dict(sorted((k, n) for k, n in out.items() if n > 0))


def measure(
    model: Transformer, codec: TextCodec, draft: Path, mode: str, batch: int, repeats: int,
    max_k: int,
) -> list[dict]:  # fmt: skip
    greedy = mode == "greedy"
    built = engines(model, codec, draft, batch, max_k)
    count = max(batch, 8)
    names = list(built)
    for w in range(2):  # warm-up on other prompts
        for name in names:
            decode(built[name], prompt_set(codec, count, 10_000 + 100 * batch + w), w, greedy)
    before = {name: Counter(e.controller.selections) for name, e in built.items()}
    tok_s: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        prompts = prompt_set(codec, count, 1 + rep)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.thread_time()
            tokens = decode(built[name], prompts, rep + 1, greedy)
            tok_s[name].append(tokens / (time.thread_time() - t0))
    rows = []
    for name in names:
        ratios = [a / b for a, b in zip(tok_s[name], tok_s[VARIANTS[0]], strict=True)]
        quart = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        spent = Counter(built[name].controller.selections)
        spent.subtract(before[name])  # the measured runs' choices only
        rows.append(
            {
                "mode": mode,
                "batch": batch,
                "variant": name,
                "tok_s": round(statistics.median(tok_s[name]), 1),
                "tok_s_runs": [round(x, 1) for x in tok_s[name]],
                "vs_plain": round(paired_ratio(tok_s[name], tok_s[VARIANTS[0]]), 3),
                "vs_plain_iqr": [round(quart[0], 3), round(quart[-1], 3)],
                "k_played": played_k(spent),
            }
        )
    every, pow2 = (tok_s[v] for v in VARIANTS[1:])
    rows.append(
        {
            "mode": mode,
            "batch": batch,
            "variant": "every k ÷ powers of two",
            "paired_ratio": round(paired_ratio(every, pow2), 3),
        }
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("runs/toy-deep/target"))
    ap.add_argument("--draft", type=Path, default=Path("runs/toy-deep/draft"))
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes")
    ap.add_argument("--modes", default="sampled,greedy")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--max-k", type=int, default=MAX_K)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_lengths.json"))
    args = ap.parse_args()
    for p, what in ((args.target, "config.json"), (args.draft, "specrl_draft.json")):
        if not (p / what).is_file():
            ap.error(f"{p} has no {what}: make the toy pair first (docs/benchmarks.md)")
    modes = args.modes.split(",")
    if not set(modes) <= {"sampled", "greedy"}:
        ap.error(f"--modes: sampled and/or greedy, got {args.modes}")
    if args.max_k < 2 or args.repeats < 1:
        ap.error("--max-k must be ≥ 2 and --repeats ≥ 1")
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(1)
    model = load_model(args.target).eval()
    codec = TextCodec.from_checkpoint(args.target, model.config)
    rows = []
    for mode in modes:
        for batch in batches:
            for row in measure(model, codec, args.draft, mode, batch, args.repeats, args.max_k):
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "tok_s_runs"}))
    if args.markdown:
        print("| mode | batch | variant | tok/s | vs plain (IQR) | k played (sequence-steps) |")
        print("| --- | ---: | --- | ---: | --- | --- |")
        for r in rows:
            iqr = r.get("vs_plain_iqr")
            ratio = f"{r['vs_plain']} ({iqr[0]}–{iqr[1]})" if iqr else f"{r['paired_ratio']}"
            played = ", ".join(f"{k}: {n}" for k, n in r.get("k_played", {}).items())
            print(
                f"| {r['mode']} | {r['batch']} | {r['variant']} | {r.get('tok_s', '')} | "
                f"{ratio} | {played} |"
            )
    meta = {
        "command": " ".join(["python", "-m", "benchmarks.draft_lengths", *sys.argv[1:]]),
        "target": str(args.target),
        "draft": str(args.draft),
        "max_k": args.max_k,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
