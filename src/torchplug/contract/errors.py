"""Exceptions raised to users. Each message says what was wrong, what was expected, and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class TorchplugError(Exception):
    """Base class of every error torchplug raises on purpose."""


class ConfigurationError(TorchplugError, ValueError):
    """A setting (strategy, precision, option) is unknown, mistyped, or contradicts another."""


class PluginError(TorchplugError):
    """A plugin failed to load or does not follow the hook specification."""


class CheckpointError(TorchplugError):
    """A checkpoint is missing, incomplete, altered, or does not match the state to load into."""


def first_line(message: object, limit: int = 300, rest: str = "the traceback has it") -> str:
    """A message's first line for a one-line summary. When more follows (later lines, or a line
    over ``limit`` characters, cut at a space or ``/,;:`` in its second half, else at the limit)
    it ends ``... (cut: <rest>)``, so a reader knows there is more and where."""
    lines = [line for line in str(message).strip().splitlines() if line.strip()] or [""]
    line = lines[0].rstrip()
    if len(line) <= limit and len(lines) == 1:
        return line
    if len(line) > limit:
        cut = line[:limit]
        at = max(cut.rfind(mark) for mark in " /,;:")
        line = cut[: at + 1] if at >= limit // 2 else cut
    return f"{line.rstrip(' ,;:')} ... (cut: {rest})"


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest candidate, or an empty string.

    Args:
        word: What the user wrote.
        candidates: The names that exist.
    """
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""
