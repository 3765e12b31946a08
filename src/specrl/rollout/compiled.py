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
call of a class has run without compiling, later calls of that class skip dynamo:

- **direct calls** (where this torch exposes dynamo's cache entries): the guarded call that
  serves a class first finds, by evaluating each cache entry's guards on its arguments, the
  entry dynamo runs for it; later calls of the class run that entry's code (dynamo's rewritten
  bytecode, which feeds the compiled graph) as a plain function — no frame interception, no
  cache lookup.  This is vLLM's custom dispatcher (``TorchCompileWrapperWithCustomDispatcher``)
  and saves a further 110 µs (batch 1) to 460 µs (batch 32) per toy decode forward over the
  stance below (measured on the toy targets; docs/benchmarks.md).
  Every ``check_every``-th direct call (:data:`CHECK_EVERY` by default; every call in the
  test suite, through ``RolloutEngine(guard_check_every=1)``) first evaluates the entry's
  guards in full: should they fail, the key missed a fact, and the call, and its class from
  then on, run fully guarded;
- otherwise, dynamo's ``skip_guard_eval_unsafe`` stance: only the guards that ever told cached
  graphs apart are checked (the sizes that specialise, the model instance).  Should a key miss
  a fact after all, so that a guard-free call finds no graph, dynamo refuses to compile under
  that stance before running anything: the call is then rerun fully guarded (compiling what it
  needs) and its class stays guarded from then on.

Either is exact as long as the key covers every host-side fact a graph depends on — the bet
vLLM makes when it dispatches to its compiled graphs without dynamo's guards.  Calls run fully
guarded when the caller is inside another stance (``fail_on_recompile`` in the tests) or gives
no key; the grad mode is part of every class.

On CPU inductor builds C++ and needs a compiler (``g++``); on CUDA it uses Triton.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch

from specrl.errors import ConfigError
from specrl.models.decoder import CacheBatch, ModelOutput, Transformer

__all__ = ["Compiled", "CompiledDecode", "check_toolchain"]

RECOMPILE_LIMIT = 64
# the default of ``Compiled(check_every=…)``: every how many direct calls of a graph class its
# entry's guards are evaluated in full
CHECK_EVERY = 256

