"""The ``rollout`` check: the embedded engine, plain against best-of-N, on a real-size target.

A trained real-size pair does not exist here, and a random-init draft is never accepted by a
random-init target; the check therefore replays a *measured* acceptance profile, losslessly:

- the target is a random-init Llama-1B shape (16 layers, H 2048, V 128256; the dry run: toy-tiny)
  whose ``lm_head`` is zero, so its next-token distribution p is exactly uniform over V (every
  matmul still runs: the cost of each forward is the real one);
- ``eagle3_replay`` is the EAGLE-3 proposer with a random-init draft (every draft forward, its
  logits and their softmax still run), whose chain step j then drafts from
  q = uniform over the first m_j = round(α_j · V) token ids.  The verifier accepts a draft token
  with probability min(1, p/q) = m_j / V = α_j, exactly the conditional acceptance α_j of
  position j, and the output stays a sample of p (the verification is the engine's own);
- α_j comes from a measured per-position profile (``PROFILE``: the toy pair's EAGLE-3 draft at
  temperature 1 with the learned draft temperature, per-position rates a_j of drafts whose first
  j tokens were all accepted; α_j = a_j / a_{j−1}).  The measured per-position acceptance is
  reported next to the replayed one, which proves the replay.

Per batch size B (1, 8, 64), ``specrl plain``, ``specrl eagle3`` (``eagle3_replay`` alone) and
``specrl best-of-N`` (the bandit over ``eagle3_replay`` and ``ngram``; k ≤ 4 and the batch-size
gate for both) decode B random prompts at
temperature 1, after a warm-up round on other prompts, in rounds whose order rotates
(``benchmarks/harness.py``'s ``interleave``); the speedups are medians over rounds of a
variant's tokens/s over plain's (or best-of-N's over eagle3's) in the same round
(``harness.paired_ratio``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from benchmarks import harness
from gpu_check import REPO, Ctx, result, table

from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig
from specrl.rollout.proposers import ProposerContext, register_proposer
from specrl.rollout.proposers.eagle3 import DraftPasses, Eagle3Proposer

PROFILE = REPO / "benchmarks" / "results" / "studies" / "draft_temperature.json"
PROFILE_ROW = {"target": "runs/toy/target", "scale": "auto"}
MAX_K = 4  # the profile's drafts were at most 4 long
COLUMNS = ["batch", "variant", "tok/s", "vs plain", "τ", "acceptance", "replay per position",
           "spec step share (warm-up incl.)", "selections"]  # fmt: skip


def conditional_profile(per_position: list[float]) -> list[float]:
    """α_j = P(position j accepted | positions < j accepted) from the per-position rates a_j
    (drafts whose first j tokens were all accepted, over drafts of length ≥ j)."""
    out, prev = [], 1.0
    for a in per_position:
        out.append(min(1.0, a / prev) if prev > 0 else 0.0)
        prev = a
    return out


def load_profile(path: Path = PROFILE) -> tuple[list[float], str]:
    """The measured per-position acceptance and where it came from."""
    rows = json.loads(path.read_text())["rows"]
    row = next(r for r in rows if all(str(r.get(k)) == v for k, v in PROFILE_ROW.items()))
    return row["per_position"], f"{path.relative_to(REPO)} ({row['target']}, scale {row['scale']})"


class ReplayPasses(DraftPasses):
    """The draft's passes with each draw replaced (after the real draw, for its cost) by one
    from q = uniform over target ids < m_j at chain position j (module docstring)."""

    def __init__(self, draft, vocab: int, alphas: list[float]) -> None:
        super().__init__(draft, vocab)
        self.sizes = [max(1, min(vocab, round(a * vocab))) for a in alphas]
        self.position = 0  # the chain position the next draw is for; 0 at each round's start

    def draw(self, logits, temps, u, greedy, sampled, any_greedy=True):
        if any_greedy:  # greedy verification ignores q: there is no rate to replay
            raise ValueError("eagle3_replay replays sampled acceptance: requests need T > 0")
        super().draw(logits, temps, u, greedy, sampled, any_greedy)  # the real draw's cost
        m = self.sizes[min(self.position, len(self.sizes) - 1)]
        self.position += 1
        ids = (u * m).long().clamp_(max=m - 1)
        q = torch.zeros(logits.shape[0], self.vocab, dtype=torch.float32, device=logits.device)
        q[:, :m] = 1.0 / m
        return ids, q


class ReplayProposer(Eagle3Proposer):
    """EAGLE-3 drafting whose chain step j draws from q = uniform over target ids < m_j (module
    docstring); the draft's own forwards run as usual, so its cost is the real one."""

    name = "eagle3_replay"
    # drafting ahead (specrl.rollout.decoupled) would continue chains at other positions than
    # the profile's, and a compiled round would trace the position counter: eager and coupled
    ahead_safe = False

    def __init__(self, draft, ctx: ProposerContext, *, alphas: list[float], max_k: int = 16):
        if ctx.compile:
            raise ValueError("eagle3_replay counts chain positions on the host: compile=False")
        super().__init__(draft, ctx, max_k=max_k, temperature_scale=1.0)
        self.passes = ReplayPasses(draft, self.vocab, alphas)

    @torch.no_grad()
    def propose(self, batch, ks):
        self.passes.position = 0
        return super().propose(batch, ks)


