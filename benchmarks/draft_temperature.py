"""The EAGLE-3 draft temperature scale: acceptance of sampled drafts per scale, and "auto".

The ratio test is lossless for any draft distribution q, so the eagle3 proposer may draw its
chain from q = softmax(draft logits / (T·s)), sharper than the draft's own distribution for
s < 1 (``specrl.rollout.proposers.eagle3``).  For each target/draft pair this decodes the same
addition prompts at temperature T (one sample each, seeded per request) with an eagle3-only
engine whose scale is fixed at each of ``SCALES``, then learned (``auto``, the default), and
reports the share of drafted tokens accepted, the acceptance at each chain position, τ and the
rounds ``auto`` gave each scale.  Speculation is always on (no gate) and the bandit does not
explore (ε = 0), so each engine's chain lengths follow its own acceptance.  Outputs follow the
target's distribution in every configuration (the tests check it); only acceptance differs.

    python benchmarks/draft_temperature.py
    python benchmarks/draft_temperature.py --targets runs/toy/target runs/toy-deep/target \\
        --drafts runs/toy/draft runs/toy-deep/draft

Writes ``benchmarks/results/draft_temperature.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from specrl.config.loader import atomic_write_text
from specrl.models.checkpoint import load_model
from specrl.models.tokenizer import TextCodec
from specrl.rl.tasks import AdditionTask
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig
from specrl.rollout.proposers.eagle3 import SCALES


def run_pair(
    target: Path, draft: Path, prompts: int, batch: int, max_k: int, temperature: float
) -> list[dict]:
    model = load_model(target).eval()
    codec = TextCodec.from_checkpoint(target, model.config)
    problems = AdditionTask().sample(random.Random(0), prompts)
    encoded = [codec.encode_prompt(p.prompt) for p in problems]
    rows = []
    for scale in (*SCALES, "auto"):
        options = {"eagle3": {"path": str(draft), "temperature_scale": scale}}
        spec = SpecConfig(
            ("eagle3",), max_k=max_k, proposer_options=options, gate=False, epsilon=0.0
        )
        engine = RolloutEngine(model, codec=codec, max_batch_size=batch, spec=spec, seed=0)
        reqs = [Request(p, SamplingParams(64, temperature, seed=i)) for i, p in enumerate(encoded)]
        t0 = time.thread_time()
        out = engine.generate(reqs)
        seconds = time.thread_time() - t0
        s = engine.stats()
        spec_stats = s["spec"]
        drafts, draft_tokens = spec_stats["drafts"], spec_stats["draft_tokens"]
        row = {
            "target": str(target),
            "scale": scale,
            "acceptance": round(spec_stats["accepted"] / draft_tokens, 3),
            "per_position": [round(x, 3) for x in spec_stats["per_position"]],
            "tau": round(1 + spec_stats["accepted"] / drafts, 3),
            "mean_k": round(draft_tokens / drafts, 2),
            "tokens": sum(len(r.tokens) for r in out),
            "tok_s": round(sum(len(r.tokens) for r in out) / seconds, 1),
        }
        if scale == "auto":
            picked = s["drafters"]["eagle3"]["temperature_scale"]["scales"]
            row["auto_rounds"] = {k: v["rounds"] for k, v in picked.items()}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = "| target | scale | acceptance | position 1 … k | τ | mean k | tok/s | auto's rounds |"
    lines = [head, "| --- | --- | ---: | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        pos = " / ".join(f"{x:.2f}" for x in r["per_position"])
        rounds = r.get("auto_rounds")
        rounds_s = ", ".join(f"{k}: {v}" for k, v in rounds.items()) if rounds else "-"
        lines.append(
            f"| {Path(r['target']).parent.name} | {r['scale']} | {r['acceptance']:.3f} | {pos} "
            f"| {r['tau']:.2f} | {r['mean_k']:.2f} | {r['tok_s']:.0f} | {rounds_s} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", type=Path, nargs="+", default=[Path("runs/toy/target")])
    ap.add_argument("--drafts", type=Path, nargs="+", default=[Path("runs/toy/draft")])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_temperature.json"))
    args = ap.parse_args()
    if len(args.targets) != len(args.drafts):
        ap.error("--targets and --drafts need one draft per target")
    torch.set_num_threads(1)
    rows = []
    for target, draft in zip(args.targets, args.drafts, strict=True):
        rows += run_pair(target, draft, args.prompts, args.batch, args.max_k, args.temperature)
    print(table(rows))
    payload = {"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
