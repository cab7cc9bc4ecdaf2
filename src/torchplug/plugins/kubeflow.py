"""Kubeflow PyTorchJob: who am I, from the variables the training operator sets in each pod.

The operator starts one pod per replica (``Master`` and ``Worker``s) and sets ``MASTER_ADDR``
(the master pod's service), ``MASTER_PORT``, ``WORLD_SIZE`` (the number of pods) and ``RANK``
(this pod's index, 0 for the master). It answers only inside Kubernetes (``KUBERNETES_PORT``
set), so a plain ``RANK``/``WORLD_SIZE`` environment elsewhere is left to the torchrun reading.

Each pod is a node: the script run directly is rank ``RANK`` of ``WORLD_SIZE``; with
``torchplug launch -n N`` in every pod, the launcher fills ``--nnodes WORLD_SIZE --node-rank RANK``
and the master from it, and its N workers are described by torchrun's variables.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchplug.core.cluster import ClusterInfo, _int, master_port
from torchplug.core.spec import hookimpl

REQUIRED = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


@hookimpl
def torchplug_cluster_environment(env: Mapping[str, str]) -> ClusterInfo | None:
    if not all(key in env for key in REQUIRED):
        return None
    pods = _int(env, "WORLD_SIZE", 1)
    pod = _int(env, "RANK", 0)
    return ClusterInfo(
        rank=pod,
        world_size=pods,
        local_rank=0,
        local_world_size=1,
        node_rank=pod,
        num_nodes=pods,
        master_addr=env["MASTER_ADDR"],
        master_port=master_port(env["MASTER_PORT"]),
        source="Kubeflow PyTorchJob",
    )
