"""Kubeflow PyTorchJob: who am I, from the variables the training operator sets in each pod.

The operator starts one pod per replica (``Master`` and ``Worker``s) and sets ``MASTER_ADDR``
(the master pod's service), ``MASTER_PORT``, ``WORLD_SIZE`` (the number of pods) and ``RANK``
(this pod's index, 0 for the master). It answers only inside Kubernetes (``KUBERNETES_PORT``
set), so a plain ``RANK``/``WORLD_SIZE`` environment elsewhere is left to the torchrun reading.

With ``nprocPerNode`` set, the operator (1.7+) adds torchrun's ``PET_NNODES``,
``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` and ``PET_MASTER_ADDR``/``PET_MASTER_PORT``; they are
read first, and the pod is described as a node of ``PET_NPROC_PER_NODE`` processes.

Each pod is a node: the script run directly is rank ``RANK`` of ``WORLD_SIZE``; with
``torchplug launch -n N`` in every pod, the launcher fills ``--nnodes WORLD_SIZE --node-rank RANK``
and the master from it, and its N workers are described by torchrun's variables.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchplug.plugin import (
    ClusterInfo,
    env_int,
    hookimpl,
    master_port,
)

REQUIRED = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


@hookimpl
def torchplug_cluster_environment(env: Mapping[str, str]) -> ClusterInfo | None:
    if not all(key in env for key in REQUIRED):
        return None
    # With nprocPerNode (training operator 1.7+) the operator also sets torchrun's PET_*
    # variables: PET_NNODES pods of PET_NPROC_PER_NODE processes, this pod PET_NODE_RANK.
    pods = env_int(env, "PET_NNODES", 0) or env_int(env, "WORLD_SIZE", 1)
    pod = env_int(env, "PET_NODE_RANK", -1) if "PET_NODE_RANK" in env else env_int(env, "RANK", 0)
    per_pod = env.get("PET_NPROC_PER_NODE", "")
    per_pod_count = int(per_pod) if per_pod.strip().isdigit() else 1
    return ClusterInfo(
        rank=pod * per_pod_count,
        world_size=pods * per_pod_count,
        local_rank=0,
        local_world_size=per_pod_count,
        node_rank=pod,
        num_nodes=pods,
        master_addr=env.get("PET_MASTER_ADDR") or env["MASTER_ADDR"],
        master_port=master_port(env.get("PET_MASTER_PORT") or env["MASTER_PORT"]),
        source="Kubeflow PyTorchJob",
    )
