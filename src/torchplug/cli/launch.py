"""``torchplug launch``: check everything that can be checked, then run torchrun in this process.

Every check runs before a process starts, and each failure is one line with the fix and exit
code 2: strategy and precision names and their compatibility, the options in the config file,
``-n``, ``MASTER_PORT``, the script's existence. torchrun's own flags pass through; multi-node
runs use its rendezvous and restarts its elastic agent (``--max-restarts``). When the job fails,
the summary names the rank that failed first with its traceback, and every other rank in one line.

Why this module is over 500 lines: ``torchplug launch`` checks everything that can be checked before
a process starts (parser, process count, script, rendezvous, settings, loggers), then runs torchrun
and summarises a failure; the checks and the summary are each short functions, kept with the command
that runs them.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torchplug.contract.errors import TorchplugError
from torchplug.util.text import first_line

#: torchplug's own launcher flags; written after the script they would reach the script instead.
OWN_FLAGS = ("--strategy", "--precision", "--option", "--plugin", "--debug", "--logger")
#: Variables the launcher hands to the processes it starts.
PLUGIN_ENV = "TORCHPLUG_PLUGIN_MODULES"
DEBUG_ENV = "TORCHPLUG_DEBUG_COLLECTIVES"
LAUNCHED_ENV = "TORCHPLUG_LAUNCHED"
#: The same variable as `torchplug.features.syncbn.SYNC_BATCHNORM_ENV` (core is not imported
#: here at module level: ``torchplug launch --help`` stays cheap).
SYNC_BATCHNORM_ENV = "TORCHPLUG_SYNC_BATCHNORM"

USAGE = "torchplug launch [-n N] [--strategy NAME] [--precision P] [torchrun flags] SCRIPT [args]"


class LaunchError(TorchplugError):
    """Bad launcher input: reported in one line, exit code 2, nothing started."""


def _installed_strategies() -> str:
    try:
        from torchplug.contract.manager import get_registry

        return ", ".join(get_registry().usable_names()) or "none"
    except Exception as exc:  # help must print even with a broken plugin
        return f"(could not list: {exc})"


def launch_parser() -> argparse.ArgumentParser:
    """torchrun's parser with torchplug's flags added and shown first in ``--help``."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "torchplug launch"
    parser.usage = USAGE
    parser.description = (
        "Run a training script on N processes per node through torch.distributed.run "
        "(torchrun). torchplug's flags come first and go before the script; every torchrun "
        "flag is accepted as well (listed after torchplug's)."
    )
    own = parser.add_argument_group("torchplug options (put them before the script)")
    own.add_argument(
        "-n",
        dest="nproc_per_node",
        metavar="N",
        help="processes per node (alias of torchrun's "
        "--nproc-per-node; default: one per GPU, else 1)",
    )
    own.add_argument(
        "--strategy",
        default=None,
        metavar="NAME",
        help=f"strategy for Engine(strategy='auto') in the script; installed and usable here: "
        f"{_installed_strategies()}",
    )
    own.add_argument("--precision", default=None, metavar="P", help="32, bf16 or fp16")
    own.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a strategy option for Engine() in the script, e.g. --option timeout=60 "
        "(repeatable; the code's own keyword arguments win)",
    )
    own.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import an in-house plugin module (from the current directory too) here and in "
        "every process, so its strategies can be named (repeatable)",
    )
    own.add_argument(
        "--logger",
        action="append",
        default=[],
        metavar="NAME",
        help="a metric logger for engine.log / the Trainer in the script, e.g. --logger csv "
        "(repeatable; Engine(loggers=...) in the code wins)",
    )
    own.add_argument(
        "--sync-batchnorm",
        action="store_true",
        help="BatchNorm statistics over the global batch (Engine(sync_batchnorm=True); "
        "TORCHPLUG_SYNC_BATCHNORM=1)",
    )
    own.add_argument(
        "--debug",
        action="store_true",
        help="check before each torchplug collective that every rank calls the same operation "
        "with the same shapes and dtypes (TORCHPLUG_DEBUG_COLLECTIVES=1)",
    )
    parser.set_defaults(nproc_per_node=None)
    groups = parser._action_groups  # noqa: SLF001 - argparse has no API to order help groups
    groups.insert(0, groups.pop(groups.index(own)))
    for group in groups[1:]:
        if group.title in ("options", "optional arguments"):
            group.title = "torchrun options (passed through)"
    return parser


