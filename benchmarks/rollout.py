"""Rollout tokens/s on the toy task: specrl plain, n-gram, EAGLE-3, best-of-N vs ``transformers``.

Issue 6's benchmark.  One target (toy-small, warm-started on addition), its EAGLE-3 draft, and
the same weights loaded by ``transformers``.  For each decoding mode (``sampled``: temperature 1,
what RL does; ``greedy``: what ``transformers``' prompt lookup is usually run with) and each batch
size B (concurrent requests), every variant decodes the same prompts with the same ``max_tokens``:

- ``specrl plain``: the engine without speculation;
- ``specrl ngram``, ``specrl eagle3``: one proposer, the engine's default gate and bandit over k;
- ``specrl best-of-N``: the bandit picks per request between ``eagle3`` and ``ngram`` (and k),
  behind the batch-size gate;
- with ``--compile``, also ``specrl plain compiled`` and ``specrl best-of-N compiled``: the same
  engines with ``RolloutEngine(compile=True)`` (the decode step under ``torch.compile``,
  :mod:`specrl.rollout.compiled`; EAGLE-3's drafting passes too), compiled before the warm-up
  runs;
- with ``--decoupled``, also ``specrl decoupled best-of-N``: best-of-N with decoupled drafting
  (:mod:`specrl.rollout.decoupled`: a drafter — ``--drafter thread`` or ``process`` — drafts
  step t + 1 while the target verifies step t).  It needs ``--clock wall`` (its drafting runs
  elsewhere, which a thread CPU clock would not count).  With ``--threads N ≥ 2`` every other
  variant decodes with N torch threads and the decoupled one with N − 1 for the target and 1 for
  the drafter (a drafter process's engine lends it the one thread in decoupled steps only and
  decodes other steps with all N: plain decoding gets all the cores the decoupled engine uses);
  with ``--threads 1`` the decoupled engine has its drafter on top (one core more than the
  others: say so with the figures);
- ``hf plain``: ``model.generate`` (greedy, or ``do_sample`` at T = 1 with top-k/top-p off);
- ``hf prompt lookup``: assisted generation with ``prompt_lookup_num_tokens``; ``transformers``
  allows it at batch size 1 only ("assisted generate is only supported for batch_size = 1"), so
  its other rows are marked unsupported.

Workload: P = max(B, 8) addition prompts per measured run, one sample each.  specrl gets them
all with B KV-cache slots; ``transformers`` decodes them in static batches of B (left padded).
At B = 1 both decode the prompts one after the other; at B ≥ 8 P = B, one wave, so continuous
batching gives specrl no refill advantage.  Tokens = generated tokens up to and including eos
(``transformers`` keeps finished rows in its batch until all are done: that is its real cost).

Engines are built once per (mode, B), compiled ones call ``RolloutEngine.warmup()`` (every
graph class, as ``specrl rollout serve`` does before it reports healthy), and all are warmed
with two runs on other prompts (allocations, the gate's cost model, the bandit: an RL engine
lives for the whole run).  Each measured repeat
uses a fresh prompt set (the same for every variant), so the n-gram proposer's history of earlier
responses never holds the prompt being decoded: n-gram drafts come from the prompt and the
sequence itself, as with prompt lookup.  Variants are interleaved, in an order that changes per
repeat, and the median over repeats is reported; the targets' ratios are medians of per-repeat
ratios (variants of one repeat run back to back, so a slow stretch of a shared machine cancels
out).
One torch thread; time is the thread's CPU time by default (``--clock cpu``: on a shared
machine it measures the work done, not the wait for a core); ``--clock wall`` for a dedicated
machine.  The engines' gates read the same clock.

Greedy outputs are checked: every specrl variant must reproduce specrl plain token for token
(``exact`` column); ``transformers``' agreement with specrl plain is reported too (batched
``transformers`` runs on left-padded inputs, whose rounding can flip a near-tie).

    python benchmarks/rollout.py --target runs/toy/target --draft runs/toy/draft
    python benchmarks/rollout.py --quick          # B = 1, 8, sampled only, 1 repeat
    python benchmarks/rollout.py --compile        # plus the compiled plain and best-of-N
    python benchmarks/rollout.py --decoupled --clock wall --threads 2 --batches 1,4,8,32

Writes ``benchmarks/results/rollout.json`` and prints a Rich table plus the issue's targets.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specrl.models.checkpoint import load_model
from specrl.models.decoder import Transformer
from specrl.models.tokenizer import TextCodec
from specrl.rl.tasks import AdditionTask
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig

try:
    from benchmarks import harness
except ModuleNotFoundError:  # run as a file (python benchmarks/rollout.py)
    import harness

MAX_K = 8  # the bandit chooses k in 1 … 8
WARMUP = 2  # warm-up rounds per (mode, B) on other prompts
SPECRL = ("specrl plain", "specrl ngram", "specrl eagle3", "specrl best-of-N")
COMPILED = ("specrl plain compiled", "specrl best-of-N compiled")
DECOUPLED = "specrl decoupled best-of-N"
HF = ("hf plain", "hf prompt lookup")
COLUMNS = (
    "mode", "batch", "variant", "tok_s", "vs_plain", "vs_hf", "tau", "acceptance",
    "spec_step_share", "forwards_per_token", "exact", "agree",
)  # fmt: skip


def spec_configs(
    draft: Path, compiled: bool, max_k: int = MAX_K, decoupled: bool = False,
    drafter: str = "process",
) -> dict[str, SpecConfig | None]:  # fmt: skip
    """The specrl variants' speculation settings (names ending in "compiled" compile)."""
    eagle = {"eagle3": {"path": str(draft)}}
    best = SpecConfig(("eagle3", "ngram"), max_k=max_k, proposer_options=eagle)
    specs = {
        "specrl plain": None,
        "specrl ngram": SpecConfig(("ngram",), max_k=max_k),
        "specrl eagle3": SpecConfig(("eagle3",), max_k=max_k, proposer_options=eagle),
        "specrl best-of-N": best,
    }
    if compiled:
        specs.update(zip(COMPILED, (None, best), strict=True))
    if decoupled:
        specs[DECOUPLED] = SpecConfig(
            ("eagle3", "ngram"), max_k=max_k, proposer_options=eagle, decoupled=True,
            drafter=drafter,
        )  # fmt: skip
    return specs


