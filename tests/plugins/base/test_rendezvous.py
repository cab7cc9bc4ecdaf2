"""The default process-group setup (`torchplug.plugins.base.DistributedStrategy`): a rank that
waits for the others says what it waits for (issue 36 item 7)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from torchplug.plugin import free_port

#: Rank 1 of 2 whose rank 0 never starts (a leftover RANK/WORLD_SIZE in the shell): the notice is
#: brought forward to 1 s and the group's timeout to 20 s, so the run ends by itself.
WAITING = textwrap.dedent(
    """
    import torchplug.plugins.base as base
    base.RENDEZVOUS_NOTICE = 1.0
    import torchplug as tp
    try:
        tp.Engine("ddp", timeout=20)
    except Exception as exc:
        print("gave up:", type(exc).__name__)
    """
)


@pytest.mark.slow
def test_a_rank_waiting_for_the_rendezvous_names_the_address_and_where_it_came_from(tmp_path):
    script = tmp_path / "waiting.py"
    script.write_text(WAITING)
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))},
        "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "PYTHONWARNINGS": "ignore",
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert "gave up:" in done.stdout, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("torchplug: rank")]
    assert len(lines) == 1, done.stderr[-3000:]  # said once, not once a second
    line = lines[0]
    assert f"rank 1 of 2 has waited 1 s for the other ranks at 127.0.0.1:{port}" in line
    assert f"MASTER_ADDR=127.0.0.1, MASTER_PORT={port}, RANK=1, WORLD_SIZE=2" in line
    assert "gives up after 20 s" in line and "left over in the shell" in line


def test_free_port_comes_from_below_job_ports_and_the_ephemeral_range_and_is_free():
    """Outgoing connections take their local ports from the ephemeral range, so a port from it
    could be gone again before rank 0's store binds it; a port `job_port` can derive could be
    the one a concurrent MPI or SLURM job binds for its store (a rank of it then waited for
    its rank 0 in the suite). Below both, only a bind of one's own takes it."""
    import socket

    from torchplug.plugins.torchrun import JOB_PORTS, _ephemeral_low, job_port

    low = min(_ephemeral_low(), JOB_PORTS.start)
    assert {job_port("mpi", str(i)) for i in range(2000)} <= set(JOB_PORTS)
    for port in {free_port() for _ in range(20)}:
        assert 10000 <= port < low, port
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
