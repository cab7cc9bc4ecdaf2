"""Plugin objects for the registry tests."""

from __future__ import annotations

import torchplug.plugin as tpp
from torchplug.plugins.single import SingleDevice


def provider(**info) -> object:
    """A plugin object announcing one strategy (the single-device backend under another name)."""

    class Provider:
        @tpp.hookimpl
        def torchplug_register_strategies(self, register):
            register(tpp.StrategyInfo(factory=SingleDevice, description="test", **info))

    return Provider()
