"""The plugin host: registration hooks through pluggy, duplicate precisions, tracing through
pluggy's monitoring, the registry lock, blocks that survive a reset, built-ins without entry
points."""

from __future__ import annotations

import threading
from importlib import metadata

import pytest

import torchplug as tp
import torchplug.plugin as tpp
from support.plugins import provider
from torchplug.contract import manager
from torchplug.contract.types import PrecisionInfo


def test_registration_hooks_are_called_through_the_plugin_manager():
    registry = manager.get_registry()
    seen: list[str] = []
    undo = registry.pm.add_hookcall_monitoring(
        lambda hook, impls, kwargs: seen.append(hook), lambda *a: None
    )
    try:
        tp.register(provider(name="through-pluggy"))
    finally:
        undo()
    assert "torchplug_register_strategies" in seen
    assert registry.strategies["through-pluggy"].provider != ""


def test_a_precision_registered_twice_raises_like_a_strategy():
    class SecondAmp:
        @tpp.hookimpl
        def torchplug_register_precisions(self, register):
            register(PrecisionInfo(name="amp2", factory=object, precisions=("bf16",)))

    with pytest.raises(tp.PluginError, match=r"precision\(s\) \['bf16'\] already provided.*amp"):
        tp.register(SecondAmp(), name="second-amp")
    assert manager.get_registry().precisions["bf16"].provider == "amp"
    assert "second-amp" not in dict(manager.get_registry().pm.list_name_plugin())


def test_tracing_leaves_the_hook_functions_alone(monkeypatch, capfd):
    monkeypatch.setenv("TORCHPLUG_TRACE", "1")
    with tp.Engine("single") as engine:
        for caller in engine._pm.get_hookcallers(engine.backend):
            for impl in caller.get_hookimpls():
                # the plugin's own bound method, not a tracing closure
                assert getattr(impl.function, "__self__", None) is engine.backend, caller.name
    assert "torchplug_setup: answered by SingleDevice" in capfd.readouterr().err


def test_a_marked_function_under_no_hook_name_is_refused():
    class Typo:
        @tpp.hookimpl
        def setup(self, engine):
            pass

    with pytest.raises(tp.PluginError, match="'setup' is not a torchplug hook.*torchplug_setup"):
        tp.register(Typo(), name="typo")


def test_blocks_survive_a_registry_reset():
    tp.block("ddp")
    manager.reset_registry()
    assert "ddp" not in manager.get_registry().strategies
    manager.reset_registry(forget_blocks=True)
    assert "ddp" in manager.get_registry().strategies


def test_concurrent_registration_loses_nothing():
    manager.get_registry()
    errors: list[BaseException] = []

    def add(i: int) -> None:
        try:
            tp.register(provider(name=f"threaded-{i}"), name=f"threaded-{i}")
            tp.unregister(f"threaded-{i}") if i % 2 else None
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    names = set(manager.get_registry().strategies)
    assert {f"threaded-{i}" for i in range(0, 16, 2)} <= names
    assert not {f"threaded-{i}" for i in range(1, 16, 2)} & names


def test_built_ins_are_entry_points_and_a_checkout_not_installed_is_told_to_install(monkeypatch):
    """Issue 33 item 4: one list of built-ins, the entry points (no second list in the code). A
    source checkout put on ``sys.path`` without being installed has no entry points at all, and
    is told how to fix that instead of finding no strategy."""
    registry = manager.get_registry()
    assert {"single", "ddp", "fsdp", "deepspeed", "fairscale-oss"} <= set(registry.strategies)
    assert {"bf16", "fp16"} <= set(registry.precisions)
    assert registry.strategies["ddp"].distribution == "torchplug"
    monkeypatch.setattr(metadata, "entry_points", lambda **kw: [])
    manager.reset_registry()
    with pytest.raises(tp.PluginError, match=r"not found.*Install torchplug.*pip install -e \."):
        manager.get_registry()


def test_ddp_options_are_declared_once_with_torchs_defaults():
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    from torchplug.plugins.ddp import DDP_OPTIONS, DDPStrategy

    torch_defaults = inspect.signature(DistributedDataParallel.__init__).parameters
    for option in DDP_OPTIONS:  # only what differs from torch's default is passed to torch
        # torch's None means "its own default" (True for broadcast_buffers, 25 for bucket_cap_mb)
        assert torch_defaults[option.name].default in (option.default, None), option.name
    info = manager.get_registry().strategies["ddp"]
    assert {o.name for o in DDP_OPTIONS} <= {o.name for o in info.options}
    assert DDPStrategy(static_graph=True, bucket_cap_mb=25.0).ddp_kwargs == {"static_graph": True}
    with pytest.raises(TypeError, match="unknown option.*'static'"):
        DDPStrategy(static=True)
