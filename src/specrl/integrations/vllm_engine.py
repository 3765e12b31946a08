"""vLLM as the rollout backend: the :class:`~specrl.rollout.RolloutEngine` interface on vLLM.

``VllmRolloutEngine(policy_dir, draft_export_dir=…)`` builds ``vllm.LLM`` with
``speculative_config={"method": "eagle3", "model": <export>, "num_speculative_tokens": k}``
(the draft exported by :func:`specrl.models.draft_io.export_draft` in vLLM's layer-id
convention) and offers the embedded engine's methods:

- ``generate(requests) -> list[Result]`` — request-major, ``n`` samples each; per-token
  ``logprobs`` are vLLM's sampled-token logprobs (``logprobs=0``), which follow the processed
  (temperature/top-k/top-p) distribution when ``logprobs_mode="processed_logprobs"`` is
  available, else the raw one — :attr:`logprob_kind` says which;
- ``update_weights(policy=…, draft=…, version=…)`` — hot update through a worker extension
  (:class:`SpecrlWorkerExtension`, ``collective_rpc``) that calls the models' ``load_weights``;
  the draft is loaded with serving names (``midlayer.*``; vLLM renames them);
- ``stats()`` — vLLM's speculative-decoding counters mapped to specrl's names (τ = 1 +
  accepted / drafts, as vLLM defines it).

Not exercised on this project's CPU machines (vLLM needs a GPU): the conversion functions
below are unit-tested against vLLM-shaped objects, the rest follows vLLM's public API
(``LLM``, ``SamplingParams``, ``collective_rpc``, ``get_metrics``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specrl.errors import missing_extra
from specrl.rollout.engine import Request, Result
from specrl.rollout.sampling import SamplingParams


def _vllm():
    try:
        import vllm
    except ImportError:
        raise missing_extra("vllm", "vllm") from None
    return vllm


def to_vllm_params(p: SamplingParams, module: Any) -> Any:
    """specrl sampling parameters → ``vllm.SamplingParams`` (one sampled-token logprob)."""
    return module.SamplingParams(
        n=p.n,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k if p.top_k > 0 else -1,
        max_tokens=p.max_tokens,
        seed=p.seed,
        stop=list(p.stop) or None,
        stop_token_ids=list(p.stop_token_ids) or None,
        logprobs=0,
    )


def from_vllm_output(out: Any, prompt_tokens: Sequence[int], versions: tuple[int, int]):
    """One ``vllm.RequestOutput`` → specrl :class:`Result` objects (one per sample)."""
    results = []
    for i, comp in enumerate(out.outputs):
        toks = list(comp.token_ids)
        lps = []
        for t, entry in zip(toks, comp.logprobs or [{}] * len(toks), strict=True):
            lp = entry.get(t) if entry else None
            lps.append(float(getattr(lp, "logprob", lp)) if lp is not None else float("nan"))
        finish = "stop" if comp.finish_reason == "stop" else "length"
        results.append(
            Result(
                request_id=out.request_id,
                index=getattr(comp, "index", i),
                prompt_tokens=list(prompt_tokens),
                tokens=toks,
                text=comp.text,
                logprobs=lps,
                policy_logprobs=lps,
                finish_reason=finish,
                stop_reason=comp.stop_reason,
                spec={},
                policy_versions=versions,
            )
        )
    return results


def spec_stats_from_metrics(metrics: Sequence[Any]) -> dict[str, Any]:
    """vLLM's ``LLM.get_metrics()`` spec-decode counters → specrl's names (τ, α)."""
    values: dict[str, float] = {}
    for m in metrics:
        name = getattr(m, "name", "")
        if name.startswith("vllm:spec_decode_"):
            values[name.removeprefix("vllm:spec_decode_")] = float(getattr(m, "value", 0.0))
    drafts = values.get("num_drafts", 0.0)
    accepted = values.get("num_accepted_tokens", 0.0)
    draft_tokens = values.get("num_draft_tokens", 0.0)
    return {
        "drafts": int(drafts),
        "accepted": int(accepted),
        "draft_tokens": int(draft_tokens),
        "tau": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
    }


class SpecrlWorkerExtension:
    """Mixed into vLLM workers (``worker_extension_cls``): in-place weight loading."""

    def specrl_load_policy(self, weights: list[tuple[str, Any]]) -> None:
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]

    def specrl_load_draft(self, weights: list[tuple[str, Any]]) -> None:
        drafter = self.model_runner.drafter  # type: ignore[attr-defined]
        drafter.model.load_weights(weights=[(n, t) for n, t in weights if n != "t2d"])


class VllmRolloutEngine:
    """The rollout-engine interface on vLLM (see the module docstring)."""

    logprob_kind = "sampled-token logprob as reported by vLLM"

    def __init__(
        self,
        policy_dir: str,
        *,
        draft_export_dir: str | None = None,
        num_speculative_tokens: int = 3,
        tensor_parallel_size: int = 1,
        max_num_seqs: int = 256,
        seed: int = 0,
        gpu_memory_utilization: float = 0.85,
        dtype: str = "bfloat16",
    ) -> None:
        vllm = _vllm()
        spec = None
        if draft_export_dir is not None:
            spec = {
                "method": "eagle3",
                "model": draft_export_dir,
                "num_speculative_tokens": num_speculative_tokens,
            }
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=policy_dir,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            seed=seed,
            speculative_config=spec,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=True,
            worker_extension_cls=f"{__name__}.SpecrlWorkerExtension",
        )
        self.policy_version = 0
        self.draft_version = 0

    def generate(self, requests: Sequence[Request]) -> list[Result]:
        prompts = [{"prompt_token_ids": list(r.prompt)} for r in requests]
        params = [to_vllm_params(r.params, self._vllm) for r in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        versions = (self.policy_version, self.policy_version)
        results: list[Result] = []
        for req, out in zip(requests, outs, strict=True):
            results.extend(from_vllm_output(out, req.prompt, versions))
        return results

    def update_weights(
        self,
        policy: Mapping[str, Any] | None = None,
        draft: Mapping[str, Any] | None = None,
        version: int | None = None,
    ) -> None:
        if policy is not None:
            self.llm.collective_rpc("specrl_load_policy", args=(list(policy.items()),))
            self.policy_version = version if version is not None else self.policy_version + 1
        if draft is not None:
            self.llm.collective_rpc("specrl_load_draft", args=(list(draft.items()),))
            self.draft_version = version if version is not None else self.draft_version + 1
        self.llm.reset_prefix_cache()  # cached KV of the old weights must not be reused

    def stats(self) -> dict[str, Any]:
        return {
            "policy_version": self.policy_version,
            "draft_version": self.draft_version,
            "spec": spec_stats_from_metrics(self.llm.get_metrics()),
        }
