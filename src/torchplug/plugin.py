"""torchplug for plugin authors: everything a backend, precision, logger or cluster plugin is
written with, in one place (``torchplug`` itself is the users' face: Engine, Trainer, launch).

    from torchplug.plugin import DistributedStrategy, StrategyInfo, hookimpl

    class MyDDP(DistributedStrategy):
        @hookimpl
        def torchplug_wrap(self, engine, model, optimizers): ...

Built-in backends are written with this face alone, exactly as a third party's are: besides
the hook marker, the records, the base classes and the errors, it holds what a backend needs
(timeouts, ports, capability probes, device moves, mesh sharding, memory-rule helpers, and the
calls a backend with its own checkpoint files makes), each documented in the API reference.

Names are imported on first use, as in ``torchplug`` itself: a plugin module that imports this
at its top stays cheap to import when ``torchplug plugins`` announces it (no torch until a name
that needs it is used). The author names among them used through ``torchplug`` (``tp.hookimpl``,
``tp.StrategyInfo``, ...) keep working through plugin API 1.x, with a DeprecationWarning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchplug import _lazy

_EXPORTS = {
    # the hook marker and the API this torchplug implements
    "hookimpl": "torchplug.contract.spec",
    "API_VERSION": "torchplug.contract.spec",
    "Contract": "torchplug.contract.spec",
    # what a plugin announces
    "StrategyInfo": "torchplug.contract.types",
    "PrecisionInfo": "torchplug.contract.types",
    "LoggerInfo": "torchplug.contract.types",
    "Option": "torchplug.contract.types",
    "ClusterInfo": "torchplug.contract.types",
    "Runtime": "torchplug.contract.types",
    # base classes with torch.distributed's default answers, and the options they take
    "Strategy": "torchplug.plugins.base",
    "DistributedStrategy": "torchplug.plugins.base",
    "distributed_options": "torchplug.plugins.base",
    "DDPStrategy": "torchplug.plugins.ddp",
    # what every hook gets as its `engine` argument: what a backend may read and call
    "HookContext": "torchplug.contract.context",
    "HookContextWarning": "torchplug._deprecated",
    # the state protocol: tensors a save gathers one at a time (ZeRO-3-style backends)
    "Deferred": "torchplug.checkpoint.deferred",
    # registering in code, and the errors a hook raises
    "register": "torchplug.contract.manager",
    "unregister": "torchplug.contract.manager",
    "block": "torchplug.contract.manager",
    "PluginError": "torchplug.contract.errors",
    "ConfigurationError": "torchplug.contract.errors",
    "CheckpointError": "torchplug.contract.errors",
    "did_you_mean": "torchplug.util.text",
    "some_of": "torchplug.util.text",
    # options: validators and the collective timeout every process-group backend defaults to
    "positive_number": "torchplug.util.text",
    "DEFAULT_TIMEOUT": "torchplug.contract.types",
    # cluster environments: ports and the scheduler's variables
    "free_port": "torchplug.plugins.torchrun",
    "job_port": "torchplug.plugins.torchrun",
    "master_port": "torchplug.plugins.torchrun",
    "env_int": "torchplug.plugins.torchrun",
    "inside_torchrun": "torchplug.plugins.torchrun",
    # what this machine can run (a strategy's precision_check)
    "cuda_lacks": "torchplug.util.capabilities",
    "cpu_kernels_missing": "torchplug.util.capabilities",
    "gpu_check": "torchplug.util.capabilities",
    "found_inf": "torchplug.util.torchprivate",
    "nothing_unscaled": "torchplug.util.torchprivate",
    "ddp_reduction_finished": "torchplug.util.torchprivate",
    "norm_base": "torchplug.util.torchprivate",
    # moving a model, its optimizer and batches
    "default_device": "torchplug.plugins.base",
    "move_to_device": "torchplug.features.data",
    "map_tensors": "torchplug.util.nested",
    "cast_floating": "torchplug.util.nested",
    "rebind_optimizer": "torchplug.engine.wrappers",
    "record_ties": "torchplug.engine.scaling",
    "restore_ties": "torchplug.engine.scaling",
    # sharding on a device mesh (FSDP2, tensor parallel and their combinations)
    "job_mesh": "torchplug.plugins.sharding",
    "with_mesh": "torchplug.plugins.sharding",
    "fully_shard_kwargs": "torchplug.plugins.sharding",
    "shard": "torchplug.plugins.sharding",
    "refuse_sharded_twice": "torchplug.plugins.sharding",
    "UnusedParameters": "torchplug.plugins.sharding",
    "finish_wrap": "torchplug.plugins.sharding",
    "compile_units": "torchplug.plugins.sharding",
    "without_gradient_sync": "torchplug.plugins.sharding",
    "clip_largest": "torchplug.plugins.sharding",
    "shard_units": "torchplug.plugins.sharding",
    "shard_norms_in_fp32": "torchplug.plugins.sharding",
    "make_contiguous": "torchplug.plugins.sharding",
    "NORM_TYPES": "torchplug.plugins.sharding",
    "plan_matches": "torchplug.plugins.sharding",
    "plan_split": "torchplug.plugins.sharding",
    # memory rules (StrategyInfo(memory=...)): what a rule is asked and answers
    "MemoryQuery": "torchplug.features.memory",
    "MemoryEstimate": "torchplug.features.memory",
    "ParamSpec": "torchplug.features.memory",
    "NotEstimable": "torchplug.features.memory",
    "not_estimable": "torchplug.features.memory",
    "replicated": "torchplug.features.memory",
    "even_sharding": "torchplug.features.memory",
    "ceil_div": "torchplug.features.memory",
    "model_tp_plan": "torchplug.features.memory",
    "state_bytes": "torchplug.features.memory",
    # a backend's own checkpoint files inside the portable checkpoint (DeepSpeed's)
    "portable_save": "torchplug.checkpoint.native",
    "portable_load": "torchplug.checkpoint.native",
    "portable_manifest": "torchplug.checkpoint.native",
    "native_part": "torchplug.checkpoint.native",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # (the built-in plugins' own modules are left out: they import this face)
    from torchplug._deprecated import HookContextWarning
    from torchplug.checkpoint.deferred import Deferred
    from torchplug.checkpoint.native import (
        native_part,
        portable_load,
        portable_manifest,
        portable_save,
    )
    from torchplug.contract.context import HookContext
    from torchplug.contract.errors import (
        CheckpointError,
        ConfigurationError,
        PluginError,
    )
    from torchplug.contract.manager import block, register, unregister
    from torchplug.contract.spec import API_VERSION, Contract, hookimpl
    from torchplug.contract.types import (
        DEFAULT_TIMEOUT,
        ClusterInfo,
        LoggerInfo,
        Option,
        PrecisionInfo,
        Runtime,
        StrategyInfo,
    )
    from torchplug.engine.scaling import record_ties, restore_ties
    from torchplug.engine.wrappers import rebind_optimizer
    from torchplug.features.data import move_to_device
    from torchplug.features.memory import (
        MemoryEstimate,
        MemoryQuery,
        NotEstimable,
        ParamSpec,
        ceil_div,
        even_sharding,
        model_tp_plan,
        not_estimable,
        replicated,
        state_bytes,
    )
    from torchplug.util.capabilities import cpu_kernels_missing, cuda_lacks, gpu_check
    from torchplug.util.nested import cast_floating, map_tensors
    from torchplug.util.text import did_you_mean, positive_number, some_of
    from torchplug.util.torchprivate import (
        ddp_reduction_finished,
        found_inf,
        norm_base,
        nothing_unscaled,
    )


__getattr__, __dir__ = _lazy.exports("torchplug.plugin", _EXPORTS, globals())
