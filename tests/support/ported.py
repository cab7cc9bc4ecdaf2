"""The ported scripts (support/ported_scripts.py) under a strategy against their ``ddp`` run,
and resumed from a mid-run checkpoint against the uninterrupted run."""

from __future__ import annotations

import pytest

from support.ported_scripts import accelerate_checkpointing, ddp_tutorial, fabric_classifier
from support.reference import assert_close_dicts
from torchplug.testing.kit import LOW_PRECISION_TOLERANCE

SCRIPTS = {"ddp_tutorial": ddp_tutorial, "fabric_classifier": fabric_classifier}


def tolerance(precision: str | None) -> float:
    return LOW_PRECISION_TOLERANCE.get(precision or "32", 1e-5)


def matches(result: dict, expected: dict, precision: str | None) -> None:
    atol = tolerance(precision)
    assert result["losses"] == pytest.approx(expected["losses"], abs=atol)
    assert_close_dicts(result["params"], expected["params"], atol=atol)
    for key in ("accuracies", "lr"):
        if key in expected:
            assert result[key] == pytest.approx(expected[key], abs=max(atol, 1e-12))


_ddp_cache: dict = {}


def ddp_result(ranks, script: str, precision: str | None, tmp_path) -> dict:
    key = (script, precision)
    if key not in _ddp_cache:
        if script == "accelerate_checkpointing":
            runs = ranks.run(accelerate_checkpointing, "ddp", str(tmp_path / "ddp"), precision)
        else:
            runs = ranks.run(SCRIPTS[script], "ddp", precision)
        _ddp_cache[key] = runs[0]
    return _ddp_cache[key]


def check_strategy(ranks, strategy: str, precision: str | None, tmp_path) -> None:
    """Every script under ``strategy`` against ``ddp``, and the resumed run against the whole."""
    for script, fn in SCRIPTS.items():
        expected = ddp_result(ranks, script, precision, tmp_path)
        for result in ranks.run(fn, strategy, precision, timeout=300):
            matches(result, expected, precision)
    expected = ddp_result(ranks, "accelerate_checkpointing", precision, tmp_path)
    whole = ranks.run(
        accelerate_checkpointing, strategy, str(tmp_path / strategy), precision, timeout=300
    )
    for result in whole:
        matches(result, expected, precision)
    half = str(tmp_path / f"{strategy}-half")
    ranks.run(accelerate_checkpointing, strategy, half, precision, stop_after_epoch=0)
    resumed = ranks.run(
        accelerate_checkpointing,
        strategy,
        half,
        precision,
        resume_from=f"{half}/epoch_0",
        timeout=300,
    )
    for result in resumed:
        assert result["lr"] == whole[0]["lr"]
        assert_close_dicts(result["params"], whole[0]["params"], atol=1e-6)
