"""``torchplug convert``: a checkpoint to ``model.safetensors`` (the work is in the core)."""

from __future__ import annotations

import sys
from typing import Any


def convert(args: Any) -> int:
    from torchplug.cli.conversion import convert as run_convert
    from torchplug.contract.errors import TorchplugError

    try:
        written = run_convert(
            args.source,
            args.destination,
            entry=args.entry,
            optimizer=args.optimizer,
            progress=args.progress,
            to=args.to,
            trust_pickles=args.trust_pickles,
            source_format=args.source_format,
            max_shard_size=args.max_shard_size,
        )
    except TorchplugError as exc:
        print(f"torchplug convert: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
