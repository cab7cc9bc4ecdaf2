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
    "hookimpl": "torchplug.core.spec",
    "API_VERSION": "torchplug.core.spec",
    "Contract": "torchplug.core.spec",
    # what a plugin announces
    "StrategyInfo": "torchplug.core.registry",
    "PrecisionInfo": "torchplug.core.registry",
    "LoggerInfo": "torchplug.core.registry",
    "Option": "torchplug.core.registry",
    "ClusterInfo": "torchplug.core.cluster",
    # base classes with torch.distributed's default answers, and the options they take
    "Strategy": "torchplug.core.strategy",
    "DistributedStrategy": "torchplug.core.strategy",
    "distributed_options": "torchplug.core.strategy",
    "DDPStrategy": "torchplug.plugins.ddp",
    "Runtime": "torchplug.core.engine",
    # what every hook gets as its `engine` argument: what a backend may read and call
    "HookContext": "torchplug.core.context",
    "HookContextWarning": "torchplug.core.context",
    # the state protocol: tensors a save gathers one at a time (ZeRO-3-style backends)
    "Deferred": "torchplug.checkpoint.deferred",
    # registering in code, and the errors a hook raises
    "register": "torchplug.core.manager",
    "unregister": "torchplug.core.manager",
    "block": "torchplug.core.manager",
    "PluginError": "torchplug.core.errors",
    "ConfigurationError": "torchplug.core.errors",
    "CheckpointError": "torchplug.core.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from torchplug.checkpoint.deferred import Deferred
    from torchplug.core.cluster import ClusterInfo
    from torchplug.core.context import HookContext, HookContextWarning
    from torchplug.core.engine import Runtime
    from torchplug.core.errors import CheckpointError, ConfigurationError, PluginError
    from torchplug.core.manager import block, register, unregister
    from torchplug.core.registry import LoggerInfo, Option, PrecisionInfo, StrategyInfo
    from torchplug.core.spec import API_VERSION, Contract, hookimpl
    from torchplug.core.strategy import DistributedStrategy, Strategy, distributed_options
    from torchplug.plugins.ddp import DDPStrategy


__getattr__, __dir__ = _lazy.exports("torchplug.plugin", _EXPORTS, globals())
