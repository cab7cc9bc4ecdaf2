"""The plugin API version: which plugins this torchplug can load, and what to tell the others.

A plugin declares the versions of the plugin API it supports as a specifier string, e.g.
``">=1.0,<2"``, in its module (``TORCHPLUG_API``) or in its ``StrategyInfo(api=...)``. This module
reads such specifiers with the standard library only (the core imports no ``packaging``):
comma-separated clauses of ``>=``, ``>``, ``<=``, ``<``, ``==`` (``==1.*`` too) and ``!=`` on
``MAJOR[.MINOR]`` numbers.
"""

from __future__ import annotations

import re
from operator import eq, ge, gt, le, lt, ne

from torchplug.contract.errors import PluginError
from torchplug.contract.spec import API_VERSION

#: Module attribute (or class attribute) where a plugin declares the API range it supports.
ATTRIBUTE = "TORCHPLUG_API"

#: Which torchplug release first provided each plugin API version (for "upgrade to ..." hints).
API_RELEASES: dict[str, str] = dict.fromkeys(("1.0", "1.1", "1.2", "1.3", "1.4", "1.5"), "0.1.0")

_OPERATORS = {">=": ge, ">": gt, "<=": le, "<": lt, "==": eq, "!=": ne}
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)?\s*(\d+)(?:\.(\d+|\*))?\s*$")


def _version(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def parse(specifier: str) -> list[tuple[str, tuple[int, int], bool]]:
    """``">=1.0,<2"`` -> ``[(">=", (1, 0), False), ("<", (2, 0), False)]`` (the flag: ``1.*``).

    Raises a PluginError naming the expected form when a clause cannot be read.
    """
    clauses = []
    for part in str(specifier).split(","):
        if not part.strip():
            continue
        match = _CLAUSE.match(part)
        if match is None:
            raise PluginError(
                f"Plugin API specifier {specifier!r} cannot be read at {part.strip()!r}; expected "
                f"comma-separated clauses like '>=1.0,<2' (operators >=, >, <=, <, ==, !=; "
                f"versions MAJOR or MAJOR.MINOR, '==1.*' for any 1.x)."
            )
        op, major, minor = match.group(1) or "==", int(match.group(2)), match.group(3)
        wildcard = minor == "*"
        clauses.append((op, (major, 0 if wildcard or minor is None else int(minor)), wildcard))
    return clauses


def satisfies(version: str, specifier: str) -> bool:
    """Whether API ``version`` (``"1.0"``) lies within ``specifier``."""
    have = _version(version)
    for op, want, wildcard in parse(specifier):
        ok = (have[0] == want[0]) == (op == "==") if wildcard else _OPERATORS[op](have, want)
        if not ok:
            return False
    return True


def incompatibility(specifier: str | None, what: str) -> str | None:
    """Why ``what`` (a plugin or strategy) declaring ``specifier`` cannot load here, or None.

    The message names the API this torchplug provides and the torchplug release to install.
    """
    if specifier is None or not str(specifier).strip():
        return None
    if satisfies(API_VERSION, specifier):
        return None
    from torchplug.util.version import VERSION as __version__

    fitting = [r for api, r in API_RELEASES.items() if satisfies(api, specifier)]
    if fitting:
        need = f"install torchplug {fitting[0]}, which provides a fitting API"
    elif all(op in ("<", "<=") for op, _, _ in parse(specifier)):
        need = "it needs an older torchplug than any release with a plugin API"
    else:
        need = (
            "it needs a newer torchplug than this one: upgrade torchplug "
            "(pip install -U torchplug), or install a release of the plugin made for "
            f"API {API_VERSION}"
        )
    return (
        f"{what} supports torchplug plugin API {specifier!r}, but torchplug {__version__} "
        f"provides API {API_VERSION}; {need}."
    )
