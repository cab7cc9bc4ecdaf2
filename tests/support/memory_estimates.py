"""torchplug estimate-memory's numbers for support/memory_body.py's model, and the check
against the bytes a real step measured."""

from __future__ import annotations

import pytest
import torch

from support import memory_body
from torchplug.cli.estimate import estimates

FIELDS = ("params", "grads", "optimizer", "masters")


def estimate_for(strategy: str, precision: str = "32", world_size: int = 2, **options) -> dict:
    with torch.device("meta"):
        model = memory_body.build()
    rows, skipped = estimates(model, world_size, precision, "adamw", [strategy], options)
    assert not skipped, skipped
    return rows[0]


def assert_within(estimate: dict, measured: list[dict], rel: float = 0.05) -> None:
    """Each field of the estimate within ``rel`` of the fullest rank's measured bytes."""
    for field in FIELDS:
        fullest = max(m[field] for m in measured)
        assert estimate[field] == pytest.approx(fullest, rel=rel, abs=0), (
            field,
            estimate,
            measured,
        )
