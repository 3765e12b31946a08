"""The ``rl_step`` check: RL steps' time split (rollout / policy / draft / sync), cotrain vs none.

Two trainers (``specrl train``'s own :func:`~specrl.train.loop.build_trainer`) on the same
random-init target and random-init EAGLE-3 draft — GPU: the Llama-1B shape, bf16 policy; dry
run: toy-tiny — with ``draft.mode: cotrain`` (eagle3 + ngram drafters, the draft trained on
every policy forward) and ``draft.mode: none`` (plain decoding), advanced one step each in
turn: a warm-up step, then the measured ones.  Figures are the trainer's own per-step times
(``time_rollout``, ``time_policy_update``, ``time_draft_update``, ``time_sync``: host clocks
around each phase, which this check makes synchronise the device first, so each phase's queued
kernels count in that phase and not in the next) and the whole step between synchronisations.

A random draft is not accepted by a random target (τ ≈ 1, the gate turns speculation off), so
this check measures what co-training *costs* — the draft update against the policy update, the
sync, the gate's probes — while the ``rollout`` check measures what speculation *saves*.  The
``projected`` figures combine the two: none's step with its rollout divided by the rollout
check's best-of-N speedup at batch 64, plus cotrain's measured draft update and sync.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from gpu_check import Ctx, result, table

MODES = ("cotrain", "none")


class SyncedTime:
    """The ``time`` module as the trainer's modules see it during the check: ``perf_counter``
    synchronises the device first (phase boundaries only: a few syncs per step)."""

    def __init__(self, sync) -> None:
        self._sync = sync

    def perf_counter(self) -> float:
        self._sync()
        return time.perf_counter()

    def __getattr__(self, name: str):
        return getattr(time, name)


def synced_phase_clocks(sync) -> None:
    """Make the trainer's phase timers (``specrl.train.loop``, ``.strategy``) device-synced."""
    import specrl.train.loop as loop
    import specrl.train.strategy as strategy

    for module in (loop, strategy):
        module.time = SyncedTime(sync)


KEYS = ("time_rollout", "time_policy_update", "time_draft_update", "time_sync")


def _artifacts(ctx: Ctx, cfg, dtype: torch.dtype, draft_vocab: int):
    """The target (HF-format, char tokenizer) and its draft, in a scratch folder."""
    from gpu_check_rollout import build_pair

    from specrl.models.checkpoint import save_model
    from specrl.models.draft_io import save_draft
    from specrl.models.tokenizer import char_tokenizer

    base = Path(tempfile.mkdtemp(prefix="gpu_check_rl_"))  # checkpoints stay out of --out
    target, draft = build_pair(cfg, torch.device(ctx.device), dtype, draft_vocab, zero_head=False)
    save_model(target, base / "target", tokenizer=char_tokenizer())
    save_draft(draft, base / "draft", target=target)
    del target, draft
    return base


def _recipe(base, ctx: Ctx, mode: str, dtype: str, sizes: dict[str, int]) -> dict[str, Any]:
    batch = sizes["prompts"] * sizes["n"]
    rec: dict[str, Any] = {
        "run": {"name": f"gpu-check-{mode}", "out_dir": str(base / mode), "seed": 0,
                "device": ctx.device, "deterministic": False},
        "task": {"name": "addition", "min_digits": 2, "max_digits": 3, "eval_size": 8},
        "policy": {"path": str(base / "target"), "dtype": dtype,
                   "max_new_tokens": sizes["max_tokens"]},
        "draft": {"mode": mode, "path": str(base / "draft"), "ttt_steps": 3},
        "rollout": {"prompts_per_step": sizes["prompts"], "n": sizes["n"], "temperature": 1.0,
                    "max_tokens": sizes["max_tokens"], "max_batch_size": batch,
                    "speculation": {"proposers": ["eagle3", "ngram"], "max_k": 4}},
        "algo": {"name": "grpo", "minibatches": 2, "dynamic_sampling": False},
        "checkpoint": {"every": 0},
        "train": {"steps": sizes["steps"], "eval_every": 0},
    }  # fmt: skip
    if mode == "none":
        rec["rollout"]["speculation"] = None
    return rec


