"""`Record`: the value equality, hash and repr a dataclass writes for itself, written once.

Why: ``@dataclass`` compiles its ``__eq__``, ``__hash__`` and ``__repr__`` for every class at
import time (Python 3.11: one ``exec`` each, 0.1-0.3 ms). torchplug has some fifteen dataclasses
on the way to ``torchplug.Engine``, and import time is a benchmark row. A class declared
``@dataclass(eq=False, repr=False)`` on this base behaves as the plain ``@dataclass`` would:
equal when of the same class with equal compared fields, hashable by value when frozen (else
unhashable, as ``eq=True`` makes a mutable dataclass), ``Name(field=value, ...)`` as its repr.
"""

from __future__ import annotations

import dataclasses
import reprlib

#: Per class: (the fields compared, those hashed, those shown), read once.
_PLANS: dict[type, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}


def _plan(cls: type) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    plan = _PLANS.get(cls)
    if plan is None:
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        plan = _PLANS[cls] = (
            tuple(f.name for f in fields if f.compare),
            tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash)),
            tuple(f.name for f in fields if f.repr),
        )
    return plan


class Record:
    """Base of a dataclass declared with ``eq=False, repr=False``: dataclass semantics for
    ``==``, ``hash()`` and ``repr()`` without compiling them per class."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        names = _plan(self.__class__)[0]
        # (tuples, as the dataclass compares: identity first, then ==)
        return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)

    def __hash__(self) -> int:
        if not self.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"unhashable type: {type(self).__name__!r}")
        return hash(tuple(getattr(self, n) for n in _plan(self.__class__)[1]))

    @reprlib.recursive_repr()
    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in _plan(self.__class__)[2])
        return f"{self.__class__.__qualname__}({shown})"
