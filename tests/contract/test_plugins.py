"""The registry: discovery, in-house and installed plugins, loading controls, and errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import torchplug as tp
import torchplug.plugin as tpp
from support.installing import installed
from support.paths import ROOT
from support.plugins import provider
from torchplug.contract import manager

# -- errors that name the fix ----------------------------------------------------------------------


def test_unknown_strategy_suggests_the_closest_and_lists_installed():
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("dpp")
    message = str(info.value)
    assert "Unknown strategy 'dpp'. Did you mean 'ddp'?" in message
    usable = manager.get_registry().usable_names()
    assert f"Installed: {', '.join(usable)}." in message
    assert {"ddp", "fsdp", "single"} <= set(usable)
    assert "torchplug plugins" in message


def test_installed_but_unusable_strategy_says_why_and_how_to_fix():
    tp.register(
        provider(
            name="needs-pkg",
            requires=("definitely_not_installed_pkg",),
            install_hint="pip install torchplug[needs-pkg]",
        )
    )
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("needs-pkg")
    assert "package 'definitely_not_installed_pkg' not installed" in str(info.value)
    assert "pip install torchplug[needs-pkg]" in str(info.value)
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("need-pkg")
    assert "Did you mean 'needs-pkg'?" in str(info.value)
    unusable = str(info.value).split("Installed but unusable here: ")[1]
    assert "needs-pkg: package 'definitely_not_installed_pkg' not installed" in unusable


def test_unusable_strategies_sharing_a_reason_are_named_together_with_it_once():
    """deepspeed's five spellings missing one package: one line of names, one fix."""
    for name in ("needs-pkg-a", "needs-pkg-b"):
        tp.register(
            provider(
                name=name,
                requires=("definitely_not_installed_pkg",),
                install_hint="pip install torchplug[needs-pkg]",
            )
        )
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("needs-pkg-c")
    message = str(info.value)
    assert "needs-pkg-a, needs-pkg-b: package 'definitely_not_installed_pkg' not" in message
    assert message.count("definitely_not_installed_pkg") == 1, message


def test_unknown_option_suggests_the_closest():
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("ddp", find_unused_paramters=True)
    message = str(info.value)
    assert "Unknown option 'find_unused_paramters' for strategy 'ddp'." in message
    assert "Did you mean 'find_unused_parameters'?" in message
    assert "timeout: float" in message  # lists the valid options


def test_wrong_option_type_names_expected_type():
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("ddp", find_unused_parameters="yes")
    assert "expects bool, got str 'yes'" in str(info.value)
    with tp.Engine("single", device="cpu") as engine:  # right type is accepted
        assert engine.device == torch.device("cpu")


def test_fp16_with_a_strategy_that_cannot_do_it():
    tp.register(
        provider(
            name="bf16-only", precisions=("32", "bf16"), owns_precision=True, distributed=False
        )
    )
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("bf16-only", precision="fp16")
    message = str(info.value)
    assert "Strategy 'bf16-only' cannot run precision 'fp16'" in message
    assert "supports 32, bf16" in message


def test_unknown_precision_suggests_the_closest():
    with pytest.raises(tp.ConfigurationError, match="Did you mean 'bf16'"):
        tp.Engine("single", precision="bf61")


def test_code_and_launcher_naming_different_strategies_is_an_error(monkeypatch):
    monkeypatch.setenv("TORCHPLUG_LAUNCH_STRATEGY", "single")
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("ddp")
    message = str(info.value)
    assert "strategy='ddp'" in message and "--strategy single" in message
    assert "drop the --strategy flag" in message


def test_code_and_launcher_agreeing_through_an_alias_is_fine(monkeypatch):
    monkeypatch.setenv("TORCHPLUG_LAUNCH_STRATEGY", "single")
    with tp.Engine("single-device") as engine:
        assert engine.strategy == "single"


