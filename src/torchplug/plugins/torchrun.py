"""torchrun: who am I, from the variables torchrun (and ``torchplug launch``) set, and the port
and variable helpers every cluster environment uses. Built in, through the same
``torchplug_cluster_environment`` hook a third-party scheduler plugin uses, as two answers:

- ``torchrun`` (this module) answers *first*, inside a worker torchrun started
  (``TORCHELASTIC_RUN_ID``, ``RANK`` and ``WORLD_SIZE`` set): there torchrun's variables describe
  this process, whatever else the environment holds (a scheduler's variables, SLURM's or
  ``mpirun``'s, are inherited from the launcher process and describe it). So a scheduler plugin
  never has to step aside in torchrun's workers (unless it marks itself ``tryfirst``: don't).
- ``environment`` (`ENVIRONMENT`) answers *last*: ``RANK``/``WORLD_SIZE`` set by hand or by
  another launcher, after every scheduler plugin had its say. Without either, a process is rank
  0 of 1.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Mapping

from torchplug.plugin import ClusterInfo, ConfigurationError, hookimpl

#: The ports `job_port` derives from a scheduler's ids (below Linux's ephemeral range);
#: `free_port` picks below them.
JOB_PORTS = range(20000, 32768)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a master port of one's own), below both the ports
    `job_port` derives and the kernel's ephemeral range where it can be.

    A port ``bind(0)`` hands out comes from the ephemeral range, which every outgoing
    connection (gloo's, a store client's) draws its local port from too: between this call and
    the store's ``bind`` one of them could take it (``EADDRINUSE`` on rank 0, seen in the test
    suite's busy moments). A port among `JOB_PORTS` could be the one a concurrent scheduler job
    (an MPI or SLURM step) derives for its own store. A port below both is taken only by another
    ``bind`` of one's own.

    Args:
        host: The address to bind.
    """
    candidates = range(10000, min(_ephemeral_low(), JOB_PORTS.start))
    pick = random.SystemRandom()  # not the script's seeded random: other processes pick too
    for _ in range(32 if len(candidates) > 1000 else 0):
        port = pick.choice(candidates)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def env_int(env: Mapping[str, str], key: str, default: int) -> int:
    """``env[key]`` as an integer, ``default`` when unset or empty; a ConfigurationError naming
    the variable when it is not a number (a cluster environment reading its scheduler's ids).

    Args:
        env: The environment read.
        key: The variable.
        default: The value when it is unset or empty.
    """
    value = env.get(key, "")
    try:
        return int(value) if value.strip() else default
    except ValueError:
        raise ConfigurationError(
            f"Environment variable {key}={value!r} is not an integer; expected this process's "
            f"{key.lower()} as a whole number. The launcher that set it is misconfigured: unset "
            f"it, or start the script with `torchplug launch`/torchrun, which set it."
        ) from None


def job_port(*ids: str) -> int:
    """A TCP port every process of one job (step) derives alike from the scheduler's ids, and
    that another job or step (other ids) gets a different one of 12,768 with high probability:
    concurrent steps of one allocation must never meet at one rendezvous. The ports lie below
    Linux's ephemeral range (32768-60999), which outgoing connections (another step's gloo
    pairs) take from: a port there was seen in use by one (EADDRINUSE at the rendezvous).

    Args:
        *ids: The scheduler's ids of this job and step (e.g. ``SLURM_JOB_ID``, ``SLURM_STEP_ID``).
    """
    import zlib

    return JOB_PORTS[zlib.crc32("/".join(ids).encode()) % len(JOB_PORTS)]


def master_port(value: str | None, name: str = "MASTER_PORT") -> int | None:
    """``value`` as a TCP port (1-65535), or ``None`` when unset; else a ConfigurationError.

    Args:
        value: The variable's value.
        name: The variable's name, for the error.
    """
    if value is None or not value.strip():
        return None
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigurationError(
            f"{name}={value!r} is not a TCP port; expected a whole number from 1 to 65535. "
            f"Set it to a free port (e.g. {name}=29500) or unset it to let the launcher choose."
        )
    return port


