"""Every built-in strategy passes the conformance kit; a broken one fails it, saying how."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchplug.testing.conformance import Conformance
from torchplug.testing.kit import check


class TestSingle(Conformance):
    strategy = "single"


class TestDDP(Conformance):
    strategy = "ddp"


class TestFSDP(Conformance):
    strategy = "fsdp"


def test_a_strategy_that_forgets_to_average_fails_parity_by_a_measured_amount(ranks):
    [outcome] = check("no-average", plugins=["broken_strategy"], pool=ranks, only=["parity"])
    assert not outcome.passed
    assert outcome.name == "parity"
    assert "max |param diff|" in outcome.detail and "> tolerance 1e-05" in outcome.detail
    worst = float(outcome.detail.split("max |param diff| ")[1].split()[0])
    assert worst > 1e-3


@pytest.mark.slow
def test_check_command_reports_pass_and_fail_per_property():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchplug",
            "check",
            "no-average",
            "--plugin",
            "broken_strategy",
            "--only",
            "parity",
            "--only",
            "collectives",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "FAIL  parity" in run.stdout and "PASS  collectives" in run.stdout
    assert "1 passed, 1 failed" in run.stdout
