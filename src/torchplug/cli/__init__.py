"""The ``torchplug`` command: launch, plugins, doctor, check, convert, config, estimate-memory.

The command line sits above the core (it may use the testing kit; nothing below imports it).
Importing this package imports neither torch nor any plugin, so ``torchplug --help`` is instant;
each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any


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
    _plugin_flag(p)
    p = sub.add_parser(
        "doctor", help="versions, devices, cluster, resolved settings and their sources"
    )
    _plugin_flag(p)
    p = sub.add_parser(
        "check", help="run the conformance kit on a strategy (torchplug check ddp -n 2)"
    )
    p.add_argument("strategy")
    p.add_argument("-n", "--nprocs", type=int, default=2, help="ranks to run on (default 2)")
    p.add_argument(
        "--precision",
        default=None,
        help="32, bf16 or fp16 (default: every precision the strategy supports, in turn)",
    )
    _plugin_flag(p)
    p.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="PROPERTY",
        help="check only this property (repeatable)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a strategy option the kit's Engines get, e.g. --option bucket_cap_mb=1 "
        "(repeatable; checked against the strategy's options before any rank starts)",
    )
    p = sub.add_parser(
        "convert",
        help="turn a checkpoint into DST/model.safetensors (loadable without torchplug), or a "
        "native DeepSpeed checkpoint into a portable one (--to checkpoint)",
    )
    p.add_argument(
        "source", help="a checkpoint directory written by engine.save (or by DeepSpeed itself)"
    )
    p.add_argument(
        "destination", help="directory to write model.safetensors into (or the new checkpoint)"
    )
    p.add_argument("--entry", default=None, help="which module entry (default: the only one)")
    p.add_argument("--optimizer", action="store_true", help="also write optimizer.safetensors")
    p.add_argument(
        "--trust-pickles",
        action="store_true",
        help="read a directory that is not a torchplug checkpoint (e.g. DeepSpeed's native "
        "one), whose files are pickles: only for a checkpoint you trust; never with a key set",
    )
    p.add_argument(
        "--from",
        dest="source_format",
        default=None,
        metavar="FORMAT",
        help="with --trust-pickles: which plugin reads it (e.g. deepspeed)",
    )
    p.add_argument(
        "--to",
        choices=("safetensors", "checkpoint"),
        default="safetensors",
        help="safetensors files (default), or a portable torchplug checkpoint (for a native "
        "DeepSpeed checkpoint: model, optimizer state and step, loadable by every strategy)",
    )
    p.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="split the safetensors export into shards of at most SIZE (e.g. 2GB, 500MiB) with "
        "model.safetensors.index.json, as save_pretrained does (default: one file)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: on a terminal or for checkpoints over 1 GiB)",
    )
    p = sub.add_parser(
        "config",
        help="write torchplug.toml (strategy, precision, processes, nodes, loggers, options) "
        "from flags or --ask",
    )
    from torchplug.cli.config import add_arguments  # argparse only: no torch

    add_arguments(p)
    p = sub.add_parser(
        "estimate-memory",
        help="per-rank bytes of parameters, gradients and optimizer state for a model under "
        "each installed strategy, from its shapes on the meta device",
    )
    from torchplug.cli.estimate import add_arguments as add_estimate_arguments

    add_estimate_arguments(p)
    return parser


def _plugin_flag(p: argparse.ArgumentParser) -> None:
    """``--plugin MODULE``, as ``launch`` takes it: an in-house plugin module, imported first."""
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import and register an in-house plugin module first (repeatable)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``torchplug`` command; return its exit code (2: bad input, nothing started)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # torch warns on import when numpy is absent; none of our commands needs numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    if argv and argv[0] == "launch":
        from torchplug.cli.launch import launch

        return launch(argv[1:])
    args: Any = _parser().parse_args(argv)
    if args.command == "plugins":
        from torchplug.cli.plugins import plugins

        try:
            return plugins(verbose=args.verbose, modules=args.plugin)
        except BrokenPipeError:  # `torchplug plugins | head`: the reader has what it wanted
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes at exit
            return 0
    if args.command == "doctor":
        from torchplug.cli.doctor import doctor

        return doctor(plugins=args.plugin)
    if args.command == "convert":
        from torchplug.cli.convert import convert

        return convert(args)
    if args.command == "config":
        from torchplug.cli.config import config

        return config(args)
    if args.command == "estimate-memory":
        from torchplug.cli.estimate import estimate_memory

        return estimate_memory(args)
    if args.command == "check":
        from torchplug.cli.check import check

        return check(args)
    _parser().print_help()
    return 0
