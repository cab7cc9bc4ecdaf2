"""torchplug's pytest plugin, loaded automatically (``pytest11`` entry point) where torchplug is
installed. It only provides the ``torchplug_ranks`` fixture and imports nothing heavy; the
conformance suite lives in `torchplug.testing.conformance`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from torchplug.testing.processes import RankPool, default_sys_path


@pytest.fixture(scope="session")
def torchplug_ranks() -> Iterator[RankPool]:
    """Two ranks on loopback, started once; each call gets a fresh process group."""
    pool = RankPool(2, sys_path=default_sys_path(), env={"PYTHONWARNINGS": "ignore"})
    yield pool
    pool.stop()