def prompt_set(codec: TextCodec, count: int, seed: int) -> list[list[int]]:
    problems = AdditionTask().sample(random.Random(seed), count)
    return [codec.encode_prompt(p.prompt) for p in problems]


class HFRunner:
    """``transformers`` ``generate`` over static batches of B prompts (left padded)."""

    def __init__(self, path: Path, eos: int, pad: int) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos, self.pad = eos, pad

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        batch: int,
        greedy: bool,
        max_tokens: int,
        seed: int,
        lookup: int = 0,
    ) -> list[list[int]]:
        torch.manual_seed(seed)
        kw: dict = dict(max_new_tokens=max_tokens, eos_token_id=self.eos, pad_token_id=self.pad)
        if greedy:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        if lookup:
            kw.update(prompt_lookup_num_tokens=lookup)
        out = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            gen = self.model.generate(ids, attention_mask=mask, **kw)[:, width:].tolist()
            for row in gen:
                n = row.index(self.eos) + 1 if self.eos in row else len(row)
                out.append(row[:n])
        return out


BASE_KEYS = ("seconds", "wall", "tokens", "out")  # per measured run; engines add their counters


def engine_stats(engine: RolloutEngine) -> dict:
    s = engine.stats()
    return {
        "drafts": s["spec"]["drafts"],
        "draft_tokens": s["spec"]["draft_tokens"],
        "accepted": s["spec"]["accepted"],
        "spec_steps": s["gating"]["spec_steps"],
        "plain_steps": s["gating"]["plain_steps"],
        "forwards": s["target_forwards"],
        "graphs": s["compiled_graphs"] or 0,  # graphs compiled so far (compiled engines)
    }


@dataclass
class Setup:
    """What every measured run of one mode shares."""

    mode: str  # "sampled" | "greedy"
    model: Transformer
    codec: TextCodec
    hf: HFRunner
    specs: dict[str, SpecConfig | None]
    max_tokens: int
    lookup: int  # prompt_lookup_num_tokens
    clock: Callable[[], float]
    threads: int = 1  # torch threads of every variant; the decoupled one's target gets one less

    @property
    def greedy(self) -> bool:
        return self.mode == "greedy"


