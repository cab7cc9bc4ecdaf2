"""What this machine can run: the one probe behind every "precision not available here" answer.

A precision a backend declares (``StrategyInfo.precisions``) is what its code implements; whether
*this* machine can run it is a separate fact (DeepSpeed's fp16 needs CPU fp16 kernels that an AMD
EPYC without AVX512-FP16 lacks; AMP's bf16 needs a GPU with bfloat16 support). That fact is asked
here, once, and every consumer reads the same answer: ``torchplug plugins`` lists it, ``torchplug
launch`` and ``doctor`` refuse before anything starts, ``torchplug check`` and the conformance kit
report ``SKIP`` with the reason, the Engine refuses at construction, and the test suite skips.

Where the answer comes from: the strategy's own ``StrategyInfo.precision_check`` when it owns
precision (DeepSpeed, FSDP2, XLA), otherwise the precision plugin's ``PrecisionInfo.check``
(AMP). Both ask the machine through the probes below (`cpu_kernels_missing`,
`cuda_lacks`), never a list of CPU models.

``TORCHPLUG_ASSUME_NO_KERNELS=fp16`` (or ``bf16,fp16``) makes those probes answer as if this
machine had no native kernels for the named precisions: the refusal path of an AMD EPYC without
fp16 kernels, run on a machine that has them (the test suite does this), or a way to keep a
backend off kernels that are broken here in a way no probe sees.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Mapping


#: Precisions whose native kernels the probes treat as absent here (comma-separated).
ASSUME_NO_KERNELS_ENV = "TORCHPLUG_ASSUME_NO_KERNELS"


def assumed_missing(precision: str) -> bool:
    """Whether ``TORCHPLUG_ASSUME_NO_KERNELS`` names ``precision``."""
    named = {p.strip().lower() for p in os.environ.get(ASSUME_NO_KERNELS_ENV, "").split(",")}
    return precision in named


def cpu_kernels_missing(precision: str) -> str | None:
    """Why this CPU has no native (oneDNN) kernels for ``precision``, or ``None`` if it has them.

    torch answers from the CPU's instruction set (AVX512-FP16/AMX-FP16 for fp16, AVX512-BF16,
    AVX512 or AMX for bf16); a build without oneDNN answers no.

    Args:
        precision: ``"bf16"`` or ``"fp16"``.
    """
    probes = {
        "fp16": "_is_mkldnn_fp16_supported",
        "bf16": "_is_mkldnn_bf16_supported",
    }
    if precision not in probes:
        return None
    if assumed_missing(precision):
        return (
            f"this CPU has no {precision} kernels "
            f"({ASSUME_NO_KERNELS_ENV}={os.environ[ASSUME_NO_KERNELS_ENV]} says so)"
        )
    try:
        supported = bool(getattr(torch.ops.mkldnn, probes[precision])())
    except (AttributeError, RuntimeError):
        supported = False
    if supported:
        return None
    return f"this CPU has no {precision} kernels (torch.ops.mkldnn.{probes[precision]}() is False)"


def cuda_lacks(precision: str) -> str | None:
    """Why the visible CUDA device cannot run ``precision`` natively, or ``None``.

    Args:
        precision: ``"bf16"``, ``"fp16"`` or ``"32"``.
    """
    if precision in ("bf16", "fp16") and assumed_missing(precision):
        return (
            f"this GPU has no {precision} kernels "
            f"({ASSUME_NO_KERNELS_ENV}={os.environ[ASSUME_NO_KERNELS_ENV]} says so)"
        )
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        return f"{torch.cuda.get_device_name()} has no bfloat16 support"
    return None


def gpu_check(precision: str) -> str | None:
    """``precision_check`` for a backend whose low precision runs on any CPU (torch's reference
    kernels) and on a GPU that supports it (FSDP2's mixed precision, tensor parallel).

    Args:
        precision: ``"bf16"``, ``"fp16"`` or ``"32"``.
    """
    return cuda_lacks(precision) if torch.cuda.is_available() else None


def precision_unavailable(info: Any, precision: str, precisions: Mapping[str, Any]) -> str | None:
    """Why ``precision`` cannot run under strategy ``info`` on this machine, or ``None``.

    ``info`` is a `StrategyInfo`; ``precisions`` the registry's precision plugins (name ->
    info). A precision the strategy does not declare at all is a different error (configuration,
    not machine) and is not answered here. The reason reads as "fp16 not available on this
    machine: <why>"."""
    if precision == "32" or precision not in info.precisions:
        return None
    if info.owns_precision:
        check = info.precision_check
    else:
        plugin = precisions.get(precision)
        check = plugin.check if plugin is not None else None
    why = check(precision) if check is not None else None
    return None if why is None else f"{precision} not available on this machine: {why}"


def device_unavailable(supports_cpu: bool, supports_cuda: bool) -> str | None:
    """Why a strategy's declared devices (``StrategyInfo.supports_cpu``, ``supports_cuda``)
    rule this machine out, or ``None``: enforced for every strategy, built-in or third-party."""
    if not torch.cuda.is_available():
        if not supports_cpu:
            return (
                "it declares supports_cpu=False (it needs a CUDA GPU) and this machine has "
                "no usable CUDA device"
            )
    elif not (supports_cuda or supports_cpu):
        return "it declares neither supports_cpu nor supports_cuda"
    return None
