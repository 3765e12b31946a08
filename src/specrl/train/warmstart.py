"""Supervised warm-start: train a toy target from scratch on worked task solutions.

Produces an ordinary HF-format checkpoint (config.json + model.safetensors + tokenizer.json) that
every other command treats like any downloaded model.  The default recipe stops while accuracy
is still imperfect: it stops at the first held-out evaluation whose greedy accuracy reaches
``target_accuracy`` (default 50 %), leaving RL room to improve it.

Loss: next-token cross-entropy on completion tokens only (prompt tokens are masked), packed
batches with ``cu_seqlens`` (no padding, no cross-sequence attention).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specrl.config.schema import Recipe, WarmstartConfig
from specrl.core.attention import PackedLayout
from specrl.core.runtime import pick_device, seed_everything, set_determinism
from specrl.models.checkpoint import save_model
from specrl.models.decoder import Transformer
from specrl.models.presets import preset_config
from specrl.models.tokenizer import TextCodec, char_tokenizer, special_ids
from specrl.rl.tasks import Problem, Task, task_from_config
from specrl.train.evaluate import evaluate
from specrl.train.metrics import MetricsWriter


@dataclass
class WarmstartResult:
    path: str
    steps: int
    final_loss: float
    accuracy: float
    eval_size: int
    seconds: float
    num_params: int


def task_from_recipe(recipe: Recipe) -> Task:
    return task_from_config(recipe.task)


def eval_problems(recipe: Recipe, task: Task) -> list[Problem]:
    """The held-out evaluation set: drawn with seed + 1 (training draws with seed)."""
    return task.sample(random.Random(recipe.run.seed + 1), recipe.task.eval_size)


def sft_batch(
    codec: TextCodec, problems: list[Problem], device: torch.device
) -> tuple[torch.Tensor, PackedLayout, torch.Tensor, torch.Tensor]:
    """Packed ids, layout, next-token labels and a completion-only loss mask."""
    ids, labels, mask, lens = [], [], [], []
    for p in problems:
        prompt = codec.encode_prompt(p.prompt)
        completion = codec.encode_completion(p.solution or p.answer)
        seq = prompt + completion
        ids.extend(seq)
        labels.extend([*seq[1:], 0])
        # position t predicts seq[t+1]; train on predictions of completion tokens
        mask.extend([0.0] * (len(prompt) - 1) + [1.0] * len(completion) + [0.0])
        lens.append(len(seq))
    return (
        torch.tensor(ids, device=device),
        PackedLayout.from_lengths(lens, device=device),
        torch.tensor(labels, device=device),
        torch.tensor(mask, device=device),
    )


def lr_at(step: int, cfg: WarmstartConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def run_warmstart(
    recipe: Recipe,
    out_path: str | Path,
    *,
    task: Task | None = None,
    progress=None,
    overwrite: bool = False,
) -> WarmstartResult:
    """Train the preset on the recipe's task and write the checkpoint to ``out_path`` (an
    existing directory specrl did not write is refused unless ``overwrite``)."""
    cfg = recipe.policy.warmstart or WarmstartConfig()
    task = task or task_from_recipe(recipe)
    set_determinism(recipe.run.deterministic, recipe.run.threads)
    seed_everything(recipe.run.seed)
    device = pick_device(recipe.run.device)
    tok = char_tokenizer()
    ids = special_ids(tok)
    config = preset_config(
        cfg.preset,
        vocab_size=tok.get_vocab_size(),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    codec = TextCodec(tok, chat=recipe.policy.chat_template)
    model = Transformer(config).init_weights(recipe.run.seed).to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    rng = random.Random(recipe.run.seed)
    held_out = eval_problems(recipe, task)
    run_dir = Path(recipe.run.directory)
    t0 = time.perf_counter()
    loss_val = float("nan")
    accuracy = float("nan")
    done = 0
    with MetricsWriter(run_dir / "warmstart.jsonl", truncate_after_step=0) as log:
        for step in range(cfg.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            x, layout, y, m = sft_batch(codec, task.sample(rng, cfg.batch_size), device)
            logits = model(x, layout).logits
            loss = (F.cross_entropy(logits, y, reduction="none") * m).sum() / m.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            loss_val = loss.item()
            rec = {"step": step + 1, "loss": loss_val, "lr": opt.param_groups[0]["lr"]}
            last = step + 1 == cfg.steps
            if last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                accuracy = evaluate(
                    model, codec, task, held_out, recipe.policy.max_new_tokens
                ).accuracy
                rec["accuracy"] = accuracy
            log.write(rec)
            if progress is not None:
                progress(step + 1, cfg.steps, loss_val, rec.get("accuracy"))
            done = step + 1
            if cfg.target_accuracy is not None and rec.get("accuracy", -1.0) >= cfg.target_accuracy:
                break
    seconds = time.perf_counter() - t0
    provenance = {
        "created_by": "specrl warm-start",
        "preset": cfg.preset,
        "task": recipe.task.name,
        "steps": done,
        "seed": recipe.run.seed,
        "final_loss": loss_val,
        "heldout_accuracy": accuracy,
    }
    save_model(
        model,
        out_path,
        tokenizer=tok,
        extra_files={"specrl_provenance.json": json.dumps(provenance, indent=2) + "\n"},
        overwrite=overwrite,
    )
    return WarmstartResult(
        str(out_path), done, loss_val, accuracy, len(held_out), seconds, config.num_params
    )
