"""Megatron-core as specrl's policy backend (``pip install 'specrl[megatron]'``).

- :mod:`.compat`: Megatron's CUDA calls answered on the CPU, scoped to Megatron code on a
  machine without CUDA (:func:`~.compat.cpu_compat`);
- :mod:`.convert`: specrl's decoder families as ``GPTModel`` s and HF ↔ Megatron weights.

Nothing here imports ``megatron`` at module import time; :func:`require` does, raising the
project's one-line error naming the pip command when it is missing.
"""

from __future__ import annotations

from types import ModuleType

from specrl.errors import missing_extra

# the version this backend is tested with (the newest that installs on Python 3.11)
TESTED_VERSION = "0.16.1"


def require() -> ModuleType:
    """``megatron.core``, or :class:`~specrl.errors.DependencyError` naming the extra."""
    try:
        import megatron.core as core
    except ImportError:
        raise missing_extra("megatron-core", "megatron") from None
    return core
