"""The ``torchplug`` command: launch, plugins, doctor, convert.

``torchplug launch`` builds a ``torch.distributed.run`` (torchrun) invocation and runs it in this
process: torchrun's own flags pass through, multi-node runs use its rendezvous, and there is no
home-made process spawning. Importing this module imports neither torch nor any plugin, so
``torchplug --help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

BACKEND_PACKAGES = ("deepspeed", "fairscale", "torch_xla", "torch-xla", "safetensors")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


# -- launch ---------------------------------------------------------------------------------------


def _launch_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "torchplug launch"
    parser.description = (
        "Run a training script on N processes per node through torch.distributed.run "
        "(torchrun). Every torchrun flag is accepted. --strategy/--precision reach "
        "Engine(strategy='auto') in the script."
    )
    parser.add_argument("-n", dest="nproc_per_node", help="alias of --nproc-per-node")
    parser.add_argument("--strategy", default=None, help="strategy for Engine(strategy='auto')")
    parser.add_argument("--precision", default=None, help="32, bf16 or fp16")
    parser.set_defaults(nproc_per_node=None)
    return parser


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


def _launch_in_process(args: Any, strategy: str) -> int:
    """One process per host (torch_xla SPMD): run the script here, not under torchrun."""
    import runpy

    if str(args.nproc_per_node or "1") != "1":
        print(
            f"torchplug launch: strategy '{strategy}' runs one process per host and spreads it "
            f"over the host's devices itself; drop -n/--nproc-per-node.",
            file=sys.stderr,
        )
        return 2
    sys.argv = [args.training_script, *args.training_script_args]
    if args.module:
        runpy.run_module(args.training_script, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(args.training_script, run_name="__main__")
    return 0


def launch(argv: Sequence[str]) -> int:
    parser = _launch_parser()
    args = parser.parse_args(list(argv))
    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from torchplug.core.errors import TorchplugError
    from torchplug.core.registry import normalize_precision

    try:
        if args.strategy:
            from torchplug.core.manager import get_registry

            info = get_registry().strategy(args.strategy)
            os.environ["TORCHPLUG_LAUNCH_STRATEGY"] = info.name
            if info.launcher == "xla":
                if args.precision:
                    os.environ["TORCHPLUG_LAUNCH_PRECISION"] = normalize_precision(args.precision)
                return _launch_in_process(args, info.name)
            if info.launcher != "torchrun":
                raise TorchplugError(
                    f"Strategy '{info.name}' needs the '{info.launcher}' launcher, which this "
                    f"torchplug cannot start. Run the script directly as its docs describe."
                )
        if args.precision:
            os.environ["TORCHPLUG_LAUNCH_PRECISION"] = normalize_precision(args.precision)
    except TorchplugError as exc:
        print(f"torchplug launch: {exc}", file=sys.stderr)
        return 2
    if args.nproc_per_node is None:
        args.nproc_per_node = str(torch.cuda.device_count() or 1)
    from torchplug.core import cluster

    apply_cluster(args, parser, cluster.detect())
    single_node = str(args.nnodes) in ("1", "1:1")
    if single_node and not args.rdzv_endpoint and "MASTER_PORT" not in os.environ:
        args.standalone = True  # a free port per run: several launches can share the machine
    try:
        run(args)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0


# -- plugins --------------------------------------------------------------------------------------


def plugins(verbose: bool = False) -> int:
    from torchplug.core.manager import STRATEGY_HOOKS, get_registry

    registry = get_registry()
    rows = []
    for name, info in sorted(registry.strategies.items()):
        reason = info.unusable_reason()
        provider = info.distribution or "in-house"
        if info.version:
            provider += f" {info.version}"
        rows.append(
            [
                name,
                ", ".join(info.aliases) or "-",
                f"{provider} ({info.provider})",
                "usable" if reason is None else f"unusable: {reason}",
            ]
        )
    print(_table(rows, ["strategy", "aliases", "provided by", "status"]))
    if registry.precisions:
        print()
        print(
            _table(
                [
                    [p, i.name, f"{i.distribution or 'in-house'} {i.version}".strip()]
                    for p, i in sorted(registry.precisions.items())
                ],
                ["precision", "plugin", "provided by"],
            )
        )
    if verbose:
        for name, info in sorted(registry.strategies.items()):
            print(f"\n{name}: {info.description}")
            caps = [
                c
                for c in ("shards_parameters", "shards_optimizer", "owns_precision")
                if getattr(info, c)
            ]
            caps += ["cpu"] if info.supports_cpu else []
            caps += ["cuda"] if info.supports_cuda else []
            print(
                f"  capabilities: {', '.join(caps) or '-'}; "
                f"precisions: {', '.join(info.precisions)}"
            )
            print(f"  launcher: {info.launcher}; requires: {', '.join(info.requires) or '-'}")
            for opt in info.options:
                print(f"  option {opt.name}: {opt.type_name()} = {opt.default!r}  {opt.help}")
        print("\nplugins and their hooks:")
        for plugin_name, plugin in sorted(registry.pm.list_name_plugin(), key=lambda x: str(x[0])):
            hooks = [h.name for h in registry.pm.get_hookcallers(plugin) or []]
            extension = " (extension: joins every Engine)" if set(hooks) & STRATEGY_HOOKS else ""
            print(f"  {plugin_name}{extension}: {', '.join(sorted(hooks))}")
    if registry.errors:
        print("\nplugins that failed to load:")
        for name, error in sorted(registry.errors.items()):
            print(f"  {name}: {error}")
    if registry.blocked:
        print(f"\nblocked: {', '.join(sorted(registry.blocked))}")
    return 0


# -- doctor ---------------------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def doctor() -> int:
    import pluggy
    import torch

    import torchplug
    from torchplug.core import cluster, config
    from torchplug.core.errors import TorchplugError
    from torchplug.core.manager import get_registry

    print("versions")
    print(f"  python     {platform.python_version()} ({sys.executable})")
    print(f"  torchplug  {torchplug.__version__}")
    print(f"  torch      {torch.__version__}")
    print(f"  pluggy     {pluggy.__version__}")
    for package in ("deepspeed", "fairscale", "torch_xla", "safetensors"):
        print(f"  {package:<10} {_version(package)}")
    print("devices")
    print(f"  cpu        {os.cpu_count()} cores")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"  cuda:{i}     {torch.cuda.get_device_name(i)}")
    else:
        print("  cuda       none")
    env = cluster.detect()
    print("cluster environment")
    print(f"  detected by  {env.source}")
    for field in (
        "rank",
        "world_size",
        "local_rank",
        "node_rank",
        "num_nodes",
        "master_addr",
        "master_port",
    ):
        print(f"  {field:<12} {getattr(env, field)}")
    registry = get_registry()
    print("settings (value, and where it came from)")
    try:
        settings = config.resolve(canonical=lambda n: registry.canonical(n) or n)
    except TorchplugError as exc:
        print(f"  error: {exc}")
        return 1
    for name, value, source in settings.rows():
        shown = value
        if name == "strategy" and value == "auto":
            shown = f"auto -> {'ddp' if env.world_size > 1 else 'single'}"
        print(f"  {name:<10} {shown!s:<24} {source}")
    print("plugins")
    print(f"  strategies usable here: {', '.join(registry.usable_names()) or 'none'}")
    for name, error in sorted(registry.errors.items()):
        print(f"  failed: {name}: {error}")
    return 0


# -- check ----------------------------------------------------------------------------------------


def check(args: Any) -> int:
    from torchplug.core.errors import TorchplugError
    from torchplug.testing.kit import PROPERTIES, Kit

    unknown = [p for p in args.only or () if p not in PROPERTIES]
    if unknown:
        print(
            f"torchplug check: unknown property {unknown}; choose from {', '.join(PROPERTIES)}",
            file=sys.stderr,
        )
        return 2
    try:
        kit = Kit(args.strategy, args.nprocs, plugins=args.plugin)
    except TorchplugError as exc:
        print(f"torchplug check: {exc}", file=sys.stderr)
        return 2
    where = f"{kit.nprocs} ranks" if kit.nprocs > 1 else "1 process: the strategy runs one"
    print(f"torchplug check {kit.strategy} ({where})")
    try:
        outcomes = kit.check(args.only or PROPERTIES)
    finally:
        kit.close()
    for outcome in outcomes:
        print(f"  {outcome}")
    failed = [o.name for o in outcomes if not o.passed]
    print(f"{len(outcomes) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


# -- convert --------------------------------------------------------------------------------------


def convert(args: Any) -> int:
    from torchplug.checkpoint.convert import convert as run_convert
    from torchplug.core.errors import TorchplugError

    try:
        written = run_convert(
            args.source,
            args.destination,
            entry=args.entry,
            optimizer=args.optimizer,
            progress=args.progress,
        )
    except TorchplugError as exc:
        print(f"torchplug convert: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


# -- entry ----------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchplug",
        description="One PyTorch training loop, any distributed backend.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "launch",
        help="run a script on N processes through torchrun (torchplug launch --help)",
        add_help=False,
    )
    p = sub.add_parser("plugins", help="list installed strategies and plugins")
    p.add_argument("-v", "--verbose", action="store_true", help="options, capabilities, hooks")
    sub.add_parser("doctor", help="versions, devices, cluster, resolved settings and their sources")
    p = sub.add_parser(
        "check", help="run the conformance kit on a strategy (torchplug check ddp -n 2)"
    )
    p.add_argument("strategy")
    p.add_argument("-n", "--nprocs", type=int, default=2, help="ranks to run on (default 2)")
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import and register an in-house plugin module first (repeatable)",
    )
    p.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="PROPERTY",
        help="check only this property (repeatable)",
    )
    p = sub.add_parser(
        "convert",
        help="turn a checkpoint into DST/model.safetensors (loadable without torchplug)",
    )
    p.add_argument("source", help="a checkpoint directory written by engine.save")
    p.add_argument("destination", help="directory to write model.safetensors into")
    p.add_argument("--entry", default=None, help="which module entry (default: the only one)")
    p.add_argument("--optimizer", action="store_true", help="also write optimizer.safetensors")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: on a terminal or for checkpoints over 1 GiB)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        return launch(argv[1:])
    args: Any = _parser().parse_args(argv)
    if args.command == "plugins":
        return plugins(verbose=args.verbose)
    if args.command == "doctor":
        return doctor()
    if args.command == "convert":
        return convert(args)
    if args.command == "check":
        return check(args)
    _parser().print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
