"""The run's checkpoints: made sure to exist before RL starts, then loaded for the trainer.

``policy.path`` missing + ``policy.warmstart`` given → supervised warm-start writes it;
``draft.path`` missing + ``draft.init`` given (and ``draft.mode != none``) → init-draft writes it.
Existing checkpoints are reused as they are, so a recipe can be re-run without redoing them.
:func:`prepare_run` is the trainer's entry point, called before the trainer is built: rank 0
creates the run directory and what is missing while the other ranks wait at a barrier;
:func:`load_models` then loads what the trainer trains (from a checkpoint on resume).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specrl.config.loader import dump_recipe
from specrl.config.schema import Recipe
from specrl.core.fsio import check_output
from specrl.core.runtime import seed_everything
from specrl.errors import CheckpointError, ConfigError
from specrl.models.checkpoint import load_model, load_tokenizer
from specrl.models.decoder import Transformer
from specrl.models.draft import Eagle3Draft
from specrl.models.draft_io import DRAFT_META, load_draft
from specrl.models.presets import check_shape
from specrl.models.tokenizer import TextCodec
from specrl.train.layout import TrainLayout
from specrl.train.rundir import RunDirLock, open_run_dir

Progress = Callable[[str, int, int, str], None]  # (phase, done, total, info)


def policy_ready(recipe: Recipe) -> bool:
    return (Path(recipe.policy.path) / "config.json").is_file()


def draft_ready(recipe: Recipe) -> bool:
    return (Path(recipe.draft.path) / DRAFT_META).is_file()


def check_artifacts(recipe: Recipe, source: str) -> None:
    """One-line errors for checkpoints that are neither present nor creatable."""
    if not recipe.policy.path:
        raise ConfigError(
            f"{source}: policy.path is empty", hint="set policy.path to an HF checkpoint directory"
        )
    run_dir = recipe.run.directory
    if not policy_ready(recipe):
        # the warm-start will write here: nothing it would replace may be lost
        check_output(
            recipe.policy.path,
            kind="dir",
            inputs=[run_dir, recipe.draft.path if draft_ready(recipe) else None],
            flag=f"{source}: policy.path",
            probe=False,
            fix="point policy.path at an HF checkpoint directory (with config.json) or at a "
            "new one",
        )
    if not policy_ready(recipe) and recipe.policy.warmstart is None:
        raise CheckpointError(
            f"{source}: policy.path '{recipe.policy.path}' holds no checkpoint and the recipe "
            "has no policy.warmstart to create one",
            hint="point policy.path at an HF-format directory, or add a policy.warmstart section",
        )
    spec = recipe.rollout.speculation
    if recipe.draft.mode == "none":
        if spec and "eagle3" in spec.proposers:
            raise ConfigError(
                f"{source}: rollout.speculation.proposers has 'eagle3' but draft.mode is 'none'",
                hint="remove eagle3 or set a draft mode",
            )
        return
    if not recipe.draft.path:
        raise ConfigError(
            f"{source}: draft.mode is '{recipe.draft.mode}' but draft.path is empty",
            hint="set draft.path, or draft.mode: none",
        )
    if not draft_ready(recipe):
        check_output(
            recipe.draft.path,
            kind="dir",
            inputs=[run_dir, recipe.policy.path],
            flag=f"{source}: draft.path",
            probe=False,
            fix="point draft.path at a specrl draft directory or at a new one",
        )
    if not draft_ready(recipe) and recipe.draft.init is None:
        raise CheckpointError(
            f"{source}: draft.path '{recipe.draft.path}' holds no specrl draft and the recipe "
            "has no draft.init to create one",
            hint=f"specrl init-draft --target {recipe.policy.path} --out {recipe.draft.path}",
        )


def ensure_artifacts(recipe: Recipe, progress: Progress | None = None) -> dict[str, str]:
    """Create what is missing (rank 0 only); returns what was done, for the run log."""
    done: dict[str, str] = {}
    if not policy_ready(recipe):
        from specrl.train.warmstart import run_warmstart

        cb = None
        if progress is not None:
            cb = lambda s, n, loss, acc: progress(
                "warm-start", s, n, f"loss {loss:.3f}" + (f" acc {acc:.0%}" if acc else "")
            )
        res = run_warmstart(recipe, recipe.policy.path, progress=cb)
        done["policy"] = (
            f"warm-started {res.steps} steps → {Path(res.path).resolve()} "
            f"(held-out accuracy {res.accuracy:.1%})"
        )
    if recipe.draft.mode != "none" and not draft_ready(recipe):
        from specrl.rl.tasks import task_from_config
        from specrl.train.draft_init import DraftInitOptions, run_draft_init

        init = recipe.draft.init
        assert init is not None
        opts = DraftInitOptions(
            target=recipe.policy.path,
            out=recipe.draft.path,
            task=task_from_config(recipe.task),
            draft_vocab=init.draft_vocab,
            prompts=init.prompts,
            eval_prompts=min(recipe.task.eval_size, 128),
            max_new_tokens=recipe.rollout.max_tokens,
            temperature=recipe.rollout.temperature,
            steps=init.steps,
            ttt_steps=init.ttt_steps,
            batch_size=init.batch_size,
            lr=init.lr,
            init=init.init,
            tap_layers=tuple(init.tap_layers) if init.tap_layers else None,
            seed=recipe.run.seed,
            device="cuda" if recipe.run.device == "cuda" else "cpu",
            chat_template=recipe.policy.chat_template,
        )
        cb = None
        if progress is not None:
            cb = lambda phase, d, n, info: progress(f"init-draft {phase}", d, n, info)
        res = run_draft_init(opts, progress=cb)
        done["draft"] = (
            f"initialised {Path(res.out).resolve()}: simulated τ {res.before['tau']} → "
            f"{res.after['tau']} at k={res.after['k']}"
        )
    return done


def prepare_run(
    recipe: Recipe,
    layout: TrainLayout,
    progress: Progress | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
) -> tuple[dict, RunDirLock | None]:
    """Rank 0: the run directory, locked for this run and checked not to hold another run
    (:func:`specrl.train.rundir.open_run_dir`; ``resume``/``overwrite`` as the CLI flags), with
    ``recipe.resolved.yaml``, and the policy and draft checkpoints the recipe can create
    (:func:`ensure_artifacts`); every rank then meets at the layout's barrier.  Returns what was
    created (empty on the other ranks) and the held run-directory lock (None on the others)."""
    created: dict[str, str] = {}
    lock = None
    if layout.rank == 0:
        run_dir = Path(recipe.run.directory)
        lock = open_run_dir(run_dir, resume=resume, overwrite=overwrite)
        try:
            dump_recipe(recipe, run_dir / "recipe.resolved.yaml")
            created = ensure_artifacts(recipe, progress)
        except BaseException:
            lock.release()
            raise
    layout.barrier()
    return created, lock


@dataclass
class RunModels:
    """What a run trains, loaded: the policy with its tokenizer and prompt codec, the draft
    (``draft.mode != none``; its embedding shared with the policy) and the KL reference model
    (``algo.kl_coef > 0``)."""

    policy: Transformer
    tokenizer: Any
    codec: TextCodec
    policy_dir: Path  # where the policy was loaded from (the vLLM backend loads it from there)
    draft: Eagle3Draft | None = None
    reference: Transformer | None = None


def load_models(
    recipe: Recipe, device: torch.device, *, source: str, resume_from: Path | None = None
) -> RunModels:
    """The recipe's checkpoints, or ``resume_from``'s policy and draft (the reference model is
    always the initial policy), after seeding every generator with ``run.seed``."""
    policy_dir = resume_from / "policy" if resume_from else Path(recipe.policy.path)
    seed_everything(recipe.run.seed)
    policy = load_model(policy_dir, dtype=recipe.policy.dtype, device=device)
    if recipe.policy.shape:
        check_shape(policy.config, recipe.policy.shape, f"{source}: policy.path")
    tokenizer = load_tokenizer(policy_dir)
    if tokenizer is None:
        raise ConfigError(f"'{policy_dir}' has no tokenizer.json; specrl train needs one")
    reference = None
    if recipe.algo.kl_coef > 0:
        reference = load_model(recipe.policy.path, dtype=recipe.policy.dtype, device=device)
        reference.eval().requires_grad_(False)
    draft = None
    if recipe.draft.mode != "none":
        draft_dir = resume_from / "draft" if resume_from else Path(recipe.draft.path)
        draft, _ = load_draft(draft_dir, policy, share_embedding=True)
        if recipe.draft.mode == "frozen":
            draft.requires_grad_(False)
    codec = TextCodec.from_checkpoint(policy_dir, policy.config, chat=recipe.policy.chat_template)
    return RunModels(policy, tokenizer, codec, policy_dir, draft, reference)
