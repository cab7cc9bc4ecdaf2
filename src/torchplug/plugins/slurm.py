"""SLURM: who am I, from the variables ``srun`` sets. Built in, through the same
``torchplug_cluster_environment`` hook a third-party scheduler plugin uses.

It answers when SLURM started this process as one of its tasks (``SLURM_PROCID`` and
``SLURM_NTASKS`` set) and torchrun did not (under torchrun, torchrun's variables describe the
process). The step's own variables come first (``SLURM_STEP_NODELIST``,
``SLURM_STEP_NUM_TASKS``, ...: a step may run on part of the job's nodes): the master is the
step's first node; the port is ``MASTER_PORT`` if set, else derived from the job *and step*
ids, so that every task of a step agrees without talking and concurrent steps of one allocation
(a sweep) do not meet.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torchplug.plugin import (
    ClusterInfo,
    hookimpl,
    inside_torchrun,
    job_port,
    master_port,
)


def expand_nodelist(nodelist: str) -> list[str]:
    """``"node[01-03,7],gpu5"`` -> ``["node01", "node02", "node03", "node7", "gpu5"]``."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain.strip())
            continue
        for part in ranges.split(","):
            if "-" in part:
                start, end = part.split("-", 1)
                width = len(start)
                hosts += [f"{prefix}{i:0{width}d}" for i in range(int(start), int(end) + 1)]
            else:
                hosts.append(f"{prefix}{part}")
    return hosts


def tasks_per_node(value: str, node: int) -> int:
    """Parse ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``) for node index ``node``."""
    counts: list[int] = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", value):
        counts += [int(count)] * (int(repeat) if repeat else 1)
    return counts[node] if node < len(counts) else (counts[-1] if counts else 1)


@hookimpl
def torchplug_cluster_environment(env: Mapping[str, str]) -> ClusterInfo | None:
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env or inside_torchrun(env):
        return None  # torchrun's workers: torchrun's variables describe them
    # The step's own layout first: a step may use part of the job's nodes (srun -N 1 -w b)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get(
        "SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")
    )
    hosts = expand_nodelist(nodelist)
    node = int(env.get("SLURM_NODEID", "0"))
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    local_world = int(
        env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or tasks_per_node(per_node, node)
    )
    if "SLURM_STEP_NODELIST" in env and hosts:  # this task's node index within the step
        host = env.get("SLURMD_NODENAME", "")
        node = hosts.index(host) if host in hosts else node
    job = env.get("SLURM_JOB_ID", "0")
    step = env.get("SLURM_STEP_ID", "")
    port = master_port(env.get("MASTER_PORT"))
    port = port if port is not None else job_port("slurm", job, step)
    return ClusterInfo(
        rank=int(env["SLURM_PROCID"]),
        world_size=int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]),
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        local_world_size=local_world,
        node_rank=node,
        num_nodes=len(hosts)
        or int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES", "1")),
        master_addr=env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
        master_port=port,
        source="SLURM",
    )
