"""Exceptions raised to users. Each message says what was wrong, what was expected, and the fix."""

from __future__ import annotations

# API 1.x: the text helpers moved to torchplug.util.text; these names keep working here.
from torchplug.util.text import did_you_mean, first_line  # noqa: F401


class TorchplugError(Exception):
    """Base class of every error torchplug raises on purpose."""


class ConfigurationError(TorchplugError, ValueError):
    """A setting (strategy, precision, option) is unknown, mistyped, or contradicts another."""


class PluginError(TorchplugError):
    """A plugin failed to load or does not follow the hook specification."""


class CheckpointError(TorchplugError):
    """A checkpoint is missing, incomplete, altered, or does not match the state to load into."""