def test_single_process_strategy_under_a_multi_process_launcher_is_an_error(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(tp.ConfigurationError, match="runs in one process.*rank 1 of 2"):
        tp.Engine("single")


# -- in-house plugins ------------------------------------------------------------------------------


class Counting(tpp.Strategy):
    """An in-house backend: the single-device strategy, counting its hook calls."""

    calls: list[str] = []

    def __init__(self, label: str = "x") -> None:
        self.label = label

    @tpp.hookimpl
    def torchplug_setup(self, engine, cluster):
        Counting.calls.append(f"setup:{self.label}")
        return tpp.Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    @tpp.hookimpl
    def torchplug_backward(self, engine, loss, model):
        Counting.calls.append("backward")
        loss.backward()
        return True

    @staticmethod
    @tpp.hookimpl
    def torchplug_register_strategies(register):
        register(
            tpp.StrategyInfo(
                name="counting",
                factory=Counting,
                description="counts hook calls",
                options=(tpp.Option("label", str, "x"),),
                distributed=False,
            )
        )


class LossRecorder:
    """An extension plugin: wraps backward to see every loss, whatever the backend."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    @tpp.hookimpl(wrapper=True)
    def torchplug_backward(self, engine, loss, model):
        self.losses.append(loss.item())
        return (yield)


def one_step(engine: tp.Engine) -> float:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.setup(model, optimizer)
    loss = model(torch.ones(2, 3)).sum()
    engine.backward(loss)
    optimizer.step()
    return loss.item()


def test_in_house_strategy_registered_in_one_line_is_selectable_and_its_hooks_run():
    Counting.calls.clear()
    tp.register(Counting)  # a class is instantiated; its registration hook announces 'counting'
    recorder = LossRecorder()
    with tp.Engine("counting", label="mine", plugins=[recorder]) as engine:
        loss = one_step(engine)
    assert Counting.calls == ["setup:mine", "backward"]
    assert recorder.losses == [loss]


def test_globally_registered_extension_joins_every_engine():
    recorder = LossRecorder()
    tp.register(recorder, name="loss-recorder")
    with tp.Engine("single") as engine:
        first = one_step(engine)
    with tp.Engine("single", precision="bf16") as engine:
        second = one_step(engine)
    assert recorder.losses == [first, second]
    tp.unregister("loss-recorder")
    with tp.Engine("single") as engine:
        one_step(engine)
    assert len(recorder.losses) == 2


def test_wrong_hook_signature_is_rejected_naming_plugin_and_hook():
    class Broken:
        @tpp.hookimpl
        def torchplug_backward(self, engine, los):
            return True

    with pytest.raises(tp.PluginError) as info:
        tp.register(Broken(), name="broken-plugin")
    message = str(info.value)
    assert "broken-plugin" in message and "torchplug_backward" in message and "los" in message


def test_misspelled_hook_is_rejected_with_a_suggestion():
    class Typo:
        def torchplug_backwards(self, engine, loss, model):
            return True

    with pytest.raises(tp.PluginError, match="Did you mean 'torchplug_backward'"):
        tp.register(Typo(), name="typo")


# -- installed plugins (entry points) --------------------------------------------------------------


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch) -> Path:
    """A distribution 'fakeplug' with one working and one broken entry point, on sys.path."""
    marker = tmp_path / "imported.txt"
    (tmp_path / "fakeplug-1.2.3.dist-info").mkdir()
    (tmp_path / "fakeplug-1.2.3.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakeplug\nVersion: 1.2.3\n"
    )
    (tmp_path / "fakeplug-1.2.3.dist-info" / "entry_points.txt").write_text(
        "[torchplug]\nfakeplug = fakeplug_mod\nbroken = broken_mod\n"
    )
    (tmp_path / "fakeplug_mod.py").write_text(
        textwrap.dedent(
            f"""
            open({str(marker)!r}, "a").write("fakeplug\\n")
            import torchplug.plugin as tpp
            from torchplug.plugins.single import SingleDevice

            @tpp.hookimpl
            def torchplug_register_strategies(register):
                register(tpp.StrategyInfo(name="fake", factory=SingleDevice,
                                         description="from an installed package",
                                         distributed=False))
            """
        )
    )
    (tmp_path / "broken_mod.py").write_text(
        f"open({str(marker)!r}, 'a').write('broken\\n')\nraise ImportError('needs libfoo')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fakeplug_mod", "broken_mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return marker


def imported(marker: Path) -> list[str]:
    return marker.read_text().split() if marker.exists() else []


def test_installed_plugin_is_found_and_a_broken_one_is_reported_by_name(fake_distribution):
    with pytest.warns(UserWarning, match="'broken'.*ImportError: needs libfoo"):
        registry = manager.get_registry()
    info = registry.strategies["fake"]
    assert (info.provider, info.distribution, info.version) == ("fakeplug", "fakeplug", "1.2.3")
    assert registry.errors == {"broken": "ImportError: needs libfoo"}
    with tp.Engine("fake") as engine:  # the working plugin and the built-ins keep working
        one_step(engine)
    with tp.Engine("single") as engine:
        one_step(engine)


def test_disable_autoload_loads_built_ins_only(fake_distribution, monkeypatch):
    monkeypatch.setenv("TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = manager.get_registry()
    assert {"ddp", "fsdp", "single"} <= set(registry.strategies)
    assert all(info.distribution == "torchplug" for info in registry.strategies.values())
    assert imported(fake_distribution) == []


def test_allow_list_loads_only_named_third_party_plugins(fake_distribution, monkeypatch):
    monkeypatch.setenv("TORCHPLUG_PLUGINS", "fakeplug")
    registry = manager.get_registry()
    assert "fake" in registry.strategies and not registry.errors
    assert imported(fake_distribution) == ["fakeplug"]


def test_built_ins_are_the_entry_points_pyproject_declares_and_nothing_else():
    """Issue 33 item 4: one list. torchplug's own plugins are found through the entry points of
    its distribution, as a third party's are; no second, hand-kept list in the code."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    from torchplug.contract import discovery

    root = ROOT
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]
    assert manager.builtin_modules() == declared["torchplug"]
    assert not hasattr(discovery, "BUILTIN_PLUGINS")
    registry = manager.get_registry()
    assert all(registry.pm.has_plugin(name) for name in declared["torchplug"])