def _int_or(value: Any, default: int) -> int:
    text = str(value).split(":")[-1]
    return int(text) if text.isdigit() else default


def warn_loopback(nodes: int, master_addr: str | None) -> None:
    """On a multi-node run, say so when this host's name resolves to a loopback address: gloo
    and NCCL would then offer 127.0.0.1 to the other nodes (``Gloo connectFullMesh failed``,
    or a wait for the timeout) unless told which interface to use."""
    import socket

    if nodes <= 1 or os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME"):
        return
    try:
        own = socket.gethostbyname(socket.gethostname())
        master = socket.gethostbyname(master_addr or "127.0.0.1")
    except OSError:
        return
    if master.startswith("127."):
        return  # every node on this host (a test on loopback): nothing to tell apart
    if own.startswith("127."):
        print(
            f"torchplug launch: warning: this host's name ({socket.gethostname()}) resolves to "
            f"{own}, a loopback address, on a {nodes}-node run (master {master_addr}): gloo and "
            f"NCCL would offer it to the other nodes. Set GLOO_SOCKET_IFNAME (gloo) or "
            f"NCCL_SOCKET_IFNAME (NCCL) to the interface the nodes reach each other on, e.g. "
            f"GLOO_SOCKET_IFNAME=eth0 (docs/launcher.md).",
            file=sys.stderr,
        )


def scheduler_started_every_rank(info: Any, asked_for: str | None) -> bool:
    """Whether the scheduler started several tasks on this node (``srun -n 2 torchplug launch``,
    ``mpirun -np 2 torchplug launch``): then each task is one rank of one world, and the script
    runs in this process, with the scheduler's identity. Spawning ``-n`` workers per task would
    make a world per task (silently: every one training alone, all writing the same files). An
    explicit ``-n`` above 1 there is refused, naming the two ways to say what is meant."""
    if info.source in ("torchrun", "single process") or info.local_world_size <= 1:
        return False
    if asked_for is not None and str(asked_for).strip() not in ("1",):
        raise LaunchError(
            f"{info.source} started {info.local_world_size} tasks on this node (rank "
            f"{info.rank} of {info.world_size}), and each would spawn -n {asked_for} workers: "
            f"{info.world_size} separate jobs. Either let the scheduler start every rank "
            f"(srun -n {info.world_size} torchplug launch SCRIPT, without -n), or start one "
            f"launcher per node that spawns the workers (srun --ntasks-per-node=1 torchplug "
            f"launch -n {info.local_world_size} SCRIPT; mpirun --map-by ppr:1:node)."
        )
    return True


def apply_cluster(args: Any, parser: argparse.ArgumentParser, info: Any) -> list[str]:
    """Fill torchrun's multi-node flags the user left at their defaults from the cluster
    environment a plugin detected (SLURM, SageMaker, ...); return the flags filled."""
    if info.num_nodes <= 1 or info.source in ("torchrun", "single process"):
        return []
    wanted = {
        "nnodes": str(info.num_nodes),
        "node_rank": info.node_rank,
        "master_addr": info.master_addr,
        "master_port": info.master_port,
    }
    filled = []
    for dest, value in wanted.items():
        if value is not None and getattr(args, dest) == parser.get_default(dest):
            setattr(args, dest, value)
            filled.append(dest)
    return filled


# -- checks ---------------------------------------------------------------------------------------


