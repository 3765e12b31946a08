"""Errors a user can cause and fix.

Every error that bad input can trigger is a :class:`SpecrlError`: the CLI prints it as one line
``Error: <message>`` plus an optional ``hint`` line (the next command to run), exits with code 1 and
shows a traceback only under ``--debug``.  Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class SpecrlError(Exception):
    """An error caused by input the user controls (files, recipes, flags, layouts)."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class ConfigError(SpecrlError):
    """A recipe or model config that cannot be used as written."""


class CheckpointError(SpecrlError):
    """A checkpoint directory that is missing, truncated or does not match."""


class DataError(SpecrlError):
    """A data file (JSONL prompts, corpora) with a malformed record."""


class OutputError(SpecrlError):
    """An output path specrl refuses to write (it holds something else, or is an input)."""


class LayoutError(SpecrlError):
    """A parallel layout (dp × cp × pp) that the world size or the model cannot satisfy."""


class DependencyError(SpecrlError):
    """An optional backend that is not installed."""


def missing_extra(module: str, extra: str) -> DependencyError:
    """The error for an optional backend that failed to import, naming the exact pip command."""
    return DependencyError(
        f"optional backend '{module}' is not installed",
        hint=f"pip install 'specrl[{extra}]'",
    )