def test_the_allow_list_applies_to_built_ins_too_but_the_minimal_defaults(
    fake_distribution, monkeypatch
):
    """Allow-listing a third-party plugin leaves torchplug's own backends out as well, each
    named with the reason; the defaults every Engine needs stay, and a selected built-in that
    was left out says so."""
    monkeypatch.setenv("TORCHPLUG_PLUGINS", "fakeplug,fsdp")
    registry = manager.get_registry()
    assert {"fake", "fsdp", "single"} <= set(registry.strategies)
    assert "ddp" not in registry.strategies and "tp" not in registry.strategies
    assert "not in the allow-list" in registry.hidden["ddp"]
    assert "torch_distributed" not in registry.hidden and "checkpoint" not in registry.hidden
    with pytest.raises(tp.ConfigurationError, match=r"ddp \(not in the allow-list"):
        tp.Engine("ddp")
    engine = tp.Engine("single")  # the minimal defaults answer its hooks
    model = engine.setup(torch.nn.Linear(2, 1))
    assert model(torch.ones(1, 2)).shape == (1, 1)
    engine.close()


def test_blocked_plugins_are_never_imported(fake_distribution, monkeypatch):
    monkeypatch.setenv("TORCHPLUG_BLOCK_PLUGINS", "broken")
    tp.block("fakeplug")
    registry = manager.get_registry()
    assert "fake" not in registry.strategies and not registry.errors
    assert imported(fake_distribution) == []
    assert registry.blocked == {"broken", "fakeplug"}


def test_a_block_naming_no_plugin_is_shown_with_the_names_to_use(fake_distribution, monkeypatch):
    """A block takes plugin names; one naming a package, or misspelt, would otherwise look as if
    it took effect (an outsider blocked `torchplug-counting`, the package, and nothing was)."""
    monkeypatch.setenv("TORCHPLUG_BLOCK_PLUGINS", "FakePlug,torch-distributed,broken")
    registry = manager.get_registry()
    assert "fake" in registry.strategies  # the package name blocked nothing
    from torchplug.cli.plugins import loading_state

    lines = loading_state(registry)
    unmatched = [line for line in lines if line.startswith("blocked but matching no plugin")]
    assert len(unmatched) == 2, lines  # 'broken' is a plugin's name: it took effect
    package, typo = sorted(unmatched)
    assert "FakePlug (the package FakePlug provides the plugin(s) broken, fakeplug" in package
    assert "Did you mean 'torch_distributed'?" in typo, typo


