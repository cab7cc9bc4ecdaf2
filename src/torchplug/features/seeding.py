"""``seed_everything``: one call that makes a run repeatable.

Seeds Python's ``random``, torch (CPU and every CUDA device) and numpy when it is installed, with
the same seed on every rank (so every rank builds the same initial model). Data-loader workers
are seeded per rank and per worker by [`seed_worker`][torchplug.seed_worker] (otherwise every worker
of every rank would draw the same random augmentations).
"""

from __future__ import annotations

import os
import random
import sys

import torch

SEED_ENV = "TORCHPLUG_SEED"
WORKERS_ENV = "TORCHPLUG_SEED_WORKERS"
_MAX_SEED = 2**32 - 1


def seed_everything(seed: int, *, workers: bool = True) -> int:
    """Seed ``random``, torch and numpy (if installed) with ``seed``; return it.

    With ``workers``, loaders set up by
    [`Engine.setup_dataloader`][torchplug.Engine.setup_dataloader] that have worker processes and no
    ``worker_init_fn`` of their own get [`seed_worker`][torchplug.seed_worker], which gives each
    worker of each rank its own stream derived from ``(seed, rank, worker id)``.

    Args:
        seed: The seed (the same on every rank seeds every rank alike).
        workers: Give set-up loaders with worker processes [`seed_worker`][torchplug.seed_worker].

    Returns:
        The seed.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(
            f"seed_everything: seed {seed!r} is not a whole number from 0 to {_MAX_SEED}. "
            f"Pass e.g. seed_everything(42)."
        )
    os.environ[SEED_ENV] = str(seed)
    os.environ[WORKERS_ENV] = "1" if workers else "0"
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    numpy = sys.modules.get("numpy")
    if numpy is None:
        try:
            import numpy
        except ImportError:
            numpy = None
    if numpy is not None:
        numpy.random.seed(seed)
    return seed


def worker_seed(base: int, rank: int, worker_id: int) -> int:
    """The seed of data-loader worker ``worker_id`` of ``rank``: distinct for every pair."""
    sequence = (base * 1_000_003 + rank) * 1_000_003 + worker_id
    return sequence % (_MAX_SEED + 1)


def seed_worker(worker_id: int) -> None:
    """A ``worker_init_fn`` seeding ``random``, torch and numpy per rank and worker.

    Args:
        worker_id: The DataLoader worker's index, as ``worker_init_fn`` receives it.
    """
    base = int(os.environ.get(SEED_ENV, "0"))
    rank = int(os.environ.get("RANK", "0"))
    seed = worker_seed(base, rank, worker_id)
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


def seeding_workers() -> bool:
    return os.environ.get(WORKERS_ENV) == "1"
