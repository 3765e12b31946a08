"""The one place a rollout engine is built: :func:`build_engine` from a recipe's rollout section.

``specrl rollout``, ``specrl rollout serve`` and ``specrl train`` all call it, so an engine
means the same thing wherever it runs: the recipe section
(:class:`~specrl.config.schema.RolloutConfig`) gives the slots, compilation and speculation
(:class:`~specrl.config.schema.SpeculationConfig`, which the engine takes as it is, with the
draft added to the eagle3 proposer's options here); the caller gives what a recipe
cannot — the policy and draft (modules or checkpoint directories), the codec, a seed, the
longest sequence, a clock.

Backends (``rollout.backend``): ``embedded``, specrl's engine
(:class:`~specrl.rollout.engine.RolloutEngine`, built by :func:`build_embedded`), and ``vllm``
(:class:`~specrl.integrations.vllm_engine.VllmEngine`, built by
:func:`~specrl.integrations.vllm_engine.build_vllm`; imported only when chosen, so vLLM stays an
optional extra).  Both implement :class:`~specrl.rollout.types.Engine`; :func:`build_engine` is
the single place the recipe chooses between them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from specrl.config.schema import RolloutConfig, SpeculationConfig
from specrl.core.runtime import pick_device
from specrl.errors import CheckpointError, ConfigError
from specrl.models.checkpoint import load_model, load_tokenizer
from specrl.models.decoder import Transformer
from specrl.models.draft import Eagle3Draft
from specrl.models.tokenizer import TextCodec
from specrl.rollout.engine import RolloutEngine
from specrl.rollout.types import Engine

Source = Transformer | str | Path  # a module (copied: the engine owns its weights) or a directory
DraftSource = Eagle3Draft | str | Path


def build_engine(
    rollout: RolloutConfig,
    policy: Source,
    draft: DraftSource | None = None,
    *,
    codec: TextCodec | None = None,
    device: str = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    clock: Callable[[], float] | None = None,
    workdir: str | Path | None = None,
) -> Engine:
    """The rollout engine the recipe section ``rollout`` describes, decoding ``policy``.

    ``policy``: the policy module (the engine decodes a copy; ``update_weights`` keeps it
    current) or an HF-format checkpoint directory (loaded on ``device``; its tokenizer gives the
    codec).  ``draft``: the EAGLE-3 draft (module, copied, or specrl draft directory), used when
    the speculation proposers include ``eagle3``.  ``codec``: the text codec (needed for text
    prompts and stop strings; default: the checkpoint's).  ``seed``: the engine's sampling and
    decision seed.  ``max_model_len``: longest prompt + output (default: the model's).
    ``clock``: the engine's clock (the trainer's deterministic mode counts forwards).
    ``workdir``: where the vLLM backend writes what it serves from (policy checkpoint, draft
    export) when given modules; default: a temporary directory the engine removes on close.
    """
    if rollout.backend == "vllm":
        from specrl.integrations.vllm_engine import build_vllm

        return build_vllm(
            rollout,
            policy,
            draft,
            codec=codec,
            device=device,
            seed=seed,
            max_model_len=max_model_len,
            workdir=workdir,
        )
    return build_embedded(
        rollout,
        policy,
        draft,
        codec=codec,
        device=device,
        seed=seed,
        max_model_len=max_model_len,
        clock=clock,
    )


def build_embedded(
    rollout: RolloutConfig,
    policy: Source,
    draft: DraftSource | None = None,
    *,
    codec: TextCodec | None = None,
    device: str = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    clock: Callable[[], float] | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> RolloutEngine:
    """specrl's own engine (arguments as :func:`build_engine`; ``eos_token_ids``: the tokens
    that end a sample, default the model's — ``()`` decodes to ``max_tokens``, as benchmarks
    do)."""
    if isinstance(policy, Transformer):
        model = copy.deepcopy(policy).eval()
    else:
        model, own_codec = load_target(Path(policy), device)
        codec = codec or own_codec
    spec = spec_config(rollout.speculation, draft)
    kwargs: dict[str, Any] = {} if clock is None else {"clock": clock}
    if eos_token_ids is not None:
        kwargs["eos_token_ids"] = eos_token_ids
    return RolloutEngine(
        model,
        codec=codec,
        max_batch_size=rollout.max_batch_size,
        max_model_len=max_model_len,
        spec=spec,
        seed=seed,
        compile=rollout.compile,
        **kwargs,
    )


def spec_config(
    speculation: SpeculationConfig | None, draft: DraftSource | None = None
) -> SpeculationConfig | None:
    """The engine's speculation settings from the recipe's (None: plain decoding)."""
    if speculation is None or not speculation.proposers:
        return None
    options = {name: dict(o) for name, o in speculation.proposer_options.items()}
    if "eagle3" in speculation.proposers:
        if draft is None:
            raise ConfigError(
                "rollout.speculation.proposers has 'eagle3' but no draft was given",
                hint="pass a draft (specrl rollout --draft DIR), or drop eagle3",
            )
        given = (
            {"draft": copy.deepcopy(draft)}
            if isinstance(draft, Eagle3Draft)
            else {"path": str(draft)}
        )
        options["eagle3"] = {"max_k": speculation.max_k, **options.get("eagle3", {}), **given}
    return dataclasses.replace(speculation, proposer_options=options)


def load_target(path: Path, device: str | torch.device = "auto") -> tuple[Transformer, TextCodec]:
    """An HF-format checkpoint directory as (model on ``device``, its text codec)."""
    model = load_model(path, device=pick_device(device) if isinstance(device, str) else device)
    if load_tokenizer(path) is None:
        raise CheckpointError(
            f"'{path}' has no tokenizer.json", hint="rollouts encode text prompts with it"
        )
    return model, TextCodec.from_checkpoint(path, model.config)
