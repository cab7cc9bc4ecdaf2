"""The conformance kit as pytest tests, for backend authors' own test suites.

Subclass `Conformance` in a test module; torchplug's pytest plugin (loaded automatically)
provides the ranks::

    from torchplug.testing.conformance import Conformance

    class TestMyBackend(Conformance):
        strategy = "my-backend"        # options = {...}; plugins = ["my_module"]; nprocs = 2
        precision = "bf16"             # one class per precision the backend supports

or let `classes` make one class per precision.

Every property of `torchplug.testing.kit` (its ``PROPERTIES`` list) becomes a test, run on real
ranks started once per session by torchrun (the ``torchplug_ranks`` fixture); a failure of a
property the strategy declares a deviation for (``StrategyInfo(deviations=...)``) is an ``xfail``
with the reason, as ``torchplug check`` reports it DEVIATES.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from torchplug.testing.kit import PROPERTIES, Kit, Outcome
from torchplug.testing.processes import RankPool


def _expect(outcome: Outcome) -> None:
    if outcome.skipped:
        pytest.skip(f"{outcome.name}: {outcome.detail}")
    if outcome.deviated:  # declared by the strategy: reported, neither a pass nor a failure
        pytest.xfail(f"{outcome.name} deviates {outcome.detail}")
    assert outcome.passed, f"{outcome.name}: {outcome.detail}"


def require_precision(strategy: str, precision: str | None, plugins: Sequence[str] = ()) -> None:
    """Skip the calling test when ``precision`` cannot run under ``strategy`` on this machine,
    with the registry's reason (the probe ``torchplug plugins``, ``launch`` and ``check`` use)."""
    from torchplug.contract import manager
    from torchplug.engine.config import normalize_precision
    from torchplug.testing import bodies

    bodies.register(plugins)
    registry = manager.get_registry()
    why = registry.precision_unavailable(
        registry.strategy(strategy), normalize_precision(precision)
    )
    if why is not None:
        pytest.skip(why)


class Conformance:
    """Subclass with ``strategy = "name"``: one test per property of the conformance kit."""

    strategy: str = ""
    nprocs: int = 2
    plugins: Sequence[str] = ()
    options: dict[str, Any] = {}  # noqa: RUF012 - read-only class configuration
    precision: str = "32"

    @pytest.fixture(scope="class")
    @classmethod
    def torchplug_kit(cls, torchplug_ranks: RankPool) -> Iterator[Kit]:
        pool = torchplug_ranks if torchplug_ranks.nprocs == cls.nprocs else None
        kit = Kit(
            cls.strategy,
            cls.nprocs,
            plugins=cls.plugins,
            options=cls.options,
            pool=pool,
            precision=cls.precision,
        )
        unavailable = kit.unavailable()
        if unavailable is not None:  # every property of the class: SKIP with the reason
            kit.close()
            pytest.skip(unavailable)
        yield kit
        kit.close()


def _property_test(name: str) -> Any:
    def test(self: Conformance, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.outcome(name))

    test.__name__ = test.__qualname__ = f"test_{name}"
    test.__doc__ = f"The kit's ``{name}`` property (`torchplug.testing.kit.Kit.{name}`)."
    return test


# One test per kit property, made from the kit's own list, so that a property added to the kit
# is a test of every third-party suite too (the list once had one more entry than the methods).
for _name in PROPERTIES:
    setattr(Conformance, f"test_{_name}", _property_test(_name))
del _name


def classes(
    strategy: str, precisions: Sequence[str] = ("32", "bf16", "fp16"), **attributes: Any
) -> dict[str, type[Conformance]]:
    """One `Conformance` test class per precision, named for pytest to collect::

    globals().update(classes("my-backend", ("32", "bf16"), plugins=["my_module"]))
    """
    made: dict[str, type[Conformance]] = {}
    for precision in precisions:
        name = f"Test_{strategy.replace('-', '_')}_{precision}_Conformance"
        body = {"strategy": strategy, "precision": precision, **attributes}
        made[name] = type(name, (Conformance,), body)
    return made
