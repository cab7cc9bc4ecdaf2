"""IBM Spectrum LSF: who am I, from the variables ``jsrun`` sets for each task of a job.

It answers when LSF runs this process as a ``jsrun`` task: ``LSB_JOBID`` with
``JSM_NAMESPACE_RANK`` (global rank), ``JSM_NAMESPACE_SIZE`` (world size) and
``JSM_NAMESPACE_LOCAL_RANK``. The job's compute hosts come from ``LSB_DJOB_RANKFILE`` (a file with
one host per slot) or ``LSB_MCPU_HOSTS`` (``"host slots host slots ..."``); the first entry is the
launch node, which runs no task, and is skipped, as in Lightning's LSFEnvironment. The master is
the first compute host; the port is ``MASTER_PORT`` if set, else derived from the job id so every
task agrees without talking.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torchplug.plugin import (
    ClusterInfo,
    env_int,
    hookimpl,
    master_port,
)

REQUIRED = ("LSB_JOBID", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK")


def compute_hosts(env: Mapping[str, str]) -> list[str]:
    """The job's compute hosts in order, once each, without the launch node."""
    entries: list[str] = []
    rankfile = env.get("LSB_DJOB_RANKFILE", "")
    if rankfile and Path(rankfile).is_file():
        entries = [line.strip() for line in Path(rankfile).read_text().splitlines()]
        entries = [e for e in entries if e]
    elif env.get("LSB_MCPU_HOSTS"):
        words = env["LSB_MCPU_HOSTS"].split()
        entries = [words[i] for i in range(0, len(words) - 1, 2)]
    return list(dict.fromkeys(entries[1:]))


@hookimpl
def torchplug_cluster_environment(env: Mapping[str, str]) -> ClusterInfo | None:
    if not all(key in env for key in REQUIRED):
        return None
    hosts = compute_hosts(env)
    world = env_int(env, "JSM_NAMESPACE_SIZE", 1)
    rank = env_int(env, "JSM_NAMESPACE_RANK", 0)
    nodes = max(1, len(hosts))
    local_world = env_int(env, "JSM_NAMESPACE_LOCAL_SIZE", max(1, world // nodes))
    port = master_port(env.get("MASTER_PORT"))
    job = env["LSB_JOBID"]
    return ClusterInfo(
        rank=rank,
        world_size=world,
        local_rank=env_int(env, "JSM_NAMESPACE_LOCAL_RANK", 0),
        local_world_size=local_world,
        node_rank=rank // local_world,
        num_nodes=nodes,
        master_addr=env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
        master_port=port if port is not None else 10000 + int(job[-4:] if job.isdigit() else 0),
        source="LSF",
    )
