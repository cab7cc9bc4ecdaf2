"""``torchplug launch --strategy ft-ddp --replicas R [-n N] [torchplug launch flags] SCRIPT``
(or ``python -m torchplug_torchft launch --replicas R ...``).

ft-ddp declares this module's `launch` its launcher (``StrategyInfo.launcher``), so ``torchplug
launch`` hands it the command line; without ``--replicas`` it answers ``None`` and torchrun
starts one group as usual (a group of a cluster job, pointed at a lighthouse by the variables
below).

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
    "torchplug launch --strategy ft-ddp --replicas R [--min-replicas M] [-n N] "
    "[--max-restarts K] [other torchplug launch flags] SCRIPT [args] (or python -m "
    "torchplug_torchft launch --replicas R ...)"
)


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(prog="torchplug launch --strategy ft-ddp", usage=USAGE)
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


#: ``torchplug launch`` sets it for the processes a strategy's own launcher starts: their
#: ``torchplug launch --strategy ft-ddp`` then runs one group through torchrun.
OWN_LAUNCHER_ENV = "TORCHPLUG_OWN_LAUNCHER"


def launch(argv: Sequence[str]) -> int | None:
    """Start the lighthouse and the groups; wait for every group; return the exit status.
    ``None`` when the command asks for no ``--replicas`` (one group: torchrun starts it)."""
    before_script = argv[: next((i for i, w in enumerate(argv) if w.endswith(".py")), len(argv))]
    asked = any(w == "--replicas" or w.startswith("--replicas=") for w in before_script)
    if not asked and os.environ.get(OWN_LAUNCHER_ENV):  # torchplug launch, one group
        if {"-h", "--help"} & set(before_script):  # this launcher's flags, then torchrun's
            print(parser().format_help(), flush=True)
        return None
    from torchft.coordination import LighthouseServer

    os.environ[OWN_LAUNCHER_ENV] = "torchplug_torchft.launch:launch"
    args, rest = parser().parse_known_args(argv)
    rest = _without_strategy(rest)
    if args.replicas < 1:
        print(
            f"torchplug launch: --replicas {args.replicas}: expected 1 or more replica groups "
            f"(e.g. --replicas 2). Usage: {USAGE}",
            file=sys.stderr,
        )
        return 2
    if not 1 <= args.min_replicas <= args.replicas:
        print(
            f"torchplug launch: --min-replicas {args.min_replicas} with --replicas "
            f"{args.replicas}: expected 1 <= min-replicas <= replicas. Usage: {USAGE}",
            file=sys.stderr,
        )
        return 2
    if not rest:
        print(f"torchplug launch: no script given. Usage: {USAGE}", file=sys.stderr)
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


def _without_strategy(words: list[str]) -> list[str]:
    """``words`` less a ``--strategy NAME`` before the script (each group is ft-ddp)."""
    out, i = [], 0
    while i < len(words):
        word = words[i]
        if word.endswith(".py") or word == "--":
            return out + words[i:]
        if word == "--strategy":
            i += 2
            continue
        if not word.startswith("--strategy="):
            out.append(word)
        i += 1
    return out
