"""Deprecated: the modules of ``torchplug.core`` moved to `torchplug.util`, `torchplug.contract`,
`torchplug.features`, `torchplug.engine` and `torchplug.plugins` (docs/architecture.md).

``import torchplug.core.X`` keeps working through plugin API 1.x: it returns the module at its
new place, with a DeprecationWarning naming it. Plugin authors import `torchplug.plugin`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: Where each old module lives now.
MOVED = {
    "torchprivate": "torchplug.util.torchprivate",
    "nested": "torchplug.util.nested",
    "capabilities": "torchplug.util.capabilities",
    "version": "torchplug.util.version",
    "errors": "torchplug.contract.errors",
    "spec": "torchplug.contract.spec",
    "registry": "torchplug.contract.types",
    "cluster": "torchplug.plugins.torchrun",
    "context": "torchplug.contract.context",
    "hooks": "torchplug.contract.hooks",
    "dispatch": "torchplug.contract.dispatch",
    "manager": "torchplug.contract.manager",
    "discovery": "torchplug.contract.discovery",
    "validation": "torchplug.contract.validation",
    "apiversion": "torchplug.contract.apiversion",
    "installed": "torchplug.contract.registry",
    "hookdoc": "torchplug.cli.hookdoc",
    "data": "torchplug.features.data",
    "seeding": "torchplug.features.seeding",
    "metrics": "torchplug.features.metrics",
    "throughput": "torchplug.features.throughput",
    "profiling": "torchplug.features.profiling",
    "batchsize": "torchplug.features.batchsize",
    "syncbn": "torchplug.features.syncbn",
    "preemption": "torchplug.features.preemption",
    "faults": "torchplug.features.faults",
    "sharing": "torchplug.features.sharing",
    "memory": "torchplug.features.memory",
    "async_save": "torchplug.checkpoint.async_save",
    "engine": "torchplug.engine.engine",
    "connector": "torchplug.engine.connector",
    "config": "torchplug.engine.config",
    "checkpoint_settings": "torchplug.checkpoint.settings",
    "launcher": "torchplug.engine.launcher",
    "collectives": "torchplug.engine.collectives",
    "wrappers": "torchplug.engine.wrappers",
    "checkpointing": "torchplug.engine.checkpointing",
    "scaling": "torchplug.engine.scaling",
    "resume": "torchplug.engine.resume",
    "strategy": "torchplug.plugins.base",
    "defaults": "torchplug.plugins.torch_distributed",
}


def _moved(name: str) -> ModuleType:
    target = MOVED[name]
    warnings.warn(
        f"torchplug.core.{name} moved to {target}; the old name works through plugin API 1.x. "
        f"Plugin authors: import from torchplug.plugin instead.",
        DeprecationWarning,
        stacklevel=3,
    )
    return importlib.import_module(target)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import torchplug.core.X`` with the module X moved to."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _moved(spec.name.rpartition(".")[2])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was imported at its new place."""


def __getattr__(name: str) -> ModuleType:
    if name in MOVED:
        return _moved(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
