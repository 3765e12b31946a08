"""The ``vllm`` check: vLLM with specrl's exported EAGLE-3 draft, on the same weights as specrl.

One random-init target (HF-format checkpoint with its tokenizer; GPU: the Llama-1B shape, dry
run: toy-small, whose head size vLLM's CPU attention takes) and its random-init draft, both
written once.  The engines come from the project's one factory,
:func:`specrl.rollout.factory.build_engine`, with ``rollout.backend`` switched: ``embedded``
plain, ``vllm`` plain and ``vllm`` with ``eagle3`` (the factory exports the draft in vLLM's
format).  Each decodes B random prompts (B = 1, 8, 64) at temperature 1 after a warm-up call;
tokens/s per engine, and τ of the speculative one (a random pair: this proves that vLLM loads
and runs specrl's export on CUDA, and sets vLLM's plain speed beside the embedded engine's;
the rollout check measures what a drafter's acceptance buys).

Skipped with the reason when vLLM is not installed or this checkout's factory has no vLLM
backend.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check import Ctx, result, table

BATCHES = (1, 8, 64)


def _why_not() -> str | None:
    """Why the vLLM check cannot run in this environment (None: it can)."""
    from gpu_check_steps import VLLM_MISSING

    if importlib.util.find_spec("vllm") is None:
        return VLLM_MISSING
    from specrl.config.schema import RolloutConfig

    if "backend" not in {f.name for f in dataclasses.fields(RolloutConfig)}:
        return "skipped: this checkout's engine factory has no vLLM backend (rollout.backend)"
    return None


def _engines(ctx: Ctx, policy: Path, draft: Path, max_model_len: int):
    """(name, build) for each engine, built one at a time (vLLM engines hold device memory)."""
    from specrl.config.loader import from_dict
    from specrl.config.schema import RolloutConfig
    from specrl.rollout.factory import build_engine

    def config(backend: str, spec: dict | None) -> RolloutConfig:
        data: dict[str, Any] = {"backend": backend, "max_batch_size": max(BATCHES),
                                "temperature": 1.0, "speculation": spec}  # fmt: skip
        if backend == "vllm":
            data["vllm"] = {"dtype": "bfloat16" if ctx.device == "cuda" else "float32"}
        return from_dict(RolloutConfig, data, source="gpu_check vllm")

    eagle = {"proposers": ["eagle3"], "max_k": 3}
    variants = [("specrl plain", config("embedded", None)), ("vllm plain", config("vllm", None)),
                ("vllm eagle3", config("vllm", eagle))]  # fmt: skip
    for name, rollout in variants:
        yield (
            name,
            lambda r=rollout: build_engine(
                r, str(policy), str(draft), device=ctx.device, seed=0, max_model_len=max_model_len
            ),
        )


def run(ctx: Ctx) -> dict[str, Any]:
    from gpu_check_rollout import _prompts, build_pair
    from gpu_check_steps import LLAMA_1B, _no_cuda

    from specrl.models.checkpoint import save_model
    from specrl.models.config import ModelConfig
    from specrl.models.draft_io import save_draft
    from specrl.models.presets import preset_config
    from specrl.models.tokenizer import char_tokenizer

    if (why := _no_cuda(ctx) or _why_not()) is not None:
        return result("skipped", why)
    tok = char_tokenizer()
    if ctx.dry_run:
        cfg = preset_config("toy-small", vocab_size=tok.get_vocab_size())
        dtype, prompt_len, max_tokens, draft_vocab = torch.float32, 8, 8, 32
    else:
        cfg = ModelConfig(**LLAMA_1B, max_position_embeddings=4096, tie_word_embeddings=False)
        dtype, prompt_len, max_tokens, draft_vocab = torch.bfloat16, 128, 128, 32000
    base = Path(tempfile.mkdtemp(prefix="gpu_check_vllm_"))
    try:
        target, draft = build_pair(cfg, torch.device(ctx.device), dtype, draft_vocab, False)
        save_model(target, base / "target", tokenizer=tok)
        save_draft(draft, base / "draft", target=target)
        del target, draft
        rows, figures = [], {}
        longest = 2 * (prompt_len + max_tokens)
        for name, build in _engines(ctx, base / "target", base / "draft", longest):
            if ctx.left() < 20:
                rows.append([name, "-", "-", "-", "skipped: the check's time limit"])
                continue
            engine = build()
            try:
                for b in BATCHES:
                    tps, tau = _measure(engine, _prompts, b, prompt_len, max_tokens, cfg.vocab_size)
                    rows.append([name, b, round(tps, 1), tau, ""])
                    figures[f"{name.replace(' ', '_')}_b{b}_tok_s"] = round(tps, 1)
            finally:
                close = getattr(engine, "close", None)
                if callable(close):
                    close()
                del engine
                gc.collect()
                if ctx.device == "cuda":
                    torch.cuda.empty_cache()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for b in BATCHES:
        plain, ours = figures.get(f"vllm_plain_b{b}_tok_s"), figures.get(f"specrl_plain_b{b}_tok_s")
        if plain and ours:
            figures[f"b{b}_specrl_over_vllm_plain"] = round(ours / plain, 3)
    return result("ok", figures=figures, tables=[table(
        f"vLLM and the embedded engine on {ctx.device}, the same random-init weights "
        f"({cfg.num_hidden_layers} layers, H {cfg.hidden_size}, V {cfg.vocab_size}); "
        f"prompts {prompt_len}, {max_tokens} tokens, T = 1",
        ["engine", "batch", "tok/s", "τ", "note"], rows,
    )])  # fmt: skip


def _measure(engine, prompts_of, batch: int, prompt_len: int, max_tokens: int, vocab: int):
    """tok/s of one timed generate after a warm-up one (other prompts), and its τ."""
    from specrl.rollout import Request, SamplingParams

    def call(seed: int):
        prompts = prompts_of(batch, prompt_len, vocab, seed)
        reqs = [Request(p, SamplingParams(max_tokens, 1.0, seed=seed * 1000 + i))
                for i, p in enumerate(prompts)]  # fmt: skip
        t0 = time.perf_counter()
        res = engine.generate(reqs)
        return time.perf_counter() - t0, res

    call(500 + batch)
    rates, taus = [], []
    for rep in range(2):
        seconds, res = call(rep + 1)
        rates.append(sum(len(r.tokens) for r in res) / seconds)
        spec = (getattr(res, "stats", None) or {}).get("spec") or {}
        if spec.get("tau") is not None:
            taus.append(spec["tau"])
    tau = round(statistics.fmean(taus), 3) if taus else None
    return statistics.median(rates), tau
