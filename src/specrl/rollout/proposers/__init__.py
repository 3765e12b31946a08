"""Draft proposers: the protocol every drafter implements, and the registry that builds them.

A proposer turns sequences into draft tokens; the engine verifies them losslessly against the
target (:mod:`specrl.rollout.verify`), so a proposer can only cost speed, never change outputs.

Life of a sequence, as a proposer sees it (all calls come from the engine thread):

1. ``reset(seq)``: the sequence was admitted to a cache slot (fresh state; ``seq.output`` empty).
2. ``observe(batch, accepted, taps, committed)``: after **every** target forward that committed
   KV for the sequences in ``batch`` (their prefill, plain decode steps, and verifications,
   whichever proposer drafted), after the emitted tokens were appended to ``seq.tokens``.
   ``committed[b]`` positions of sequence b were fed to the target and kept: the prompt at
   prefill, else ``accepted[b] + 1`` (the previous last token and the accepted drafts).  They
   are the positions ``seq.kv_len - committed[b] … seq.kv_len - 1``; the feature at position t
   predicts token ``seq.tokens[t + 1]``, which is already known.  ``taps[layer]`` holds
   ``[sum(committed), H]`` detached hidden states of those positions (decoder layer outputs,
   SpecForge convention), sequences in batch order; ``None`` when no proposer asked for taps.
3. ``propose(batch, ks)``: draft at most ``ks[b]`` tokens continuing ``batch[b].tokens``.
   ``ks[b]`` may be 0 (the sequence is one token from its limit): it drafts nothing, but the
   engine passes every sequence of the step that chose this proposer, so a batched drafter can
   keep its batch whole (EAGLE-3's compiled passes keep the engine's slots 0..B−1).
4. ``release(seq)``: the sequence finished (its slot is reused); free per-sequence state.

Between steps the engine may **move** running sequences to other slots (it keeps the occupied
slots compact): ``move(moves)`` copies, for each ``(seq, new_slot)``, any per-slot state (a KV
cache indexed by ``seq.slot``, still the old slot during the call) to ``new_slot``.

A proposer that defers work until it drafts (EAGLE-3 runs its step-0 pass over the positions
committed since its last call only when it next drafts) reports ``backlog(batch)``: the
positions it has queued for those sequences; the gate prices drafting by them.

Every hook is declared by :class:`Proposer`; :class:`ProposerBase` gives the optional ones
their "nothing to do" behaviour (no per-slot state, no backlog, no compiled graphs, no stats, no
state), so a simple drafter writes ``propose``, ``observe``, ``reset`` and ``release`` only.
``state_dict()`` is the JSON-able state a resumed run needs to replay its drafts exactly (the
n-gram history, EAGLE-3's temperature-scale bandit); the engine saves it with its own.

A :class:`Draft` with ``probs=None`` is one-hot (the verifier then needs no q); otherwise
``probs[i]`` is the full-vocabulary distribution ``tokens[i]`` was sampled from, already
processed with the request's temperature/top-k/top-p if the proposer samples (the ratio test
needs the q that was actually used; sample with ``seq.generator`` to stay reproducible).

Proposers are built by name from the registry; third-party or test proposers call
:func:`register_proposer`.  Built-in modules are imported on first use.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from specrl.errors import ConfigError
from specrl.models.decoder import Transformer
from specrl.rollout.compiled import CHECK_EVERY
from specrl.rollout.types import Draft, SeqState

__all__ = [
    "Draft",
    "Proposer",
    "ProposerBase",
    "ProposerContext",
    "SeqState",
    "SupportsWeights",
    "available_proposers",
    "build_proposer",
    "proposer_module",
    "register_proposer",
    "with_weights",
]


class Proposer(Protocol):
    """What the engine needs from a drafter (see the module docstring for the call order)."""

    name: str
    tap_layers: tuple[int, ...]  # target layers whose outputs ``observe`` needs; () if none
    # False: ``observe`` does nothing (the sequences' tokens are all it reads, when it drafts),
    # so a drafter process is sent no per-step call
    observes: bool

    def propose(self, batch: list[SeqState], ks: list[int]) -> list[Draft]: ...

    def observe(
        self,
        batch: list[SeqState],
        accepted: list[int],
        taps: dict[int, torch.Tensor] | None,
        committed: list[int],
    ) -> None: ...

    def reset(self, seq: SeqState) -> None: ...

    def release(self, seq: SeqState) -> None: ...

    def move(self, moves: list[tuple[SeqState, int]]) -> None:
        """Copy per-slot state of each ``seq`` (at ``seq.slot``) to its new slot."""
        ...

    def backlog(self, batch: list[SeqState]) -> int:
        """Positions queued for ``batch`` that the next ``propose`` catches up first."""
        ...

    @property
    def compiled_graphs(self) -> int:
        """Graphs its own ``torch.compile`` passes compiled so far."""
        ...

    def stats(self) -> dict[str, Any]:
        """The proposer's own state for ``RolloutEngine.stats()["drafters"]``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state a resumed run needs (idle engine)."""
        ...

    ahead_safe: bool  # may draft ahead on the decoupled drafter worker (specrl.rollout.decoupled)

    def propose_ahead(
        self, batch: list[SeqState], drafts: list[Draft], ks: list[int]
    ) -> list[Draft] | None:
        """Draft ``ks[b]`` tokens continuing ``batch[b].tokens + drafts[b].tokens``, on the
        worker; None: no state of its own to extend (``propose`` on shadow sequences does)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class ProposerBase:
    """The optional :class:`Proposer` hooks, as a proposer without such state has them."""

    name: str
    tap_layers: tuple[int, ...] = ()
    observes = True

    def move(self, moves: list[tuple[SeqState, int]]) -> None:
        pass

    def backlog(self, batch: list[SeqState]) -> int:
        return 0

    @property
    def compiled_graphs(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    ahead_safe = False

    def propose_ahead(
        self, batch: list[SeqState], drafts: list[Draft], ks: list[int]
    ) -> list[Draft] | None:
        return None


@runtime_checkable
class SupportsWeights(Protocol):
    """A proposer with trainable weights (e.g. an EAGLE-3 draft): ``update_weights(draft=…)``
    validates the update with every such proposer's ``check_weights`` (raising
    :class:`~specrl.errors.CheckpointError` on a mismatch) before any ``load_weights``."""

    def check_weights(self, state: Mapping[str, torch.Tensor]) -> Any: ...

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None: ...


def with_weights(proposers: Mapping[str, Any]) -> dict[str, SupportsWeights]:
    """The proposers among ``proposers`` that take draft weights, by name."""
    return {n: p for n, p in proposers.items() if isinstance(p, SupportsWeights)}


@dataclass
class ProposerContext:
    """What a factory may use to build a proposer for one engine."""

    target: Transformer  # the policy (shares its embedding with an EAGLE-3 draft)
    max_model_len: int  # KV positions per slot
    num_slots: int  # concurrent sequences
    seed: int
    compile: bool = False  # the engine compiles its decode steps; a proposer may compile its own
    guard_check_every: int = CHECK_EVERY  # for its Compiled callables (rollout.compiled)


ProposerFactory = Callable[..., Proposer]  # (ctx: ProposerContext, **options) -> Proposer

_REGISTRY: dict[str, ProposerFactory] = {}
# Built-in proposers register themselves when their module is imported (lazily, on first use).
_BUILTIN_MODULES: dict[str, str] = {
    "ngram": "specrl.rollout.proposers.ngram",
    "eagle3": "specrl.rollout.proposers.eagle3",
}


def register_proposer(name: str, factory: ProposerFactory | None = None, *, replace: bool = False):
    """Register ``factory(ctx, **options) -> Proposer`` under ``name`` (usable as a decorator)."""

    def add(f: ProposerFactory) -> ProposerFactory:
        if name in _REGISTRY and not replace and _REGISTRY[name] is not f:
            raise ValueError(f"proposer {name!r} is already registered")
        _REGISTRY[name] = f
        return f

    return add(factory) if factory is not None else add


def proposer_module(name: str) -> str | None:
    """The module whose import registers ``name`` (a built-in's, or the registered factory's
    module): what a drafter process imports before :func:`build_proposer`."""
    if name in _REGISTRY:
        return getattr(_REGISTRY[name], "__module__", None)
    return _BUILTIN_MODULES.get(name)


def available_proposers() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def build_proposer(name: str, ctx: ProposerContext, **options: Any) -> Proposer:
    """The proposer registered as ``name``; unknown names raise ConfigError listing the known."""
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ConfigError(
            f"unknown proposer {name!r}", hint="choose from " + ", ".join(available_proposers())
        )
    try:
        inspect.signature(factory).bind(ctx, **options)
    except TypeError as exc:
        raise ConfigError(f"proposer {name!r}: bad options {sorted(options)} ({exc})") from None
    proposer = factory(ctx, **options)
    if proposer.name != name:
        raise ValueError(f"factory for {name!r} built a proposer named {proposer.name!r}")
    return proposer
