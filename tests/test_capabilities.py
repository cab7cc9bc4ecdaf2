"""Declared capabilities are enforced by the core when an Engine is created, for every strategy,
built-in or third-party; ``torchplug plugins`` lists what is unusable here and why."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch

import torchplug as tp
from test_plugins import provider
from torchplug.cli.plugins import plugins

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def listing() -> dict[str, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        plugins()
    return {line.split()[0]: line for line in out.getvalue().splitlines() if line.strip()}


@needs_no_cuda
def test_fairscale_fsdp_is_refused_on_a_cpu_machine_with_the_capability_and_alternatives():
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("fairscale-fsdp")
    message = str(info.value)
    assert "supports_cpu=False" in message and "no usable CUDA device" in message
    assert "Choose a usable strategy (" in message and "ddp" in message and "fsdp" in message
    assert "fairscale-fsdp" not in message.split("Choose a usable strategy")[1]
    row = listing()["fairscale-fsdp"]
    assert "unusable: it declares supports_cpu=False" in row


@needs_no_cuda
def test_a_third_party_cuda_only_strategy_is_refused_by_the_core():
    tp.register(provider(name="gpu-only", supports_cpu=False))  # no check= of its own
    with pytest.raises(tp.ConfigurationError, match="'gpu-only'.*supports_cpu=False"):
        tp.Engine("gpu-only")
    assert "unusable: it declares supports_cpu=False" in listing()["gpu-only"]
    assert "gpu-only" not in tp.core.manager.get_registry().usable_names()


def test_a_strategy_for_neither_device_is_refused_and_a_cpu_one_runs():
    tp.register(provider(name="nowhere", supports_cpu=False, supports_cuda=False))
    tp.register(provider(name="cpu-only", supports_cuda=False))
    with pytest.raises(tp.ConfigurationError, match="'nowhere' is installed but cannot run here"):
        tp.Engine("nowhere")
    with tp.Engine("cpu-only") as engine:
        assert engine.device.type == "cpu"
