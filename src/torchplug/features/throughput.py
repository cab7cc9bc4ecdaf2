"""Throughput and model FLOPs utilisation (MFU) of your own loop: samples, tokens and FLOPs per
second, on this rank and over all of them (Fabric's ``ThroughputMonitor``).

    flops = tp.measure_flops(model, lambda: model(x).sum())   # one step's FLOPs, counted once
    monitor = tp.ThroughputMonitor(engine, window=20)
    start = time.perf_counter()
    for step, (x, y) in enumerate(loader):
        ...
        monitor.update(time=time.perf_counter() - start, batches=step + 1,
                       samples=(step + 1) * len(x), flops=flops)
        if step % 10 == 0:
            monitor.compute_and_log(step)        # through the Engine's loggers

Rates are taken over the last ``window`` updates (a moving window, so a slow first step does not
weigh on the rest). MFU is FLOPs per second over the device's peak: known for common GPUs (by
the name torch reports, at the precision you train in), given as ``peak_flops`` otherwise (a
CPU's depends on the machine: measure it or take its datasheet's).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Protocol

import torch

from torchplug.contract.errors import ConfigurationError


class Engine(Protocol):
    """What a monitor uses of the Engine (or anything that has the same members)."""

    device: torch.device
    precision: str
    world_size: int

    def log(self, metrics: Any, step: int | None = None) -> None: ...

    def reduce(self, tensor: Any, op: str = "mean") -> torch.Tensor: ...


#: Dense peak FLOP/s by GPU name (as torch.cuda.get_device_name reports it) and precision.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"32": 67e12, "bf16": 989e12, "fp16": 989e12},
    "H100": {"32": 67e12, "bf16": 989e12, "fp16": 989e12},  # SXM; PCIe is 756e12
    "A100": {"32": 19.5e12, "bf16": 312e12, "fp16": 312e12},
    "A10G": {"32": 31.2e12, "bf16": 125e12, "fp16": 125e12},
    "L4": {"32": 30.3e12, "bf16": 121e12, "fp16": 121e12},
    "V100": {"32": 15.7e12, "fp16": 125e12},
    "T4": {"32": 8.1e12, "fp16": 65e12},
}


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """The dense peak FLOP/s of ``device`` at ``precision``, if this table knows it."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS.items():
        if key in name:
            return peaks.get(precision)
    return None


def measure_flops(model: torch.nn.Module, step: Callable[[], torch.Tensor]) -> int:
    """FLOPs of one ``step()`` (a forward returning the loss) and its backward, counted by torch's
    ``FlopCounterMode`` (matrix multiplications, convolutions, attention); the gradients it
    makes are cleared again. Run it once, on a representative batch.

    Args:
        model: The model whose gradients are cleared afterwards.
        step: A function of no arguments running the forward and returning the loss.

    Returns:
        The FLOPs counted.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        loss = step()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


class ThroughputMonitor:
    """Samples/s, tokens/s, FLOP/s and MFU of the loop, on this rank and over all ranks.

    Args:
        engine: The Engine whose loggers, ranks and device it uses.
        window: How many of the latest updates the rates are measured over (at least 2).
        peak_flops: The device's peak FLOP/s for MFU (``None``: looked up for known devices and
            precisions).
    """

    def __init__(
        self, engine: Engine, *, window: int = 100, peak_flops: float | None = None
    ) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 2:
            raise ConfigurationError(
                f"ThroughputMonitor(window={window!r}): expected a whole number >= 2 (rates "
                f"need two updates). Pass e.g. window=20."
            )
        if peak_flops is not None and not peak_flops > 0:
            raise ConfigurationError(
                f"ThroughputMonitor(peak_flops={peak_flops!r}): expected the device's peak "
                f"FLOP/s, a positive number (e.g. 312e12 for an A100 in bf16)."
            )
        self.engine = engine
        self.peak_flops = peak_flops or device_peak_flops(engine.device, engine.precision)
        self._points: collections.deque[tuple[float, ...]] = collections.deque(maxlen=window)
        self._flops_total = 0.0

    def update(
        self,
        *,
        time: float,
        batches: int,
        samples: int,
        tokens: int | None = None,
        flops: float | None = None,
    ) -> None:
        """Record the totals so far on this rank: seconds since the start, batches, samples and
        tokens processed, and the FLOPs of the step just done (added up here).

        Args:
            time: Seconds since the start (growing with every update).
            batches: Batches processed so far.
            samples: Samples processed so far.
            tokens: Tokens processed so far, for ``tokens_per_s``.
            flops: The FLOPs of the step just done ([`measure_flops`][torchplug.measure_flops]), for
                ``flops_per_s`` and MFU.
        """
        if self._points and time <= self._points[-1][0]:
            raise ConfigurationError(
                f"ThroughputMonitor.update(time={time!r}): time must grow with every update "
                f"(the last was {self._points[-1][0]!r}); pass the seconds since the start."
            )
        self._flops_total += flops or 0.0
        self._points.append((time, batches, samples, tokens or 0, self._flops_total))

    @property
    def totals(self) -> dict[str, float]:
        """The last update's totals on this rank: ``time``, ``batches``, ``samples``,
        ``tokens`` and ``flops`` (added up); empty before the first update."""
        if not self._points:
            return {}
        names = ("time", "batches", "samples", "tokens", "flops")
        return dict(zip(names, self._points[-1], strict=True))

    def compute(self, all_ranks: bool = True) -> dict[str, float]:
        """The rates over the window: ``batches_per_s``, ``samples_per_s``, ``tokens_per_s``,
        ``flops_per_s`` and ``mfu`` on this rank, and ``global/…`` summed over every rank.
        Empty until two updates.

        Args:
            all_ranks: Also the ``global/…`` sums, a collective: call it on every rank then.
                ``False``: this rank's rates only, no collective.
        """
        if len(self._points) < 2:
            return {}
        (t0, *first), (t1, *last) = self._points[0], self._points[-1]
        seconds = t1 - t0
        names = ("batches_per_s", "samples_per_s", "tokens_per_s", "flops_per_s")
        rates = {n: (b - a) / seconds for n, a, b in zip(names, first, last, strict=True)}
        if not self._points[-1][3]:
            rates.pop("tokens_per_s")
        if not self._flops_total:
            rates.pop("flops_per_s")
        if not all_ranks:
            if self.peak_flops and "flops_per_s" in rates:
                rates["mfu"] = rates["flops_per_s"] / self.peak_flops
            return rates
        together = self.engine.reduce(
            torch.tensor(list(rates.values()), dtype=torch.float64, device=self.engine.device),
            "sum",
        ).tolist()
        result = dict(rates)
        result.update({f"global/{n}": v for n, v in zip(rates, together, strict=True)})
        if self.peak_flops and "flops_per_s" in rates:
            result["mfu"] = rates["flops_per_s"] / self.peak_flops
            result["global/mfu"] = result["global/flops_per_s"] / (
                self.peak_flops * self.engine.world_size
            )
        return result

    def compute_and_log(self, step: int | None = None) -> dict[str, Any]:
        """[`compute`][torchplug.ThroughputMonitor.compute], logged under ``throughput/…`` through
        the Engine's loggers.

        Args:
            step: The step to log at (``None``: the step after the last one logged).
        """
        result = self.compute()
        if result:
            self.engine.log({f"throughput/{k}": v for k, v in result.items()}, step=step)
        return result
