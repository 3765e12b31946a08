"""The target's decode forward under ``torch.compile``, shape-stable across steps.

Eager decoding at rollout batch sizes is mostly per-op overhead: each layer runs a dozen small
elementwise kernels (RMSNorm's composite, RoPE, SiLU·up, residual adds) around its GEMMs.
Inductor fuses them into a few loops, but only pays off when the compiled graphs are reused, so
the engine feeds the compiled forward steps of one structure whatever the batch:

- every decode step is **padded to a uniform [B, M] block** (M = longest k + 1 of the step;
  short rows are filled with token 0), the padded rows' logits are dropped after the forward;
  their K/V land beyond the sequence's committed length, like a rejected draft's, which
  attention never reads and the next step overwrites (the engine's cache has ``max_k`` spare
  rows for them);
- the sequences hold **slots 0..B−1** (compact slots), so the cache is sliced, never gathered;
- the host flags are a function of (B, M) only: no mask for one sequence and one token,
  a causal mask built in the graph otherwise.

The EAGLE-3 proposer compiles its drafting round with the same rules: a first pass over the
newly committed positions (padded to a uniform [B, M] block, M ≤ max k + 1; anything older is
caught up eagerly first), then one pass per chain position (one token per sequence, no mask
for a single sequence), each ending with the draft token picked on device; the whole batch
stays in every pass, so the sequences keep slots 0..B−1.

Sizes (B, M, the KV length) are symbolic (``dynamic=True``); sizes 1 specialise, so a run
compiles about four graphs (B = 1 or more, M = 1 or more) and none afterwards.  Prefill stays
eager (its lengths vary the most, and it runs once per request).  The compiled graph reads the
parameters at each call, so in-place weight updates (``RolloutEngine.update_weights``) need no
recompilation; the GEMMs are the module path's (q, k, v apart: the fused copies of
:mod:`specrl.models.fused` check versions on the host, which a graph cannot).

**Guard-free calls.**  Before running a graph, dynamo checks its guards: every parameter's
size, stride and dtype, every input's, the symbolic-size relations — 50–350 µs a call here,
a fifth of a batch-1 decode step.  Callers name each call's *graph class* (``key``: the
host-side facts that choose the graph, e.g. "one sequence, one token").  Once a fully guarded
call of a class has run without compiling, later calls of that class run under dynamo's
``skip_guard_eval_unsafe`` stance: only the guards that ever told cached graphs apart are
checked (the sizes that specialise, the model instance), which is exact as long as the key
covers every host-side fact a graph depends on — the same bet vLLM makes when it dispatches
to its compiled graphs without dynamo's guards.  Calls run fully guarded when the caller is
inside another stance (``fail_on_recompile`` in the tests) or gives no key.  Should a key miss
a fact after all, so that a guard-free call finds no graph, dynamo refuses to compile under
that stance before running anything: the call is then rerun fully guarded (compiling what it
needs) and its class stays guarded from then on.

On CPU inductor builds C++ and needs a compiler (``g++``); on CUDA it uses Triton.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Hashable
from typing import Any

import torch

from specrl.errors import ConfigError
from specrl.models.decoder import CacheBatch, ModelOutput, Transformer

__all__ = ["Compiled", "CompiledDecode", "check_toolchain"]

RECOMPILE_LIMIT = 64


def check_toolchain(device: torch.device) -> None:
    """Fail fast, with the fix, where inductor cannot build kernels (no C++ compiler on CPU)."""
    if device.type == "cpu":
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None and shutil.which("g++") is None:
            raise ConfigError(
                f"compiled decoding on CPU needs a C++ compiler ({cxx!r} or g++ on PATH): "
                "install one (Debian: apt install g++) or run without --compile"
            )


class Compiled:
    """``torch.compile(fn, dynamic=True)`` for the engine's shape-stable calls: counts the graphs
    it compiles, skips guard evaluation for graph classes already served (module docstring) and
    names the way out when compilation fails."""

    def __init__(self, fn: Callable[..., Any], device: torch.device, what: str) -> None:
        check_toolchain(device)
        import torch._dynamo  # the counters read in __call__
        import torch.fx.experimental._config  # use_duck_shape, set in __call__

        self._fn = torch.compile(fn, dynamic=True)
        self.what = what
        self.graphs = 0  # graphs dynamo compiled for this callable so far
        self.guard_free = _STANCES is not None  # this torch has the hooks
        self._served: set[Hashable] = set()  # graph classes a guarded call ran without compiling
        self.unguarded = 0  # calls run with guard evaluation skipped
        self._always_guarded: set[Hashable] = set()  # classes a guard-free call had to leave

    def __call__(self, *args: Any, key: Hashable | None = None, **kwargs: Any) -> Any:
        counters = torch._dynamo.utils.counters["stats"]
        before = counters["unique_graphs"]
        dynamo, fx = torch._dynamo.config, torch.fx.experimental._config
        saved = dynamo.recompile_limit, fx.use_duck_shape
        # dynamo's recompile limit counts the graphs of every model behind one code object in
        # the process (tests, engines rebuilt on new models); each model needs ≈ 4.  No duck
        # sizing: sizes that happen to be equal while a graph compiles (the batch and the KV
        # heads, an input's storage offset) must not become one symbol whose guard fails, and
        # recompiles, once they differ.  (Plain attribute writes: config.patch costs ≈ 30 µs.)
        dynamo.recompile_limit, fx.use_duck_shape = max(saved[0], RECOMPILE_LIMIT), False
        stance = None
        if self.guard_free and key is not None and key in self._served:
            stance = _skip_guards()
            self.unguarded += stance is not None
        try:
            try:
                out = self._fn(*args, **kwargs)
            except RuntimeError as e:
                if stance is None or _UNSAFE_RECOMPILE not in str(e):
                    raise
                # the class needs a graph the guard-free stance may not compile: its key misses
                # a guard that matters.  Dynamo refuses on entering the frame, before running
                # it (the engine's compiled functions are whole graphs, their cache writes
                # idempotent); rerun guarded, and keep this class guarded from now on.
                _STANCES[1](stance)  # type: ignore[index]
                stance = None
                self._served.discard(key)
                self._always_guarded.add(key)
                out = self._fn(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = e.inner_exception  # a SpecrlError: the CLI prints one line, not a traceback
            raise ConfigError(
                f"torch.compile could not build {self.what} ({type(inner).__name__}: {inner})",
                hint="run without --compile (RolloutEngine(compile=False))",
            ) from e
        finally:
            dynamo.recompile_limit, fx.use_duck_shape = saved
            if stance is not None:
                _STANCES[1](stance)  # type: ignore[index]
        compiled = counters["unique_graphs"] - before
        self.graphs += compiled
        if (
            key is not None
            and stance is None
            and not compiled
            and key not in self._always_guarded
            and _default_stance()
        ):
            self._served.add(key)
        return out


def _stance_hooks() -> tuple[Any, Callable[[Any], Any], type] | None:
    """dynamo's stance hooks (module, setter, stance type); None where this torch lacks them
    (guard-free calls then stay off).  ``torch.compiler.set_stance`` itself costs ≈ 200 µs a
    call, more than the guards it would skip."""
    from torch._dynamo import eval_frame

    setter = getattr(eval_frame, "_set_stance", None)
    kind = getattr(eval_frame, "DynamoStance", None)
    if setter is None or kind is None or not hasattr(eval_frame, "_stance"):
        return None
    return eval_frame, setter, kind


_STANCES = _stance_hooks()
# what dynamo raises when a call under the guard-skipping stance would need a new graph
_UNSAFE_RECOMPILE = "skip_guard_eval_unsafe"


def _default_stance() -> bool:
    """True in dynamo's default stance with full guards (not inside a test's stance)."""
    if _STANCES is None:
        return False
    current = _STANCES[0]._stance
    return current.stance == "default" and not current.skip_guard_eval_unsafe


_SKIP: dict[Any, Any] = {}  # default-stance backend → its guard-skipping twin


def _skip_guards() -> Any | None:
    """Enter the guard-skipping stance if the current one is the default; returns the stance
    to restore (None: left as it was)."""
    if not _default_stance():
        return None
    eval_frame, setter, kind = _STANCES  # type: ignore[misc]
    current = eval_frame._stance
    skip = _SKIP.get(current.backend)
    if skip is None:
        skip = _SKIP[current.backend] = kind("default", True, current.backend)
    return setter(skip)


class CompiledDecode(Compiled):
    """``model.forward`` compiled for the engine's padded decode steps."""

    def __init__(self, model: Transformer) -> None:
        super().__init__(model.forward, model.device, "the decode step")

    def __call__(  # type: ignore[override]
        self, ids: torch.Tensor, layout: Any, cache: CacheBatch, taps: tuple[int, ...]
    ) -> ModelOutput:
        # the graph class: the sizes that specialise (one sequence; one token each) and the
        # host flags (functions of those two in the engine's padded steps, named for safety)
        batch = cache.prefix_lens.shape[0]
        key = (batch == 1, ids.shape[0] == batch, cache.slots_are_prefix, cache.full_rows)
        return super().__call__(ids, layout, taps=taps, cache=cache, key=key)