def run_variant(
    setup: Setup, engines: dict[str, RolloutEngine], name: str, batch: int,
    prompts: list[list[int]], seed: int,
) -> list[list[int]] | None:  # fmt: skip
    """Generated tokens per prompt (None: the variant does not support this batch size)."""
    if name == "hf plain":
        torch.set_num_threads(setup.threads)
        return setup.hf.generate(prompts, batch, setup.greedy, setup.max_tokens, seed)
    if name == "hf prompt lookup":
        if batch > 1:
            return None  # transformers: assisted generation needs batch size 1
        torch.set_num_threads(setup.threads)
        return setup.hf.generate(
            prompts, batch, setup.greedy, setup.max_tokens, seed, lookup=setup.lookup
        )
    # a drafter thread takes one of the cores (it sets its own threads); a drafter process's
    # engine lends it one of its threads itself, in decoupled steps only
    spec = setup.specs.get(name)
    lend = name == DECOUPLED and spec is not None and spec.drafter == "thread"
    torch.set_num_threads(max(setup.threads - 1, 1) if lend else setup.threads)
    temperature = 0.0 if setup.greedy else 1.0
    reqs = [
        Request(p, SamplingParams(setup.max_tokens, temperature, seed=seed * 1000 + i))
        for i, p in enumerate(prompts)
    ]
    return [r.tokens for r in engines[name].generate(reqs)]


def measure_batch(setup: Setup, batch: int, repeats: int) -> dict[str, list[dict]]:
    """Two warm-up rounds, then ``repeats`` interleaved rounds of every variant; per-run records."""
    engines = {
        name: RolloutEngine(
            setup.model, codec=setup.codec, max_batch_size=batch, spec=spec, seed=0,
            clock=setup.clock, compile=name.endswith("compiled"),
        )
        for name, spec in setup.specs.items()
    }  # fmt: skip
    for engine in engines.values():
        engine.warmup()  # compiled engines: every graph class now, as a server does (else 0)
    count = max(batch, 8)
    prompts: dict[int, list[list[int]]] = {}  # per round, the same for every variant

    def run(name: str, rep: int) -> dict | None:
        if rep not in prompts:  # warm-up rounds (rep < 0) decode other prompts
            seed = 10_000 + 100 * batch + rep + WARMUP if rep < 0 else 1 + rep
            prompts[rep] = prompt_set(setup.codec, count, seed)
        run_seed = rep + WARMUP if rep < 0 else rep + 1
        before = engine_stats(engines[name]) if name in engines else None
        t0, w0 = setup.clock(), time.perf_counter()
        out = run_variant(setup, engines, name, batch, prompts[rep], run_seed)
        seconds, wall = setup.clock() - t0, time.perf_counter() - w0
        if out is None or rep < 0:
            return None
        rec = dict(zip(BASE_KEYS, (seconds, wall, sum(map(len, out)), out), strict=True))
        if before is not None:
            after = engine_stats(engines[name])
            rec.update({k: after[k] - before[k] for k in after})
        return rec

    return harness.interleave([*setup.specs, *HF], repeats, run, warmup=WARMUP)


