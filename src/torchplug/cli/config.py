"""``torchplug config``: write ``torchplug.toml`` from flags (or answers to questions).

The file holds what ``Engine()`` and ``torchplug launch`` read when the code and the command line
leave a setting out (docs/settings.md): the strategy, precision and strategy options, the
loggers, and for the launcher the processes per node and nodes. Every value is checked as the
Engine and the launcher check it (a strategy that is not installed, a precision it cannot run, an
unknown option or logger) before anything is written; an existing file is replaced only with
``--force``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

FIELDS = ("strategy", "precision", "processes", "nodes", "loggers")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default=None, metavar="NAME", help="e.g. ddp, fsdp")
    p.add_argument("--precision", default=None, metavar="P", help="32, bf16 or fp16")
    p.add_argument("-n", "--processes", type=int, default=None, metavar="N",
                   help="processes per node for torchplug launch")  # fmt: skip
    p.add_argument("--nodes", type=int, default=None, metavar="M",
                   help="nodes for torchplug launch")  # fmt: skip
    p.add_argument("--logger", action="append", default=None, metavar="NAME",
                   help="a metric logger (repeatable)")  # fmt: skip
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a strategy option, e.g. --option timeout=60 (repeatable)")  # fmt: skip
    p.add_argument("-o", "--output", default="torchplug.toml", help="where (torchplug.toml)")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    p.add_argument("--ask", action="store_true", help="ask for each setting not given")


def _ask(args: argparse.Namespace) -> None:
    """Fill the settings the flags left out from answers on stdin (empty: leave it out)."""
    prompts = {
        "strategy": "strategy (ddp, fsdp, deepspeed-zero3, ...)",
        "precision": "precision (32, bf16, fp16)",
        "processes": "processes per node",
        "nodes": "nodes",
        "loggers": "loggers, comma-separated (csv, jsonl, tensorboard, ...)",
    }
    for field, prompt in prompts.items():
        current = getattr(args, "logger" if field == "loggers" else field)
        if current:
            continue
        answer = input(f"{prompt} [leave out]: ").strip()
        if not answer:
            continue
        if field in ("processes", "nodes"):
            setattr(args, field, int(answer) if answer.isdigit() else answer)
        elif field == "loggers":
            args.logger = [n.strip() for n in answer.split(",") if n.strip()]
        else:
            setattr(args, field, answer)


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    """The file's table from the flags, each value checked; a ConfigurationError otherwise."""
    from torchplug.contract.errors import ConfigurationError
    from torchplug.contract.manager import get_registry
    from torchplug.engine import config as settings
    from torchplug.engine.config import normalize_precision

    table: dict[str, Any] = {}
    registry = get_registry()
    info = None
    if args.strategy:
        info = registry.strategy(args.strategy)  # a clear error for an unknown name
        table["strategy"] = info.name
    if args.precision:
        precision = normalize_precision(args.precision)
        if info is not None:
            why = registry.precision_unavailable(info, precision)
            if why is not None:
                raise ConfigurationError(f"--precision {args.precision}: {why}")
        table["precision"] = precision
    for field in ("processes", "nodes"):
        value = getattr(args, field)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(
                    f"--{field} {value!r}: expected a whole number >= 1, e.g. --{field} 2."
                )
            table[field] = value
    if args.logger:
        unknown = [n for n in args.logger if n not in registry.loggers]
        if unknown:
            raise ConfigurationError(
                f"Unknown logger(s) {unknown}; installed: {', '.join(sorted(registry.loggers))}."
            )
        table["loggers"] = list(args.logger)
    if args.option:
        if info is None:
            raise ConfigurationError(
                "--option needs --strategy: options belong to a strategy (its names and types)."
            )
        options = dict(settings.parse_option(text) for text in args.option)
        info.resolve_options(options)  # unknown names and wrong types are refused here
        table["options"] = options
    return table


def render(table: dict[str, Any]) -> str:
    """``table`` as TOML (strings, numbers, booleans, lists of strings, one options table)."""
    lines = ["# written by `torchplug config`; the code's arguments and launch flags win", ""]
    for key in FIELDS:
        if key in table:
            lines.append(f"{key} = {json.dumps(table[key])}")
    if table.get("options"):
        lines += ["", "[options]"]
        lines += [f"{name} = {json.dumps(value)}" for name, value in table["options"].items()]
    return "\n".join(lines) + "\n"


def _write(out: Path, text: str) -> None:
    """``text`` into a fresh temporary file beside ``out`` (``mkstemp``: created exclusively,
    so a name planted there, a link or a FIFO, is never followed or opened), checked as
    torchplug will read it, then renamed over ``out``."""
    import os
    import tempfile

    from torchplug.engine.config import _checked, _load_toml

    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        _checked(_load_toml(tmp), out)  # what torchplug will read back, checked as it will be
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def config(args: argparse.Namespace) -> int:
    from torchplug.contract.errors import TorchplugError

    out = Path(args.output)
    if (out.exists() or out.is_symlink()) and not args.force:
        print(f"torchplug config: {out} exists; pass --force to replace it.", file=sys.stderr)
        return 2
    if out.is_dir():
        print(
            f"torchplug config: {out} is a directory; name the file to write with -o, e.g. "
            f"-o {out / 'torchplug.toml'}.",
            file=sys.stderr,
        )
        return 2
    try:
        if args.ask:
            _ask(args)
        table = settings_from(args)
        text = render(table)
        _write(out, text)
    except TorchplugError as exc:
        print(f"torchplug config: {exc}", file=sys.stderr)
        return 2
    except EOFError:
        print(
            "torchplug config --ask: the input ended before every question was answered; "
            "nothing was written. Answer on a terminal, or pass the settings as flags.",
            file=sys.stderr,
        )
        return 2
    except OSError as exc:
        print(
            f"torchplug config: cannot write {out}: {exc.strerror or exc}"
            f"{f' ({exc.filename})' if exc.filename else ''}. Nothing was written; check the "
            f"directory exists and is writable.",
            file=sys.stderr,
        )
        return 2
    print(f"wrote {out}:\n{text}", end="")
    return 0