def run(ctx: Ctx) -> dict[str, Any]:
    from gpu_check_steps import LLAMA_1B, _no_cuda

    from specrl.models.config import ModelConfig
    from specrl.models.presets import preset_config
    from specrl.models.tokenizer import char_tokenizer

    if (why := _no_cuda(ctx)) is not None:
        return result("skipped", why)
    if ctx.dry_run:
        cfg = preset_config("toy-tiny", vocab_size=char_tokenizer().get_vocab_size())
        dtype, draft_vocab = "float32", 24
        sizes = {"prompts": 2, "n": 2, "max_tokens": 8, "steps": 2}
    else:
        cfg = ModelConfig(**LLAMA_1B, max_position_embeddings=4096, tie_word_embeddings=False)
        dtype, draft_vocab = "bfloat16", 32000
        sizes = {"prompts": 8, "n": 8, "max_tokens": 64, "steps": 4}
    base = _artifacts(ctx, cfg, getattr(torch, dtype), draft_vocab)
    try:
        return _measure(ctx, base, cfg, dtype, sizes)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _measure(ctx: Ctx, base: Path, cfg, dtype: str, sizes: dict[str, int]) -> dict[str, Any]:
    from specrl.config import Recipe, load_recipe
    from specrl.train.loop import build_trainer

    sync = torch.cuda.synchronize if ctx.device == "cuda" else (lambda: None)
    synced_phase_clocks(sync)
    trainers, gens = {}, {}
    for mode in MODES:
        path = base / f"{mode}.yaml"
        path.write_text(yaml.safe_dump(_recipe(base, ctx, mode, dtype, sizes), sort_keys=False))
        trainers[mode] = build_trainer(load_recipe(path, Recipe, []), source=str(path))
        gens[mode] = trainers[mode].steps()
    recs: dict[str, list[dict]] = {m: [] for m in MODES}
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    for step in range(sizes["steps"]):
        if step > 1 and ctx.left() < 20:
            break
        for mode in MODES if step % 2 == 0 else tuple(reversed(MODES)):
            sync()
            t0 = time.perf_counter()
            rec = next(gens[mode])
            sync()
            if step > 0:  # step 0 warms up (allocations, cuBLAS, the optimizer states)
                recs[mode].append(rec)
                walls[mode].append(time.perf_counter() - t0)
    for g in gens.values():
        g.close()
    rows, figures = [], {}
    for mode in MODES:
        mean = {k: statistics.fmean(r.get(k) or 0.0 for r in recs[mode]) for k in KEYS}
        wall = statistics.fmean(walls[mode])
        tau = [r["tau"] for r in recs[mode] if r.get("tau") is not None]
        rows.append([mode, *(round(mean[k], 4) for k in KEYS), round(wall, 4),
                     round(statistics.fmean(tau), 3) if tau else None])  # fmt: skip
        for k in KEYS:
            figures[f"{mode}_{k.removeprefix('time_')}_s"] = round(mean[k], 4)
        figures[f"{mode}_step_s"] = round(wall, 4)
    f = figures
    f["step_cotrain_over_none"] = round(f["cotrain_step_s"] / f["none_step_s"], 3)
    if f["cotrain_policy_update_s"] > 0:
        f["draft_over_policy_update"] = round(
            f["cotrain_draft_update_s"] / f["cotrain_policy_update_s"], 3
        )
    tables = [table(
        f"RL step on {ctx.device}: {cfg.num_hidden_layers} layers, H {cfg.hidden_size}, "
        f"V {cfg.vocab_size}, {dtype}; {sizes['prompts']} prompts × {sizes['n']} samples, "
        f"{sizes['max_tokens']} tokens; mean of {len(walls['none'])} steps after a warm-up",
        ["mode", "rollout s", "policy update s", "draft update s", "sync s", "step s", "τ"],
        rows,
    )]  # fmt: skip
    projected = _projected(ctx, figures)
    if projected is not None:
        figures.update(projected)
    return result("ok", figures=figures, tables=tables, records={m: recs[m] for m in MODES})


def _projected(ctx: Ctx, f: dict[str, float]) -> dict[str, float] | None:
    """Cotrain's step with the rollout check's measured speedup at batch 64 (a rollout of
    prompts × n samples decodes that many sequences at once); None without that result."""
    path = ctx.out / "rollout.json"
    if not path.is_file():
        return None
    res = json.loads(path.read_text())
    speedup = res.get("figures", {}).get("b64_speedup")
    if res.get("status") != "ok" or not speedup:
        return None
    step = (f["none_rollout_s"] / speedup + f["none_policy_update_s"]
            + f["cotrain_draft_update_s"] + f["cotrain_sync_s"])  # fmt: skip
    return {
        "projected_cotrain_step_s": round(step, 4),
        "projected_step_cotrain_over_none": round(step / f["none_step_s"], 3),
    }
