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

The EAGLE-3 proposer compiles its chain step (one draft-layer pass and the draft logits for one
token per sequence) with the same rules: sequences in slots 0..B−1, no mask for a single
sequence.  Its catch-up pass over the newly committed positions stays eager.

Sizes (B, M, the KV length) are symbolic (``dynamic=True``); sizes 1 specialise, so a run
compiles about four graphs (B = 1 or more, M = 1 or more) and none afterwards.  Prefill stays
eager (its lengths vary the most, and it runs once per request).  The compiled graph reads the
parameters at each call, so in-place weight updates (``RolloutEngine.update_weights``) need no
recompilation; the GEMMs are the module path's (q, k, v apart: the fused copies of
:mod:`specrl.models.fused` check versions on the host, which a graph cannot).

On CPU inductor builds C++ and needs a compiler (``g++``); on CUDA it uses Triton.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
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
    it compiles and names the way out when compilation fails."""

    def __init__(self, fn: Callable[..., Any], device: torch.device, what: str) -> None:
        check_toolchain(device)
        import torch._dynamo  # the counters read in __call__
        import torch.fx.experimental._config  # use_duck_shape, patched in __call__

        self._fn = torch.compile(fn, dynamic=True)
        self.what = what
        self.graphs = 0  # graphs dynamo compiled for this callable so far

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        counters = torch._dynamo.utils.counters["stats"]
        before = counters["unique_graphs"]
        try:
            # dynamo's recompile limit counts the graphs of every model behind one code object
            # in the process (tests, engines rebuilt on new models); each model needs ≈ 4.
            # No duck sizing: sizes that happen to be equal while a graph compiles (the batch
            # and the KV heads, an input's storage offset) must not become one symbol whose
            # guard fails, and recompiles, once they differ.
            with (
                torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT),
                torch.fx.experimental._config.patch(use_duck_shape=False),
            ):
                out = self._fn(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = e.inner_exception  # a SpecrlError: the CLI prints one line, not a traceback
            raise ConfigError(
                f"torch.compile could not build {self.what} ({type(inner).__name__}: {inner})",
                hint="run without --compile (RolloutEngine(compile=False))",
            ) from e
        self.graphs += counters["unique_graphs"] - before
        return out


class CompiledDecode(Compiled):
    """``model.forward`` compiled for the engine's padded decode steps."""

    def __init__(self, model: Transformer) -> None:
        super().__init__(model.forward, model.device, "the decode step")

    def __call__(  # type: ignore[override]
        self, ids: torch.Tensor, layout: Any, cache: CacheBatch, taps: tuple[int, ...]
    ) -> ModelOutput:
        return super().__call__(ids, layout, taps=taps, cache=cache)
