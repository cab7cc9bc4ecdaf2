"""Output a user sees is ours and deliberate: no stray prints from backends, no import noise."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys

import pytest
import torch

import torchplug as tp


def save_deepspeed_capturing_stdout(path: str) -> str:
    """What a DeepSpeed engine.save prints to this rank's stdout."""
    out = io.StringIO()
    with tp.Engine("deepspeed-zero2", timeout=60.0) as engine:
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = engine.setup(model, optimizer)
        engine.backward(model(torch.ones(2, 4)).sum())
        optimizer.step()
        with contextlib.redirect_stdout(out):
            engine.save(path, {"model": model, "optimizer": optimizer})
    return out.getvalue()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_save_prints_nothing(ranks, tmp_path):
    for printed in ranks.run(save_deepspeed_capturing_stdout, str(tmp_path / "ckpt"), timeout=300):
        assert "Reconstructed" not in printed and "Processing zero checkpoint" not in printed
        assert printed == ""


@pytest.mark.slow
def test_no_numpy_warning_from_our_commands(tmp_path):
    hidden = tmp_path / "numpy"  # a numpy that is not there, as on a machine without it
    hidden.mkdir()
    (hidden / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named numpy", name="numpy")\n'
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}

    def stderr(*args: str) -> str:
        run = subprocess.run(
            [sys.executable, *args], env=env, capture_output=True, text=True, timeout=120
        )
        return run.stderr

    assert "Failed to initialize NumPy" in stderr("-c", "import torch")  # the noise exists
    assert "Failed to initialize NumPy" not in stderr("-m", "torchplug", "plugins")
