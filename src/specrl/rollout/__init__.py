"""Rollouts: the embedded speculative engine, proposers, lossless verification, HTTP server.

- :mod:`~specrl.rollout.types`: requests, results, sequence state, drafts, the ``Engine``
  Protocol every backend implements;
- :mod:`~specrl.rollout.factory`: ``build_engine`` from a recipe's rollout section (the CLI,
  the server and the trainer all call it);
- :mod:`~specrl.rollout.engine`: :class:`RolloutEngine` (continuous batching, slot KV cache,
  speculation, weight updates, stats);
- :mod:`~specrl.rollout.sampling`: sampling parameters, processed distributions, the sampler;
- :mod:`~specrl.rollout.verify`: the accept / recover / bonus rule, batched on device;
- :mod:`~specrl.rollout.proposers`: the ``Proposer`` protocol, the registry, ``ngram``;
- :mod:`~specrl.rollout.gating`: the speculation policy (batch-size gate, drafter/k choice),
  over :mod:`~specrl.rollout.estimates` (acceptance per position, cost curves) and
  :mod:`~specrl.rollout.bandit` (ε-greedy, running means);
- :mod:`~specrl.rollout.metrics`: τ, per-position acceptance, counters, the stale-draft alarm;
- :mod:`~specrl.rollout.server`: the OpenAI-compatible HTTP server (``specrl rollout serve``).
"""

from specrl.rollout.engine import RolloutEngine, SpecConfig
from specrl.rollout.sampling import SamplingParams
from specrl.rollout.types import Engine, Request, Result, Results

__all__ = [
    "Engine",
    "Request",
    "Result",
    "Results",
    "RolloutEngine",
    "SamplingParams",
    "SpecConfig",
]