def import_plugins(modules: Sequence[str]) -> None:
    """Import each in-house plugin module (the current directory on ``sys.path``) and register
    it unless it registered itself; the processes started later do the same through
    ``TORCHPLUG_PLUGIN_MODULES``."""
    if not modules:
        return
    from torchplug.contract.manager import get_registry, import_plugin_module

    registry = get_registry()
    for name in modules:
        import_plugin_module(registry, name, strict=True)
    previous = [m for m in os.environ.get(PLUGIN_ENV, "").split(",") if m.strip()]
    os.environ[PLUGIN_ENV] = ",".join(dict.fromkeys([*previous, *modules]))


def from_file(args: Any, parser: argparse.ArgumentParser) -> None:
    """``processes`` and ``nodes`` of the config file (``torchplug config`` writes them) for
    ``-n`` and ``--nnodes`` when the command line leaves them out; the flags win."""
    from torchplug.engine.config import find_config

    table, _ = find_config()
    if args.nproc_per_node is None and "processes" in table:
        args.nproc_per_node = str(table["processes"])
    if "nodes" in table and args.nnodes == parser.get_default("nnodes"):
        args.nnodes = str(table["nodes"])


def nproc(value: str | None) -> str:
    """``-n``'s value checked: a positive integer, or torchrun's auto/cpu/gpu/xpu."""
    import torch

    if value is None:
        return str(torch.cuda.device_count() or 1)
    text = str(value).strip().lower()
    if text in ("auto", "cpu", "xpu"):
        return text
    if text == "gpu":
        if not torch.cuda.is_available():
            raise LaunchError(
                "-n gpu asks for one process per GPU, but this machine has no CUDA device. "
                "Give a number instead, e.g. -n 2."
            )
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1 or not text.lstrip("+").isdigit():
        raise LaunchError(
            f"-n/--nproc-per-node {value!r} is not a number of processes; expected a whole "
            f"number of 1 or more (or auto, cpu, gpu). Fix: e.g. -n 2."
        )
    return str(count)


