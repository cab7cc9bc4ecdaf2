"""``torchplug check NAME``: the conformance kit on a strategy, in real processes."""

from __future__ import annotations

import sys
from typing import Any


def check(args: Any) -> int:
    from torchplug.contract.errors import TorchplugError
    from torchplug.testing.kit import OPTIONAL_PROPERTIES, PROPERTIES, Kit

    unknown = [p for p in args.only or () if p not in PROPERTIES + OPTIONAL_PROPERTIES]
    if unknown:
        print(
            f"torchplug check: unknown property {unknown}; choose from "
            f"{', '.join(PROPERTIES + OPTIONAL_PROPERTIES)}",
            file=sys.stderr,
        )
        return 2
    from torchplug.contract import manager
    from torchplug.engine.config import normalize_precision, parse_option
    from torchplug.testing import bodies

    try:
        bodies.register(args.plugin)
        info = manager.get_registry().strategy(args.strategy)
        options = dict(parse_option(text) for text in getattr(args, "option", None) or ())
        info.resolve_options(options)  # unknown names and wrong types: refused before any rank
        precisions = [normalize_precision(args.precision)] if args.precision else info.precisions
    except TorchplugError as exc:
        print(f"torchplug check: {exc}", file=sys.stderr)
        return 2
    failed_total, passed_total, skipped_total, refused_total, deviated_total = 0, 0, 0, 0, 0
    pool = None
    for precision in precisions:
        try:
            kit = Kit(
                args.strategy,
                args.nprocs,
                plugins=args.plugin,
                options=options,
                precision=precision,
                pool=pool,
            )
        except TorchplugError as exc:
            print(f"torchplug check: {exc}", file=sys.stderr)
            return 2
        where = f"{kit.nprocs} ranks" if kit.nprocs > 1 else "1 process: the strategy runs one"
        given = "".join(f", {k}={v!r}" for k, v in options.items())
        print(f"torchplug check {kit.strategy}{given}, precision {precision} ({where})")
        outcomes = kit.check(args.only or PROPERTIES)
        if kit.nprocs > 1 and kit.started:
            pool = kit.pool  # one set of ranks for every precision; stopped below
        for outcome in outcomes:
            print(f"  {outcome}")
        failed_total += sum(1 for o in outcomes if not (o.passed or o.skipped or o.deviated))
        deviated_total += sum(1 for o in outcomes if o.deviated)
        passed_total += sum(1 for o in outcomes if o.passed)
        skipped_total += sum(1 for o in outcomes if o.skipped)
        refused_total += sum(1 for o in outcomes if o.passed and o.refused)
    if pool is not None:
        pool.stop()
    if refused_total:  # a PASS that is a declared refusal, not the property working
        print(
            f"({refused_total} of the passes are refusals the strategy declares: see 'refused "
            f"as declared' above)"
        )
    deviates = f", {deviated_total} deviate as declared" if deviated_total else ""
    print(f"{passed_total} passed, {failed_total} failed, {skipped_total} skipped{deviates}")
    return 1 if failed_total else 0
