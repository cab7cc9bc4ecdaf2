"""``amp``: bf16/fp16 autocast and fp16 loss scaling, for any backend not owning precision.

It composes through hook wrappers only: after the backend wraps the model, its forward runs under
``torch.autocast`` (outputs back in fp32); for fp16, an autograd hook on the loss scales the
gradients whatever the backend's backward does, and the optimizer step goes through
``torch.amp.GradScaler``, which skips a step whose gradients hold inf/NaN and lowers the scale.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Generator
from typing import Any

import torch

from torchplug.plugin import (
    ClusterInfo,
    ConfigurationError,
    HookContext,
    Option,
    PrecisionInfo,
    Runtime,
    cast_floating,
    cuda_lacks,
    found_inf,
    hookimpl,
    nothing_unscaled,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


_LOW = (torch.float16, torch.bfloat16)


def _to_fp32(value: Any) -> Any:
    """The model's outputs back in fp32. A lone tensor (most models' output) is cast by
    ``.float()`` directly: the generic walk and ``Tensor.to``'s overload parsing cost each
    forward ~9 µs more (``python -m benchmarks --only step``'s bf16 row)."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _LOW else value
    return cast_floating(value, torch.float32, only=_LOW)


class MixedPrecision:
    """The precision plugin object placed in an Engine's active set."""

    def __init__(
        self, precision: str, init_scale: float = 2.0**16, growth_interval: int = 2000
    ) -> None:
        self.precision = precision
        self.scaler_kwargs = {"init_scale": init_scale, "growth_interval": growth_interval}
        self.dtype = DTYPES[precision]
        self.device_type = "cpu"
        self.scaler: torch.amp.GradScaler | None = None
        self._stepped: set[int] = set()
        self._scaled = False  # an engine.backward has scaled a loss
        #: Optimizers unscaled for clipping since the scaler's last update, by id.
        self._unscaled: dict[int, torch.optim.Optimizer] = {}

    def context(self) -> contextlib.AbstractContextManager[None]:
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    @hookimpl(wrapper=True)
    def torchplug_setup(
        self, engine: HookContext, cluster: ClusterInfo
    ) -> Generator[None, Any, Any]:
        runtime: Runtime = yield
        self.device_type = runtime.device.type
        if (
            self.precision == "bf16"
            and self.device_type == "cuda"
            and not torch.cuda.is_bf16_supported()
        ):
            raise ConfigurationError(
                f"precision='bf16' needs a GPU with bfloat16 support; {runtime.device} has none. "
                f"Use precision='fp16', or run on a newer GPU."
            )
        if self.precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device_type, **self.scaler_kwargs)
        return runtime

    @hookimpl(wrapper=True)
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> Generator[None, Any, Any]:
        wrapped, optimizers = yield
        forward = wrapped.forward

        @functools.wraps(forward)
        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with self.context():
                return _to_fp32(forward(*args, **kwargs))

        engine.restore_on_close(wrapped, "forward")
        wrapped.forward = autocast_forward
        return wrapped, optimizers

    @hookimpl(tryfirst=True)
    def torchplug_autocast(self, engine: HookContext) -> contextlib.AbstractContextManager[None]:
        return self.context()


