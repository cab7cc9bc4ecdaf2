"""DeepSpeed ZeRO stages 1/2/3 (``pip install torchplug[deepspeed]``); deepspeed is imported only
when one of these strategies is selected.

* Precision is DeepSpeed's own (``bf16`` / ``fp16`` sections of its config), never the AMP plugin.
* The user's torch optimizer is passed through, so nothing is compiled; ops that need compiling
  (CPU offload's DeepSpeedCPUAdam) are announced before DeepSpeed builds them. DeepSpeed's CPU
  shared-memory all-reduce op, which it would otherwise JIT-compile with g++ on every first
  start (minutes on 2 cores, a failure without a compiler), is switched off.
* The process group is torchplug's; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK are
  set from the cluster environment, so DeepSpeed never falls back to MPI discovery.
* Checkpoints hold DeepSpeed's native checkpoint (exact resume on the same stage and world size)
  and, consolidated with DeepSpeed's zero_to_fp32, the model in the portable format, so any
  strategy can load the model.

Why this module is over 500 lines: it is one backend plugin, as DESIGN.md asks (one module each),
and DeepSpeed needs more than the others: its own precision, optimizer step, state hooks for ZeRO
partitions, native checkpoints and their conversion; the ZeRO layout itself is already apart in
``deepspeed_state.py``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import math
import os
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchplug.plugin import (
    DEFAULT_TIMEOUT,
    CheckpointError,
    ClusterInfo,
    ConfigurationError,
    DistributedStrategy,
    HookContext,
    Option,
    Runtime,
    StrategyInfo,
    cast_floating,
    cpu_kernels_missing,
    cuda_lacks,
    hookimpl,
    native_part,
    norm_base,
    portable_load,
    portable_manifest,
    portable_save,
)
from torchplug.plugins.deepspeed import memory
from torchplug.plugins.deepspeed.usage import ModulesUsed

INSTALL = "pip install torchplug[deepspeed]"
OFFLOAD = ("none", "cpu", "nvme")
NATIVE = "deepspeed"  # the native checkpoint's directory inside a torchplug checkpoint
TAG = "torchplug"
#: Optimizers DeepSpeed's ZeRO accepts without zero_allow_untested_optimizer.
_ZERO_TESTED = ("Adam", "AdamW", "DeepSpeedCPUAdam", "FusedAdam", "FusedLamb", "Lamb")
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _quiet_deepspeed() -> None:
    """Silence DeepSpeed's per-import and per-step chatter that asks nothing of the user."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"deepspeed(\.|$)")
    # DeepSpeed calls torch.distributed functions torch has deprecated, warning on every step.
    warnings.filterwarnings(
        "ignore", category=FutureWarning, module=r"torch\.distributed\.c10d_logger"
    )


def _import_deepspeed() -> Any:
    _quiet_deepspeed()
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # The CPU shared-memory all-reduce is an optimisation DeepSpeed JIT-compiles on first start.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _cast_forward(ds_engine: Any, dtype: torch.dtype) -> None:
    """DeepSpeed holds bf16/fp16 weights but leaves inputs as they come: cast floating inputs
    to the weights' dtype and floating outputs back to fp32, as the AMP plugin and FSDP do."""
    forward = ds_engine.forward

    @functools.wraps(forward)
    def cast_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_floating((args, kwargs), dtype)
        return cast_floating(forward(*args, **kwargs), torch.float32)

    ds_engine.forward = cast_forward


def _norms_in_fp32(model: torch.nn.Module) -> list[torch.nn.Module]:
    """DeepSpeed casts parameters to bf16/fp16 but leaves buffers fp32, and torch's batch_norm
    cannot combine low-precision weights with fp32 running statistics (every BatchNorm model
    crashed). Each such layer computes in fp32 instead, as torch's AMP runs it: its weight and
    bias cast up (differentiably) while its own forward runs, its output cast back to its
    input's dtype; the statistics stay fp32, as in every other strategy's checkpoints. Undone at
    teardown (`_restore_norms`)."""
    patched = []
    for module in model.modules():
        if not isinstance(module, norm_base()):
            continue
        stats = getattr(module, "running_mean", None)
        weight = getattr(module, "weight", None)
        if stats is None or weight is None or weight.dtype == stats.dtype:
            continue
        module.forward = functools.partial(_fp32_norm_forward, module)
        patched.append(module)
    return patched


def _fp32_norm_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    slots = module._parameters  # noqa: SLF001
    held = {name: slots[name] for name in ("weight", "bias") if slots.get(name) is not None}
    try:
        for name, param in held.items():
            slots[name] = param.float()
        out = type(module).forward(module, x.float())
    finally:
        slots.update(held)
    return out.to(x.dtype)


def _restore_norms(modules: list[torch.nn.Module]) -> None:
    for module in modules:
        module.__dict__.pop("forward", None)


