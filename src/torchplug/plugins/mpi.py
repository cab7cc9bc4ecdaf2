"""``mpirun``/``mpiexec``: who am I, from the variables Open MPI or MPICH/Intel MPI set.

Open MPI sets ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``
and ``OMPI_COMM_WORLD_LOCAL_SIZE``; MPICH's and Intel MPI's Hydra launcher set ``PMI_RANK``,
``PMI_SIZE``, ``MPI_LOCALRANKID`` and ``MPI_LOCALNRANKS``. Both place ranks on nodes in blocks
(the default mapping), so the node rank is ``rank // local size``.

MPI says nothing about a TCP address for torch's store: give ``MASTER_ADDR`` (the first node)
with ``mpirun -x MASTER_ADDR=host`` (Open MPI) or ``-genv MASTER_ADDR host`` (MPICH) when the job
spans nodes; on one node it is 127.0.0.1. The port is ``MASTER_PORT`` if set, else derived from
the MPI job's id, so two concurrent jobs on one node do not share it: Open MPI's
``PMIX_NAMESPACE`` (or its older job-id variables), Hydra's ``PMI_KVS_NAME`` where it exports
one, else the job's Hydra control port. Debian's MPICH exports no job variable at all (only
``PMI_RANK``, ``PMI_SIZE``, ``PMI_FD`` and the local ones); every rank of a job, on every node,
runs under a ``hydra_pmi_proxy --control-port HOST:PORT`` naming that job's ``mpiexec``, so that
address is the job's id (read from ``/proc``: Linux). 29500 only where none of these is found.

Two patterns work: ``mpirun -np 8 python train.py`` (each MPI rank is a training process) and
``mpirun -np 2 --map-by node torchplug launch -n 4 train.py`` (one launcher per node; torchrun's
variables describe its workers, which the manager reads first inside them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from torchplug.plugin import (
    ClusterInfo,
    ConfigurationError,
    env_int,
    hookimpl,
    job_port,
    master_port,
)

DEFAULT_PORT = 29500
#: Variables naming the MPI job (Open MPI / PMIx namespace, MPICH's Hydra KVS name), from which
#: the port is derived; without one, DEFAULT_PORT.
JOB_IDS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMI_KVS_NAME")

#: (implementation, rank, size, local rank, local size) variables, in the order they are tried.
FLAVOURS = (
    (
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


@hookimpl
def torchplug_cluster_environment(env: Mapping[str, str]) -> ClusterInfo | None:
    for flavour, rank_key, size_key, local_key, local_size_key in FLAVOURS:
        if rank_key not in env or size_key not in env:
            continue
        rank, world = env_int(env, rank_key, 0), env_int(env, size_key, 1)
        local_world = max(1, env_int(env, local_size_key, world))
        nodes = max(1, -(-world // local_world))
        address = env.get("MASTER_ADDR", "")
        if not address:
            if nodes > 1:
                raise ConfigurationError(
                    f"mpirun ({flavour}) started {world} ranks on {nodes} nodes, but MASTER_ADDR "
                    f"is not set, and MPI does not say which host rank 0 is on. Pass it on: "
                    f"mpirun -x MASTER_ADDR=<first node> (Open MPI) or -genv MASTER_ADDR "
                    f"<first node> (MPICH/Intel MPI)."
                )
            address = "127.0.0.1"
        port = master_port(env.get("MASTER_PORT"))
        if port is None:  # one port per MPI job: two concurrent jobs on a node must not meet
            job = next((env[k] for k in JOB_IDS if env.get(k)), "") or hydra_job()
            port = job_port("mpi", job) if job else DEFAULT_PORT
        return ClusterInfo(
            rank=rank,
            world_size=world,
            local_rank=env_int(env, local_key, 0),
            local_world_size=local_world,
            node_rank=rank // local_world,
            num_nodes=nodes,
            master_addr=address,
            master_port=port,
            source=f"mpirun ({flavour})",
        )
    return None


def hydra_job(pid: int | None = None, depth: int = 16) -> str:
    """The ``--control-port HOST:PORT`` of the ``hydra_pmi_proxy`` this process runs under
    (its parent, or further up when the rank is a shell's child), else ``""``: the one thing
    every rank of one MPICH/Intel MPI job shares and no other job has."""
    pid = os.getpid() if pid is None else pid
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().decode(errors="replace").split("\0")
            with open(f"/proc/{pid}/stat") as handle:
                parent = int(handle.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return ""
        if os.path.basename(argv[0]).startswith("hydra_pmi_proxy") and "--control-port" in argv:
            where = argv.index("--control-port") + 1
            return f"hydra:{argv[where]}" if where < len(argv) else ""
        if parent <= 1:
            return ""
        pid = parent
    return ""
