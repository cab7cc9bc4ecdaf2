"""torchplug cluster environment for SageMaker: who am I, from SageMaker's training variables.

SageMaker starts the entry point once per host and sets ``SM_HOSTS`` (a JSON list of host names),
``SM_CURRENT_HOST``, ``SM_NUM_GPUS`` and ``SM_NUM_CPUS``. A host's node rank is its place in
``SM_HOSTS``; the first host is the master. One process per GPU (one per host without GPUs).
Under torchrun (``torchplug launch``), torchrun's variables describe each process instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from torchplug.plugin import ClusterInfo, hookimpl

DEFAULT_PORT = 29500


@hookimpl
def torchplug_cluster_environment(env: Mapping[str, str]) -> ClusterInfo | None:
    if "SM_HOSTS" not in env or "SM_CURRENT_HOST" not in env:
        return None
    if "TORCHELASTIC_RUN_ID" in env or "RANK" in env:
        return None  # a process started by torchrun: torchrun's variables say who it is
    hosts = json.loads(env["SM_HOSTS"])
    current = env["SM_CURRENT_HOST"]
    if current not in hosts:
        raise ValueError(
            f"SM_CURRENT_HOST={current!r} is not in SM_HOSTS={hosts}; SageMaker's environment is "
            f"inconsistent. Check the training job's configuration."
        )
    node = hosts.index(current)
    per_host = int(env.get("SM_NUM_GPUS") or 0) or 1
    return ClusterInfo(
        rank=node * per_host,
        world_size=len(hosts) * per_host,
        local_rank=0,
        local_world_size=per_host,
        node_rank=node,
        num_nodes=len(hosts),
        master_addr=hosts[0],
        master_port=int(env.get("MASTER_PORT") or DEFAULT_PORT),
        source="SageMaker",
    )
