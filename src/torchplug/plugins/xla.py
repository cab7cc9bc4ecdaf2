"""``xla``: data parallel with torch_xla SPMD over every local XLA device (TPU, or any PJRT device).

One process per host: the batch each host loads is sharded over its devices along a ``data`` mesh
axis, parameters are replicated, and XLA's compiler inserts the gradient all-reduce — the path
torch_xla recommends for TPUs. Multi-host runs start one process per host through torch_xla's
runtime, so ``torchplug launch --strategy xla`` runs the script in its own process instead of
torchrun. ``pip install torchplug[xla]``; torch_xla is imported only when this strategy is chosen.

Precision is XLA's: bf16 runs the forward under ``torch.autocast("xla", torch.bfloat16)``
(``torch_xla.amp.autocast`` fails off TPU); fp16 is refused.

On a machine without accelerators, ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=2`` gives two virtual CPU
devices to test on.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchplug.plugin import (
    ClusterInfo,
    ConfigurationError,
    HookContext,
    Runtime,
    Strategy,
    StrategyInfo,
    hookimpl,
    map_tensors,
    rebind_optimizer,
    record_ties,
    restore_ties,
)

INSTALL = "pip install torchplug[xla]"


def recorded_build(torch_xla_dir: Path) -> tuple[str | None, str | None]:
    """torch_xla's own version and the torch git revision it was built from (its version.py)."""
    version_file = torch_xla_dir / "version.py"
    if not version_file.is_file():
        return None, None
    text = version_file.read_text()
    version = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", text)
    revision = re.search(r"__torch_gitrev__\s*=\s*['\"]([0-9a-f]+)['\"]", text)
    return (version.group(1) if version else None), (revision.group(1) if revision else None)


def version_mismatch(xla_version: str | None, torch_revision: str | None) -> str | None:
    """Why this torch cannot run this torch_xla, or None. Releases pair by major.minor (the
    recorded revision is the build's, which need not be the release tag's)."""
    if xla_version is None:
        return None
    pair = ".".join(xla_version.split(".")[:2])
    have = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if pair == have:
        return None
    return (
        f"torch_xla {xla_version} was built against torch {pair} (revision "
        f"{(torch_revision or '?')[:12]}) but torch {torch.__version__} is installed; install "
        f"torch=={pair}.* with it (pip install torch=={xla_version} torch_xla=={xla_version})"
    )


def _usable() -> str | None:
    """Why the xla strategy cannot run here, checked without importing torch_xla (a mismatched
    torch_xla can crash the interpreter on import)."""
    spec = importlib.util.find_spec("torch_xla")
    if spec is None or not spec.submodule_search_locations:
        return None  # StrategyInfo.requires reports the missing package
    mismatch = version_mismatch(*recorded_build(Path(next(iter(spec.submodule_search_locations)))))
    if mismatch:
        return mismatch
    device = os.environ.get("PJRT_DEVICE", "").upper()
    no_libtpu = importlib.util.find_spec("libtpu") is None and not os.environ.get(
        "TPU_LIBRARY_PATH"
    )
    if device == "TPU" and no_libtpu:
        return (
            "PJRT_DEVICE=TPU but libtpu is not installed (pip install torch_xla[tpu]); on a "
            "machine without TPUs use PJRT_DEVICE=CPU"
        )
    return None


def _to_cpu(value: Any) -> Any:
    return map_tensors(value, lambda t: t.detach().cpu())