def _reset_deepspeed_state() -> None:
    """Forget DeepSpeed's module-level process groups, so a later Engine starts clean."""
    import deepspeed.comm.comm as comm
    import deepspeed.utils.groups as groups
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None:  # ZeRO-3's process-wide F.linear replacement
        torch.nn.functional.linear = original
    comm.cdb = None
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.isupper() and not isinstance(value, str):
            if isinstance(value, dict):
                value.clear()
            elif not callable(value):
                setattr(groups, name, None)


def _user_config(config: dict[str, Any] | str | None) -> tuple[dict[str, Any], str]:
    if config is None:
        return {}, ""
    if isinstance(config, dict):
        return json.loads(json.dumps(config)), "the config dict passed as config="
    path = Path(config)
    if not path.is_file():
        raise ConfigurationError(
            f"DeepSpeed config file {config} does not exist. Pass config= a dict or the path of "
            f"a JSON file."
        )
    try:
        return json.loads(path.read_text()), f"DeepSpeed config file {path}"
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"DeepSpeed config file {path} is not valid JSON: {exc}") from None


#: The models and optimizers a DeepSpeed engine took over in this process (by identity).
_TAKEN: weakref.WeakSet[Any] = weakref.WeakSet()


def _refuse_set_up_before(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """Refuse a model or optimizer an earlier DeepSpeed engine took over: ZeRO swaps the
    optimizer's param groups for its own partitions and ZeRO-3 partitions the parameters in
    place, so a second ``deepspeed.initialize`` failed deep inside with a ``KeyError`` or
    ``IndexError`` (found by the kit's ``reuse`` property). A model ZeRO-3 partitioned while it
    was built (``engine.init_module``) is not refused: only what a setup took over."""
    own = {id(p) for p in model.parameters()}
    foreign = [
        i
        for optimizer in optimizers
        for i, group in enumerate(optimizer.param_groups)
        if any(id(p) not in own for p in group["params"])
    ]
    taken = [type(obj).__name__ for obj in (model, *optimizers) if obj in _TAKEN]
    if taken or foreign:
        what = (
            f"the {' and the '.join(taken)} given were set up by an earlier Engine's DeepSpeed"
            if taken
            else f"the optimizer's param group(s) {foreign} hold tensors that are not the "
            f"model's parameters (another model's, or DeepSpeed's flat partitions)"
        )
        raise ConfigurationError(
            f"DeepSpeed cannot set up this model and optimizer: {what}. DeepSpeed takes over "
            f"what it is given, for good. Build the model and the optimizer anew for this "
            f"Engine (load a checkpoint the earlier one saved into them to carry its training "
            f"on)."
        )


class DeepSpeedStrategy(DistributedStrategy):
    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: str = "none",
        offload_params: str = "none",
        nvme_path: str | None = None,
        config: dict[str, Any] | str | None = None,
        process_group_backend: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        native_checkpoint: bool = False,
        _named: bool = False,
    ) -> None:
        super().__init__(process_group_backend, timeout)
        self.stage = stage
        self.offload_optimizer = offload_optimizer
        self.offload_params = offload_params
        self.nvme_path = nvme_path
        self.config_arg = config
        self.stage_fixed_by_name = _named
        self.native_checkpoint = native_checkpoint
        self.ds_engine: Any = None
        self.optimizers: list[Any] = []

    # -- setup ------------------------------------------------------------------------------------

    @hookimpl
    def torchplug_setup(self, engine: HookContext, cluster: ClusterInfo) -> Runtime:
        deepspeed = _import_deepspeed()
        if engine.precision == "fp16":
            from deepspeed.accelerator import get_accelerator

            if torch.float16 not in get_accelerator().supported_dtypes():
                raise ConfigurationError(
                    f"DeepSpeed does not support fp16 on this device "
                    f"({get_accelerator().device_name()}: 'Type fp16 is not supported on your "
                    f"device'). Use precision='bf16' or precision=None here, or fp16 on a GPU."
                )
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise ConfigurationError(
                "offload to 'nvme' needs nvme_path='/path/on/a/fast/disk'. Pass it, or offload "
                "to 'cpu'."
            )
        self.config, self.config_source = self._config(engine)  # conflicts: before any work
        runtime = super().torchplug_setup(engine, cluster)
        self.saved_env = {k: os.environ.get(k) for k in _DIST_ENV}
        for key, value in {
            "RANK": runtime.rank,
            "WORLD_SIZE": runtime.world_size,
            "LOCAL_RANK": runtime.local_rank,
            "MASTER_ADDR": cluster.master_addr,
            "MASTER_PORT": cluster.master_port or 29500,
        }.items():
            os.environ[key] = str(value)
        deepspeed.init_distributed(
            dist_backend=torch.distributed.get_backend(),
            auto_mpi_discovery=False,
            verbose=False,
        )
        return runtime

    def _config(self, engine: HookContext) -> tuple[dict[str, Any], str]:
        user, source = _user_config(self.config_arg)
        config = dict(user)
        config.setdefault("train_micro_batch_size_per_gpu", 1)  # batches are the user's own
        config.setdefault("gradient_accumulation_steps", 1)
        config.setdefault("steps_per_print", 2**31 - 1)
        config.setdefault("wall_clock_breakdown", False)
        # DeepSpeed clips at 1.0 unless told otherwise; a plain training loop does not clip, and
        # switching backends must not change the math. Set it in your config to clip.
        config.setdefault("gradient_clipping", 0.0)

        def agree(what: str, ours: Any, ours_from: str, theirs: Any) -> None:
            if theirs is not None and theirs != ours:
                raise ConfigurationError(
                    f"Conflicting {what}: {ours!r} from {ours_from}, but {theirs!r} in {source}. "
                    f"Set it in one place only: remove it from the DeepSpeed config, or change "
                    f"the torchplug setting to match."
                )

        precision_from = engine.settings.precision.source
        scaling = {k: v for k, v in engine.precision_options.items() if v is not None}
        if engine.precision == "fp16":
            # GradScaler's behaviour, as the AMP plugin gives every other backend: start at
            # init_scale, halve on every overflow, double after growth_interval clean steps.
            # Explicit precision_options must agree with your DeepSpeed config; the defaults
            # yield to it.
            fp16 = user.get("fp16") if isinstance(user.get("fp16"), dict) else {}
            init_scale = scaling.get("init_scale", 2.0**16)
            power = math.log2(init_scale) if init_scale > 0 else 0.5
            if power != int(power):
                raise ConfigurationError(
                    f"precision_options init_scale={init_scale} is not a power of two, which "
                    f"DeepSpeed needs (initial_scale_power). Use e.g. 65536.0."
                )
            wanted = {
                "initial_scale_power": (int(power), "init_scale" in scaling),
                "loss_scale_window": (
                    scaling.get("growth_interval", 2000),
                    "growth_interval" in scaling,
                ),
                "hysteresis": (1, False),
            }
            for key, (value, explicit_value) in wanted.items():
                if explicit_value:
                    agree(f"fp16.{key}", value, "precision_options", fp16.get(key))
                config.setdefault("fp16", {}).setdefault(key, value)
        for name in ("bf16", "fp16"):
            enabled = (
                user.get(name, {}).get("enabled") if isinstance(user.get(name), dict) else None
            )
            agree(
                f"{name}.enabled",
                engine.precision == name,
                f"precision ({precision_from})",
                enabled,
            )
            config.setdefault(name, {})["enabled"] = engine.precision == name
        zero = config.setdefault("zero_optimization", {})
        explicit = self.stage_fixed_by_name or "stage" in engine.settings.options
        stage_from = "the strategy name" if self.stage_fixed_by_name else "the strategy option"
        if explicit:
            agree(
                "ZeRO stage", self.stage, stage_from, user.get("zero_optimization", {}).get("stage")
            )
        zero.setdefault("stage", self.stage)
        # ZeRO-3 would otherwise replace torch.nn.functional.linear for the whole process.
        zero.setdefault("memory_efficient_linear", False)
        for part, device in (("optimizer", self.offload_optimizer), ("param", self.offload_params)):
            if device != "none":
                zero[f"offload_{part}"] = {"device": device, "nvme_path": self.nvme_path}
        # The user's torch optimizer is what steps, offloaded or not (DeepSpeed would otherwise
        # insist on its compiled DeepSpeedCPUAdam for offload, and refuse untested optimizers
        # such as SGD under ZeRO); set these keys in your DeepSpeed config to get its defaults.
        config.setdefault("zero_force_ds_cpu_optimizer", False)
        config.setdefault("zero_allow_untested_optimizer", True)
        if "optimizer" in config and config.get("zero_optimization", {}).get("offload_optimizer"):
            warnings.warn(
                "Your DeepSpeed config builds its own optimizer with CPU/NVMe offload: DeepSpeed "
                "compiles DeepSpeedCPUAdam with g++ on first use (minutes on few cores; needs a "
                "compiler). Pass a torch optimizer to engine.setup instead to avoid it.",
                stacklevel=2,
            )
        return config, source or "defaults"

    # -- wrapping and steps -----------------------------------------------------------------------

    @hookimpl
    def torchplug_wrap(
        self, engine: HookContext, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        deepspeed = _import_deepspeed()
        if len(optimizers) > 1:
            raise ConfigurationError(
                f"DeepSpeed drives one optimizer per model; got {len(optimizers)}. Combine the "
                f"parameter groups into one optimizer."
            )
        if self.ds_engine is not None:
            raise ConfigurationError(
                "This deepspeed Engine already set up a model; create one torchplug Engine per "
                "model with DeepSpeed."
            )
        _refuse_set_up_before(model, optimizers)
        if optimizers and "train_mode" in optimizers[0].param_groups[0]:
            raise ConfigurationError(
                f"DeepSpeed cannot drive a schedule-free optimizer "
                f"({type(optimizers[0]).__name__}): its train()/eval() switch would change "
                f"DeepSpeed's flat partitions, not the weights the model computes with, so "
                f"evaluations would silently use the training weights. Use it with ddp, fsdp or "
                f"tp, or a regular optimizer (AdamW) under DeepSpeed."
            )
        untested = optimizers and type(optimizers[0]).__name__ not in _ZERO_TESTED
        if untested and self.config["zero_optimization"]["stage"] > 0:
            if self.config.get("zero_allow_untested_optimizer"):
                warnings.warn(
                    f"DeepSpeed has not tested ZeRO with {type(optimizers[0]).__name__}; "
                    f"torchplug lets it run (as Lightning Fabric does). Set "
                    f'"zero_allow_untested_optimizer": false in the DeepSpeed config to refuse.',
                    stacklevel=4,
                )
            else:
                raise ConfigurationError(
                    f"DeepSpeed ZeRO refuses the untested optimizer "
                    f"{type(optimizers[0]).__name__} because your DeepSpeed config sets "
                    f'"zero_allow_untested_optimizer": false. Remove that key, or use Adam/AdamW.'
                )
        # Parameter names by group, taken before DeepSpeed flattens the groups: the portable
        # optimizer state is keyed by them.
        self.params = dict(model.named_parameters())
        by_id = {id(p): name for name, p in self.params.items()}
        self.group_names = [
            [by_id[id(p)] for p in group["params"] if id(p) in by_id]
            for group in (optimizers[0].param_groups if optimizers else [])
        ]
        ds_engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizers[0] if optimizers else None,
            config=self.config,
            dist_init_required=False,
        )
        _TAKEN.update([model, *optimizers])
        # removed at teardown; under ZeRO-3 its hooks run ahead of DeepSpeed's gathers
        zero3 = self.config["zero_optimization"]["stage"] == 3
        self.modules_used = ModulesUsed(model, engine, lockstep=zero3)
        self.ds_engine = ds_engine
        if engine.precision in ("bf16", "fp16"):
            self.fp32_norms = _norms_in_fp32(model)
            _cast_forward(
                ds_engine, torch.bfloat16 if engine.precision == "bf16" else torch.float16
            )
        # The user's own optimizer is returned (DeepSpeed steps it inside its wrapper): it is a
        # torch Optimizer, so LR schedulers made before or after setup drive the real one.
        self.optimizers = [*optimizers, ds_optimizer]
        return ds_engine, list(optimizers)

    @hookimpl
    def torchplug_backward(
        self, engine: HookContext, loss: torch.Tensor, model: torch.nn.Module | None
    ) -> bool:
        ds_engine = self._engine_for("backward")
        if getattr(self, "modules_used", None) is not None:
            self.modules_used.check(engine)  # ranks that used different parameters: refused
        ds_engine.backward(loss)
        return True

    @hookimpl
    def torchplug_optimizer_step(
        self,
        engine: HookContext,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None,
    ) -> bool:
        ds_engine = self._engine_for("optimizer.step()")
        skipped = getattr(ds_engine, "skipped_steps", 0)
        try:
            ds_engine.step()
        finally:  # a clip_grad_norm_ call clips one step, as in a plain loop
            ds_optimizer = self.optimizers[-1]
            if hasattr(ds_optimizer, "clip_grad"):
                ds_optimizer.clip_grad = float(self.config.get("gradient_clipping") or 0.0)
        return getattr(ds_engine, "skipped_steps", 0) == skipped

    @hookimpl
    def torchplug_init_module(self, engine: HookContext) -> Any:
        """ZeRO-3 builds the model partitioned (``deepspeed.zero.Init``): each module is
        initialised in full, as an eager build does, then only this rank's partition is kept."""
        if self.config["zero_optimization"]["stage"] != 3:
            return None
        deepspeed = _import_deepspeed()
        return deepspeed.zero.Init(config_dict_or_path=self.config, remote_device=None)

    @hookimpl
    def torchplug_load_pretrained(
        self, engine: HookContext, model: torch.nn.Module, path: Any, strict: bool
    ) -> dict[str, list[str]] | None:
        """ZeRO-3's partitioned parameters are not read into: refused before anything is read
        (other stages hold whole parameters: the built-in answer reads them)."""
        partitioned = [n for n, p in model.named_parameters() if hasattr(p, "ds_id")]
        if partitioned:
            raise CheckpointError(
                f"The model's {partitioned[0]!r} is a DeepSpeed ZeRO-partitioned parameter, "
                f"which load_pretrained does not read into. Load the weights before setup "
                f"(e.g. from_pretrained, or load_pretrained under init_module() without "
                f"empty=True), or use a strategy whose parameters are DTensors (fsdp, tp)."
            )
        return None

    @hookimpl
    def torchplug_broadcast(
        self, engine: HookContext, tensor: torch.Tensor, src: int
    ) -> torch.Tensor | None:
        """A parameter ``zero.Init`` has partitioned (``ds_id``) is DeepSpeed's already: left as
        it is (the buffers beside it, which it does not partition, are broadcast as usual)."""
        return tensor if hasattr(tensor, "ds_id") else None

    @hookimpl
    def torchplug_compile(
        self, engine: HookContext, model: torch.nn.Module, options: dict[str, Any]
    ) -> torch.nn.Module:
        raise ConfigurationError(
            "Engine(compile=...) is not supported with DeepSpeed: its engine hooks ZeRO into the "
            "module's parameters in ways torch.compile does not trace. Drop compile=, or use "
            "'fsdp' (which compiles each unit)."
        )

    @hookimpl
    def torchplug_no_sync(self, engine: HookContext, model: torch.nn.Module) -> Any:
        if engine.accumulating is None:
            raise ConfigurationError(
                "engine.no_sync() is not available with DeepSpeed (ZeRO partitions gradients as "
                "they are reduced). Use engine.accumulate(model, steps) (it works on every "
                "strategy), or set gradient_accumulation_steps in the DeepSpeed config."
            )
        return self._not_a_boundary()

    @contextlib.contextmanager
    def _not_a_boundary(self) -> Any:
        """An accumulation micro-step under engine.accumulate: DeepSpeed keeps the gradients
        (ZeRO reduces them into its partitions as usual) and does not step."""
        ds_engine = self._engine_for("engine.accumulate()")
        ds_engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            ds_engine.set_gradient_accumulation_boundary(True)

    @hookimpl
    def torchplug_checkpoint_state(self, engine: HookContext) -> dict[str, Any]:
        """fp16: DeepSpeed's dynamic loss scale (scale, iterations since the last overflow,
        hysteresis) travels with every checkpoint, so a resumed run scales and skips as the
        uninterrupted one (ZeRO's own checkpoint keeps it; the portable one did not)."""
        scaler = getattr(self.optimizers[-1], "loss_scaler", None) if self.optimizers else None
        if engine.precision != "fp16" or scaler is None:
            return {}
        return {"deepspeed.loss_scaler": _LossScaleState(scaler)}

    @hookimpl
    def torchplug_clip_grad_norm(
        self,
        engine: HookContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        norm_type: float,
    ) -> torch.Tensor:
        """``clip_grad_norm_`` as in a plain loop: the global pre-clip norm now, and the next
        step clips to ``max_norm``. ZeRO holds the reduced gradients in its partitions (no
        ``p.grad`` to scale), so the clip itself is DeepSpeed's own, inside its step, with the
        same coefficient as torch's (``max_norm / (norm + 1e-6)`` when below 1)."""
        ds_engine = self._engine_for("engine.clip_grad_norm_()")
        configured = float(self.config.get("gradient_clipping") or 0.0)
        if configured > 0 and configured != float(max_norm):
            raise ConfigurationError(
                f"Conflicting gradient clipping: engine.clip_grad_norm_(max_norm={max_norm}) but "
                f'"gradient_clipping": {configured} in {self.config_source}. Clip in one place '
                f"only: remove gradient_clipping from the DeepSpeed config, or pass "
                f"max_norm={configured}."
            )
        if float(norm_type) != 2.0:
            raise ConfigurationError(
                f"DeepSpeed clips by the L2 norm only; engine.clip_grad_norm_ got "
                f"norm_type={norm_type}. Use norm_type=2 (the default) with DeepSpeed."
            )
        ds_optimizer = self.optimizers[-1]
        if not hasattr(ds_optimizer, "clip_grad"):
            raise ConfigurationError(
                f"DeepSpeed's optimizer wrapper {type(ds_optimizer).__name__} has no gradient "
                f'clipping to set; set "gradient_clipping": {max_norm} in the DeepSpeed config.'
            )
        from deepspeed.utils import safe_get_full_grad

        squares = torch.zeros((), dtype=torch.float64)
        for param in ds_engine.module.parameters():
            if not param.requires_grad:
                continue
            grad = safe_get_full_grad(param)  # every rank takes part (ZeRO gathers)
            if grad is not None:
                squares += grad.detach().double().pow(2).sum().cpu()
        scale = float(getattr(ds_optimizer, "loss_scale", 1.0) or 1.0)
        norm = (squares.sqrt() / scale).float()
        ds_optimizer.clip_grad = float(max_norm)  # for the step that follows; reset after it
        return norm.to(engine.device)

    def _engine_for(self, what: str) -> Any:
        if self.ds_engine is None:
            raise ConfigurationError(
                f"{what} before engine.setup(model, optimizer): DeepSpeed needs the model set up."
            )
        return self.ds_engine

    @hookimpl
    def torchplug_teardown(self, engine: HookContext) -> None:
        self.ds_engine = None
        if getattr(self, "modules_used", None) is not None:
            self.modules_used.remove()
            self.modules_used = None
        _restore_norms(getattr(self, "fp32_norms", []))
        _reset_deepspeed_state()
        for key, value in getattr(self, "saved_env", {}).items():  # as they were before setup
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        super().torchplug_teardown(engine)

    # -- checkpoints ------------------------------------------------------------------------------

    def _ds_optimizer(self, optimizer: Any) -> Any:
        if not any(optimizer is o for o in self.optimizers):
            raise CheckpointError(
                "This optimizer was not set up with this DeepSpeed Engine; pass the optimizer "
                "engine.setup returned."
            )
        return self.optimizers[-1]

    @hookimpl
    def torchplug_reads_in_place(self, engine: HookContext, kind: str) -> bool:
        # DeepSpeed's partitions are flat slices, not tensors DCP can read into.
        return False

    @hookimpl
    def torchplug_model_state(self, engine: HookContext, model: torch.nn.Module) -> dict[str, Any]:
        """Full fp32 model state: DeepSpeed's master weights (ZeRO-3 gathers its partitions)."""
        from torchplug.plugins.deepspeed import state as deepspeed_state

        module = getattr(model, "module", model)
        return deepspeed_state.model_state(module, engine.precision in ("bf16", "fp16"))

    @hookimpl
    def torchplug_load_model_state(
        self, engine: HookContext, model: torch.nn.Module, state: dict[str, Any], strict: bool
    ) -> bool:
        from torchplug.plugins.deepspeed import state as deepspeed_state

        deepspeed_state.load_model_state(getattr(model, "module", model), state, strict)
        return True

    @hookimpl
    def torchplug_optimizer_state(
        self, engine: HookContext, model: torch.nn.Module, optimizer: Any
    ) -> dict[str, Any]:
        """The torch optimizer's state by parameter name, gathered from ZeRO's partitions."""
        from torchplug.plugins.deepspeed import state as deepspeed_state

        return deepspeed_state.optimizer_state(
            self._ds_optimizer(optimizer), self.optimizers[0], self.group_names, self.params
        )

    @hookimpl
    def torchplug_load_optimizer_state(
        self, engine: HookContext, model: torch.nn.Module, optimizer: Any, state: dict[str, Any]
    ) -> bool:
        from torchplug.plugins.deepspeed import state as deepspeed_state

        deepspeed_state.load_optimizer_state(
            self._ds_optimizer(optimizer), self.optimizers[0], self.group_names, self.params, state
        )
        return True

    @hookimpl
    def torchplug_save(
        self, engine: HookContext, path: str, state: dict[str, Any], metadata: dict[str, Any]
    ) -> bool:
        ds_engine = self._engine_for("engine.save")
        if not self.native_checkpoint:
            portable_save(engine, path, state, metadata)
            return True
        header = {
            "deepspeed": {
                "dir": NATIVE,
                "tag": TAG,
                "stage": self.config["zero_optimization"]["stage"],
            }
        }
        portable_save(
            engine,
            path,
            state,
            metadata,
            native=lambda tmp: ds_engine.save_checkpoint(str(tmp / NATIVE), tag=TAG),
            header=header,
        )
        return True

    @hookimpl
    def torchplug_load(
        self, engine: HookContext, path: str, state: dict[str, Any] | None, strict: bool
    ) -> dict[str, Any]:
        """The portable entries, from any strategy and world size; with native_checkpoint=True
        and a native part of the same stage and world size, DeepSpeed's own resume instead."""
        ds_engine = self._engine_for("engine.load")
        if not self.native_checkpoint or state is None:
            return portable_load(engine, path, state, strict)
        root, manifest = portable_manifest(engine, path)
        native = manifest.get("deepspeed")
        stage = self.config["zero_optimization"]["stage"]
        valid = (
            isinstance(native, dict)
            and native.get("dir") == NATIVE
            and isinstance(native.get("tag"), str)
            and native.get("stage") == stage
            and manifest["world_size"] == engine.world_size
        )
        if not valid:  # another strategy, stage or world size: the portable part
            return portable_load(engine, path, state, strict)
        native_dir = native_part(root, manifest, native["dir"])
        ds_engine.load_checkpoint(
            str(native_dir),
            tag=native["tag"],
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        restored = [key for key, obj in state.items() if obj is ds_engine]
        restored += [key for key, obj in state.items() if any(obj is o for o in self.optimizers)]
        return portable_load(engine, path, state, strict, skip=lambda key, _: key in restored)


def _named(stage: int, **preset: Any) -> Callable[..., DeepSpeedStrategy]:
    @functools.wraps(DeepSpeedStrategy)
    def factory(**options: Any) -> DeepSpeedStrategy:
        return DeepSpeedStrategy(stage=stage, _named=True, **preset, **options)

    return factory


def _options(with_stage: bool, with_offload: bool = True) -> tuple[Option, ...]:
    options = [*DistributedStrategy.strategy_options()]
    if with_stage:
        options.append(Option("stage", int, 2, "ZeRO stage", choices=(1, 2, 3)))
    if with_offload:
        options += [
            Option(
                "offload_optimizer", str, "none", "optimizer state to cpu/nvme", choices=OFFLOAD
            ),
            Option(
                "offload_params", str, "none", "parameters to cpu/nvme (stage 3)", choices=OFFLOAD
            ),
        ]
    options += [
        Option("nvme_path", (str, type(None)), None, "directory for nvme offload"),
        Option("config", (dict, str, type(None)), None, "DeepSpeed config: a dict or JSON path"),
        Option(
            "native_checkpoint",
            bool,
            False,
            "also write DeepSpeed's own checkpoint (same-topology resume unpickles it)",
        ),
    ]
    return tuple(options)


class _LossScaleState:
    """DeepSpeed's loss scaler as a stateful object (plain numbers, equal on every rank)."""

    FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return {f: _plain(getattr(self.scaler, f)) for f in self.FIELDS if hasattr(self.scaler, f)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field, value in state.items():
            if field in self.FIELDS:
                setattr(self.scaler, field, value)


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def precision_check(precision: str) -> str | None:
    """Why DeepSpeed cannot run ``precision`` on this machine, or ``None``: its accelerator's
    rule (``get_accelerator().supported_dtypes()``), answered without importing deepspeed. Its
    CUDA accelerator needs compute capability 7 for fp16 and a bf16 GPU for bf16; its CPU
    accelerator runs bf16 everywhere and fp16 only with the CPU's oneDNN fp16 kernels.
    tests/plugins/deepspeed/test_deepspeed.py checks this answer against DeepSpeed's own on the
    machine."""
    chosen = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if chosen not in ("", "cpu", "cuda"):
        _import_deepspeed()  # another accelerator: only DeepSpeed knows its rule
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        if dtype in accelerator.supported_dtypes():
            return None
        return f"DeepSpeed's {accelerator.device_name()} accelerator does not list {dtype}"
    if chosen != "cpu" and torch.cuda.is_available():
        if precision == "fp16":
            major, minor = torch.cuda.get_device_capability()
            deprecated_ok = os.environ.get("DS_ALLOW_DEPRECATED_FP16") == "1" and major == 6
            if major < 7 and not deprecated_ok:
                return (
                    f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}; "
                    f"DeepSpeed's fp16 needs 7.0 (DS_ALLOW_DEPRECATED_FP16=1 admits 6.x)"
                )
        return cuda_lacks(precision)
    if precision == "fp16":
        missing = cpu_kernels_missing("fp16")
        if missing is not None:
            return f"{missing}, which DeepSpeed's CPU accelerator needs for fp16"
    return None


@hookimpl
def torchplug_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    common: dict[str, Any] = {
        "precision_check": precision_check,
        "precision_options": (
            Option("init_scale", (float, type(None)), None, "fp16: the first loss scale (2**k)"),
            Option("growth_interval", (int, type(None)), None, "fp16: clean steps before doubling"),
        ),
        "requires": ("deepspeed",),
        "install_hint": INSTALL,
        "owns_precision": True,
        "precisions": ("32", "bf16", "fp16"),
        "shards_optimizer": True,
        # DeepSpeed compiles through its own config; micro-batches are marked by
        # engine.accumulate (its gradient-accumulation boundary), not by a bare no_sync; a
        # model and optimizer it took over cannot be handed on (_refuse_set_up_before); ranks
        # that use different parameters are refused before the backward, under ZeRO-3 before
        # the module's gather in the forward (usage.py).
        "refuses": ("compile", "no_sync", "clip_norm_type", "reuse", "rank_dependent"),
    }
    register(
        StrategyInfo(
            name="deepspeed",
            factory=DeepSpeedStrategy,
            options=_options(True),
            description="DeepSpeed ZeRO (stage option 1/2/3, offload, your DeepSpeed config).",
            memory=memory.deepspeed_memory,
            **common,
        )
    )
    for stage in (1, 2, 3):
        register(
            StrategyInfo(
                name=f"deepspeed-zero{stage}",
                factory=_named(stage),
                options=_options(False),
                description=f"DeepSpeed ZeRO stage {stage}.",
                shards_parameters=stage == 3,
                memory=memory.zero(stage),
                **common,
            )
        )
    register(
        StrategyInfo(
            name="deepspeed-zero3-offload",
            factory=_named(3, offload_optimizer="cpu", offload_params="cpu"),
            options=_options(False, with_offload=False),
            description="DeepSpeed ZeRO stage 3, optimizer and parameters offloaded to the CPU.",
            memory=memory.zero(3, offload_optimizer="cpu", offload_params="cpu"),
            shards_parameters=True,
            **common,
        )
    )


def _quietly(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(...)`` with its prints to stdout swallowed: zero_to_fp32 prints "Processing
    zero checkpoint", "Reconstructed fp32 state dict with N params" and more on every save,
    output the user did not ask for (its errors still raise)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return function(*args, **kwargs)


def _native_tag(source: Path) -> tuple[Path, str] | None:
    """``(checkpoint directory, tag)`` of a native DeepSpeed checkpoint: the directory that
    ``engine.save_checkpoint(dir)`` wrote (with its ``latest`` file), or one tag inside it."""
    if (source / "latest").is_file():
        tag = (source / "latest").read_text().strip()
        return source, tag
    if any(source.glob("*model_states.pt")) and any(source.glob("*optim_states.pt")):
        return source.parent, source.name
    return None


@hookimpl
def torchplug_read_checkpoint(source: Path, optimizer: bool) -> dict[str, Any] | None:
    """A native DeepSpeed checkpoint (any ZeRO stage and world size) as portable state: the fp32
    model by DeepSpeed's zero_to_fp32, the optimizer state by its universal-checkpoint
    conversion (ds_to_universal), both DeepSpeed's own readers."""
    found = _native_tag(source)
    if found is None:
        return None
    _quiet_deepspeed()
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ModuleNotFoundError:
        raise CheckpointError(
            f"{source} is a native DeepSpeed checkpoint; reading it needs deepspeed: {INSTALL}."
        ) from None
    root, tag = found
    if not (root / tag).is_dir():
        raise CheckpointError(
            f"{root}/latest names tag {tag!r}, but {root / tag} does not exist. Pass the tag "
            f"directory you want to convert instead."
        )
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        model = _quietly(get_fp32_state_dict_from_zero_checkpoint, str(root), tag=tag)
    model = {k: v.float() if v.is_floating_point() else v for k, v in model.items()}
    result: dict[str, Any] = {"model": model, "optimizer": None, "step": None}
    shapes, steps, stage = _native_header(root / tag)
    result["format"] = f"DeepSpeed ZeRO-{stage} checkpoint"
    result["step"] = steps
    if optimizer:
        result["optimizer"] = _universal_optimizer(root / tag, model, shapes)
    return result


def _native_header(tag_dir: Path) -> tuple[list[list[str]], int | None, int]:
    """Parameter names per group, global step and ZeRO stage, from rank 0's model states file
    (a pickle of DeepSpeed's: the user chose to convert this checkpoint)."""
    files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise CheckpointError(f"{tag_dir} holds no DeepSpeed model states file; is it complete?")
    header = torch.load(files[0], map_location="cpu", weights_only=False)
    groups = [list(group) for group in header.get("param_shapes", [])]
    step = header.get("global_steps")
    optim = sorted(tag_dir.glob("*optim_states.pt"))
    stage = 3 if any("zero_pp_rank" in f.name for f in files) else 2
    if optim:
        state = torch.load(optim[0], map_location="cpu", weights_only=False)
        with contextlib.suppress(AttributeError, KeyError, TypeError, ValueError):
            stage = int(state["optimizer_state_dict"]["zero_stage"])
    return groups, step if isinstance(step, int) else None, stage


def _universal_optimizer(
    tag_dir: Path, model: dict[str, torch.Tensor], groups: list[list[str]]
) -> dict[str, Any]:
    """The optimizer state by parameter name, through DeepSpeed's ds_to_universal."""
    import argparse
    import shutil
    import tempfile

    from deepspeed.checkpoint import ds_to_universal

    work = Path(tempfile.mkdtemp(prefix="torchplug-universal-"))
    try:
        args = argparse.Namespace(
            input_folder=str(tag_dir),
            output_folder=str(work / "universal"),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,  # plain DeepSpeed runs do not record it
        )
        with contextlib.redirect_stderr(io.StringIO()):
            _quietly(ds_to_universal.main, args)
        zero = work / "universal" / "zero"
        common = torch.load(zero / "optimizer_state.pt", map_location="cpu", weights_only=False)
        saved_groups = common.get("param_groups") or []
        if len(saved_groups) != len(groups):
            raise CheckpointError(
                f"{tag_dir}: {len(saved_groups)} optimizer parameter groups but "
                f"{len(groups)} groups of parameter names; cannot tell which is which."
            )
        steps = [
            v.get("step")
            for v in (common.get("optimizer_state_dict") or {}).get("state", {}).values()
        ]
        state: dict[str, dict[str, Any]] = {}
        for names in groups:
            for name in names:
                folder = zero / name
                if not folder.is_dir():
                    continue
                entry: dict[str, Any] = {}
                for file in sorted(folder.glob("*.pt")):
                    value = torch.load(file, map_location="cpu", weights_only=False)
                    if isinstance(value, dict):
                        value = value.get("param")
                    if file.stem == "fp32" or value is None:
                        continue
                    if file.stem == "step":
                        entry["step"] = torch.as_tensor(value, dtype=torch.float32).clone()
                    else:
                        entry[file.stem] = value.reshape(model[name].shape).float().clone()
                if "step" not in entry and steps and steps[0] is not None:
                    entry["step"] = torch.as_tensor(steps[0], dtype=torch.float32).clone()
                state[name] = entry
        param_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
            for g, names in zip(saved_groups, groups, strict=True)
        ]
        return {"state": state, "param_groups": param_groups}
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"DeepSpeed's universal-checkpoint conversion of {tag_dir} failed "
            f"({type(exc).__name__}: {exc}). Convert the model alone: torchplug convert SRC DST "
            f"(model.safetensors)."
        ) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