@register_proposer("eagle3_replay")
def _replay(ctx: ProposerContext, *, draft, alphas: list[float], max_k: int = 16):
    return ReplayProposer(draft, ctx, alphas=alphas, max_k=max_k)


def build_pair(
    cfg, device: torch.device, dtype: torch.dtype, draft_vocab: int, zero_head: bool = True
):
    """A random-init target and a random-init EAGLE-3 draft; ``zero_head``: the target's
    lm_head is zero, so its next-token distribution is exactly uniform."""
    from specrl.models.decoder import Transformer
    from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights

    with torch.device(device):
        target = Transformer(cfg)
    target.init_weights(0)
    if zero_head:
        with torch.no_grad():
            target.lm_head.weight.zero_()
    target = target.to(dtype).eval()
    dcfg = DraftConfig.for_target(cfg, draft_vocab_size=min(draft_vocab, cfg.vocab_size))
    with torch.device(device):
        draft = Eagle3Draft(dcfg)
    init_draft_weights(draft, 1)
    counts = torch.arange(cfg.vocab_size, 0, -1, dtype=torch.float64)
    draft.set_vocab_map(build_vocab_map(counts, dcfg.draft_vocab_size).to(device))
    draft.refresh_embedding(target.model.embed_tokens.weight)
    return target, draft.to(dtype).eval()


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(8, vocab, (n, length), generator=gen).tolist()


def _generate(engine: RolloutEngine, prompts, max_tokens: int, seed: int, sync) -> dict:
    reqs = [Request(p, SamplingParams(max_tokens, 1.0, seed=seed * 1000 + i))
            for i, p in enumerate(prompts)]  # fmt: skip
    sync()
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    sync()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": sum(len(r.tokens) for r in res), "stats": res.stats}


