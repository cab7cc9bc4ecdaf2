"""The conformance kit as pytest tests, for backend authors' own test suites.

Subclass `Conformance` in a test module; torchplug's pytest plugin (loaded automatically)
provides the ranks::

    from torchplug.testing.conformance import Conformance

    class TestMyBackend(Conformance):
        strategy = "my-backend"        # options = {...}; plugins = ["my_module"]; nprocs = 2
        precision = "bf16"             # one class per precision the backend supports

or let `classes` make one class per precision.

Every property of `torchplug.testing.kit` becomes a test, run on real ranks started once per
session by torchrun (the ``torchplug_ranks`` fixture).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from torchplug.testing.kit import Kit, Outcome
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
    from torchplug.contract.types import normalize_precision
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

    def test_parity(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.parity())

    def test_sgd(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.sgd())

    def test_clipping(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.clipping())

    def test_accumulation(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.accumulation())

    def test_schedulers(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.schedulers())

    def test_fp16_skip(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.fp16_skip())

    def test_data_order(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.data_order())

    def test_optimizer_type(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.optimizer_type())

    def test_collectives(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.collectives())

    def test_checkpoint(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.checkpoint())

    def test_resume(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.resume())

    def test_portability(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.portability())

    def test_single_process(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.single_process())

    def test_materialization(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.materialization())

    def test_replicas(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.replicas())

    def test_real_model(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.real_model())

    def test_hyperparameters(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.hyperparameters())

    def test_barrier(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.barrier())

    def test_sharding(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.sharding())

    def test_unsupported(self, torchplug_kit: Kit) -> None:
        _expect(torchplug_kit.unsupported())


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