def test_blocking_a_built_in_removes_its_strategies():
    manager.get_registry()
    tp.block("ddp")
    with pytest.raises(tp.ConfigurationError, match="Unknown strategy 'ddp'"):
        tp.Engine("ddp")


def tmp_backend_spec():
    import importlib.util

    return importlib.util.find_spec("tmp_backend")


@pytest.mark.slow
def test_plugin_package_installed_with_pip_is_selectable_and_listed(tmp_path):
    """A real package with its own pyproject entry point, pip-installed (into a temporary
    target on the path, not into the running environment)."""
    package = tmp_path / "torchplug-tmp-backend"
    (package / "tmp_backend").mkdir(parents=True)
    (package / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["setuptools>=69"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "torchplug-tmp-backend"
            version = "0.7.1"
            dependencies = []

            [project.entry-points.torchplug]
            tmp-backend = "tmp_backend"
            """
        )
    )
    (package / "tmp_backend" / "__init__.py").write_text(
        textwrap.dedent(
            """
            import torchplug.plugin as tpp
            from torchplug.plugins.single import SingleDevice

            class Backend(SingleDevice):
                @tpp.hookimpl
                def torchplug_backward(self, engine, loss, model):
                    print("tmp-backend backward")
                    loss.backward()
                    return True

            @tpp.hookimpl
            def torchplug_register_strategies(register):
                register(tpp.StrategyInfo(name="tmp-backend", factory=Backend,
                                         description="installed by a test", distributed=False))
            """
        )
    )
    with installed(package):  # into a temporary target: the environment is left alone
        listing = subprocess.run(
            [sys.executable, "-m", "torchplug", "plugins"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        line = next(x for x in listing.stdout.splitlines() if x.startswith("tmp-backend"))
        assert "torchplug-tmp-backend 0.7.1" in line and "usable" in line
        script = (
            "import torch, torchplug as tp\n"
            "with tp.Engine('tmp-backend') as e:\n"
            "    model = torch.nn.Linear(2, 1)\n"
            "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "    model, opt = e.setup(model, opt)\n"
            "    e.backward(model(torch.ones(1, 2)).sum()); opt.step()\n"
            "    print('strategy', e.strategy)\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr
        assert "tmp-backend backward" in run.stdout and "strategy tmp-backend" in run.stdout
        target = Path(tmp_backend_spec().origin).parent.parent
    # nothing is left installed, nothing was built in the package's folder
    assert tmp_backend_spec() is None and not target.exists()
    assert not any(p.name == "build" or p.name.endswith(".egg-info") for p in package.rglob("*"))


def test_in_house_strategy_name_clash_is_an_error_at_registration():
    with pytest.raises(tp.PluginError, match="'ddp'.*already provided by plugin 'ddp'"):
        tp.register(provider(name="ddp"), name="clash")
    assert manager.get_registry().strategies["ddp"].provider == "ddp"


def test_trace_prints_each_hook_call(monkeypatch, capfd):
    monkeypatch.setenv("TORCHPLUG_TRACE", "1")
    with tp.Engine("single") as engine:
        one_step(engine)
    err = capfd.readouterr().err
    assert "[torchplug] torchplug_setup: answered by SingleDevice -> Runtime(" in err
    # what SingleDevice does not change is answered by the built-in defaults plugin
    assert (
        "[torchplug] torchplug_backward: answered by torch_distributed "
        "(torchplug.plugins.torch_distributed) "
        "-> True" in err
    )
    with tp.Engine("single", precision="bf16") as engine:
        one_step(engine)
    assert "torchplug_wrap: wrapped by MixedPrecision" in capfd.readouterr().err