def summarize(mode: str, batch: int, name: str, runs: list[dict], plain: list[dict]) -> dict:
    """One table row from the runs of a variant (``plain``: specrl plain's runs)."""
    if not runs:
        note = "unsupported: transformers assisted generation is batch 1"
        return {"mode": mode, "batch": batch, "variant": name, "tok_s": None, "note": note}
    row = {
        "mode": mode,
        "batch": batch,
        "variant": name,
        "tok_s": round(statistics.median(r["tokens"] / r["seconds"] for r in runs), 1),
        "tok_s_runs": [round(r["tokens"] / r["seconds"], 1) for r in runs],  # repeat order
        "wall_tok_s": round(statistics.median(r["tokens"] / r["wall"] for r in runs), 1),
        "tokens": round(statistics.mean(r["tokens"] for r in runs)),
    }
    if "drafts" in runs[0]:
        agg = {k: sum(r[k] for r in runs) for k in runs[0] if k not in BASE_KEYS}
        steps = agg["spec_steps"] + agg["plain_steps"]
        drafts, draft_tokens = agg["drafts"], agg["draft_tokens"]
        row["tau"] = round(1 + agg["accepted"] / drafts, 2) if drafts else None
        row["acceptance"] = round(agg["accepted"] / draft_tokens, 3) if draft_tokens else None
        row["spec_step_share"] = round(agg["spec_steps"] / steps, 2) if steps else 0.0
        row["forwards_per_token"] = round(agg["forwards"] / sum(r["tokens"] for r in runs), 3)
        # compilation inside the measured runs (a graph class the warm-up did not meet): its
        # seconds are in that repeat's time
        row["graphs_while_measured"] = agg["graphs"]
    if mode == "greedy":
        pairs = list(zip(runs, plain, strict=True))
        seqs = [a == b for r, p in pairs for a, b in zip(r["out"], p["out"], strict=True)]
        row["exact"] = all(r["out"] == p["out"] for r, p in pairs)
        row["agree"] = round(sum(seqs) / len(seqs), 3)
    return row


