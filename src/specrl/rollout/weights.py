"""Validation of weight updates: everything is checked before anything is replaced.

An engine's weights change in place (``RolloutEngine.update_weights``, the EAGLE-3 proposer's
``load_weights``, the server's ``POST /v1/weights``).  A check that runs tensor by tensor while
copying leaves a half-updated model behind when a late tensor is refused, so every update is
first validated completely by :func:`plan_update`, which returns the copies to make; only then
does :func:`apply_update` run them (and the caller bumps its version) in one step.

What a valid update is:

- **names**: exactly the tensors it replaces (none missing, none unexpected; ``optional`` names,
  such as a tied ``lm_head.weight``, may be present or not and are not copied);
- **shapes**: exactly those of the tensors replaced;
- **dtypes**: the same dtype, or one of these safe casts — a floating tensor into a floating
  weight of another precision (a bfloat16 trainer updating a float32 engine: values are rounded
  to the weight's precision and must fit its range), an integer tensor into an integer buffer
  whose range holds every value.  Everything else is refused: integers (or booleans) into
  floating weights, floating values into integer or boolean buffers, complex tensors;
- **values**: every floating value finite (no NaN, no ±inf);
- **EAGLE-3 vocabulary maps** (:func:`check_vocab_map`): ``d2t`` maps every draft id to a
  distinct target id inside the target vocabulary, and ``t2d`` marks exactly those ids.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from specrl.errors import CheckpointError

__all__ = ["apply_update", "check_vocab_map", "plan_update"]

Copy = tuple[torch.Tensor, torch.Tensor]  # (the engine's tensor, the new value)


def _examples(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _check_meta(what: str, name: str, value: Any, own: torch.Tensor) -> None:
    """Type, layout, shape and dtype of one tensor (no values read)."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{what} weight '{name}' is a {type(value).__name__}, not a tensor")
    if value.layout != torch.strided or value.is_meta:
        raise CheckpointError(f"{what} weight '{name}' holds no dense data ({value.layout})")
    if tuple(value.shape) != tuple(own.shape):
        raise CheckpointError(
            f"{what} weight '{name}' has shape {tuple(value.shape)}, the engine's is "
            f"{tuple(own.shape)}"
        )
    src, dst = _kind(value.dtype), _kind(own.dtype)
    if src != dst or src == "complex":
        raise CheckpointError(
            f"{what} weight '{name}' has dtype {_dtype(value.dtype)}, which cannot be loaded "
            f"into the engine's {_dtype(own.dtype)} (floating weights take floating tensors, "
            "integer buffers integer ones)"
        )


def _check_values(what: str, checks: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Finite floating values that fit the engine's dtype, integers that fit theirs.  The
    per-tensor reductions stay on their device and are read back once per device (a policy of
    hundreds of tensors on a GPU costs one sync, not hundreds)."""
    per_device: dict[torch.device, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for name, value, own in checks:
        if value.numel():
            per_device.setdefault(value.device, []).append((name, value, own))
    for items in per_device.values():
        stats = []  # per tensor: [max |x| (NaN/inf when any value is), 0] or [min, max]
        for _, value, own in items:
            if value.is_floating_point():  # the ∞-norm reduces without a temporary copy
                big = torch.linalg.vector_norm(value, float("inf")).double()
                stats.append(torch.stack([big, torch.zeros_like(big)]))
            elif value.dtype != own.dtype and value.dtype != torch.bool:
                stats.append(torch.stack([value.min().double(), value.max().double()]))
            else:
                stats.append(torch.zeros(2, dtype=torch.float64, device=value.device))
        host = torch.stack(stats).tolist()
        for (name, value, own), (a, b) in zip(items, host, strict=True):
            if value.is_floating_point():
                if not math.isfinite(a):  # counted only now, on the way to the error
                    n = int((~torch.isfinite(value)).sum())
                    raise CheckpointError(
                        f"{what} weight '{name}' has {n} non-finite value{'s' * (n != 1)} "
                        "(NaN or inf)"
                    )
                limit = torch.finfo(own.dtype).max
                if a > limit:
                    raise CheckpointError(
                        f"{what} weight '{name}' has values beyond the range of the engine's "
                        f"{_dtype(own.dtype)} (|x| ≤ {limit:.4g})"
                    )
            elif value.dtype != own.dtype and value.dtype != torch.bool:
                info = torch.iinfo(own.dtype)
                if a < info.min or b > info.max:
                    raise CheckpointError(
                        f"{what} weight '{name}' has values in [{int(a)}, {int(b)}], beyond the "
                        f"engine's {_dtype(own.dtype)}"
                    )


def plan_update(
    what: str,
    given: Mapping[str, torch.Tensor],
    own: Mapping[str, torch.Tensor],
    *,
    optional: Iterable[str] = (),
) -> list[Copy]:
    """The copies that load ``given`` into ``own`` (the engine's tensors, by name), after
    validating the whole update (module docstring); raises :class:`CheckpointError` naming the
    first problem and copies nothing.  ``what`` names the weights in messages ("policy")."""
    if not isinstance(given, Mapping):
        raise CheckpointError(f"{what} weights must be a mapping of names to tensors")
    skip = set(optional)
    names = [k for k in own if k not in skip]
    keys = [k for k in given if not (isinstance(k, str) and k in skip)]
    missing = sorted(set(names) - set(keys))
    unexpected = sorted(str(k) for k in set(keys) - set(names))
    if missing or unexpected:
        parts = [f"{len(missing)} missing ({_examples(missing)})"] if missing else []
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({_examples(unexpected)})")
        raise CheckpointError(f"{what} weights do not match the engine's: " + ", ".join(parts))
    for name in names:
        _check_meta(what, name, given[name], own[name])
    _check_values(what, [(name, given[name], own[name]) for name in names])
    return [(own[name], given[name]) for name in names]


def check_vocab_map(what: str, d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """An EAGLE-3 draft→target vocabulary map that indexes safely: draft id ``i`` is target id
    ``i + d2t[i]``, every one in ``[0, vocab_size)`` and distinct, and ``t2d`` (bool,
    ``[vocab_size]``) is true exactly at those ids.  Dtypes and shapes are :func:`plan_update`'s."""
    ids = torch.arange(d2t.numel(), device=d2t.device, dtype=torch.int64) + d2t.to(torch.int64)
    if ids.numel() == 0:
        raise CheckpointError(f"{what} 'd2t' is empty")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise CheckpointError(
            f"{what} 'd2t' maps draft ids to target ids in [{lo}, {hi}], outside the target "
            f"vocabulary [0, {vocab_size})"
        )
    if int(torch.unique(ids).numel()) != ids.numel():
        raise CheckpointError(f"{what} 'd2t' maps two draft ids to the same target id")
    marked = torch.zeros(vocab_size, dtype=torch.bool, device=ids.device)
    marked[ids] = True
    if t2d.numel() != vocab_size or not torch.equal(t2d.to(marked.device, torch.bool), marked):
        raise CheckpointError(f"{what} 't2d' does not mark exactly the target ids 'd2t' maps to")


@torch.no_grad()
def apply_update(copies: Iterable[Copy]) -> None:
    """Run the copies of a validated update (:func:`plan_update`), in place."""
    for own, value in copies:
        own.copy_(value)
