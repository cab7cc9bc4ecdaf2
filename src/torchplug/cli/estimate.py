"""``torchplug estimate-memory``: per-rank bytes of parameters, gradients, optimizer state (and
DeepSpeed's fp32 masters) for a model under each installed strategy, from parameter shapes alone.

    torchplug estimate-memory mypkg.models:build -n 8 --optimizer adamw --precision bf16
    torchplug estimate-memory path/to/config.json -n 2 --strategy fsdp --json
    torchplug estimate-memory gpt2 -n 4            # a transformers model type, default config

The model is built on the meta device (no memory is allocated, nothing is downloaded); each
strategy's sharding rule (``StrategyInfo.memory``, `torchplug.features.memory`) turns its
parameter shapes into what the fullest rank holds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        help="'package.module:factory' (a callable taking no arguments and returning an "
        "nn.Module, called under torch.device('meta'); or an nn.Module instance), a "
        "transformers config.json (or a directory holding one), or a transformers model type "
        "such as gpt2 (its default config)",
    )
    p.add_argument("-n", "--nprocs", "--world-size", dest="world_size", type=int, default=2,
                   metavar="N", help="ranks (data-parallel world size; default 2)")  # fmt: skip
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="whose state to count (default adamw)")  # fmt: skip
    p.add_argument("--precision", default="32", help="32, bf16 or fp16 (default 32)")
    p.add_argument("--strategy", action="append", default=None, metavar="NAME",
                   help="only this strategy (repeatable; default: every usable one)")  # fmt: skip
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a strategy option, with one --strategy (e.g. stage=3)")  # fmt: skip
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import and register an in-house plugin first (repeatable)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON (exact bytes) instead")


def human(n: int) -> str:
    """Bytes in binary units: ``0 B``, ``812 B``, ``1.50 KiB``, ``3.25 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError  # pragma: no cover


def load_model(text: str) -> tuple[Any, str]:
    """``(module on the meta device, what it is)`` for the ``MODEL`` argument."""
    import torch

    from torchplug.contract.errors import ConfigurationError

    path = Path(text)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        transformers = _transformers(text)
        try:
            config = transformers.AutoConfig.from_pretrained(str(path))
        except Exception as exc:
            raise ConfigurationError(
                f"{text}: not a transformers config (a config.json with a model_type): {exc}"
            ) from None
        return _from_config(transformers, config, f"transformers config {path}")
    if ":" in text:
        module_name, _, attr = text.partition(":")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # MODULE next to the user, as --plugin finds it
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigurationError(
                f"{text}: cannot import '{module_name}' ({exc}). Pass 'package.module:factory' "
                f"importable from the current directory."
            ) from None
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ConfigurationError(f"{text}: module '{module_name}' has no '{attr}'.")
            obj = getattr(obj, part)
        if not isinstance(obj, torch.nn.Module):
            if not callable(obj):
                raise ConfigurationError(
                    f"{text}: '{attr}' is a {type(obj).__name__}; expected a callable returning "
                    f"an nn.Module (or an nn.Module)."
                )
            try:
                with torch.device("meta"):
                    obj = obj()
            except Exception as exc:
                raise ConfigurationError(
                    f"{text}: calling '{attr}()' on the meta device failed: "
                    f"{type(exc).__name__}: {exc}. The factory must take no arguments and "
                    f"build the model without reading or computing weights."
                ) from None
        if type(obj).__name__.endswith("Config") and hasattr(obj, "model_type"):
            return _from_config(_transformers(text), obj, f"transformers config from {text}")
        if not isinstance(obj, torch.nn.Module):
            raise ConfigurationError(
                f"{text}: the factory returned a {type(obj).__name__}, not an nn.Module."
            )
        return obj, f"{text} ({type(obj).__name__})"
    transformers = _transformers(text)
    try:
        config = transformers.AutoConfig.for_model(text)
    except ValueError:
        raise ConfigurationError(
            f"{text!r} is no file, no 'module:factory' and no transformers model type (e.g. gpt2, "
            f"llama, bert). Nothing is downloaded: pass a local config.json for hub models."
        ) from None
    return _from_config(transformers, config, f"transformers model type '{text}', default config")


def _transformers(text: str) -> Any:
    from torchplug.contract.errors import ConfigurationError

    try:
        import transformers
    except ImportError:
        raise ConfigurationError(
            f"{text}: a transformers config needs the transformers package (pip install "
            f"transformers), or pass 'package.module:factory'."
        ) from None
    return transformers


def _from_config(transformers: Any, config: Any, what: str) -> tuple[Any, str]:
    """The causal-LM model of ``config`` (the head training uses), else its base model."""
    import torch

    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            model = transformers.AutoModel.from_config(config)
    return model, f"{what} ({type(model).__name__})"