def run_mode(
    mode: str, batches: list[int], repeats: int, max_tokens: int, target: Path, draft: Path,
    lookup: int, clock: Callable[[], float], compiled: bool, max_k: int = MAX_K,
    decoupled: bool = False, threads: int = 1, drafter: str = "process",
) -> list[dict]:  # fmt: skip
    model = load_model(target).eval()
    codec = TextCodec.from_checkpoint(target, model.config)
    hf = HFRunner(target, codec.eos_id, model.config.pad_token_id or 0)
    specs = spec_configs(draft, compiled, max_k, decoupled, drafter)
    setup = Setup(mode, model, codec, hf, specs, max_tokens, lookup, clock, threads)
    rows = []
    for batch in batches:
        samples = measure_batch(setup, batch, repeats)
        for name, runs in samples.items():
            rows.append(summarize(mode, batch, name, runs, samples["specrl plain"]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


paired_ratio = harness.paired_ratio  # other scripts import it from here


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, per mode, from the rows (ratios paired per repeat)."""
    runs = {(r["mode"], r["batch"], r["variant"]): r.get("tok_s_runs") for r in rows}
    tps = {(r["mode"], r["batch"], r["variant"]): r["tok_s"] for r in rows}
    out = []

    def add(mode: str, name: str, value: float, need: float) -> None:
        out.append(
            {
                "mode": mode,
                "target": name,
                "value": round(value, 2),
                "need": need,
                "met": value >= need,
            }
        )

    for mode in dict.fromkeys(r["mode"] for r in rows):
        batches = sorted({r["batch"] for r in rows if r["mode"] == mode})
        names = [v for v in (*SPECRL, *COMPILED) if (mode, batches[0], v) in runs]
        get = {b: {v: runs[mode, b, v] for v in (*names, "hf plain")} for b in batches}
        suffixes = ["", " compiled"] if COMPILED[0] in names else [""]
        for suffix in suffixes:
            for b, need in ((1, 2.0), (32, 0.95)):
                if b in batches:
                    bon = get[b][f"specrl best-of-N{suffix}"]
                    ratio = paired_ratio(bon, get[b][f"specrl plain{suffix}"])
                    add(mode, f"best-of-N{suffix} / plain{suffix} at B={b}", ratio, need)
        if (mode, batches[0], DECOUPLED) in runs:
            for b in batches:
                dec = runs[mode, b, DECOUPLED]
                if b == 1:
                    ratio = paired_ratio(dec, runs[mode, b, "specrl best-of-N"])
                    add(mode, f"decoupled / serial best-of-N at B={b}", ratio, 1.3)
                ratio = paired_ratio(dec, runs[mode, b, "specrl plain"])
                add(mode, f"decoupled best-of-N / plain at B={b}", ratio, 1.0)
        for b in batches:
            # the best single proposer by median throughput, then paired with best-of-N
            single = max(("specrl ngram", "specrl eagle3"), key=lambda v: tps[mode, b, v])
            ratio = paired_ratio(get[b]["specrl best-of-N"], get[b][single])
            add(mode, f"best-of-N / best single at B={b}", ratio, 0.95)
        for suffix in suffixes:
            for b in batches:
                ratio = paired_ratio(get[b][f"specrl plain{suffix}"], get[b]["hf plain"])
                add(mode, f"specrl plain{suffix} / hf plain at B={b}", ratio, 1.5)
    return out


def add_ratios(rows: list[dict]) -> None:
    base = {(r["mode"], r["batch"], r["variant"]): r["tok_s"] for r in rows}
    for r in rows:
        if r["tok_s"] is None:
            continue
        plain = base[r["mode"], r["batch"], "specrl plain"]
        hf = base[r["mode"], r["batch"], "hf plain"]
        r["vs_plain"] = round(r["tok_s"] / plain, 2)
        r["vs_hf"] = round(r["tok_s"] / hf, 2)


def main() -> None:
    ap = harness.parser(__doc__, "rollout", repeats=9)
    ap.add_argument("--target", type=Path, default=Path("runs/toy/target"))
    ap.add_argument("--draft", type=Path, default=Path("runs/toy/draft"))
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--modes", default="sampled,greedy", help="sampled and/or greedy")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--max-k", type=int, default=MAX_K, help="longest draft of the speculative variants"
    )
    ap.add_argument(
        "--lookup", type=int, default=None, help="prompt_lookup_num_tokens (default: --max-k)"
    )
    ap.add_argument(
        "--compile", action="store_true", help="add compiled plain and best-of-N engines"
    )
    ap.add_argument(
        "--decoupled",
        action="store_true",
        help="add decoupled best-of-N (needs --clock wall)",
    )
    ap.add_argument(
        "--drafter",
        choices=("thread", "process"),
        default="process",
        help="decoupled best-of-N's drafter: a thread, or a process of its own (CPU)",
    )
    args = ap.parse_args()
    if args.decoupled and args.clock != "wall":
        ap.error("--decoupled needs --clock wall (its drafter runs on a thread of its own)")
    if args.max_k < 1:
        ap.error(f"--max-k must be ≥ 1, got {args.max_k}")
    if args.lookup is None:
        args.lookup = args.max_k
    clock = harness.configure(ap, args)
    for p, what in ((args.target, "config.json"), (args.draft, "specrl_draft.json")):
        if not (p / what).is_file():
            ap.error(f"{p} has no {what}: make the toy pair first (see docs/benchmarks.md)")
    batches = [1, 8] if args.quick else [int(b) for b in args.batches.split(",")]
    modes = ["sampled"] if args.quick else args.modes.split(",")
    repeats = 1 if args.quick else args.repeats
    rows = []
    for mode in modes:
        rows += run_mode(
            mode, batches, repeats, args.max_tokens, args.target, args.draft, args.lookup, clock,
            args.compile, args.max_k, args.decoupled, args.threads, args.drafter,
        )  # fmt: skip
    add_ratios(rows)
    checks = targets(rows)
    title = (
        f"rollout, addition, ≤{args.max_tokens} tokens, max k {args.max_k}, "
        f"{args.clock} clock, {args.threads} thread, median of {repeats}"
        + (f", decoupled drafter: {args.drafter}" if args.decoupled else "")
    )
    shown = [r if r["tok_s"] is not None else {**r, "tok_s": "unsupported"} for r in rows]
    import transformers

    config = {
        "target": str(args.target),
        "draft": str(args.draft),
        "max_tokens": args.max_tokens,
        "max_k": args.max_k,
        "compile": args.compile,
        "decoupled": args.decoupled,
        "drafter": args.drafter if args.decoupled else None,
        "threads": {
            "plain, serial, hf": args.threads,
            "decoupled": {
                "target": max(args.threads - 1, 1),
                "drafter": 1,
                "target in plain and coupled steps": args.threads
                if args.drafter == "process"
                else max(args.threads - 1, 1),
            },
        },
        "prompt_lookup_num_tokens": args.lookup,
        "transformers": transformers.__version__,
    }
    harness.report(
        args,
        [(title, shown, COLUMNS), ("targets", checks, ("mode", "target", "value", "need", "met"))],
        {"config": config, "rows": rows, "targets": checks},
    )


if __name__ == "__main__":
    main()
