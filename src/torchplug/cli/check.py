"""``torchplug check NAME``: the conformance kit on a strategy, in real processes."""

from __future__ import annotations

import sys
from typing import Any


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
