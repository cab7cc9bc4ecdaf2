"""Public functions kept through plugin API 1.x with a DeprecationWarning (torchplug's own code
calls what they wrap, never these)."""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any

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
    from torchplug.contract.errors import PluginError
    from torchplug.util.text import did_you_mean

    registry = manager.registry_in_use()  # a plugin announcing may ask for a parent's
    canonical = registry.canonical(strategy)
    if canonical is None:
        raise PluginError(
            f"options_of({strategy!r}): no strategy of that name is registered (yet)."
            f"{did_you_mean(strategy, sorted(registry.strategies))} Name an installed strategy; "
            f"torchplug's own strategies are always registered before third-party plugins."
        )
    return registry.strategies[canonical].options


class HookContextWarning(DeprecationWarning):
    """A hook read an Engine member that the
    [`HookContext`][torchplug.plugin.HookContext] does not offer."""


# Python hides DeprecationWarnings raised outside __main__, and a hook never runs in __main__:
# without this filter an author would not see it under torchplug launch or torchplug check.
# Only when the user chose no warning filter (-W, PYTHONWARNINGS): then theirs decides, so
# `-W error` makes it an error and `PYTHONWARNINGS=ignore::DeprecationWarning` hides it.
if not sys.warnoptions:
    warnings.filterwarnings("default", category=HookContextWarning)


class EngineFallThrough:
    """API 1.x: a name the `HookContext` does not offer reaches the Engine (held weakly, so the
    context keeps no Engine alive), with a `HookContextWarning` naming the member.

    Args:
        engine: The Engine whose context this is.
    """

    __slots__ = ("_engine",)

    def __init__(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)

    def _target(self, name: str) -> Any:
        engine = self._engine()
        if engine is None:
            raise AttributeError(f"'HookContext' object has no attribute {name!r}")
        return engine

    def get(self, name: str) -> Any:
        value = getattr(self._target(name), name)  # an unknown name raises AttributeError
        if not name.startswith("__"):
            warnings.warn(
                f"engine.{name} in a hook: the hook's `engine` argument is a "
                f"torchplug.plugin.HookContext, which does not offer '{name}' (it lists what a "
                f"backend may read and call). It reaches the Engine through API 1.x; use a "
                f"HookContext member, or keep what you need from the setup hook.",
                HookContextWarning,
                stacklevel=3,
            )
        return value

    def set(self, name: str, value: Any) -> None:
        warnings.warn(
            f"engine.{name} = ... in a hook: the hook's `engine` argument is a "
            f"torchplug.plugin.HookContext; keep your state on your plugin object instead. "
            f"It is set on the Engine through API 1.x.",
            HookContextWarning,
            stacklevel=3,
        )
        setattr(self._target(name), name, value)
