"""One RL step's experience: this replica's prompts, their rollout requests, scored samples.

- :func:`replica_prompts`: the step's prompts drawn on every rank (the generator stays in step
  everywhere), this data-parallel replica's slice of them;
- :func:`rollout_requests`: ``n`` samples per prompt with per-request seeds derived from
  (seed, step, prompt), so sampling does not depend on batch composition;
- :func:`score`: rewards from the task's verifier, group advantages (GRPO; DAPO dynamic
  sampling drops groups whose rewards are all equal), the training samples, and the step's
  rollout counters (:data:`COUNTERS`) taken from the ``generate`` call's own statistics;
- :func:`rollout_metrics`: the metrics record's rollout part from those counters summed over
  the replicas (:func:`sum_counters`);
- :func:`wave_metrics`: the shape of this replica's rollout wave — the response-length
  distribution (p50 / p90 / max) and the live batch per engine step, run-length encoded;
- :func:`max_seq_len`: the longest prompt + response the engine admits.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch

from specrl.config.schema import AlgoConfig, RolloutConfig
from specrl.models.tokenizer import TextCodec
from specrl.rl.advantages import group_advantages, informative_groups
from specrl.rl.tasks import Problem, Task
from specrl.rollout import Request, SamplingParams
from specrl.rollout.types import Results
from specrl.train.batch import Sample

# a step's counters, summed over the replicas' rollout ranks (zero on the other ranks)
COUNTERS = (
    "reward_sum",
    "count",
    "correct",
    "groups_kept",
    "response_tokens",
    "drafts",
    "accepted",
    "draft_tokens",
    "target_forwards",
    "tokens",
    "alarms",
    "samples",
)


def replica_prompts(
    task: Task, rng: random.Random, prompts_per_step: int, dp: int, dp_rank: int
) -> list[tuple[int, Problem]]:
    """(index in the step, problem) of this replica's share of the step's prompts."""
    problems = task.sample(rng, prompts_per_step)
    per_replica = prompts_per_step // dp
    start = dp_rank * per_replica
    return list(enumerate(problems))[start : start + per_replica]


def rollout_requests(
    prompts: list[tuple[int, Problem]],
    codec: TextCodec,
    rollout: RolloutConfig,
    seed: int,
    step: int,
) -> list[Request]:
    return [
        Request(
            codec.encode_prompt(p.prompt),
            SamplingParams(
                max_tokens=rollout.max_tokens,
                temperature=rollout.temperature,
                n=rollout.n,
                seed=(seed * 1_000_003 + step * 10_007 + i) % 2**62,
            ),
            request_id=f"s{step}-p{i}",
        )
        for i, p in prompts
    ]


def score(
    task: Task, prompts: list[tuple[int, Problem]], results: Results, n: int, algo: AlgoConfig
) -> tuple[list[Sample], dict[str, float]]:
    """The training samples of ``results`` (``n`` per prompt, request-major) and the counters."""
    rewards = [float(task.reward(res.text, prompts[j // n][1])) for j, res in enumerate(results)]
    adv = group_advantages(rewards, n, std_normalize=algo.std_normalize)
    keep = set(informative_groups(rewards, n) if algo.dynamic_sampling else range(len(prompts)))
    samples = [
        Sample(list(res.prompt_tokens), list(res.tokens), list(res.logprobs), adv[j])
        for j, res in enumerate(results)
        if j // n in keep
    ]
    stats, spec = results.stats, results.stats["spec"]
    counters = {
        "reward_sum": sum(rewards),
        "count": len(rewards),
        "correct": sum(1 for x in rewards if x >= 1.0),
        "groups_kept": len(keep),
        "response_tokens": sum(len(res.tokens) for res in results),
        "samples": len(samples),
        **{k: spec[k] for k in ("drafts", "accepted", "draft_tokens")},
        **{k: stats[k] for k in ("target_forwards", "tokens", "alarms")},
    }
    return samples, counters


def sum_counters(
    counters: dict[str, float], sum_: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, float]:
    """This replica's :data:`COUNTERS` (missing ones 0) summed over the replicas by ``sum_``
    (the layout's all-reduce; collective)."""
    t = torch.tensor([float(counters.get(k, 0)) for k in COUNTERS], dtype=torch.float64)
    return dict(zip(COUNTERS, sum_(t).tolist(), strict=True))


def rollout_metrics(g: dict[str, float], stats: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The record's rollout part: ``g`` the :data:`COUNTERS` summed over the replicas,
    ``stats`` this replica's ``Results.stats`` ({} off the rollout ranks), ``seconds`` its
    rollout time."""
    count, drafts = max(g["count"], 1), g["drafts"]
    return {
        "reward": g["reward_sum"] / count,
        "accuracy": g["correct"] / count,
        "groups_kept": int(g["groups_kept"]),
        "samples_trained": int(g["samples"]),
        "response_len": g["response_tokens"] / count,
        "tau": 1 + g["accepted"] / drafts if drafts else None,
        "acceptance_rate": g["accepted"] / g["draft_tokens"] if g["draft_tokens"] else None,
        # this replica's (rank 0's, in the metrics file)
        "per_position_acceptance": stats.get("spec", {}).get("per_position", []),
        "drafter_selections": stats.get("selections", {}),
        "tau_by_proposer": {
            name: s["tau"] for name, s in stats.get("proposers", {}).items() if s["drafts"]
        },
        "forwards_per_token": g["target_forwards"] / max(g["tokens"], 1),
        "spec_alarms": int(g["alarms"]),
        "rollout_tokens": int(g["tokens"]),
        "rollout_tokens_per_s": g["tokens"] / max(seconds, 1e-9),
    }


def _quantile(sorted_xs: list[int], q: float) -> int:
    """The nearest-rank q-quantile of a sorted non-empty list."""
    return sorted_xs[max(math.ceil(q * len(sorted_xs)), 1) - 1]


def run_lengths(values: list[list[int]] | list[tuple[int, ...]]) -> list[list[int]]:
    """``[[*value, repeats], …]``: consecutive equal entries of ``values`` folded together."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][:-1] == list(v):
            out[-1][-1] += 1
        else:
            out.append([*v, 1])
    return out


def wave_metrics(results: Results | None) -> dict[str, Any]:
    """This replica's rollout wave ({} off the rollout ranks): response lengths in tokens
    (nearest-rank p50 / p90, max) and, where the engine reports it, ``live_batch``: per engine
    step ``[live sequences, of them drafting, consecutive steps alike]``."""
    if results is None or not len(results):
        return {}
    lengths = sorted(len(r.tokens) for r in results)
    out: dict[str, Any] = {
        "response_len_p50": _quantile(lengths, 0.5),
        "response_len_p90": _quantile(lengths, 0.9),
        "response_len_max": lengths[-1],
    }
    wave = results.stats.get("wave")
    if wave is not None:
        out["live_batch"] = run_lengths(wave)
    return out


def max_seq_len(task: Task, codec: TextCodec, max_positions: int, max_tokens: int) -> int:
    """Longest prompt + response the engine admits (bounds the pipeline's token budget): four
    times the longest of 64 sampled prompts, plus ``max_tokens`` and a margin, within the
    model's ``max_positions``."""
    longest_prompt = 0
    for p in task.sample(random.Random(0), 64):
        longest_prompt = max(longest_prompt, len(codec.encode_prompt(p.prompt)))
    return min(max_positions, 4 * longest_prompt + max_tokens + 16)