def estimates(
    model: Any,
    world_size: int,
    precision: str,
    optimizer: str,
    strategies: list[str] | None = None,
    options: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """``(rows, skipped)``: one row per strategy estimated (name, bytes, notes), and each
    strategy not estimated with the reason."""
    from torchplug.contract.errors import ConfigurationError
    from torchplug.contract.manager import get_registry
    from torchplug.features import memory

    registry = get_registry()
    specs = memory.param_specs(model)
    names = strategies or sorted(registry.strategies)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    done: set[str] = set()
    for name in names:
        canonical = registry.canonical(name)
        if canonical is None:
            raise ConfigurationError(registry.unknown_strategy_message(name))
        if canonical in done:  # a name and its alias: one row
            continue
        done.add(canonical)
        info = registry.strategies[canonical]
        why = info.unusable_reason()
        if why is None and precision not in info.precisions:
            why = f"runs precision {', '.join(info.precisions)}, not {precision}"
        if why is None and world_size > 1 and not info.distributed:
            why = f"one process per {'host' if info.launcher != 'torchrun' else 'job'}"
            why += " (estimate with -n 1)" if info.name == "single" else ""
        if why is not None:
            skipped.append({"strategy": info.name, "reason": why})
            continue
        query = memory.MemoryQuery(
            specs,
            world_size,
            precision,
            optimizer,
            info.resolve_options(options or {}),
            memory.model_tp_plan(model),
        )
        try:
            estimate = memory.rule_for(info)(query)
        except memory.NotEstimable as exc:
            skipped.append({"strategy": info.name, "reason": str(exc)})
            continue
        except Exception as exc:  # a plugin's broken rule costs its row, not the table
            reason = f"its memory rule failed: {type(exc).__name__}: {exc}"
            skipped.append({"strategy": info.name, "reason": reason})
            continue
        rows.append({"strategy": info.name, **estimate.as_dict()})
    return rows, skipped


def estimate_memory(args: argparse.Namespace) -> int:
    from torchplug.contract.errors import ConfigurationError, TorchplugError
    from torchplug.engine import config as settings
    from torchplug.engine.config import normalize_precision

    try:
        if args.plugin:
            from torchplug.contract.manager import get_registry, import_plugin_module

            for module in args.plugin:
                import_plugin_module(get_registry(), module, strict=True)
        if args.world_size < 1:
            raise ConfigurationError(f"-n {args.world_size}: expected 1 or more ranks.")
        precision = normalize_precision(args.precision)
        options = dict(settings.parse_option(text) for text in args.option)
        if options and len(args.strategy or []) != 1:
            raise ConfigurationError(
                "--option needs exactly one --strategy: options belong to a strategy."
            )
        model, what = load_model(args.model)
        rows, skipped = estimates(
            model, args.world_size, precision, args.optimizer, args.strategy, options
        )
    except TorchplugError as exc:
        print(f"torchplug estimate-memory: {exc}", file=sys.stderr)
        return 2
    from torchplug.features import memory

    specs = memory.param_specs(model)
    numel = sum(p.numel for p in specs)
    nbytes = sum(p.numel * p.itemsize for p in specs)
    if args.json:
        print(
            json.dumps(
                {
                    "model": what,
                    "parameters": numel,
                    "parameter_bytes": nbytes,
                    "world_size": args.world_size,
                    "precision": precision,
                    "optimizer": args.optimizer,
                    "strategies": rows,
                    "not_estimated": skipped,
                },
                indent=2,
            )
        )
        return 0
    from torchplug.cli.plugins import table

    print(f"model: {what}: {numel:,} parameters, {human(nbytes)} as built")
    print(
        f"per-rank bytes on the fullest of {args.world_size} ranks, optimizer {args.optimizer}, "
        f"precision {precision} (model state only: no activations or buffers)\n"
    )
    header = ["strategy", "params", "grads", "optimizer state", "fp32 masters", "total"]
    fields = ("params", "grads", "optimizer", "masters", "total")
    body = [[r["strategy"], *(human(r[k]) for k in fields)] for r in rows]
    print(table(body, header) if body else "(no strategy estimated)")
    notes: dict[str, list[str]] = {}  # each note once, with every strategy it is about
    for r in rows:
        for note in r["notes"]:
            notes.setdefault(note, []).append(r["strategy"])
    if notes:
        print("\nnotes:")
        for note, names in notes.items():
            print(f"  {', '.join(names)}: {note}")
    if skipped:
        print("\nnot estimated:")
        for s in skipped:
            print(f"  {s['strategy']}: {s['reason']}")
    return 0
