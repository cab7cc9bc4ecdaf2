"""Who am I: torchrun's variables, SLURM's (built in), through one firstresult hook."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torchplug.core import cluster
from torchplug.plugins.slurm import expand_nodelist, tasks_per_node

SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[07-09,12],login1",
    "SLURM_TASKS_PER_NODE": "2(x4)",
    "SLURM_JOB_ID": "123456",
}


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        ("a1", ["a1"]),
        ("x[9-11]", ["x9", "x10", "x11"]),
        ("r[001-002],s[1,3]", ["r001", "r002", "s1", "s3"]),
    ],
)
def test_nodelist_bracket_ranges_expand(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_tasks_per_node_with_repeats():
    assert [tasks_per_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]


def test_slurm_task_identity():
    info = cluster.detect(SLURM)
    assert (info.rank, info.world_size, info.local_rank, info.node_rank) == (5, 8, 1, 2)
    assert (info.num_nodes, info.local_world_size, info.master_addr) == (5, 2, "gpu07")
    assert info.master_port == 10000 + 3456 and info.source == "SLURM"


def test_torchrun_inside_slurm_wins():
    env = {**SLURM, "RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
    assert cluster.detect(env).source == "torchrun" and cluster.detect(env).rank == 3


def test_plain_process_is_rank_zero_of_one():
    info = cluster.detect({})
    assert (info.rank, info.world_size, info.source) == (0, 1, "single process")


def doctor_run(env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    """``torchplug doctor`` with ``env`` as the whole environment (plus PATH)."""
    return subprocess.run(
        [sys.executable, "-m", "torchplug", "doctor"],
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            # a source checkout run with PYTHONPATH=src tests that checkout, not an installed copy
            **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ},
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def doctor(env: dict[str, str], cwd) -> str:
    """``torchplug doctor``'s output; the settings must be valid."""
    run = doctor_run(env, cwd)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def identity(output: str) -> dict[str, str]:
    """The last word of each line of doctor's output, by its first word."""
    return {line.split()[0]: line.split()[-1] for line in output.splitlines() if line.strip()}


def test_doctor_reports_the_slurm_identity(tmp_path):
    lines = identity(doctor(SLURM, tmp_path))
    assert lines["detected"] == "SLURM"
    assert (lines["rank"], lines["world_size"], lines["node_rank"]) == ("5", "8", "2")
    assert lines["master_addr"] == "gpu07"
