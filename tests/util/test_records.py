"""`Record` gives a dataclass declared ``eq=False, repr=False`` what ``@dataclass`` writes for
itself (equality, hash, repr): checked against plain dataclass twins, field options included."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from torchplug.contract.types import ClusterInfo, Option, StrategyInfo
from torchplug.util.records import Record


@dataclass(frozen=True)
class PlainFrozen:
    a: int
    b: list = field(default_factory=list, hash=False)
    c: str = field(default="x", compare=False)
    d: float = field(default=0.0, repr=False)


@dataclass(frozen=True, eq=False, repr=False)
class OursFrozen(Record):
    a: int
    b: list = field(default_factory=list, hash=False)
    c: str = field(default="x", compare=False)
    d: float = field(default=0.0, repr=False)


@dataclass
class PlainMutable:
    a: int
    nested: object = None


@dataclass(eq=False, repr=False)
class OursMutable(Record):
    a: int
    nested: object = None


def twins(args: tuple, kwargs: dict) -> tuple[object, object]:
    return PlainFrozen(*args, **kwargs), OursFrozen(*args, **kwargs)


@pytest.mark.parametrize(
    "left, right",
    [
        ((1,), (1,)),
        ((1,), (2,)),
        ((1, [1]), (1, [2])),
        ((1, [], "x"), (1, [], "y")),
        ((1,), (1, [], "x", 2.0)),
    ],
)
def test_equality_matches_the_dataclass(left, right):
    plain = PlainFrozen(*left) == PlainFrozen(*right)
    ours = OursFrozen(*left) == OursFrozen(*right)
    assert ours == plain


def test_hash_matches_the_dataclass_frozen_and_mutable():
    plain, ours = PlainFrozen(3, [1], "z", 1.5), OursFrozen(3, [1], "z", 1.5)
    assert hash(ours) == hash(plain)  # a and d: b is hash=False, c compare=False
    assert hash(OursFrozen(3, [9], "other", 1.5)) == hash(ours)  # b hash=False, c not compared
    with pytest.raises(TypeError, match="unhashable"):
        hash(PlainMutable(1))
    with pytest.raises(TypeError, match="unhashable type: 'OursMutable'"):
        hash(OursMutable(1))


def test_repr_matches_the_dataclass_recursion_included():
    plain, ours = PlainFrozen(1, [2], "q", 0.5), OursFrozen(1, [2], "q", 0.5)
    assert repr(ours) == repr(plain).replace("PlainFrozen", "OursFrozen")
    a, b = PlainMutable(1), OursMutable(1)
    a.nested, b.nested = a, b
    assert repr(b) == repr(a).replace("PlainMutable", "OursMutable")


def test_other_classes_and_subclasses_are_not_equal():
    assert OursFrozen(1) != PlainFrozen(1)
    assert OursFrozen(1).__eq__(PlainFrozen(1)) is NotImplemented


def test_the_public_records_keep_dataclass_behaviour():
    one = StrategyInfo(name="x", factory=object, description="d")
    assert one == StrategyInfo(name="x", factory=object, description="d")
    assert hash(one) == hash(StrategyInfo(name="x", factory=object, description="d"))
    assert one != dataclasses.replace(one, description="e")
    assert repr(Option("n", int, 1)).startswith("Option(name='n', type=<class 'int'>, default=1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.name = "y"  # type: ignore[misc]
    info = ClusterInfo(rank=0, world_size=1, local_rank=0, local_world_size=1)
    assert {info: 1}[ClusterInfo(rank=0, world_size=1, local_rank=0, local_world_size=1)] == 1