def check_script(args: Any) -> None:
    """The script (or module, or executable) exists."""
    script = args.training_script
    if args.module:
        if str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            found = importlib.util.find_spec(script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise LaunchError(
                f"-m {script}: no module of that name can be imported from here. Check the "
                f"name, run from the directory that holds it, or pip install its package."
            )
    elif args.no_python:
        if shutil.which(script) is None and not Path(script).is_file():
            raise LaunchError(
                f"--no-python {script}: no such executable on PATH or file. Check the name."
            )
    elif not Path(script).is_file():
        near = [p.name for p in Path(script).parent.glob("*.py")] if script.endswith(".py") else []
        from torchplug.util.text import did_you_mean

        raise LaunchError(
            f"Training script {script!r} does not exist (working directory {Path.cwd()})."
            f"{did_you_mean(Path(script).name, near)} Give the path of a Python file, or "
            f"-m MODULE for a module."
        )


def script_position(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int | None:
    """The index of the training script in ``argv``: the first word that is neither a flag nor
    a flag's value (``--`` ends the flags). ``None`` when there is none."""
    takes_value = {
        option: action.nargs != 0
        for action in parser._actions  # noqa: SLF001 - argparse has no public list of its actions
        for option in action.option_strings
    }
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return i + 1 if i + 1 < len(argv) else None
        if not word.startswith("-") or word == "-":
            return i
        flag = word.split("=", 1)[0]
        if "=" not in word and takes_value.get(flag, False):
            i += 1  # its value
        i += 1
    return None


def warn_flags_after_script(args: Any) -> None:
    """A torchplug flag after the script reaches the script, not torchplug: say so loudly."""
    rest = list(args.training_script_args)
    for i, word in enumerate(rest):
        flag = word.split("=", 1)[0]
        if flag not in OWN_FLAGS:
            continue
        value = word.split("=", 1)[1] if "=" in word else (rest[i + 1] if i + 1 < len(rest) else "")
        shown = f"{flag} {value}".strip() if flag != "--debug" else flag
        if getattr(args, flag.lstrip("-")):
            continue  # also given before the script: torchplug uses that one
        if _script_mentions(args, flag):
            continue  # the script has a flag of that name: it is the script's
        print(
            f"torchplug launch: warning: '{shown}' comes after the script "
            f"{args.training_script}, so it goes to the script, not to torchplug launch. If it "
            f"was meant for torchplug, put it before the script: torchplug launch ... {shown} "
            f"{args.training_script} ...",
            file=sys.stderr,
        )


def _script_mentions(args: Any, flag: str) -> bool:
    """Whether the script's source names ``flag`` (its own argparse option, most likely)."""
    path: str | None = args.training_script
    if args.module:
        spec = importlib.util.find_spec(args.training_script)
        path = spec.origin if spec is not None else None
    try:
        text = Path(path).read_text(errors="replace") if path else ""
    except OSError:
        return False
    return f'"{flag}"' in text or f"'{flag}'" in text


def check_rendezvous(args: Any, argv: Sequence[str]) -> None:
    """Honour ``MASTER_ADDR``/``MASTER_PORT`` from the environment; check the port."""
    from torchplug.plugins.torchrun import master_port

    before = argv[: argv.index(args.training_script)] if args.training_script in argv else argv
    given = {a.split("=", 1)[0].replace("_", "-") for a in before}
    if "--master-port" in given:
        master_port(str(args.master_port), "--master-port")
    elif os.environ.get("MASTER_PORT"):
        args.master_port = master_port(os.environ["MASTER_PORT"])
    if "--master-addr" not in given and os.environ.get("MASTER_ADDR"):
        args.master_addr = os.environ["MASTER_ADDR"]


def script_source(args: Any) -> str:
    """The training script's text ('' when it cannot be read: an executable, a package)."""
    try:
        if args.module:
            spec = importlib.util.find_spec(args.training_script)
            origin = spec.origin if spec is not None else None
            return Path(origin).read_text(errors="replace") if origin else ""
        if not args.no_python:
            return Path(args.training_script).read_text(errors="replace")
    except (OSError, ImportError, ValueError):
        pass
    return ""


def registered_in_script(args: Any, name: str) -> bool:
    """Whether the script names strategy ``name`` as a string literal (so it may register it in
    code, which this process cannot see without running the script)."""
    text = script_source(args)
    return any(f"{quote}{name}{quote}" in text for quote in ("'", '"'))


def check_settings(args: Any, nprocs: str) -> Any:
    """Resolve the settings as the processes will, and fail on anything wrong in them.

    A strategy name no installed or ``--plugin`` module provides is accepted only when the
    script itself names it (it may register it in code); the processes then check it, and a
    name nobody registers fails there with the same did-you-mean message. Any other unknown
    name is refused here, before a process starts.
    """
    from torchplug.contract.manager import get_registry
    from torchplug.engine import config

    registry = get_registry()
    env = dict(os.environ)
    if args.strategy and registry.canonical(args.strategy) is None:
        if not registered_in_script(args, args.strategy):
            raise LaunchError(
                f"{registry.unknown_strategy_message(args.strategy)} If the script registers "
                f"'{args.strategy}' through a module it imports, pass that module with --plugin "
                f"MODULE."
            )
        print(
            f"torchplug launch: strategy '{args.strategy}' is not installed here; the script "
            f"names it, so it is taken as registered in code and checked in the processes.",
            file=sys.stderr,
        )
        args.in_code_strategy = True
    elif args.strategy:
        env[config.LAUNCH_ENV["strategy"]] = args.strategy
    if args.precision:
        env[config.LAUNCH_ENV["precision"]] = args.precision
    if args.option:
        options = dict(config.parse_option(text) for text in args.option)
        env[config.LAUNCH_OPTIONS_ENV] = json.dumps(options)
        os.environ[config.LAUNCH_OPTIONS_ENV] = env[config.LAUNCH_OPTIONS_ENV]
    settings = config.resolve(env=env, canonical=lambda n: registry.canonical(n) or n)
    nodes = str(args.nnodes).split(":")[-1]
    world = int(nprocs) * int(nodes) if nprocs.isdigit() and nodes.isdigit() else 2
    found = config.problems(settings, registry, world)
    if found:
        raise LaunchError(found[0])
    if getattr(args, "in_code_strategy", False):
        return None
    check_contract(registry, str(settings.strategy.value), settings.strategy.source)
    return registry.strategy(args.strategy) if args.strategy else None


def check_contract(registry: Any, name: str, source: str) -> None:
    """Refuse a strategy whose backend class leaves an action hook unanswered (its default
    plugin blocked): every process would refuse at its Engine, so none is started. Read from the
    class, as `torchplug plugins` reads it; one whose class cannot be told is left to the Engine."""
    from torchplug.cli.plugins import blocked_defaults, unanswered_hooks

    canonical = registry.canonical(name)
    if canonical is None:
        return  # "auto": the Engine picks it (its own check runs there)
    info = registry.strategies[canonical]
    gap = unanswered_hooks(registry, info.factory)
    if gap:
        blocked = ", ".join(blocked_defaults(registry)) or "none"
        raise LaunchError(
            f"strategy '{info.name}' (from {source}) leaves {len(gap)} action hook(s) "
            f"unanswered: {', '.join(gap)} (blocked default plugins: {blocked}), so every "
            f"process's Engine would refuse to start. Remove {blocked} from "
            f"TORCHPLUG_BLOCK_PLUGINS (and torchplug.block calls), or answer these hooks in the "
            f"backend or in a plugin given with --plugin MODULE."
        )


def check_loggers(names: Sequence[str]) -> None:
    """Every ``--logger`` names an installed, usable logger."""
    if not names:
        return
    from torchplug.contract.manager import get_registry

    registry = get_registry()
    for name in names:
        try:
            registry.logger(name)
        except TorchplugError as exc:
            raise LaunchError(f"--logger {name}: {exc}") from None


# -- run ------------------------------------------------------------------------------------------


def export_flags(args: Any) -> None:
    """The launcher's flags for the script, as the variables every process reads."""
    if args.debug:
        os.environ[DEBUG_ENV] = "1"
    if args.sync_batchnorm:
        os.environ[SYNC_BATCHNORM_ENV] = "1"
    if args.logger:
        os.environ["TORCHPLUG_LAUNCH_LOGGERS"] = ",".join(args.logger)


def _launch_in_process(args: Any, strategy: str) -> int:
    """One process per host (torch_xla SPMD), or one rank the scheduler started: run the script
    here, not under torchrun."""
    import runpy

    if str(args.nproc_per_node or "1") != "1":
        print(
            f"torchplug launch: strategy '{strategy}' runs one process per host and spreads it "
            f"over the host's devices itself; drop -n/--nproc-per-node.",
            file=sys.stderr,
        )
        return 2
    export_flags(args)
    sys.argv = [args.training_script, *args.training_script_args]
    if args.module:
        runpy.run_module(args.training_script, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(args.training_script, run_name="__main__")
    return 0


def launch(argv: Sequence[str]) -> int:
    """Check, then run torchrun; exit code 2 for bad input, 1 for a failed job."""
    argv = list(argv)
    if not argv:
        print(
            f"torchplug launch: no training script given. Usage: {USAGE} "
            f"(torchplug launch --help lists every flag).",
            file=sys.stderr,
        )
        return 2
    freeze_imports()
    own = own_launcher(argv)
    code = own(argv) if own is not None else None
    if code is not None:
        return code
    parser = launch_parser()
    at = script_position(parser, argv)
    if at is None and not {"-h", "--help"} & set(argv):
        print(
            f"torchplug launch: no training script given after the flags {' '.join(argv)}. "
            f"Usage: {USAGE} (torchplug launch --help lists every flag).",
            file=sys.stderr,
        )
        return 2
    try:
        # Only what comes before the script is torchplug's and torchrun's: the script's own
        # arguments are never parsed here (no prefix matching of '--n' against '--nnodes').
        args = parser.parse_args(argv if at is None else argv[: at + 1])
    except SystemExit as exc:  # argparse already printed its message (or the help)
        return int(exc.code or 0)
    if at is not None:
        args.training_script_args = argv[at + 1 :]
    try:
        from torchplug.engine.connector import detect

        import_plugins(args.plugin)
        from_file(args, parser)
        asked_for = args.nproc_per_node
        args.nproc_per_node = nproc(args.nproc_per_node)
        check_script(args)
        check_rendezvous(args, argv)
        if int(getattr(args, "max_restarts", 0) or 0) < 0:
            raise LaunchError(
                f"--max-restarts {args.max_restarts} is negative; expected 0 (no restarts, the "
                f"default) or more, e.g. --max-restarts 3."
            )
        found = detect()
        warn_loopback(
            max(found.num_nodes, _int_or(args.nnodes, 1)),
            getattr(args, "master_addr", None) or found.master_addr,
        )
        in_place = scheduler_started_every_rank(found, asked_for)
        if not in_place:
            apply_cluster(args, parser, found)
        warn_flags_after_script(args)
        world = str(found.world_size) if in_place else args.nproc_per_node
        info = check_settings(args, world)
        check_loggers(args.logger)
        if args.strategy:
            os.environ["TORCHPLUG_LAUNCH_STRATEGY"] = info.name if info else args.strategy
        if args.precision:
            from torchplug.engine.config import normalize_precision

            os.environ["TORCHPLUG_LAUNCH_PRECISION"] = normalize_precision(args.precision)
        if info is not None and info.launcher == "xla":
            return _launch_in_process(args, info.name)
        if in_place:  # this process is one rank of the scheduler's world: run the script here
            args.nproc_per_node = "1"
            return _launch_in_process(args, f"one rank of {found.source}'s world")
        own = info is not None and info.launcher == os.environ.get(OWN_LAUNCHER_ENV)
        if info is not None and info.launcher != "torchrun" and not own:
            raise LaunchError(
                f"Strategy '{info.name}' needs the '{info.launcher}' launcher, which this "
                f"torchplug cannot start. Run the script directly as its docs describe."
            )
    except TorchplugError as exc:
        print(f"torchplug launch: {exc}", file=sys.stderr)
        return 2
    export_flags(args)
    os.environ[LAUNCHED_ENV] = "1"
    return _run(args)


def freeze_imports() -> None:
    """Import torch and leave what is loaded so far out of later garbage collections.

    This process only checks the command, then waits on its workers, and everything imported
    here lives until it exits: without this, a full collection while plugins load and torchrun
    starts rescans torch's million objects (40-70 ms each on the benchmark machine, before the
    first worker starts). ``gc.freeze`` is CPython's own means for
    long-lived import-time objects; what is made afterwards is collected as usual."""
    import torch  # noqa: F401 - every path below needs it (the flags are torchrun's)

    gc.freeze()


#: Set for the processes a strategy's own launcher starts: their ``torchplug launch`` runs
#: torchrun (the launcher is not handed the command line again).
OWN_LAUNCHER_ENV = "TORCHPLUG_OWN_LAUNCHER"


def own_launcher(argv: Sequence[str]) -> Callable[[list[str]], int | None] | None:
    """The launcher a strategy brings (``StrategyInfo(launcher="module:function")``), when the
    command names that strategy before its script: it is handed the whole command line, its
    own flags included (``torchplug launch --strategy ft-ddp --replicas 2 -n 1 train.py``), and
    returns the exit status, or ``None`` to have torchrun start this command as usual. The
    processes it starts have ``TORCHPLUG_OWN_LAUNCHER`` set: their ``torchplug launch`` runs
    torchrun.

    Its flags are unknown here, so the strategy is found by the words before the script (the
    first ``*.py``, ``-m``, or ``--``)."""
    if os.environ.get(OWN_LAUNCHER_ENV):
        return None
    name = None
    for i, word in enumerate(argv):
        if word in ("--", "-m", "--module") or word.endswith(".py"):
            break
        if word == "--strategy" and i + 1 < len(argv):
            name = argv[i + 1]
        elif word.startswith("--strategy="):
            name = word.split("=", 1)[1]
    if not name:
        return None
    from torchplug.contract.manager import get_registry

    registry = get_registry()
    canonical = registry.canonical(name)
    info = registry.strategies[canonical] if canonical else None
    if info is None or ":" not in info.launcher or info.unusable_reason() is not None:
        return None  # torchrun's path, which refuses an unusable strategy saying why
    launcher = info.launcher
    module, _, attribute = launcher.partition(":")
    function = getattr(importlib.import_module(module), attribute)

    def run(words: list[str]) -> int | None:
        os.environ[OWN_LAUNCHER_ENV] = launcher
        return function(words)

    return run


def _run(args: Any) -> int:
    import logging
    import tempfile

    from torch.distributed.run import run

    from torchplug.features.preemption import STATUS_ENV

    # torchrun's own failure report (a FAILED block per rank) is replaced by the summary below.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.CRITICAL)
    if getattr(args, "signals_to_handle", None) == "SIGTERM,SIGINT,SIGHUP,SIGQUIT":
        # torchrun's default, plus SLURM's early notice (srun --signal=USR1@90): passed on to
        # the workers (engine.preempted) instead of ending this launcher and orphaning them.
        args.signals_to_handle += ",SIGUSR1"
    status = tempfile.TemporaryDirectory(prefix="torchplug-launch-")
    os.environ[STATUS_ENV] = status.name
    try:
        return _run_torchrun(args, run, status.name)
    finally:
        status.cleanup()


def _run_torchrun(args: Any, run: Any, status: str) -> int:
    from torchplug.features.preemption import last_checkpoint

    enabled = gc.isenabled()
    try:
        return _run_torchrun_once(args, run, status, last_checkpoint)
    finally:
        # On a signal torch leaves the rendezvous open (launch_agent skips its shutdown so that
        # other nodes can rescale), and its keep-alive thread runs on until the handler is
        # collected. Collecting is done here, in this thread: the handler's finalizer joins that
        # thread, and if the thread's own garbage collection ran the finalizer, it would join
        # itself and print "Exception ignored in: <finalize object>" after our summary.
        gc.collect()
        if enabled:
            gc.enable()


def _run_torchrun_once(args: Any, run: Any, status: str, last_checkpoint: Any) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run(args)
    except ChildFailedError as exc:
        print(summary(exc.failures, args.training_script), file=sys.stderr)
        return 1
    except SignalException as exc:
        # SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C): torchrun's agent has passed
        # it on to the workers and waited for them; say so in one screen, not its traceback.
        gc.disable()  # until the caller has collected what this exception held (see there)
        name = signal_name(exc.sigval)
        grace = args.shutdown_timeout or os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30)
        saved = last_checkpoint(status)
        print(
            f"torchplug launch: stopped by {name} ({args.training_script}): the signal was "
            f"passed on to every worker, which had {grace} s to exit (--shutdown-timeout). "
            + (
                f"The last checkpoint saved in this run: {saved[1]} (step {saved[0]}). "
                if saved
                else "No checkpoint was saved in this run (a script that reads "
                "engine.preempted each step can save one before it exits). "
            )
            + f"Exit code {128 + int(exc.sigval)}.",
            file=sys.stderr,
        )
        return 128 + int(exc.sigval)
    return 0


def signal_name(value: Any) -> str:
    import signal

    try:
        return signal.Signals(int(value)).name
    except ValueError:
        return f"signal {value}"


# -- the failure summary --------------------------------------------------------------------------


def _error_data(failure: Any) -> dict[str, Any]:
    data = getattr(failure, "error_file_data", None) or {}
    if not data and failure.error_file and os.path.isfile(failure.error_file):
        try:
            data = json.loads(Path(failure.error_file).read_text())
        except (OSError, ValueError):
            data = {}
    message = data.get("message")
    return message if isinstance(message, dict) else {}


def _when(failure: Any) -> float:
    extra = _error_data(failure).get("extraInfo", {})
    try:
        return float(extra.get("torchplug_time") or extra.get("timestamp") or failure.timestamp)
    except (TypeError, ValueError):
        return float(failure.timestamp)


def _one_line(failure: Any, rest: str | None = None) -> str:
    message = _error_data(failure).get("message")
    if message:
        where = getattr(failure, "error_file", None)
        return first_line(message, rest=rest or (f"whole in {where}" if where else "output above"))
    if _crashed(failure):
        return (
            f"died of {failure.signal_name()}, a crash (in native code, or an "
            f"abort), not a Python exception: anything it printed is above (a native crash "
            f"may print a C++ backtrace, or nothing)"
        )
    if failure.exitcode < 0:
        return f"stopped by signal {failure.signal_name()}"
    return f"exit code {failure.exitcode} (no error recorded: its own output is above)"


#: The signals the agent (or a person) stops a worker with; any other ended a rank on its own.
_STOPS = {"SIGTERM", "SIGKILL", "SIGINT", "SIGHUP"}


def _crashed(failure: Any) -> bool:
    """A rank a signal of its own ended (SIGABRT, SIGSEGV, SIGBUS, ...) with no Python error:
    the cause, not a rank the agent stopped after another failed."""
    if failure.exitcode >= 0 or _error_data(failure):
        return False
    return signal_name(-failure.exitcode) not in _STOPS


def summary(failures: dict[int, Any], script: str = "the script") -> str:
    """The failed job in a few lines: the first failing rank with its traceback, then one line
    for each other rank."""

    def order(item: tuple[int, Any]) -> tuple[int, float, int]:
        data = _error_data(item[1])
        if _crashed(item[1]):
            kind = 0
        else:
            secondary = data.get("extraInfo", {}).get("torchplug_secondary")
            kind = 2 if not data else 1 if secondary else 0
        return kind, _when(item[1]), item[0]

    ranked = sorted(failures.items(), key=order)
    first_rank, first = ranked[0]
    lines = [
        f"torchplug launch: the job failed ({script}). Rank {first_rank} failed first: "
        f"{_one_line(first, rest='the traceback below has it whole')}"
    ]
    stalled = [r for r, f in ranked if not _error_data(f) and f.exitcode < 0 and not _crashed(f)]
    if stalled and _error_data(first).get("extraInfo", {}).get("torchplug_secondary"):
        lines.append(
            f"Rank(s) {stalled} raised nothing and were still running when it failed: the "
            f"likely stalled rank(s). Look at what they were doing (their output above)."
        )
    trace = _error_data(first).get("extraInfo", {}).get("py_callstack")
    if trace:
        lines += ["", f"rank {first_rank}'s traceback:", str(trace).rstrip(), ""]
    else:
        lines.append(f"  (exit code {first.exitcode}; its output above holds the details)")
    others = [(r, f) for r, f in ranked if r != first_rank]
    if others:
        lines.append("then:")
        headline = _one_line(first, rest="-")  # compared without where the rest lies
        lines += [
            f"  rank {r}: "
            + (
                f"the same error as rank {first_rank}"
                if _one_line(f, rest="-") == headline
                else _one_line(f)
            )
            for r, f in others
        ]
    return "\n".join(lines)