def run(ctx: Ctx) -> dict[str, Any]:
    from gpu_check_steps import LLAMA_1B, _no_cuda

    from specrl.models.config import ModelConfig
    from specrl.models.presets import preset_config

    if (why := _no_cuda(ctx)) is not None:
        return result("skipped", why)
    device = torch.device(ctx.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per_position, source = load_profile()
    alphas = conditional_profile(per_position)
    if ctx.dry_run:
        cfg = preset_config("toy-tiny", vocab_size=256)
        dtype, prompt_len, max_tokens, rounds, draft_vocab = torch.float32, 4, 6, 1, 64
    else:
        cfg = ModelConfig(**LLAMA_1B, max_position_embeddings=4096, tie_word_embeddings=False)
        dtype, prompt_len, max_tokens, rounds, draft_vocab = torch.bfloat16, 128, 128, 5, 32000
    batches = (1, 8, 64)
    target, draft = build_pair(cfg, device, dtype, draft_vocab)
    options = {"eagle3_replay": {"draft": draft, "alphas": alphas}}
    specs = {
        "specrl plain": None,
        "specrl eagle3": SpecConfig(("eagle3_replay",), max_k=MAX_K, proposer_options=options),
        "specrl best-of-N": SpecConfig(("eagle3_replay", "ngram"), max_k=MAX_K,
                                       proposer_options=options),
    }  # fmt: skip
    rows, figures, measured_pp = [], {}, {}
    for b in batches:
        if ctx.left() < 15:
            rows.append([b, "-", "skipped: the check's time limit", *["-"] * 6])
            continue
        engines = {
            name: RolloutEngine(target, max_batch_size=b, spec=spec, seed=0, eos_token_ids=(),
                                max_model_len=prompt_len + max_tokens + MAX_K + 2)
            for name, spec in specs.items()
        }  # fmt: skip

        def run_variant(name: str, rep: int, b: int = b, engines: dict = engines) -> dict:
            # rep < 0: the warm-up round (allocations, the gate's cost model, the bandit), on
            # other prompts; then each round's prompts are the same for both variants
            prompts = _prompts(b, prompt_len, cfg.vocab_size, 1 + rep if rep >= 0 else 100)
            return _generate(engines[name], prompts, max_tokens, rep + 2, sync)

        runs = harness.interleave(list(engines), rounds, run_variant, warmup=1)
        tps = {n: [x["tokens"] / x["seconds"] for x in rs] for n, rs in runs.items()}
        rows.append([b, "specrl plain", round(harness.median(tps["specrl plain"]), 1), 1.0,
                     *[None] * (len(COLUMNS) - 4)])  # fmt: skip
        for name in ("specrl eagle3", "specrl best-of-N"):
            stats = [x["stats"] for x in runs[name]]
            spec = _sum_spec([x["spec"] for x in stats])
            replay = _sum_spec([x["proposers"][ReplayProposer.name] for x in stats
                                if ReplayProposer.name in x["proposers"]])  # fmt: skip
            gating = engines[name].stats()["gating"]  # the warm-up round included
            steps = gating["spec_steps"] + gating["plain_steps"]
            speedup = harness.paired_ratio(tps[name], tps["specrl plain"])
            rows.append([
                b, name, round(harness.median(tps[name]), 1), round(speedup, 3), spec["tau"],
                spec["acceptance"], replay["per_position"],
                round(gating["spec_steps"] / steps, 2) if steps else None,
                json.dumps(_selections(stats)),
            ])  # fmt: skip
            key = "best_of_n" if name == "specrl best-of-N" else "eagle3"
            figures[f"b{b}_{key}_tok_s"] = round(harness.median(tps[name]), 1)
            if name == "specrl best-of-N":
                figures[f"b{b}_speedup"] = round(speedup, 3)
                if spec["tau"] is not None:
                    figures[f"b{b}_tau"] = spec["tau"]
            else:
                figures[f"b{b}_eagle3_speedup"] = round(speedup, 3)
        figures[f"b{b}_plain_tok_s"] = round(harness.median(tps["specrl plain"]), 1)
        figures[f"b{b}_best_of_n_over_eagle3"] = round(
            harness.paired_ratio(tps["specrl best-of-N"], tps["specrl eagle3"]), 3
        )
        measured_pp[b] = replay["per_position"]
        ctx.partial(figures, [table("rollout (so far)", COLUMNS, rows)])
        del engines
        if device.type == "cuda":
            torch.cuda.empty_cache()
    pp_rows = [["replayed (α_j → a_j)", *_rates(alphas)], ["source a_j", *per_position]]
    pp_rows += [[f"measured eagle3_replay, B={b}", *v] for b, v in measured_pp.items() if v]
    params = sum(p.numel() for p in target.parameters())
    shape = (f"{cfg.num_hidden_layers} layers, H {cfg.hidden_size}, V {cfg.vocab_size}, "
             f"{params / 1e9:.2f} B params, {str(dtype).removeprefix('torch.')}")  # fmt: skip
    return result(
        "ok",
        figures=figures,
        tables=[
            table(
                f"rollout on {ctx.device}: {shape}; prompts {prompt_len}, {max_tokens} tokens, "
                f"T = 1, k ≤ {MAX_K}, median of {rounds} rounds",
                COLUMNS,
                rows,
            ),
            table(f"per-position acceptance, replayed from {source}",
                  ["profile", *[f"a_{j + 1}" for j in range(len(per_position))]], pp_rows),
        ],
        profile={"source": source, "per_position": per_position, "alphas": alphas},
    )  # fmt: skip


def _rates(alphas: list[float]) -> list[float]:
    """The per-position rates a_j the conditional α_j imply (a round trip of the profile)."""
    out, a = [], 1.0
    for x in alphas:
        a *= x
        out.append(round(a, 3))
    return out


def _sum_spec(specs: list[dict]) -> dict[str, Any]:
    """τ, acceptance and per-position acceptance of speculation counters summed over calls."""
    drafts = sum(s["drafts"] for s in specs)
    draft_tokens = sum(s["draft_tokens"] for s in specs)
    accepted = sum(s["accepted"] for s in specs)
    width = max((len(s["position_drafts"]) for s in specs), default=0)
    pos_d, pos_a = [0] * width, [0] * width
    for s in specs:
        for j, (d, a) in enumerate(zip(s["position_drafts"], s["position_accepted"], strict=True)):
            pos_d[j] += d
            pos_a[j] += a
    return {
        "tau": round(1 + accepted / drafts, 3) if drafts else None,
        "acceptance": round(accepted / draft_tokens, 3) if draft_tokens else None,
        "per_position": [round(a / d, 3) if d else None for d, a in zip(pos_d, pos_a, strict=True)],
    }


def _selections(stats: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in stats:
        for k, v in s["selections"].items():
            out[k] = out.get(k, 0) + v
    return out
