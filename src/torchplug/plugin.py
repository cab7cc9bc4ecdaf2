"""torchplug for plugin authors: everything a backend, precision, logger or cluster plugin is
written with, in one place (``torchplug`` itself is the users' face: Engine, Trainer, launch).

    from torchplug.plugin import DistributedStrategy, StrategyInfo, hookimpl

    class MyDDP(DistributedStrategy):
        @hookimpl
        def torchplug_wrap(self, engine, model, optimizers): ...

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
    # base classes with torch.distributed's default answers, and the options they take
    "Strategy": "torchplug.plugins.base",
    "DistributedStrategy": "torchplug.plugins.base",
    "distributed_options": "torchplug.plugins.base",
    "DDPStrategy": "torchplug.plugins.ddp",
    "Runtime": "torchplug.contract.types",
    # what every hook gets as its `engine` argument: what a backend may read and call
    "HookContext": "torchplug.contract.context",
    "HookContextWarning": "torchplug.contract.context",
    # the state protocol: tensors a save gathers one at a time (ZeRO-3-style backends)
    "Deferred": "torchplug.checkpoint.deferred",
    # registering in code, and the errors a hook raises
    "register": "torchplug.contract.manager",
    "unregister": "torchplug.contract.manager",
    "block": "torchplug.contract.manager",
    "PluginError": "torchplug.contract.errors",
    "ConfigurationError": "torchplug.contract.errors",
    "CheckpointError": "torchplug.contract.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from torchplug.checkpoint.deferred import Deferred
    from torchplug.contract.cluster import ClusterInfo
    from torchplug.contract.context import HookContext, HookContextWarning
    from torchplug.contract.errors import CheckpointError, ConfigurationError, PluginError
    from torchplug.contract.manager import block, register, unregister
    from torchplug.contract.spec import API_VERSION, Contract, hookimpl
    from torchplug.contract.types import LoggerInfo, Option, PrecisionInfo, StrategyInfo
    from torchplug.engine.engine import Runtime
    from torchplug.plugins.base import DistributedStrategy, Strategy, distributed_options
    from torchplug.plugins.ddp import DDPStrategy


__getattr__, __dir__ = _lazy.exports("torchplug.plugin", _EXPORTS, globals())
