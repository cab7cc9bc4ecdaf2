"""Declared capabilities are enforced by the core when an Engine is created, for every strategy,
built-in or third-party; ``torchplug plugins`` lists what is unusable here and why."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch

import torchplug as tp
from support.plugins import provider
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
    assert "gpu-only" not in tp.contract.manager.get_registry().usable_names()


def test_a_strategy_for_neither_device_is_refused_and_a_cpu_one_runs():
    tp.register(provider(name="nowhere", supports_cpu=False, supports_cuda=False))
    tp.register(provider(name="cpu-only", supports_cuda=False))
    with pytest.raises(tp.ConfigurationError, match="'nowhere' is installed but cannot run here"):
        tp.Engine("nowhere")
    with tp.Engine("cpu-only") as engine:
        assert engine.device.type == "cpu"


# -- precisions the machine cannot run: one probe, every consumer ---------------------------------


def no_fp16_here(precision: str) -> str | None:
    return "this test machine has no fp16 kernels" if precision == "fp16" else None


def register_no_fp16() -> None:
    tp.register(
        provider(
            name="no-fp16",
            precisions=("32", "bf16", "fp16"),
            owns_precision=True,
            distributed=False,
            precision_check=no_fp16_here,
        )
    )


def test_a_precision_the_machine_cannot_run_is_refused_by_the_engine_with_the_probes_reason():
    register_no_fp16()
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("no-fp16", precision="16-mixed")
    message = str(info.value)
    assert "cannot run precision 'fp16' (set by code argument) here" in message
    assert "fp16 not available on this machine: this test machine has no fp16 kernels" in message
    assert "torchplug plugins --verbose" in message
    with tp.Engine("no-fp16", precision="bf16") as engine:  # the others run
        assert engine.precision == "bf16"


def test_doctor_and_launch_checks_report_it_before_anything_starts():
    from torchplug.contract import manager
    from torchplug.engine import config

    register_no_fp16()
    registry = manager.get_registry()
    settings = config.resolve(
        env={"TORCHPLUG_STRATEGY": "no-fp16", "TORCHPLUG_PRECISION": "fp16"},
        canonical=lambda n: registry.canonical(n) or n,
    )
    (problem,) = config.problems(settings, registry, 1)
    assert "cannot run precision 'fp16' (from environment" in problem
    assert "fp16 not available on this machine: this test machine has no fp16 kernels" in problem


def test_plugins_verbose_shows_the_unavailable_precision_with_the_reason():
    register_no_fp16()
    out = io.StringIO()
    with redirect_stdout(out):
        plugins(verbose=True)
    section = out.getvalue().split("\nno-fp16: ", 1)[1].split("\n\n", 1)[0]
    assert "precisions: 32, bf16, fp16 (not available on this machine: this test machine" in section


def test_the_kit_skips_every_property_with_the_reason_and_starts_no_ranks():
    from torchplug.testing.kit import PROPERTIES, Kit

    register_no_fp16()
    kit = Kit("no-fp16", precision="fp16")
    outcomes = kit.check()
    assert [o.name for o in outcomes] == list(PROPERTIES)
    assert all(o.skipped and not o.passed for o in outcomes)
    assert str(outcomes[0]).startswith("SKIP  parity (fp16 not available on this machine: ")
    assert not kit.started


def test_cpu_probe_reads_torch_and_the_override(monkeypatch):
    from torchplug.util import capabilities

    monkeypatch.delenv(capabilities.ASSUME_NO_KERNELS_ENV, raising=False)
    has_fp16 = torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert (capabilities.cpu_kernels_missing("fp16") is None) == has_fp16
    monkeypatch.setenv(capabilities.ASSUME_NO_KERNELS_ENV, "fp16")
    assert "TORCHPLUG_ASSUME_NO_KERNELS=fp16 says so" in capabilities.cpu_kernels_missing("fp16")
    assert (capabilities.cpu_kernels_missing("bf16") is None) == (
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )  # only the named precision is assumed missing
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert "_is_mkldnn_bf16_supported() is False" in capabilities.cpu_kernels_missing("bf16")


@needs_no_cuda
def test_amp_runs_both_low_precisions_on_any_cpu(monkeypatch):
    """CPU autocast has reference kernels: without oneDNN's fp16, AMP's fp16 still runs (only a
    backend that needs the native kernels, like DeepSpeed's, is refused)."""
    from torchplug.contract import manager
    from torchplug.util import capabilities

    monkeypatch.setenv(capabilities.ASSUME_NO_KERNELS_ENV, "bf16,fp16")
    registry = manager.get_registry()
    for name in ("single", "ddp"):
        for precision in ("bf16", "fp16"):
            assert registry.precision_unavailable(registry.strategy(name), precision) is None
    with tp.Engine("single", precision="fp16") as engine:
        assert engine.precision == "fp16"
