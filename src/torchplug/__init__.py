"""torchplug: one PyTorch training loop, any distributed backend, chosen by name.

``import torchplug`` is cheap: names are imported on first use, and no backend package is imported
until a strategy that needs it is selected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchplug import _lazy
from torchplug.core.version import VERSION as __version__

_EXPORTS = {
    "Engine": "torchplug.core.engine",
    "seed_everything": "torchplug.core.seeding",
    "seed_worker": "torchplug.core.seeding",
    "find_executable_batch_size": "torchplug.core.batchsize",
    "ThroughputMonitor": "torchplug.core.throughput",
    "measure_flops": "torchplug.core.throughput",
    "Logger": "torchplug.loggers",
    "Trainer": "torchplug.trainer.loop",
    "accuracy": "torchplug.trainer.loop",
    "launch": "torchplug.core.launcher",
    "RankFailedError": "torchplug.core.launcher",
    "register": "torchplug.core.manager",
    "unregister": "torchplug.core.manager",
    "block": "torchplug.core.manager",
    "options_of": "torchplug._deprecated",
    "TorchplugError": "torchplug.core.errors",
    "ConfigurationError": "torchplug.core.errors",
    "PluginError": "torchplug.core.errors",
    "CheckpointError": "torchplug.core.errors",
}

#: Author names: they belong to ``torchplug.plugin``. ``tp.NAME`` keeps working through plugin
#: API 1.x with a DeprecationWarning saying where to import it from, and is not in ``dir()``.
AUTHOR_NAMES = {
    "hookimpl": "torchplug.core.spec",
    "API_VERSION": "torchplug.core.spec",
    "StrategyInfo": "torchplug.core.registry",
    "PrecisionInfo": "torchplug.core.registry",
    "Option": "torchplug.core.registry",
    "LoggerInfo": "torchplug.core.registry",
    "ClusterInfo": "torchplug.core.cluster",
    "Strategy": "torchplug.core.strategy",
    "DistributedStrategy": "torchplug.core.strategy",
    "DDPStrategy": "torchplug.plugins.ddp",
    "distributed_options": "torchplug.core.strategy",
    "Runtime": "torchplug.core.engine",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from torchplug._deprecated import options_of
    from torchplug.core.batchsize import find_executable_batch_size
    from torchplug.core.cluster import ClusterInfo
    from torchplug.core.engine import Engine, Runtime
    from torchplug.core.errors import (
        CheckpointError,
        ConfigurationError,
        PluginError,
        TorchplugError,
    )
    from torchplug.core.launcher import RankFailedError, launch
    from torchplug.core.manager import block, register, unregister
    from torchplug.core.registry import LoggerInfo, Option, PrecisionInfo, StrategyInfo
    from torchplug.core.seeding import seed_everything, seed_worker
    from torchplug.core.spec import API_VERSION, hookimpl
    from torchplug.core.strategy import DistributedStrategy, Strategy, distributed_options
    from torchplug.core.throughput import ThroughputMonitor, measure_flops
    from torchplug.loggers import Logger
    from torchplug.plugins.ddp import DDPStrategy
    from torchplug.trainer.loop import Trainer, accuracy


__getattr__, __dir__ = _lazy.exports(
    "torchplug",
    {**_EXPORTS, **AUTHOR_NAMES},
    globals(),
    moved=AUTHOR_NAMES,
    moved_to="torchplug.plugin",
)
