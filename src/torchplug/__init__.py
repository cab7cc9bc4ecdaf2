"""torchplug: one PyTorch training loop, any distributed backend, chosen by name.

``import torchplug`` is cheap: names are imported on first use, and no backend package is imported
until a strategy that needs it is selected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchplug import _lazy
from torchplug.util.version import VERSION as __version__

_EXPORTS = {
    "Engine": "torchplug.engine.engine",
    "RNGState": "torchplug.engine.resume",
    "seed_everything": "torchplug.features.seeding",
    "seed_worker": "torchplug.features.seeding",
    "find_executable_batch_size": "torchplug.features.batchsize",
    "LocalSGD": "torchplug.features.localsgd",
    "ThroughputMonitor": "torchplug.features.throughput",
    "measure_flops": "torchplug.features.throughput",
    "Logger": "torchplug.loggers",
    "Trainer": "torchplug.trainer.loop",
    "accuracy": "torchplug.trainer.loop",
    "launch": "torchplug.engine.launcher",
    "RankFailedError": "torchplug.engine.launcher",
    "register": "torchplug.contract.manager",
    "unregister": "torchplug.contract.manager",
    "block": "torchplug.contract.manager",
    "options_of": "torchplug._deprecated",
    "TorchplugError": "torchplug.contract.errors",
    "ConfigurationError": "torchplug.contract.errors",
    "PluginError": "torchplug.contract.errors",
    "CheckpointError": "torchplug.contract.errors",
}

#: Author names: they belong to ``torchplug.plugin``. ``tp.NAME`` keeps working through plugin
#: API 1.x with a DeprecationWarning saying where to import it from, and is not in ``dir()``.
AUTHOR_NAMES = {
    "hookimpl": "torchplug.contract.spec",
    "API_VERSION": "torchplug.contract.spec",
    "StrategyInfo": "torchplug.contract.types",
    "PrecisionInfo": "torchplug.contract.types",
    "Option": "torchplug.contract.types",
    "LoggerInfo": "torchplug.contract.types",
    "ClusterInfo": "torchplug.contract.types",
    "Strategy": "torchplug.plugins.base",
    "DistributedStrategy": "torchplug.plugins.base",
    "DDPStrategy": "torchplug.plugins.ddp",
    "distributed_options": "torchplug.plugins.base",
    "Runtime": "torchplug.contract.types",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from torchplug._deprecated import options_of
    from torchplug.contract.errors import (
        CheckpointError,
        ConfigurationError,
        PluginError,
        TorchplugError,
    )
    from torchplug.contract.manager import block, register, unregister
    from torchplug.contract.spec import API_VERSION, hookimpl
    from torchplug.contract.types import (
        ClusterInfo,
        LoggerInfo,
        Option,
        PrecisionInfo,
        StrategyInfo,
    )
    from torchplug.engine.engine import Engine, Runtime
    from torchplug.engine.launcher import RankFailedError, launch
    from torchplug.engine.resume import RNGState
    from torchplug.features.batchsize import find_executable_batch_size
    from torchplug.features.localsgd import LocalSGD
    from torchplug.features.seeding import seed_everything, seed_worker
    from torchplug.features.throughput import ThroughputMonitor, measure_flops
    from torchplug.loggers import Logger
    from torchplug.plugins.base import DistributedStrategy, Strategy, distributed_options
    from torchplug.plugins.ddp import DDPStrategy
    from torchplug.trainer.loop import Trainer, accuracy


__getattr__, __dir__ = _lazy.exports(
    "torchplug",
    {**_EXPORTS, **AUTHOR_NAMES},
    globals(),
    moved=AUTHOR_NAMES,
    moved_to="torchplug.plugin",
)
