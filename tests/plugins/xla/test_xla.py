"""xla (torch_xla SPMD) on XLA:CPU devices against the eager CPU reference (tox -e xla).

The number of XLA devices is fixed when a process starts (CPU_NUM_DEVICES), so each run is a
subprocess of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import torchplug as tp
from support.paths import ROOT, TESTS
from support.reference import assert_close_dicts, make_model, train
from torchplug.plugins.xla import version_mismatch

needs_xla = pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="no torch_xla")


def in_xla_process(code: str, devices: int, timeout: float = 600) -> dict:
    """Run ``code`` (which sets ``result``) in a fresh process with ``devices`` XLA:CPU devices."""
    script = (
        f"import sys, json\nsys.path.insert(0, {str(TESTS)!r})\n{code}\n"
        "print('RESULT' + json.dumps(result))\n"
    )
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


TRAIN = """
from support.reference import train
r = train("xla", {precision!r}{extra})
result = {{"losses": r["losses"], "world_size": r["world_size"],
          "params": {{k: v.tolist() for k, v in r["params"].items()}}}}
"""


def xla_train(devices: int, precision: str | None = None, extra: str = "") -> dict:
    result = in_xla_process(TRAIN.format(precision=precision, extra=extra), devices)
    result["params"] = {k: torch.tensor(v) for k, v in result["params"].items()}
    return result


@pytest.fixture(scope="module")
def reference() -> dict:
    return train("single")


@needs_xla
@pytest.mark.parametrize("devices", [1, 2])
def test_xla_spmd_matches_eager_cpu_reference(reference, devices):
    result = xla_train(devices)
    assert result["world_size"] == 1  # one process; SPMD spans its devices
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert_close_dicts(result["params"], reference["params"], atol=1e-5)


@needs_xla
def test_xla_bf16_within_tolerance(reference):
    result = xla_train(2, "bf16")
    assert result["losses"] == pytest.approx(reference["losses"], abs=5e-2)
    assert result["losses"] != reference["losses"]


@needs_xla
def test_xla_checkpoint_loads_into_single_on_plain_cpu(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = xla_train(2, extra=f", steps=3, save_to={path!r}")
    with tp.Engine("single") as engine:
        model = engine.setup(make_model(seed=5))
        state = {"model": model, "step": 0}
        engine.load(path, state)
        assert state["step"] == 3
        loaded = engine.full_state(model)["model"]
    for key, value in saved["params"].items():
        assert torch.equal(loaded[key], value), key


@needs_xla
def test_the_example_runs_unchanged_with_xla():
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchplug",
            "launch",
            "--strategy",
            "xla",
            str(ROOT / "examples" / "train.py"),
            "--epochs",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "strategy='xla'" in run.stdout and "epoch  2" in run.stdout


@needs_xla
def test_fp16_on_xla_is_refused():
    with pytest.raises(tp.ConfigurationError, match="'xla' cannot run precision 'fp16'"):
        tp.Engine("xla", precision="fp16")


@needs_xla
def test_tpu_without_libtpu_says_so(monkeypatch):
    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("libtpu is installed")
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(tp.ConfigurationError, match="libtpu is not installed"):
        tp.Engine("xla")


def test_torch_and_torch_xla_release_mismatch_is_explained():
    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert version_mismatch(f"{major_minor}.0", "abc") is None
    message = version_mismatch("1.99.0", "cbe1a35dbdfdc9b7")
    assert "torch_xla 1.99.0 was built against torch 1.99" in message
    assert "cbe1a35dbdfd" in message and "pip install torch==1.99.0 torch_xla==1.99.0" in message


MULTI_HOST = """
import torch_xla.runtime as xr
import torchplug as tp
xr.process_count = lambda: 2  # as on the first of two hosts
try:
    tp.Engine("xla")
    result = {"error": None}
except tp.ConfigurationError as exc:
    result = {"error": str(exc)}
"""


@needs_xla
def test_multi_host_is_refused_not_silently_local():
    error = in_xla_process(MULTI_HOST, 1)["error"]
    assert error is not None and "Multi-host XLA is not supported" in error


@needs_xla
@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_the_conformance_kit_passes_on_xla(precision):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [sys.executable, "-m", "torchplug", "check", "xla", "--precision", precision],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=TESTS,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " 0 failed" in run.stdout
