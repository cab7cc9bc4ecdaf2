"""``python -m torchplug_torchft launch --replicas R [-n N] [torchplug launch flags] SCRIPT``.

Starts a torchft lighthouse and ``R`` replica groups on this machine, each its own ``torchplug
launch --strategy ft-ddp`` (so its own torchrun: ``--max-restarts K`` restarts that group alone,
which then rejoins live). The exit status is the first non-zero one of the groups. On a cluster,
run one lighthouse (``torchft_lighthouse``) and start each group as its own job with
``TORCHFT_LIGHTHOUSE``, ``TORCHPLUG_FT_REPLICA`` and ``TORCHPLUG_FT_REPLICAS`` set.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

USAGE = (
    "python -m torchplug_torchft launch --replicas R [--min-replicas M] [-n N] "
    "[--max-restarts K] [other torchplug launch flags] SCRIPT [args]"
)


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(prog="python -m torchplug_torchft launch", usage=USAGE)
    found.add_argument("--replicas", type=int, required=True, help="replica groups to start")
    found.add_argument(
        "--min-replicas", type=int, default=1, help="fewest groups a step commits with"
    )
    found.add_argument(
        "--join-timeout", type=float, default=1.0,
        help="seconds the lighthouse waits for every live group before forming a quorum",
    )  # fmt: skip
    found.add_argument(
        "--heartbeat-timeout", type=float, default=5.0,
        help="seconds without a heartbeat after which a group counts as dead",
    )  # fmt: skip
    return found


def launch(argv: Sequence[str]) -> int:
    """Start the lighthouse and the groups; wait for every group; return the exit status."""
    from torchft.coordination import LighthouseServer

    args, rest = parser().parse_known_args(argv)
    if args.replicas < 1 or not 1 <= args.min_replicas <= args.replicas:
        print(
            f"torchplug_torchft launch: --replicas {args.replicas} --min-replicas "
            f"{args.min_replicas}: expected 1 <= min-replicas <= replicas. {USAGE}",
            file=sys.stderr,
        )
        return 2
    if not rest:
        print(f"torchplug_torchft launch: no script given. {USAGE}", file=sys.stderr)
        return 2
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=args.min_replicas,
        join_timeout_ms=int(args.join_timeout * 1000),
        heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000),
    )
    print(f"torchplug_torchft: lighthouse at {lighthouse.address()}", flush=True)
    groups = []
    try:
        for replica in range(args.replicas):
            env = dict(os.environ)
            env.pop("MASTER_PORT", None)  # each group's torchrun picks a port of its own
            env.update(
                TORCHFT_LIGHTHOUSE=lighthouse.address(),
                TORCHPLUG_FT_REPLICA=str(replica),
                TORCHPLUG_FT_REPLICAS=str(args.replicas),
            )
            command = [sys.executable, "-m", "torchplug", "launch", "--strategy", "ft-ddp"]
            command += ["--option", f"min_replicas={args.min_replicas}", *rest]
            groups.append(subprocess.Popen(command, env=env))
        codes = [group.wait() for group in groups]
    finally:
        for group in groups:
            if group.poll() is None:
                group.terminate()
        lighthouse.shutdown()
    failed = [(i, c) for i, c in enumerate(codes) if c != 0]
    for i, code in failed:
        print(f"torchplug_torchft: replica group {i} exited with {code}", file=sys.stderr)
    return failed[0][1] if failed else 0
