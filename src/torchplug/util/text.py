"""How torchplug words what it tells people: the closest name to a misspelling, a message's first
line, the check behind a numeric option. Stdlib only, so every layer can use it."""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any


def first_line(message: object, limit: int = 300, rest: str = "the traceback has it") -> str:
    """A message's first line for a one-line summary. When more follows (later lines, or a line
    over ``limit`` characters, cut at a space or ``/,;:`` in its second half, else at the limit)
    it ends ``... (cut: <rest>)``, so a reader knows there is more and where."""
    lines = [line for line in str(message).strip().splitlines() if line.strip()] or [""]
    line = lines[0].rstrip()
    if len(line) <= limit and len(lines) == 1:
        return line
    if len(line) > limit:
        cut = line[:limit]
        at = max(cut.rfind(mark) for mark in " /,;:")
        line = cut[: at + 1] if at >= limit // 2 else cut
    return f"{line.rstrip(' ,;:')} ... (cut: {rest})"


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest candidate, or an empty string.

    Args:
        word: What the user wrote.
        candidates: The names that exist.
    """
    close = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.5)
    if not close:
        return ""
    # fewest edits first, then a name of the same length (a mistyped letter is the commonest
    # slip: 'dpp' is 'ddp' before 'pp'), then difflib's own order
    best = min(close, key=lambda c: (_edits(word, c), len(c) != len(word), close.index(c)))
    return f" Did you mean '{best}'?"


def some_of(names: Iterable[str], limit: int = 5) -> str:
    """The first ``limit`` names joined by commas, and ``...`` when there are more: how an error
    lists the parameters or modules it is about without a wall of text.

    Args:
        names: The names to list, in the order to show them (one string is one name).
        limit: How many to show, 1 or more.
    """
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"some_of(names, limit={limit!r}): expected a limit of 1 or more names.")
    shown = [names] if isinstance(names, str) else list(names)
    return ", ".join(shown[:limit]) + (", ..." if len(shown) > limit else "")


def _edits(a: str, b: str) -> int:
    """Levenshtein distance: insertions, deletions and substitutions turning ``a`` into ``b``."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (x != y))
    return row[-1]


def positive_number(unit: str, maximum: float) -> Callable[[Any], str | None]:
    """A validator for an `Option`: a finite number above 0 and at most ``maximum`` (in
    ``unit``).

    Args:
        unit: The unit the message names (``"seconds"``, ``"MiB"``).
        maximum: The largest value accepted.
    """

    def check(value: Any) -> str | None:
        if value is None:
            return None
        if not math.isfinite(value) or not 0 < value <= maximum:
            return f"must be a number of {unit} above 0 and at most {maximum:g}, got {value!r}"
        return None

    return check


def qualified_name(plugin: object) -> str:
    """``module:qualname`` of a plugin: a module's name, a class's (or an instance's class's)
    module and qualified name; how errors and listings name a plugin that has no name."""
    if inspect.ismodule(plugin):
        return plugin.__name__
    cls = plugin if inspect.isclass(plugin) else type(plugin)
    return f"{cls.__module__}:{cls.__qualname__}"


def plugin_label(plugin: object, name: str | None = None) -> str:
    """How a plugin is named to users: its registration name (an entry point's name) when it
    has a real one, with the ``module:qualname`` it comes from."""
    qualified = qualified_name(plugin)
    if not name or name.isdigit() or name == qualified:
        return qualified
    return f"{name} ({qualified})"
