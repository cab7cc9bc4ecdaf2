"""Shared fixtures: a pool of 2 real ranks (started once by torchrun) and a clean registry."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from torchplug.contract import manager
from torchplug.testing import RankPool
from torchplug.util import capabilities


@pytest.fixture(scope="session")
def ranks(torchplug_ranks: RankPool) -> RankPool:
    """Two ranks on loopback (gloo); each ``ranks.run(fn, ...)`` gets a fresh process group.

    The conformance kit's own pool (from torchplug's pytest plugin), so one torchrun serves all.
    """
    return torchplug_ranks


#: Every pool's calls wait at least 900 s: the timeouts the tests pass are hang guards sized for
#: an idle machine, and no test may fail because the machine is slow (pytest-timeout's 1,200 s
#: per test is the last guard).
RankPool.timeout_floor = 900.0


#: Fixtures that start real ranks: a test using one is multi-process, hence ``slow``.
RANK_FIXTURES = {"ranks", "torchplug_ranks", "torchplug_kit", "four"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test on real ranks is ``slow`` (``pytest -m "not slow"`` is the inner loop); tests
    that start processes themselves say so with ``@pytest.mark.slow``."""
    for item in items:
        if RANK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No torchplug or launcher variable leaks into a test; every test rebuilds the registry."""
    for key in list(os.environ):
        if key == capabilities.ASSUME_NO_KERNELS_ENV:
            continue  # a fact about the machine (tox -e deepspeed as on a CPU without fp16)
        if key.startswith("TORCHPLUG_") or key in {
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
            "TORCHELASTIC_RUN_ID",
        }:
            monkeypatch.delenv(key, raising=False)
    manager.reset_registry(forget_blocks=True)
    yield
    manager.reset_registry(forget_blocks=True)
