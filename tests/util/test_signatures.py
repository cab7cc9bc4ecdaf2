"""The hook check's fast readers (`torchplug.util.signatures`) against ``inspect``: they must
read every function and object exactly as ``inspect.signature`` and ``inspect.getattr_static``
do, or a plugin's wrong argument would slip past the check (or a right one be refused)."""

from __future__ import annotations

import functools
import inspect
import sys

import pytest
import torch

import torchplug.plugins.ddp
import torchplug.plugins.torch_distributed
from torchplug.plugin import Strategy
from torchplug.util.signatures import required_args, static_namespace


def by_inspect(function, drop_first):
    params = list(inspect.signature(function).parameters.values())
    if drop_first and params:
        params = params[1:]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and (p.kind in kinds or p.kind is inspect.Parameter.KEYWORD_ONLY)
    ]


def every_shape(a, /, b, c=1, *args, d, e=2, **kwargs): ...


def no_arguments(): ...


def only_varargs(*args, **kwargs): ...


def self_with_default(self=None, x=1, *, y): ...


def only_keywords(*, engine, model=None): ...


@functools.wraps(every_shape)
def wrapped(*args, **kwargs): ...


class Callable:
    def __call__(self, engine, loss): ...


SHAPES = [
    every_shape,
    no_arguments,
    only_varargs,
    self_with_default,
    only_keywords,
    wrapped,
    Callable(),
    len,
    torch.nn.Linear.forward,
    functools.partial(every_shape, 1),
]


@pytest.mark.parametrize("drop_first", [False, True])
# ids by hand: a repr holds an address, which differs between pytest-xdist's workers
@pytest.mark.parametrize("function", SHAPES, ids=[f"shape{i}" for i in range(len(SHAPES))])
def test_required_args_reads_what_inspect_reads(function, drop_first):
    try:
        expected = by_inspect(function, drop_first)
    except (TypeError, ValueError):
        expected = []
    assert required_args(function, drop_first) == expected


def test_required_args_reads_every_hook_of_every_loaded_module_as_inspect_does():
    checked = 0
    for module in [
        torchplug.plugins.ddp,
        torchplug.plugins.torch_distributed,
        sys.modules[__name__],
    ]:
        for value in vars(module).values():
            functions = [value]
            if inspect.isclass(value):
                functions = [v for v in vars(value).values() if inspect.isfunction(v)]
            for function in filter(inspect.isfunction, functions):
                for drop_first in (False, True):
                    assert required_args(function, drop_first) == by_inspect(function, drop_first)
                    checked += 1
    assert checked > 50


class Base(Strategy):
    def torchplug_backward(self, engine, loss, model): ...

    @staticmethod
    def torchplug_reduce(engine, tensor, op): ...


class Child(Base):
    @property
    def size(self):
        raise AssertionError("read statically: never called")

    @classmethod
    def torchplug_setup_process(cls, engine): ...


@pytest.mark.parametrize("plugin", [Child, Child(), torchplug.plugins.ddp, Base()])
def test_static_namespace_reads_every_name_as_getattr_static_does(plugin):
    namespace = static_namespace(plugin)
    for name in dir(plugin):
        if name.startswith("__"):
            continue  # the type's own slots (a module's __annotations__): never a hook
        try:
            expected = inspect.getattr_static(plugin, name)
        except AttributeError:
            continue
        if name in namespace:
            assert namespace[name] is expected, name
    assert {"torchplug_backward", "torchplug_reduce"} <= set(namespace) or inspect.ismodule(plugin)


def test_an_object_s_own_attribute_shadows_its_class_s():
    plugin = Child()
    plugin.torchplug_backward = lambda engine, loss, model: True
    assert static_namespace(plugin)["torchplug_backward"] is vars(plugin)["torchplug_backward"]
    assert (
        inspect.getattr_static(plugin, "torchplug_backward") is vars(plugin)["torchplug_backward"]
    )


def test_a_function_with_its_own_signature_is_read_as_inspect_reads_it():
    def takes_anything(*args, **kwargs): ...

    takes_anything.__signature__ = inspect.signature(every_shape)
    assert (
        required_args(takes_anything, False)
        == by_inspect(takes_anything, False)
        == [
            "a",
            "b",
            "d",
        ]
    )
