"""Who am I: rank, world size and rendezvous address, from the environment a launcher set.

Detection is the firstresult hook ``torchplug_cluster_environment``: a plugin for a scheduler
answers when its variables are present; the torchrun reading below answers last, and a plain
process with no launcher is rank 0 of 1. Inside the workers torchrun starts, `detect` reads
torchrun's variables without asking the plugins (they describe the launcher process there).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from torchplug.contract.errors import ConfigurationError
from torchplug.contract.spec import hookimpl
from torchplug.contract.types import ClusterInfo


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a master port of one's own).

    Args:
        host: The address to bind.
    """
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
    that another job or step (other ids) gets a different one of 30,000 with high probability:
    concurrent steps of one allocation must never meet at one rendezvous.

    Args:
        *ids: The scheduler's ids of this job and step (e.g. ``SLURM_JOB_ID``, ``SLURM_STEP_ID``).
    """
    import zlib

    return 20000 + zlib.crc32("/".join(ids).encode()) % 30000


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


def checked(info: ClusterInfo) -> ClusterInfo:
    """``info`` if its numbers are consistent; else an error naming the variable and the fix."""
    where = f"(from {info.source})"
    if info.world_size < 1:
        raise ConfigurationError(
            f"World size {info.world_size} {where} is not a number of processes; expected 1 or "
            f"more. Fix WORLD_SIZE, or unset RANK and WORLD_SIZE to run one process."
        )
    if not 0 <= info.rank < info.world_size:
        raise ConfigurationError(
            f"Rank {info.rank} {where} is outside the world of {info.world_size} processes; "
            f"expected 0 to {info.world_size - 1}. Fix RANK/WORLD_SIZE (a rank that does not "
            f"exist would wait for the others forever)."
        )
    if info.local_rank < 0 or info.node_rank < 0:
        raise ConfigurationError(
            f"Local rank {info.local_rank} / node rank {info.node_rank} {where} is negative; "
            f"expected 0 or more. Fix LOCAL_RANK/GROUP_RANK."
        )
    return info


def inside_torchrun(env: Mapping[str, str]) -> bool:
    """Whether this process is a worker that torchrun (or ``torchplug launch``) started."""
    return "TORCHELASTIC_RUN_ID" in env and "RANK" in env and "WORLD_SIZE" in env


@hookimpl(trylast=True)
def torchplug_cluster_environment(env: Mapping[str, str]) -> ClusterInfo:
    return torchrun_environment(env)


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


def detect(env: Mapping[str, str] | None = None) -> ClusterInfo:
    """Ask the installed cluster-environment plugins who this process is.

    Inside a worker torchrun started, torchrun's variables are the answer, whatever else the
    environment holds: a scheduler's variables (SLURM's, ``mpirun``'s) are inherited from the
    launcher process and describe it, not its workers. So a scheduler plugin answers for the
    launcher process and is never asked in its workers; it need not step aside itself.
    """
    from torchplug.contract.manager import get_registry

    env = dict(os.environ if env is None else env)
    if inside_torchrun(env):
        return checked(torchrun_environment(env))
    answer = get_registry().pm.hook.torchplug_cluster_environment(env=env)
    return checked(answer) if answer is not None else ClusterInfo()


_int = env_int  # the name API 1.x cluster plugins imported
