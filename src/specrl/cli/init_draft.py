"""``specrl init-draft``: vocab map, weights and optional offline warm-up of an EAGLE-3 draft."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from specrl.cli.common import progress_bar
from specrl.cli.ui import (
    JsonOpt,
    OverwriteOpt,
    emit_json,
    err,
    kv_table,
    out,
    positive,
    want_json,
)


class Init(str, Enum):
    random = "random"
    last_layer = "last-layer"


class Convention(str, Enum):
    vllm = "vllm"
    sglang = "sglang"


class LossKind(str, Enum):
    ce = "ce"
    tv = "tv"


def _parse_taps(text: str | None) -> tuple[int, ...] | None:
    from specrl.errors import ConfigError

    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--tap-layers {text!r} must be comma-separated integers",
            hint="e.g. --tap-layers 1,15,28 (output-of-layer ids)",
        ) from None


def init_draft_command(
    target: Annotated[Path, typer.Option("--target", help="Target HF checkpoint directory.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Draft directory to write.")],
    recipe: Annotated[Path | None, typer.Option(help="Recipe whose `task` gives prompts.")] = None,
    task: Annotated[
        str | None,
        typer.Option(
            help="Task for prompts (addition, multiplication, mixed; overrides the recipe)."
        ),
    ] = None,
    prompts: Annotated[
        int, typer.Option(min=1, help="Target generations for vocab + warm-up.")
    ] = 512,
    eval_prompts: Annotated[
        int, typer.Option(min=1, help="Held-out prompts for evaluation.")
    ] = 128,
    corpus: Annotated[
        Path | None,
        typer.Option(
            help="JSONL corpus (completion/response/text) for token counts instead of generations.",
        ),
    ] = None,
    draft_vocab: Annotated[
        int | None,
        typer.Option(min=2, help="Draft vocabulary size (default min(target vocab, 32768))."),
    ] = None,
    tap_layers: Annotated[
        str | None,
        typer.Option(help="Three target layers, output-of-layer ids (default [1, L/2−1, L−4])."),
    ] = None,
    init: Annotated[Init, typer.Option(help="Decoder-layer init.")] = Init.random,
    from_eagle3: Annotated[
        Path | None, typer.Option(help="Start from a serving-format EAGLE-3 checkpoint.")
    ] = None,
    aux_convention: Annotated[
        Convention, typer.Option(help="Layer-id convention of --from-eagle3's aux ids.")
    ] = Convention.vllm,
    steps: Annotated[int, typer.Option(min=0, help="Offline warm-up steps (0: none).")] = 0,
    ttt_steps: Annotated[int, typer.Option(min=1, max=64, help="TTT steps K during warm-up.")] = 4,
    eval_k: Annotated[
        int, typer.Option("--eval-k", min=1, max=64, help="Draft length k for τ.")
    ] = 4,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences per warm-up step.")] = 32,
    lr: Annotated[
        float,
        typer.Option(max=10, callback=positive, help="Peak AdamW learning rate."),
    ] = 3e-3,
    loss: Annotated[LossKind, typer.Option(help="ce (soft cross-entropy) or tv.")] = LossKind.ce,
    temperature: Annotated[
        float,
        typer.Option(callback=positive, help="Target sampling temperature (> 0)."),
    ] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Response budget.")] = 64,
    seed: Annotated[int, typer.Option(min=0, help="Seed.")] = 0,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Initialise an EAGLE-3 draft for a target; optionally warm it up offline."""
    from specrl.cli.common import load
    from specrl.core.fsio import check_output
    from specrl.rl.tasks import build_task, task_from_config
    from specrl.train.draft_init import DraftInitOptions, run_draft_init

    check_output(
        out_dir, kind="dir", inputs=[target, from_eagle3, corpus, recipe], overwrite=overwrite
    )
    rec = load(recipe, None)
    task_obj = build_task(task) if task else task_from_config(rec.task)
    opts = DraftInitOptions(
        target=str(target),
        out=str(out_dir),
        task=task_obj,
        corpus=str(corpus) if corpus else None,
        draft_vocab=draft_vocab,
        prompts=prompts,
        eval_prompts=eval_prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        steps=steps,
        ttt_steps=ttt_steps,
        eval_ttt_steps=eval_k,
        batch_size=batch_size,
        lr=lr,
        loss=loss.value,
        init=init.value,
        tap_layers=_parse_taps(tap_layers),
        from_eagle3=str(from_eagle3) if from_eagle3 else None,
        aux_convention=aux_convention.value,
        seed=seed,
        overwrite=overwrite,
    )
    with progress_bar("init-draft", max(steps, 1)) as update:
        res = run_draft_init(
            opts, progress=lambda _phase, done, total, info: update(done, total, info)
        )
    summary = {
        "draft": res.out,
        "draft_vocab": res.draft_vocab,
        "tap_layers": res.tap_layers,
        "trainable_params": res.params,
        "vocab_source": res.vocab_source,
        "warmup_steps": res.steps,
        "eval_k": eval_k,
        "heldout_acc_before": res.before["acc"],
        "heldout_tau_before": res.before["tau"],
        "heldout_acc_after": res.after["acc"],
        "heldout_tau_after": res.after["tau"],
        "seconds": round(res.seconds, 1),
    }
    if want_json(json_out):
        emit_json(summary)
    else:
        out.print(kv_table("init-draft (simulated τ on held-out prompts)", summary))
        err.print(f"[dim]next:[/] specrl export-draft --draft {res.out} --out <dir> --verify")
