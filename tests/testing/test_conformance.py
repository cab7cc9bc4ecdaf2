"""Every built-in strategy passes the conformance kit; a broken one fails it, saying how."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.broken_strategy import BROKEN
from support.paths import TESTS
from torchplug.testing.conformance import classes, require_precision
from torchplug.testing.kit import check

# Every built-in strategy of the base install, in every precision it supports.
globals().update(classes("single"))
globals().update(classes("ddp"))
globals().update(classes("fsdp", ("32", "bf16")))


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_broken_strategy_is_caught_by_the_property_it_breaks(ranks, name):
    prop = BROKEN[name][1]
    precision = "fp16" if prop == "fp16_skip" else "32"
    require_precision(name, precision, plugins=["support.broken_strategy"])
    # the property it breaks, and parity (the others train right): not the whole kit each time
    outcomes = check(
        name,
        plugins=["support.broken_strategy"],
        pool=ranks,
        precision=precision,
        only=[prop, "parity"],
    )
    failed = [o.name for o in outcomes if not (o.passed or o.skipped)]
    assert prop in failed, [str(o) for o in outcomes]
    # the others train right (ranks that start from different models cannot)
    assert "parity" not in failed or name in ("no-average", "reinitialises-per-rank"), failed


def test_a_declared_refusal_passes_as_one_and_is_counted(ranks):
    from support.broken_strategy import DECLARES_REFUSAL

    (clipping,) = check(
        DECLARES_REFUSAL, plugins=["support.broken_strategy"], pool=ranks, only=["clipping"]
    )
    assert clipping.passed and clipping.refused, clipping
    assert clipping.detail.startswith("refused as declared: ") and "cannot clip" in clipping.detail
    (undeclared,) = check(
        "refuses-clipping", plugins=["support.broken_strategy"], pool=ranks, only=["clipping"]
    )
    assert not undeclared.passed and not undeclared.refused
    assert "StrategyInfo(..., refuses=('clipping',))" in undeclared.detail, undeclared


def test_a_declared_deviation_is_reported_as_one_with_its_reason(ranks):
    """Issue 26 item 8: StrategyInfo(deviations=...) turns a by-design failure of one property
    into DEVIATES with the reason and the measurement; undeclared it stays a FAIL, and a
    declaration naming no property is itself reported."""
    from support.broken_strategy import DECLARES_DEVIATION, MISNAMED_DEVIATION

    clipping, parity = check(
        DECLARES_DEVIATION,
        plugins=["support.broken_strategy"],
        pool=ranks,
        only=["clipping", "parity"],
    )
    assert clipping.deviated and not clipping.passed and clipping.status == "DEVIATES", clipping
    assert "each rank clips its own gradients" in clipping.detail
    assert parity.passed and not parity.deviated  # only the declared property is excused
    (undeclared,) = check(
        "local-clip", plugins=["support.broken_strategy"], pool=ranks, only=["clipping"]
    )
    assert undeclared.status == "FAIL"
    named, clip = check(
        MISNAMED_DEVIATION, plugins=["support.broken_strategy"], pool=ranks, only=["clipping"]
    )
    assert named.name == "deviations" and named.status == "FAIL" and "cliping" in named.detail
    assert clip.status == "FAIL"


def test_a_tolerance_declared_per_option_value_applies_to_that_value_only(ranks):
    """Issue 35 item 2: tolerance can depend on an option's value. Gradients rounded through
    bf16 (round_to_bf16=True) pass sgd under the tolerance declared for that value; the exact
    regime is held to 1e-5; the same rounding under a strategy declaring 1e-5 only fails."""
    from support.broken_strategy import ONE_TOLERANCE, PER_OPTION_TOLERANCE

    plugins = ["support.broken_strategy"]
    lossy = {"round_to_bf16": True}
    (sgd,) = check(PER_OPTION_TOLERANCE, plugins=plugins, pool=ranks, only=["sgd"], options=lossy)
    assert sgd.passed and "tolerance 1e-02" in sgd.detail, sgd
    (exact,) = check(PER_OPTION_TOLERANCE, plugins=plugins, pool=ranks, only=["sgd"])
    assert exact.passed and "tolerance 1e-05" in exact.detail, exact
    (held,) = check(ONE_TOLERANCE, plugins=plugins, pool=ranks, only=["sgd"], options=lossy)
    assert not held.passed and "> tolerance 1e-05" in held.detail, held


def test_summing_instead_of_averaging_is_caught_by_sgd_where_adamw_hides_it(ranks):
    parity, sgd = check(
        "no-average", plugins=["support.broken_strategy"], pool=ranks, only=["parity", "sgd"]
    )
    # AdamW normalises the gradient scale away (the old kit's blind spot); SGD cannot.
    assert not sgd.passed
    assert float(sgd.detail.split("max |param diff| ")[1].split()[0]) > 1e-2, sgd


@pytest.mark.slow
def test_check_command_reports_pass_and_fail_per_property():
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchplug",
            "check",
            "no-average",
            "--plugin",
            "support.broken_strategy",
            "--precision",
            "32",
            "--only",
            "sgd",
            "--only",
            "collectives",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "FAIL  sgd" in run.stdout and "PASS  collectives" in run.stdout
    assert "1 passed, 1 failed" in run.stdout


@pytest.mark.slow
def test_check_passes_option_to_every_rank_and_refuses_an_unknown_one_before_starting():
    """Issue 35: ``torchplug check --option`` (a backend whose behaviour an option chooses)."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PYTHONWARNINGS": "ignore"}
    base = [sys.executable, "-m", "torchplug", "check", "no-average", "--plugin",
            "support.broken_strategy", "--precision", "32", "--only", "sgd"]  # fmt: skip
    run = subprocess.run(
        [*base, "--option", "average=true"], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "torchplug check no-average, average=True, precision 32" in run.stdout
    assert "PASS  sgd" in run.stdout
    run = subprocess.run(
        [*base, "--option", "averge=true"], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Unknown option 'averge'" in run.stderr and "Did you mean 'average'?" in run.stderr
    assert "PASS" not in run.stdout and "FAIL" not in run.stdout  # no rank was started


def test_a_backend_ignoring_a_skip_from_an_extension_is_caught_by_nan_skip(ranks):
    """The NaN guard (an extension wrapper) asks for no update; this backend steps anyway."""
    (outcome,) = check(
        "ignores-skip", plugins=["support.broken_strategy"], pool=ranks, only=["nan_skip"]
    )
    assert not outcome.passed and "step_was_skipped" in outcome.detail, outcome
    (outcome,) = check("ddp", pool=ranks, only=["nan_skip"])
    assert outcome.passed, outcome


def test_the_pytest_face_has_one_test_per_kit_property():
    """Issue 33 item 8: `Conformance`'s tests are made from the kit's property list (a third
    party's suite once lacked ``nan_skip`` because the methods were written out by hand)."""
    from torchplug.testing.conformance import Conformance
    from torchplug.testing.kit import PROPERTIES

    tests = {name for name in dir(Conformance) if name.startswith("test_")}
    assert tests == {f"test_{name}" for name in PROPERTIES}


@pytest.mark.slow
def test_the_pytest_face_reports_a_declared_deviation_as_xfail_and_nan_skip_runs(tmp_path):
    """Issue 35: a property the strategy declares a deviation for is an xfail with its reason
    through `Conformance`, as `torchplug check` says DEVIATES; an undeclared failure is a
    failure; and ``test_nan_skip`` exists and catches a backend that steps through a skip."""
    from support.broken_strategy import DECLARES_DEVIATION

    (tmp_path / "test_third_party.py").write_text(
        "from torchplug.testing.conformance import Conformance\n"
        "class TestDeclared(Conformance):\n"
        f"    strategy = {DECLARES_DEVIATION!r}\n"
        "    plugins = ['support.broken_strategy']\n"
        "class TestUndeclared(Conformance):\n"
        "    strategy = 'local-clip'\n"
        "    plugins = ['support.broken_strategy']\n"
        "class TestIgnoresSkip(Conformance):\n"
        "    strategy = 'ignores-skip'\n"
        "    plugins = ['support.broken_strategy']\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rxXf", "-p", "no:cacheprovider",
         "-k", "clipping or nan_skip", str(tmp_path / "test_third_party.py")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=1800,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert "XFAIL test_third_party.py::TestDeclared::test_clipping" in out, out[-3000:]
    assert "each rank clips its own gradients" in out, out[-3000:]
    assert "FAILED test_third_party.py::TestUndeclared::test_clipping" in out, out[-3000:]
    assert "FAILED test_third_party.py::TestIgnoresSkip::test_nan_skip" in out, out[-3000:]


#: Strategies whose outcomes span every kind: a failure (no-average's sgd), a declared deviation
#: (declares-local-clipping's clipping), a declared refusal (declares-no-clipping's clipping),
#: passes, and skips where a property cannot run.
FACES = ("no-average", "declares-local-clipping", "declares-no-clipping", "ddp")
FACE_PROPERTIES = ("sgd", "clipping", "collectives", "reuse", "frozen", "barrier", "rank_dependent")


@pytest.mark.slow
def test_the_pytest_face_and_torchplug_check_agree_on_every_property(tmp_path):
    """Issue 35 item 2: the two faces apply declarations alike; each property's result under
    `torchplug check` is the pytest face's (PASS=passed, FAIL=failed, DEVIATES=xfail,
    SKIP=skipped), for outcomes of every kind."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    only = [arg for name in FACE_PROPERTIES for arg in ("--only", name)]
    classes = "".join(
        f"class Test{i}(Conformance):\n    strategy = {name!r}\n"
        f"    plugins = ['support.broken_strategy']\n"
        for i, name in enumerate(FACES)
    )
    (tmp_path / "test_faces.py").write_text(
        f"from torchplug.testing.conformance import Conformance\n{classes}"
    )
    pytest_run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-k",
         " or ".join(f"test_{p}" for p in FACE_PROPERTIES), str(tmp_path / "test_faces.py")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=1800,
    )  # fmt: skip
    as_pytest = {"PASS": "PASSED", "FAIL": "FAILED", "DEVIATES": "XFAIL", "SKIP": "SKIPPED"}
    for i, strategy in enumerate(FACES):
        check = subprocess.run(
            [sys.executable, "-m", "torchplug", "check", strategy, "--plugin",
             "support.broken_strategy", "--precision", "32", *only],
            capture_output=True, text=True, env=env, timeout=1800,
        )  # fmt: skip
        said = {
            line.split()[1]: line.split()[0]
            for line in check.stdout.splitlines()
            if line.startswith("  ") and line.split()[0] in as_pytest
        }
        assert sorted(said) == sorted(FACE_PROPERTIES), check.stdout + check.stderr[-2000:]
        for prop, status in said.items():
            test = f"test_faces.py::Test{i}::test_{prop}"
            marks = [
                line.split()[0]
                for line in pytest_run.stdout.splitlines()
                if test in line and line.split()[0] in as_pytest.values()
            ]
            assert marks == [as_pytest[status]], (strategy, prop, status, marks)
