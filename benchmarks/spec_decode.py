"""Speculative vs plain rollouts on a repetitive toy task, across batch sizes, side by side.

For each batch size B (KV-cache slots) the engine decodes 4·B sequences (at least 8): GRPO
groups of n = 4 samples per addition prompt at temperature 1, so the batch is full and then
drains into a long tail.  Every configuration first decodes the same prompts once ("previous
epoch": RL revisits its prompts, and the n-gram drafter keeps their responses), then the
measured epoch.  Configurations:

- ``plain``: no speculation;
- ``ngram always``: n-gram drafts (own context, siblings, history), gate disabled;
- ``ngram gated``: the same with the batch-size gate (the engine's default);
- ``best-of-2 gated``: the bandit picks per request between ``ngram`` and ``ngram-short``
  (min_n = 1, max_n = 3), and k ∈ {1, 2, 4};
- ``ngram always, cold`` / ``ngram gated, cold``: a fresh engine for every measured run, so no
  previous epoch: drafts come only from the sequence itself and its live siblings;
- with ``--draft DIR`` (a specrl EAGLE-3 draft of the target): ``eagle3 gated`` and
  ``ngram+eagle3 gated`` (best-of-N between the two drafters).

Measured runs are interleaved (plain, always, gated, …, plain, …) and the median time of
``--repeats`` is reported, so machine noise hits every configuration alike.  Time is the
thread's CPU time by default (``--clock cpu``, with one torch thread): on a machine shared with
other jobs it is the work done, not the wait for a core.  The engines' cost models read the same
clock.  ``--clock wall`` uses wall-clock time instead (right on a dedicated machine).  Greedy
outputs are not compared here (the tests do that); the sampled outputs of all configurations
follow the same distribution.

    python benchmarks/spec_decode.py                  # table + benchmarks/results/spec_decode.json
    python benchmarks/spec_decode.py --quick --markdown

The target is ``--target`` (default ``runs/toy/target``); when it does not exist it is created
with the toy warm-start recipe (``recipes/toy/cotrain.yaml``, ~2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from specrl.config.loader import atomic_write_text
from specrl.models.checkpoint import load_model
from specrl.models.tokenizer import TextCodec
from specrl.rl.tasks import AdditionTask
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig
from specrl.rollout.proposers import register_proposer
from specrl.rollout.proposers.ngram import NgramProposer


class ShortNgram(NgramProposer):
    """A second drafter for best-of-N: short suffixes (1–3 tokens), more hits, less accuracy."""

    name = "ngram-short"


register_proposer("ngram-short", lambda ctx: ShortNgram(min_n=1, max_n=3), replace=True)

BASE_CONFIGS: dict[str, SpecConfig | None] = {
    "plain": None,
    "ngram always": SpecConfig(proposers=("ngram",), max_k=4, gate=False),
    "ngram gated": SpecConfig(proposers=("ngram",), max_k=4),
    "best-of-2 gated": SpecConfig(proposers=("ngram", "ngram-short"), max_k=4),
    "ngram always, cold": SpecConfig(proposers=("ngram",), max_k=4, gate=False),
    "ngram gated, cold": SpecConfig(proposers=("ngram",), max_k=4),
}


def configs(draft: Path | None) -> dict[str, SpecConfig | None]:
    out = dict(BASE_CONFIGS)
    if draft is not None:
        options = {"eagle3": {"path": str(draft)}}
        out["eagle3 gated"] = SpecConfig(("eagle3",), max_k=4, proposer_options=options)
        both = ("ngram", "eagle3")
        out["ngram+eagle3 gated"] = SpecConfig(both, max_k=4, proposer_options=options)
    return out


def ensure_target(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    from specrl.config import Recipe, load_recipe
    from specrl.train.warmstart import run_warmstart

    print(f"warm-starting a toy target into {path} …", flush=True)
    run_warmstart(load_recipe(Path("recipes/toy/cotrain.yaml"), Recipe, []), path)
    return path


def requests(batch: int, seed: int, samples_per_prompt: int, max_tokens: int) -> list[Request]:
    prompts = max(4 * batch, 8) // samples_per_prompt
    problems = AdditionTask().sample(random.Random(1234), prompts)
    return [
        Request(
            p.prompt, SamplingParams(max_tokens, 1.0, seed=seed * 1000 + i, n=samples_per_prompt)
        )
        for i, p in enumerate(problems)
    ]


def measure(engine: RolloutEngine, reqs: list[Request]) -> tuple[float, int, dict]:
    before = engine.stats()
    t0 = engine.clock()
    out = engine.generate(reqs)
    seconds = engine.clock() - t0
    after = engine.stats()
    tokens = sum(len(r.tokens) for r in out)
    spec = {k: after["spec"][k] - before["spec"][k] for k in ("drafts", "draft_tokens", "accepted")}
    gating = {k: after["gating"][k] - before["gating"][k] for k in ("spec_steps", "plain_steps")}
    forwards = after["target_forwards"] - before["target_forwards"]
    return seconds, tokens, {**spec, **gating, "forwards": forwards}


def run(
    target: Path, draft: Path | None, batches: list[int], repeats: int, max_tokens: int, clock
) -> list[dict]:
    specs = configs(draft)
    model = load_model(target)
    codec = TextCodec.from_checkpoint(target, model.config)
    rows = []
    for batch in batches:

        def fresh(name: str, batch: int = batch) -> RolloutEngine:
            spec = specs[name]
            return RolloutEngine(
                model, codec=codec, max_batch_size=batch, spec=spec, seed=0, clock=clock
            )

        engines = {name: fresh(name) for name in specs}
        for engine in engines.values():  # the previous epoch: warms caches, history, bandit
            engine.generate(requests(batch, 0, 4, max_tokens))
        samples: dict[str, list[tuple[float, int, dict]]] = {name: [] for name in engines}
        for rep in range(repeats):
            for name in engines:
                if name.endswith("cold"):
                    engines[name] = fresh(name)
                samples[name].append(
                    measure(engines[name], requests(batch, rep + 1, 4, max_tokens))
                )
        plain_tps = None
        for name, runs in samples.items():
            seconds = statistics.median(s for s, _, _ in runs)
            tokens = sum(t for _, t, _ in runs) / len(runs)
            agg = {k: sum(r[2][k] for r in runs) for k in runs[0][2]}
            tps = tokens / seconds
            plain_tps = plain_tps or tps
            steps = agg["spec_steps"] + agg["plain_steps"]
            rows.append(
                {
                    "batch": batch,
                    "config": name,
                    "tok_s": round(tps, 1),
                    "vs_plain": round(tps / plain_tps, 2),
                    "tau": round(1 + agg["accepted"] / agg["drafts"], 2) if agg["drafts"] else None,
                    "acceptance": round(agg["accepted"] / agg["draft_tokens"], 3)
                    if agg["draft_tokens"]
                    else None,
                    "forwards_per_token": round(agg["forwards"] / sum(t for _, t, _ in runs), 3),
                    "spec_step_share": round(agg["spec_steps"] / steps, 2) if steps else 0.0,
                    "tokens": int(tokens),
                    "seconds": round(seconds, 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path("runs/toy/target"))
    ap.add_argument("--draft", type=Path, default=None, help="EAGLE-3 draft dir of the target")
    ap.add_argument("--batches", default="1,4,16,64", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: default)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="batches 1,16 and one repeat")
    ap.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/spec_decode.json"))
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    batches = [1, 16] if args.quick else [int(b) for b in args.batches.split(",")]
    repeats = 1 if args.quick else args.repeats
    target = ensure_target(args.target)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        ap.error("--clock cpu measures one thread: use --threads 1 (or --clock wall)")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    rows = run(target, args.draft, batches, repeats, args.max_tokens, clock)

    from rich.console import Console
    from rich.table import Table

    threads = torch.get_num_threads()
    table = Table(
        title=f"speculative rollouts, addition, n=4, T=1, {args.clock} clock, {threads} thr"
    )
    for c in rows[0]:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*("-" if v is None else str(v) for v in r.values()))
    Console().print(table)
    if args.markdown:
        print(markdown(rows))
    meta = {
        "target": str(target),
        "draft": str(args.draft) if args.draft else None,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "clock": args.clock,
        "max_tokens": args.max_tokens,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
