"""Public functions kept through plugin API 1.x with a DeprecationWarning (torchplug's own code
calls what they wrap, never these)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchplug.contract.types import Option


def options_of(strategy: str) -> tuple[Option, ...]:
    """Deprecated since API 1.0: declare ``StrategyInfo(extends=strategy)`` instead, which
    inherits the parent's options (its own are added, or replace the parent's by name) and its
    capabilities; this keeps working through API 1.x with a ``DeprecationWarning``.

    The options a registered strategy declares.

    Args:
        strategy: A registered strategy's name or alias.

    Returns:
        Its options, in order.
    """
    warnings.warn(
        f"options_of({strategy!r}) is deprecated: declare StrategyInfo(extends={strategy!r}) to "
        f"inherit its options instead; options_of() keeps working through API 1.x",
        DeprecationWarning,
        stacklevel=2,
    )
    from torchplug.contract import manager
    from torchplug.contract.errors import PluginError, did_you_mean

    registry = manager.registry_in_use()  # a plugin announcing may ask for a parent's
    canonical = registry.canonical(strategy)
    if canonical is None:
        raise PluginError(
            f"options_of({strategy!r}): no strategy of that name is registered (yet)."
            f"{did_you_mean(strategy, sorted(registry.strategies))} Name an installed strategy; "
            f"torchplug's own strategies are always registered before third-party plugins."
        )
    return registry.strategies[canonical].options
