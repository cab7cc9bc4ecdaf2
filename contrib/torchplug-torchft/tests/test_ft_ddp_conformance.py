"""The conformance kit on ft-ddp: one replica group of two ranks on a real lighthouse (the
kit's properties are a group's: its ranks, its data-parallel share, its checkpoints)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")
pytest.importorskip("torchplug_torchft")

from torchplug.testing.conformance import Conformance  # noqa: E402


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


PORT = _free_port()


@pytest.fixture(scope="module", autouse=True)
def lighthouse():
    """A lighthouse for the module's Engines: quick to form a quorum of the one live group
    (each property's Engine is a new member; the one before it stops heartbeating)."""
    binary = shutil.which("torchft_lighthouse") or str(
        Path(sys.executable).parent / "torchft_lighthouse"
    )
    server = subprocess.Popen(
        [binary, "--min_replicas", "1", "--bind", f"[::]:{PORT}", "--join_timeout_ms", "100",
         "--heartbeat_timeout_ms", "1000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # listening?
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", PORT)) == 0:
                break
        time.sleep(0.1)
    yield
    server.kill()
    server.wait()


class TestFaultTolerantDDP(Conformance):
    strategy = "ft-ddp"
    options = {  # noqa: RUF012 - read-only class configuration
        "replicas": 1,
        "replica": 0,
        "lighthouse": f"http://127.0.0.1:{PORT}",
        "replica_timeout": 120.0,
    }