log = logging.getLogger(__name__)


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
    it compiles, runs graph classes already served without dynamo's guards (module docstring)
    and names the way out when compilation fails."""

    def __init__(
        self,
        fn: Callable[..., Any],
        device: torch.device,
        what: str,
        *,
        check_every: int = CHECK_EVERY,
    ) -> None:
        """``check_every``: every how many direct calls of a graph class its entry's guards are
        evaluated in full first (0: never; the tests use 1, so that every compiled call proves
        its class's key)."""
        check_toolchain(device)
        import torch._dynamo  # the counters read in __call__
        import torch.fx.experimental._config  # use_duck_shape, set in _run

        if check_every < 0:
            raise ValueError(f"check_every must be ≥ 0, got {check_every}")
        self._fn = torch.compile(fn, dynamic=True)
        self.what = what
        self.check_every = check_every
        self.graphs = 0  # graphs dynamo compiled for this callable so far
        self.guard_free = _STANCES is not None  # this torch has the stance hooks
        self._served: set[Hashable] = set()  # graph classes a guarded call ran without compiling
        self.unguarded = 0  # calls run with guard evaluation skipped (direct or stance)
        self.direct = 0  # of which direct calls
        self._always_guarded: set[Hashable] = set()  # classes a guard-free call had to leave
        # direct calls: the plain function behind ``fn`` (and the instance it is bound to),
        # and per served class the cache entry dynamo runs for it, as a function
        raw = getattr(fn, "__func__", fn)
        self._self = getattr(fn, "__self__", None) if raw is not fn else None
        direct_ok = _ENTRIES is not None and isinstance(raw, types.FunctionType)
        self._raw: types.FunctionType | None = raw if direct_ok else None
        self._signature = inspect.signature(raw) if direct_ok else None
        self._direct: dict[Hashable, tuple[Callable[..., Any], Any]] = {}
        self._direct_calls: dict[Hashable, int] = {}

    def __call__(self, *args: Any, key: Hashable | None = None, **kwargs: Any) -> Any:
        if key is not None:  # the grad mode is part of every graph class (dynamo guards it)
            key = (key, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            direct = self._direct.get(key)
            if direct is not None and _default_stance():
                out = self._call_direct(key, *direct, args, kwargs)
                if out is not _MISSED:
                    return out
        counters = torch._dynamo.utils.counters["stats"]
        before = counters["unique_graphs"]
        stance = entry = None
        if self.guard_free and key is not None and key in self._served:
            stance = _skip_guards()
            self.unguarded += stance is not None
        elif (
            self._raw is not None
            and key is not None
            and key not in self._always_guarded
            and _default_stance()
        ):
            # the entry dynamo will run, found before the call (which may mutate its arguments)
            entry = self._find_entry(args, kwargs)
        out, unguarded = self._run(key, stance, args, kwargs)
        compiled = counters["unique_graphs"] - before
        self.graphs += compiled
        if key is not None and not unguarded and not compiled:
            self._serve(key, entry)
        return out

    def _run(self, key: Hashable | None, stance: Any, args: tuple, kwargs: dict) -> tuple:
        """Call the compiled function through dynamo — its guards skipped under ``stance``
        (from :func:`_skip_guards`, restored here; None: fully guarded).  Returns (output,
        whether it ran unguarded)."""
        dynamo, fx = torch._dynamo.config, torch.fx.experimental._config
        saved = dynamo.recompile_limit, fx.use_duck_shape
        # dynamo's recompile limit counts the graphs of every model behind one code object in
        # the process (tests, engines rebuilt on new models); each model needs ≈ 4.  No duck
        # sizing: sizes that happen to be equal while a graph compiles (the batch and the KV
        # heads, an input's storage offset) must not become one symbol whose guard fails, and
        # recompiles, once they differ.  (Plain attribute writes: config.patch costs ≈ 30 µs.)
        dynamo.recompile_limit, fx.use_duck_shape = max(saved[0], RECOMPILE_LIMIT), False
        try:
            try:
                return self._fn(*args, **kwargs), stance is not None
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
                return self._fn(*args, **kwargs), True
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

    def _serve(self, key: Hashable, entry: Any | None) -> None:
        """A fully guarded call of class ``key`` ran without compiling: later calls of the class
        skip the guards (directly through ``entry``, the cache entry found before it)."""
        if key in self._always_guarded or not _default_stance():
            return
        self._served.add(key)
        if entry is not None:  # ran without compiling: the entry found is the one it ran
            function = _entry_function(self._raw, entry.code)  # type: ignore[arg-type]
            if function is not None:
                self._direct[key] = (function, entry)

    def _locals(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The frame locals a call starts with (what dynamo's guards read)."""
        lead = () if self._self is None else (self._self,)
        bound = self._signature.bind(*lead, *args, **kwargs)  # type: ignore[union-attr]
        bound.apply_defaults()
        return dict(bound.arguments)

    def _find_entry(self, args: tuple, kwargs: dict) -> Any | None:
        """The first of dynamo's cache entries for ``fn`` whose guards pass on these arguments
        (dynamo's own choice), or None."""
        try:
            f_locals = self._locals(args, kwargs)
            for entry in _ENTRIES(self._raw.__code__):  # type: ignore[misc, union-attr]
                if entry.guard_manager.check(f_locals):
                    return entry
        except Exception:  # a torch whose entries differ: no direct calls
            return None
        return None

    def _call_direct(
        self, key: Hashable, function: Callable[..., Any], entry: Any, args: tuple, kwargs: dict
    ) -> Any:
        n = self._direct_calls[key] = self._direct_calls.get(key, 0) + 1
        every = self.check_every
        if every and (n - 1) % every == 0 and not self._passes(entry, args, kwargs):
            log.warning(
                "compiled %s: graph class %r does not name every fact its graph depends on; "
                "its calls run fully guarded from now on",
                self.what,
                key[0],
            )
            del self._direct[key]
            self._served.discard(key)
            self._always_guarded.add(key)
            return _MISSED
        self.unguarded += 1
        self.direct += 1
        if self._self is not None:
            return function(self._self, *args, **kwargs)
        return function(*args, **kwargs)

    def _passes(self, entry: Any, args: tuple, kwargs: dict) -> bool:
        try:
            return bool(entry.guard_manager.check(self._locals(args, kwargs)))
        except Exception:  # cannot tell: take the guarded path
            return False


_MISSED = object()  # a direct call whose guards failed: run it guarded instead


def _entry_function(raw: types.FunctionType, code: types.CodeType) -> Callable[..., Any] | None:
    """``raw`` with dynamo's rewritten code of one cache entry (it reads the compiled graph from
    ``raw``'s module globals, where dynamo installed it)."""
    try:
        function = types.FunctionType(
            code, raw.__globals__, raw.__name__, raw.__defaults__, raw.__closure__
        )
    except (TypeError, ValueError):  # a closure the rewritten code does not take
        return None
    function.__kwdefaults__ = raw.__kwdefaults__
    return function


def _cache_entries() -> Callable[[types.CodeType], list[Any]] | None:
    """dynamo's cache entries of a code object (each with ``.code`` and ``.guard_manager``);
    None where this torch lacks the accessor (direct calls then stay off)."""
    from torch._dynamo import eval_frame

    return getattr(eval_frame, "_debug_get_cache_entry_list", None)


_ENTRIES = _cache_entries()


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

    def __init__(self, model: Transformer, *, check_every: int = CHECK_EVERY) -> None:
        super().__init__(model.forward, model.device, "the decode step", check_every=check_every)

    def __call__(  # type: ignore[override]
        self, ids: torch.Tensor, layout: Any, cache: CacheBatch, taps: tuple[int, ...]
    ) -> ModelOutput:
        # the graph class: the sizes that specialise (one sequence; one token each) and the
        # host flags (functions of those two in the engine's padded steps, named for safety)
        batch = cache.prefix_lens.shape[0]
        key = (batch == 1, ids.shape[0] == batch, cache.slots_are_prefix, cache.full_rows)
        return super().__call__(ids, layout, taps=taps, cache=cache, key=key)
