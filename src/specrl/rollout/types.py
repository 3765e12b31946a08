"""The rollout layer's data: requests, results, sequence state, drafts — and the engine Protocol.

Data only (no torch work, no engine logic), so every module of :mod:`specrl.rollout` and every
backend (the embedded engine, :mod:`specrl.integrations.vllm_engine`) imports it without pulling
in the others.

- :class:`Request` → an engine → one :class:`Result` per sample (``n`` per request), returned as
  :class:`Results`: the list plus the call's own statistics, so a caller never diffs counters;
- :class:`SeqState` is one sample inside the embedded engine (what proposers read);
- :class:`Draft` is a proposer's answer for one sequence;
- :class:`Engine` is what the trainer, ``specrl rollout`` and the server need of a backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from specrl.rollout.metrics import SpecStats
from specrl.rollout.sampling import SamplingParams


@dataclass
class Request:
    """A prompt (text, needs the engine's codec; or token ids) and how to sample it."""

    prompt: str | Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None  # default: "req-<counter>"


@dataclass
class Result:
    """One finished sample.

    ``logprobs[i]`` is log p(tokens[i]) under the distribution it was drawn from (after
    temperature/top-k/top-p; greedy → 0.0); ``policy_logprobs[i]`` is the raw policy's
    log-softmax at temperature 1, the one RL importance ratios need.  ``tokens`` include a final
    stop token; ``text`` excludes stop tokens and is cut before a matched stop string.
    """

    request_id: str
    index: int  # sample index within the request (a GRPO group shares request_id)
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    logprobs: list[float]
    policy_logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None  # the stop token id or stop string, if any
    spec: dict[str, Any]  # per-request speculation statistics (SpecStats.to_dict() + forwards)
    policy_versions: tuple[int, int]  # policy versions of its first and last step

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "index": self.index,
            "text": self.text,
            "tokens": self.tokens,
            "logprobs": self.logprobs,
            "policy_logprobs": self.policy_logprobs,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "policy_versions": list(self.policy_versions),
            "spec": self.spec,
        }


class Results(list[Result]):
    """What ``generate`` returns: the finished samples (request-major, then by sample index)
    and ``stats``, the statistics of this call alone — the counters of :meth:`Engine.stats`
    (``tokens``, ``target_forwards``, ``spec``, ``proposers``, ``selections``, ``alarms`` …)
    counted over its own steps."""

    def __init__(self, results: Sequence[Result] = (), stats: dict[str, Any] | None = None):
        super().__init__(results)
        self.stats: dict[str, Any] = stats if stats is not None else {}


@dataclass(eq=False)
class SeqState:
    """One sequence (one sample of one request) inside the engine; proposers read it."""

    seq_id: int
    request_id: str
    index: int  # sample index within its request (0..n-1): a GRPO group shares request_id
    tokens: list[int]  # prompt + output so far
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None  # None for greedy requests (no randomness consumed)
    slot: int = -1  # KV-cache slot while running
    kv_len: int = 0  # target KV entries committed in the slot (len(tokens) − 1 once prefilled)
    logprobs: list[float] = field(default_factory=list)  # log p under the sampling distribution
    policy_logprobs: list[float] = field(default_factory=list)  # raw policy, temperature 1
    finish_reason: str | None = None  # "stop" | "length" once finished
    stop_reason: int | str | None = None  # stop token id or stop string that ended it
    text: str | None = None  # decoded output (set when finished, or for stop strings)
    stats: SpecStats = field(default_factory=SpecStats)
    forwards: int = 0  # target forwards this sequence took part in (prefill included)
    policy_versions: tuple[int, int] = (0, 0)  # (first, last) policy version that decoded it

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        """``len(output)`` without copying it (per token on the engine's hot path)."""
        return len(self.tokens) - self.prompt_len

    @property
    def prompt(self) -> list[int]:
        return self.tokens[: self.prompt_len]


@dataclass
class Draft:
    """Draft tokens for one sequence (possibly empty) and the q they were drawn from."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] over the target vocabulary; None: one-hot


@runtime_checkable
class Engine(Protocol):
    """A rollout backend: what ``specrl train``, ``specrl rollout`` and the server call.

    The embedded :class:`~specrl.rollout.engine.RolloutEngine` and vLLM's
    (:mod:`specrl.integrations.vllm_engine`) implement it; :func:`specrl.rollout.factory.
    build_engine` builds either from a recipe's rollout section.
    """

    def generate(self, requests: Sequence[Request]) -> Results:
        """Decode every request to completion; the results and this call's statistics."""
        ...

    def update_weights(
        self,
        policy: Mapping[str, torch.Tensor] | None = None,
        draft: Mapping[str, torch.Tensor] | None = None,
        version: int | None = None,
    ) -> None:
        """Load new policy and/or draft weights (``version`` defaults to the previous + 1)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters since construction (the keys of :attr:`Results.stats`) and the backend's
        state (versions, queue sizes, its speculation policy)."""
        ...

    @property
    def takes_draft_weights(self) -> bool:
        """Whether ``update_weights(draft=…)`` has a drafter to load them into."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state a resumed run needs to replay decisions exactly (idle engine)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
