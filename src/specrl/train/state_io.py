"""Trainer state without pickle: optimizer states and RNG states as safetensors + JSON.

``torch.save`` would pickle; checkpoints here must be loadable without executing code.  An
optimizer ``state_dict`` is split into its tensors (``opt.<name>.state.<param>.<key>``) and a
JSON skeleton (param groups, non-tensor entries); RNG states are byte tensors (torch) or JSON
(Python ``random``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from specrl.errors import ConfigError


def optimizer_to_flat(
    name: str, opt: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"opt.{name}.state.{pid}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = val
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return tensors, {
        "param_groups": groups,
        "scalars": scalars,
        "state_keys": sorted(str(p) for p in sd["state"]),
    }


def optimizer_from_flat(
    name: str, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    state: dict[int, dict[str, Any]] = {int(p): {} for p in meta["state_keys"]}
    prefix = f"opt.{name}.state."
    for key, val in tensors.items():
        if key.startswith(prefix):
            pid, field = key[len(prefix) :].split(".", 1)
            state[int(pid)][field] = val
    for pid, extra in meta["scalars"].items():
        state[int(pid)].update(extra)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    opt.load_state_dict({"state": state, "param_groups": groups})


def rng_to_flat() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    return tensors, {"python": [version, list(internal), gauss]}


def rng_from_flat(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[k] for k in sorted(t for t in tensors if t.startswith("rng.cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))


def pyrandom_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_pyrandom_state(rng: random.Random, state: list[Any]) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def trainer_state(
    step: int,
    optimizers: dict[str, torch.optim.Optimizer],
    prompt_rng: random.Random,
    **extra: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One rank's trainer state at ``step``: its optimizers (``opt_<name>``), the process's
    random states, the prompt generator, and ``extra`` JSON entries (the engine's state, the
    deterministic clock)."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"step": step}
    for name, opt in optimizers.items():
        t, meta[f"opt_{name}"] = optimizer_to_flat(name, opt)
        tensors.update(t)
    t, meta["rng"] = rng_to_flat()
    tensors.update(t)
    meta["prompt_rng"] = pyrandom_state(prompt_rng)
    meta.update(extra)
    return tensors, meta


def load_trainer_state(
    path: Path,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    optimizers: dict[str, torch.optim.Optimizer],
    prompt_rng: random.Random,
) -> None:
    """Restore what :func:`trainer_state` saved (read from checkpoint ``path``)."""
    for name, opt in optimizers.items():
        if f"opt_{name}" not in meta:
            raise ConfigError(
                f"checkpoint '{path}' has no {name} optimizer (was draft.mode changed?)",
                hint="resume with the recipe it was written with",
            )
        optimizer_from_flat(name, opt, tensors, meta[f"opt_{name}"])
    rng_from_flat(tensors, meta["rng"])
    set_pyrandom_state(prompt_rng, meta["prompt_rng"])
