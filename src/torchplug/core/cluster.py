"""Who am I: rank, world size and rendezvous address, from the environment a launcher set.

Detection is the firstresult hook ``torchplug_cluster_environment``: a plugin for a scheduler
answers when its variables are present; the torchrun reading below answers last, and a plain
process with no launcher is rank 0 of 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from torchplug.core.spec import hookimpl


@dataclass(frozen=True)
class ClusterInfo:
    """The identity of this process within its job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    #: Which environment answered, e.g. ``"torchrun"`` or ``"single process"``.
    source: str = "single process"


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key, "")
    try:
        return int(value) if value.strip() else default
    except ValueError:
        raise ValueError(
            f"Environment variable {key}={value!r} is not an integer; the launcher that set it "
            f"is misconfigured. Unset it or set it to this process's {key.lower()}."
        ) from None


@hookimpl(trylast=True)
def torchplug_cluster_environment(env: Mapping[str, str]) -> ClusterInfo:
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE", 1)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        port = env.get("MASTER_PORT")
        return ClusterInfo(
            rank=_int(env, "RANK", 0),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=local_world,
            node_rank=_int(env, "GROUP_RANK", 0),
            num_nodes=max(1, world // max(1, local_world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(port) if port else None,
            source="torchrun" if "TORCHELASTIC_RUN_ID" in env else "environment (RANK/WORLD_SIZE)",
        )
    return ClusterInfo()


def detect(env: Mapping[str, str] | None = None) -> ClusterInfo:
    """Ask the installed cluster-environment plugins who this process is."""
    from torchplug.core.manager import get_registry

    answer = get_registry().pm.hook.torchplug_cluster_environment(
        env=dict(os.environ if env is None else env)
    )
    return answer if answer is not None else ClusterInfo()
