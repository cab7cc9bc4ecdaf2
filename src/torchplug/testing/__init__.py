"""Testing tools for torchplug and plugin authors: run code in real processes, compare results."""

from torchplug.testing.processes import RankError, RankPool

__all__ = ["RankError", "RankPool"]