#: The programs that start a scheduler's tasks. A process whose nearest ancestor outside a
#: wrapping shell is one of these was not started by torchrun, whatever torchrun variables it has.
TASK_STARTERS = (
    "slurmstepd", "prted", "prterun", "orted", "hydra_pmi_proxy", "mpirun", "mpiexec", "srun",
)  # fmt: skip
#: What may sit between a task starter and the rank (``srun bash -c "python train.py"``).
WRAPPERS = ("sh", "bash", "dash", "zsh", "ksh", "fish", "env", "nohup", "timeout", "stdbuf")


def started_by(pid: int | None = None, depth: int = 8) -> str:
    """The name of the program that started this process, looking past wrapping shells (read
    from ``/proc``; ``""`` where that cannot be read)."""
    pid = os.getpid() if pid is None else pid
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                parent = int(handle.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{parent}/stat") as handle:
                name = handle.read().partition("(")[2].rpartition(")")[0]
        except (OSError, ValueError, IndexError):
            return ""
        if name not in WRAPPERS or parent <= 1:
            return name
        pid = parent
    return ""


def inside_torchrun(env: Mapping[str, str]) -> bool:
    """Whether this process is a worker that torchrun (or ``torchplug launch``) started: its
    variables are set, and no scheduler's task starter started it. A shell that once ran
    torchrun keeps ``TORCHELASTIC_RUN_ID``, ``RANK`` and ``WORLD_SIZE``; ``srun`` and
    ``mpirun`` pass them on to every task, which all became "rank 1 of 2" and waited 30 minutes
    at a rendezvous nobody else came to. Such leftovers are named once and set aside, and the
    scheduler's own variables decide.

    Args:
        env: The environment read (this process's, for the look at who started it).
    """
    if not ("TORCHELASTIC_RUN_ID" in env and "RANK" in env and "WORLD_SIZE" in env):
        return False
    starter = started_by() if env is os.environ or env == os.environ else ""
    if starter in TASK_STARTERS:
        _said_leftovers(env, starter)
        return False
    return True


_SAID: set[str] = set()


def _said_leftovers(env: Mapping[str, str], starter: str) -> None:
    names = [k for k in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK") if k in env]
    if starter in _SAID:
        return
    _SAID.add(starter)
    listing = ", ".join(f"{k}={env[k]}" for k in names)
    print(  # a line, not a warning: PYTHONWARNINGS=ignore must not hide why the ranks differ
        f"torchplug: this process was started by {starter}, not by torchrun, yet torchrun's "
        f"variables are set ({listing}): left over in the shell from an earlier torchrun, "
        f"they are ignored here and the scheduler's own variables say which rank this is. "
        f"Unset them (unset {' '.join(names)}) to silence this.",
        file=sys.stderr,
        flush=True,
    )


def torchrun_environment(env: Mapping[str, str]) -> ClusterInfo:
    """The identity torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) give, or a single
    process when they are absent."""
    if "RANK" in env and "WORLD_SIZE" in env:
        world = env_int(env, "WORLD_SIZE", 1)
        local_world = env_int(env, "LOCAL_WORLD_SIZE", world)
        return ClusterInfo(
            rank=env_int(env, "RANK", 0),
            world_size=world,
            local_rank=env_int(env, "LOCAL_RANK", 0),
            local_world_size=local_world,
            node_rank=env_int(env, "GROUP_RANK", 0),
            num_nodes=max(1, world // max(1, local_world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=master_port(env.get("MASTER_PORT")),
            source="torchrun" if "TORCHELASTIC_RUN_ID" in env else "environment (RANK/WORLD_SIZE)",
        )
    return ClusterInfo()


@hookimpl(tryfirst=True)
def torchplug_cluster_environment(env: Mapping[str, str]) -> ClusterInfo | None:
    return torchrun_environment(env) if inside_torchrun(env) else None


class EnvironmentVariables:
    """The last answer: ``RANK``/``WORLD_SIZE`` (and the rest of torchrun's names) when set."""

    @hookimpl(trylast=True)
    def torchplug_cluster_environment(self, env: Mapping[str, str]) -> ClusterInfo | None:
        return torchrun_environment(env) if "RANK" in env and "WORLD_SIZE" in env else None


#: The ``environment`` entry point.
ENVIRONMENT = EnvironmentVariables()

_int = env_int  # the name API 1.x cluster plugins imported