class XLAStrategy(Strategy):
    @hookimpl
    def torchplug_compile(
        self, engine: HookContext, model: torch.nn.Module, options: dict[str, Any]
    ) -> torch.nn.Module:
        raise ConfigurationError(
            "Engine(compile=...) is not for XLA: XLA traces and compiles the step graph itself "
            "(lazy tensors). Drop compile=; torch_xla's own torch.compile(backend='openxla') "
            "can be applied to the model you pass to setup if you need it."
        )

    @hookimpl
    def torchplug_reads_in_place(self, engine: HookContext, kind: str) -> bool:
        # torch.distributed.checkpoint cannot write into XLA tensors: state goes through the CPU.
        return False

    def __init__(self) -> None:
        self.mesh: Any = None

    @hookimpl
    def torchplug_setup(self, engine: HookContext, cluster: ClusterInfo) -> Runtime:
        import numpy as np

        os.environ.setdefault("PJRT_DEVICE", "TPU" if importlib.util.find_spec("libtpu") else "CPU")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's per-compile C++ warnings
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        if xr.process_count() > 1:
            raise ConfigurationError(
                f"Strategy 'xla' runs on one host; this is host {xr.process_index()} of "
                f"{xr.process_count()}. Multi-host XLA is not supported yet: engine.reduce, "
                f"gather and checkpoints would see only this host's values. Run on one host (one "
                f"process, all its devices), or use a torch.distributed strategy."
            )
        xr.use_spmd()
        devices = xr.global_runtime_device_count()
        self.mesh = xs.Mesh(np.arange(devices), (devices, 1), ("data", "model"))
        xs.set_global_mesh(self.mesh)
        self.devices = devices
        return Runtime(
            rank=xr.process_index(),
            world_size=xr.process_count(),
            local_rank=0,
            device=torch_xla.device(),
            node_rank=xr.process_index(),
        )

    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        names = {id(p): name for name, p in model.named_parameters()}
        ties = record_ties(model)
        model = model.to(engine.device)
        restore_ties(ties)  # XLA tensors replace CPU ones slot by slot
        params = dict(model.named_parameters())
        for optimizer in optimizers:
            rebind_optimizer(optimizer, names, params, "moving the model to XLA replaces them")
        if engine.precision == "bf16":
            forward = model.forward

            @functools.wraps(forward)
            def bf16_forward(*args: Any, **kwargs: Any) -> Any:
                with torch.autocast("xla", dtype=torch.bfloat16):
                    out = forward(*args, **kwargs)
                return (
                    out.float()
                    if isinstance(out, torch.Tensor) and out.is_floating_point()
                    else out
                )

            engine.restore_on_close(model, "forward")
            model.forward = bf16_forward
        return model, optimizers

    @hookimpl
    def torchplug_place_batch(self, engine: HookContext, batch: Any) -> Any:
        """Move to the XLA device and shard along the batch dimension over the data axis."""
        import torch_xla.distributed.spmd as xs

        def place(value: torch.Tensor) -> torch.Tensor:
            value = value.to(engine.device)
            if value.dim() >= 1 and value.shape[0] % self.devices == 0:
                xs.mark_sharding(value, self.mesh, ("data",) + (None,) * (value.dim() - 1))
            return value

        return map_tensors(batch, place)

    @hookimpl
    def torchplug_optimizer_step(
        self,
        engine: HookContext,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None,
    ) -> bool:
        import torch_xla

        optimizer.step(closure) if closure is not None else optimizer.step()
        torch_xla.sync()  # cut the graph here: one compiled program per training step
        return True

    @hookimpl
    def torchplug_barrier(self, engine: HookContext) -> bool:
        import torch_xla.core.xla_model as xm

        if engine.world_size > 1:
            xm.rendezvous("torchplug.barrier")
        return True

    # checkpoints: through CPU copies, in the portable format
    @hookimpl
    def torchplug_model_state(self, engine: HookContext, model: torch.nn.Module) -> dict[str, Any]:
        return _to_cpu(model.state_dict())

    @hookimpl
    def torchplug_load_model_state(
        self, engine: HookContext, model: torch.nn.Module, state: dict[str, Any], strict: bool
    ) -> bool:
        model.load_state_dict(state, strict=strict)
        return True

    @hookimpl
    def torchplug_optimizer_state(
        self, engine: HookContext, model: torch.nn.Module, optimizer: Any
    ) -> Any:
        return _to_cpu(super().torchplug_optimizer_state(engine, model, optimizer))


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(
        StrategyInfo(
            name="xla",
            aliases=("tpu", "xla-spmd"),
            factory=XLAStrategy,
            description="torch_xla SPMD data parallel over all local XLA devices (TPU, PJRT).",
            requires=("torch_xla",),
            install_hint=INSTALL,
            precisions=("32", "bf16"),
            owns_precision=True,
            distributed=False,  # one process per host; SPMD spans the host's devices
            launcher="xla",
            supports_cuda=False,
            check=_usable,
            # XLA traces and compiles the step graph itself; moving a model to XLA replaces its
            # parameters, so a second Engine on the same (stepped) optimizer is refused
            refuses=("compile", "reuse"),
        )
    )