class ScaledMixedPrecision(MixedPrecision):
    """fp16: autocast plus GradScaler loss scaling, through wrappers of backward, the optimizer
    step and clipping.

    Only fp16 gets these wrappers: in bf16 they would do nothing but still cost a generator
    round trip in pluggy on every ``engine.backward`` and ``optimizer.step()`` (measured by
    ``python -m benchmarks --only dispatch``).
    """

    @hookimpl
    def torchplug_checkpoint_state(self, engine: HookContext) -> dict[str, Any]:
        """The GradScaler's loss scale and growth tracker travel with every checkpoint: a
        resumed fp16 run scales (and skips) exactly as the uninterrupted one."""
        return {"amp.grad_scaler": self.scaler} if self.scaler is not None else {}

    @hookimpl(wrapper=True)
    def torchplug_backward(
        self, engine: HookContext, loss: torch.Tensor, model: torch.nn.Module | None
    ) -> Generator[None, Any, Any]:
        if self.scaler is not None:
            self._update_scale()  # a step of some optimizers is still pending its update
            loss.register_hook(self.scaler.scale)
            self._scaled = True
        return (yield)

    def _update_scale(self) -> None:
        """End the scaler's round, as plain AMP's ``scaler.update()`` after each iteration: once
        every optimizer stepped, or at the next backward. An optimizer unscaled for clipping but
        not stepped (a script that skips the step when the norm is not finite) counts too: its
        inf lowers the scale, and the next round's gradients are unscaled afresh."""
        if self.scaler is None or not (self._stepped or self._unscaled):
            return
        pending = bool(self._stepped)
        for key, optimizer in self._unscaled.items():
            if key not in self._stepped:
                pending = not nothing_unscaled(self.scaler, optimizer) or pending
        if pending:
            self.scaler.update()
        self._stepped.clear()
        self._unscaled.clear()

    @hookimpl(wrapper=True)
    def torchplug_optimizer_step(
        self,
        engine: HookContext,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None,
    ) -> Generator[None, Any, Any]:
        """Wraps the backend's step: gradients are unscaled first, and a step with inf/NaN
        gradients still runs the backend's step (its syncs and flushes) but not the update."""
        if self.scaler is None:
            return (yield)
        if closure is not None:
            raise ConfigurationError(
                "optimizer.step(closure) is not supported with precision='fp16': gradient "
                "scaling needs the backward outside the step. Compute the loss and call "
                "engine.backward(loss) before optimizer.step(), or use precision='bf16'."
            )
        if not self._scaled:
            return (yield)  # no engine.backward yet: nothing was scaled, nothing to unscale
        try:  # noqa: SIM105 - a plain try: contextlib.suppress costs ~2 µs a step
            self.scaler.unscale_(optimizer)
        except RuntimeError:
            pass  # already unscaled for clipping this step
        if nothing_unscaled(self.scaler, optimizer):
            # No gradient (its parameters frozen, no backward reached them): the step updates
            # nothing, as in fp32, and the loss scale stays (GradScaler.update refuses a round
            # without one).
            return (yield)
        skipped = found_inf(self.scaler, optimizer)
        with engine.skipping_updates(optimizer, skipped):
            stepped = yield
        self._stepped.add(id(optimizer))
        # Update the scale once every optimizer of this engine has stepped; a partial set is
        # updated at the next backward, so all optimizers unscale with the same scale.
        optimizers = engine.optimizers
        if len(optimizers) == 1 or self._stepped >= {id(o) for o in optimizers}:
            self._update_scale()
        return not skipped and stepped is not False

    @hookimpl(wrapper=True)
    def torchplug_clip_grad_norm(
        self,
        engine: HookContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> Generator[None, Any, Any]:
        if self.scaler is not None and self._scaled:
            for opt in [optimizer] if optimizer is not None else engine.optimizers:
                with contextlib.suppress(RuntimeError):  # already unscaled this step
                    self.scaler.unscale_(opt)
                self._unscaled[id(opt)] = opt
        return (yield)


def make(precision: str, **options: Any) -> MixedPrecision:
    """The precision plugin object for ``precision``: loss scaling only where fp16 needs it."""
    return (ScaledMixedPrecision if precision == "fp16" else MixedPrecision)(precision, **options)


def precision_check(precision: str) -> str | None:
    """Why autocast cannot run ``precision`` here, or ``None``. CPU autocast runs bf16 and fp16
    on every CPU (torch falls back to its reference kernels without oneDNN's); a GPU needs
    bfloat16 support for bf16."""
    if precision == "bf16" and torch.cuda.is_available():
        return cuda_lacks("bf16")
    return None


@hookimpl
def torchplug_register_precisions(register: Callable[[PrecisionInfo], None]) -> None:
    register(
        PrecisionInfo(
            name="amp",
            factory=make,
            precisions=("bf16", "fp16"),
            check=precision_check,
            description="torch.autocast; fp16 adds GradScaler loss scaling with skipped inf steps.",
            options=(
                Option("init_scale", float, 2.0**16, "fp16: the GradScaler's first loss scale"),
                Option("growth_interval", int, 2000, "fp16: clean steps before the scale doubles"),
            ),
        )
    )
