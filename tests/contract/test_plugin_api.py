"""Plugin authors' API: the hook reference, errors that name and show, inherited options, the
versioned plugin API, idempotent registration, hidden plugins, the final result in traces."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pluggy
import pytest
import torch

import torchplug as tp
import torchplug.plugin as tpp
from support.paths import ROOT
from torchplug.cli import hookdoc
from torchplug.contract import apiversion, manager, spec
from torchplug.contract.types import Option

BF16COMM = ROOT / "examples" / "plugins" / "torchplug-bf16comm"


def torchplug(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPLUG_")}
    return subprocess.run(
        [sys.executable, "-m", "torchplug", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**clean, **(env or {})},
    )


# -- the hook reference ---------------------------------------------------------------------------


def test_docs_hooks_md_is_generated_from_the_spec():
    expected = hookdoc.render()
    actual = (ROOT / "docs" / "hooks.md").read_text()
    assert actual == expected, "run: python -m torchplug.cli.hookdoc > docs/hooks.md"


def test_every_hook_is_documented_with_signature_semantics_ranks_default_and_example():
    text = hookdoc.render()
    for name, _ in hookdoc.hooks():
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("```python", "**Returns**", "**Semantics**", "**Called**", "Example:"):
            assert part in section, (name, part)
        assert "**Default implementation**" in section, name
    wrap = text.split("\n## torchplug_wrap\n", 1)[1].split("\n## ", 1)[0]
    assert "optimizers: list[torch.optim.Optimizer]" in wrap and "firstresult" in wrap
    assert (
        "torchplug.plugins.torch_distributed.torchplug_wrap" in wrap and "torch_distributed" in wrap
    )


def test_the_generator_documents_a_hook_it_has_no_notes_for(monkeypatch):
    @spec.hookspec
    def torchplug_register_loggers(register):
        """Announce loggers."""

    monkeypatch.setattr(spec, "torchplug_register_loggers", torchplug_register_loggers, False)
    section = hookdoc.render().split("\n## torchplug_register_loggers\n", 1)[1]
    assert "Announce loggers." in section and "registration hook" in section
    assert "def torchplug_register_loggers(register):" in section


def test_retired_hooks_are_listed_with_their_replacement(monkeypatch):
    monkeypatch.setattr(spec, "RETIRED_HOOKS", {"torchplug_old": ("torchplug_new", "2.0")})
    assert "| `torchplug_old` | `torchplug_new` | 2.0 |" in hookdoc.render()


# -- errors that name and show --------------------------------------------------------------------


class WrongArgument(tpp.Strategy):
    @tpp.hookimpl
    def torchplug_wrap(self, engine, model, optimizer):
        return model, [optimizer]


def test_a_wrong_argument_name_names_the_plugin_and_shows_the_signature():
    with pytest.raises(tp.PluginError) as info:
        tp.register(WrongArgument())
    message = str(info.value)
    assert "'test_plugin_api:WrongArgument'" in message
    assert "torchplug_wrap takes argument(s) 'optimizer'" in message
    assert "torchplug_wrap(engine: HookContext, model: torch.nn.Module, optimizers: " in message
    assert "docs/hooks.md#torchplug_wrap" in message


class MisspelledBackend(tpp.DDPStrategy):
    @tpp.hookimpl
    def torchplug_warp(self, engine, model, optimizers):
        return model, optimizers


class AnnouncesMisspelled:
    @tpp.hookimpl
    def torchplug_register_strategies(self, register):
        register(tpp.StrategyInfo(name="misspelled", factory=MisspelledBackend, description="x"))


def test_a_misspelled_hook_on_a_strategy_class_is_refused_at_register():
    with pytest.raises(tp.PluginError) as info:
        tp.register(AnnouncesMisspelled())
    message = str(info.value)
    assert "Strategy 'misspelled'" in message and "test_plugin_api:MisspelledBackend" in message
    assert "'torchplug_warp' is not a torchplug hook. Did you mean 'torchplug_wrap'?" in message
    assert "misspelled" not in manager.get_registry().strategies


def test_at_discovery_a_broken_strategy_is_listed_as_broken_never_usable():
    registry = manager.get_registry()
    with pytest.warns(UserWarning, match="torchplug_warp"):
        registry.add(AnnouncesMisspelled(), name="third-party", strict=False)
    info = registry.strategies["misspelled"]
    assert info.unusable_reason().startswith("broken: its class")
    assert "misspelled" not in registry.usable_names()
    assert "torchplug_warp" in registry.errors["third-party"]
    with pytest.raises(tp.ConfigurationError, match="broken.*torchplug_warp"):
        tp.Engine("misspelled")


# -- inherited options and public bases ------------------------------------------------------------


class LoggedDDP(tpp.DDPStrategy):
    """The documented way to extend a backend: subclass it, inherit its options."""

    def __init__(self, every: int = 1, **ddp):
        super().__init__(**ddp)
        self.every = every


class AnnouncesLogged:
    @tpp.hookimpl
    def torchplug_register_strategies(self, register):
        register(
            tpp.StrategyInfo(
                name="logged-ddp",
                factory=LoggedDDP,
                description="DDP that logs",
                extends="ddp",
                options=(Option("every", int, 1, "log every N steps"),),
                tolerance=1e-3,
            )
        )


def test_extends_inherits_the_parents_options_capabilities_and_defaults():
    tp.register(AnnouncesLogged())
    registry = manager.get_registry()
    child, parent = registry.strategies["logged-ddp"], registry.strategies["ddp"]
    names = [o.name for o in child.options]
    assert names == [o.name for o in parent.options] + ["every"]
    assert child.tolerance == 1e-3 and child.precisions == parent.precisions
    assert child.distributed and child.launcher == "torchrun" and child.extends == "ddp"
    with tp.Engine("logged-ddp", find_unused_parameters=True, every=3) as engine:
        assert engine.backend.ddp_kwargs == {"find_unused_parameters": True}
        assert engine.backend.every == 3
    with pytest.raises(tp.ConfigurationError, match="Unknown option 'find_unused'.*Did you mean"):
        tp.Engine("logged-ddp", find_unused=True)


def test_options_of_still_gives_a_parents_options_with_a_deprecation_warning():
    manager.get_registry()  # built first: only the call itself is under watch
    with pytest.warns(DeprecationWarning, match=r"StrategyInfo\(extends='ddp'\)") as caught:
        assert tp.options_of("ddp") == manager.get_registry().strategies["ddp"].options
    assert [w.filename for w in caught] == [__file__]  # points at the caller
    with pytest.warns(DeprecationWarning):
        names = {o.name for o in tp.options_of("distributed-data-parallel")}
    assert "find_unused_parameters" in names
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(tp.PluginError, match="options_of\\('dpp'\\).*Did you mean 'ddp'"),
    ):
        tp.options_of("dpp")
    from torchplug.plugins.base import DistributedStrategy, Strategy
    from torchplug.plugins.ddp import DDPStrategy

    assert (tpp.Strategy, tpp.DistributedStrategy, tpp.DDPStrategy) == (
        Strategy,
        DistributedStrategy,
        DDPStrategy,
    )


def test_extending_an_unknown_strategy_says_which_exist():
    class Bad:
        @tpp.hookimpl
        def torchplug_register_strategies(self, register):
            register(tpp.StrategyInfo(name="x", factory=object, description="x", extends="dpp"))

    with pytest.raises(tp.PluginError, match="extends 'dpp', which is not registered.*'ddp'"):
        tp.register(Bad())


# -- the versioned plugin API ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("specifier", "ok"),
    [
        (">=1.0,<2", True),  # what the docs recommend: 1.0 plugins load on 1.5
        ("==1.*", True),
        (">=1.1", True),
        (">=1.5", True),
        (">=1.6", False),
        ("<1", False),
        ("!=1.5", False),
        ("!=1.1", True),
        ("1.5", True),
        ("1.4", False),
        ("", True),
    ],  # fmt: skip
)
def test_api_specifiers(specifier, ok):
    assert (apiversion.incompatibility(specifier, "it") is None) is ok


def test_an_unreadable_specifier_says_the_expected_form():
    with pytest.raises(tp.PluginError, match="cannot be read at '~=1'.*'>=1.0,<2'"):
        apiversion.parse(">=1,~=1")


def test_a_plugin_for_another_api_is_not_loaded_and_says_why():
    future = types.ModuleType("future_plugin")
    future.TORCHPLUG_API = ">=2.0"

    @tpp.hookimpl
    def torchplug_register_strategies(register):
        register(tpp.StrategyInfo(name="future", factory=object, description="x"))

    future.torchplug_register_strategies = torchplug_register_strategies
    registry = manager.get_registry()
    with pytest.raises(tp.PluginError) as info:
        registry.add(future, name="future-plugin", strict=False)
    message = str(info.value)
    assert "supports torchplug plugin API '>=2.0'" in message
    assert f"provides API {spec.API_VERSION}" in message and "upgrade torchplug" in message
    assert "future" not in registry.strategies and not registry.pm.has_plugin("future-plugin")


def test_a_strategy_declaring_an_incompatible_api_is_not_registered():
    class Old:
        @tpp.hookimpl
        def torchplug_register_strategies(self, register):
            register(tpp.StrategyInfo(name="old", factory=object, description="x", api="<1"))

    registry = manager.get_registry()
    with pytest.warns(UserWarning, match="Strategy 'old' supports torchplug plugin API '<1'"):
        registry.add(Old(), name="old-plugin", strict=False)
    assert "old" not in registry.strategies
    assert "not registered" in registry.errors["old-plugin"]


def test_an_incompatible_installed_plugin_is_listed_as_not_loaded(tmp_path):
    (tmp_path / "oldplug-1.0.dist-info").mkdir()
    (tmp_path / "oldplug-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: oldplug\nVersion: 1.0\n"
    )
    (tmp_path / "oldplug-1.0.dist-info" / "entry_points.txt").write_text(
        "[torchplug]\noldplug = oldplug_mod\n"
    )
    (tmp_path / "oldplug_mod.py").write_text('TORCHPLUG_API = ">=3.0"\n')
    run = torchplug("plugins", env={"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    assert run.returncode == 0, run.stderr
    line = next(x for x in run.stdout.splitlines() if x.strip().startswith("oldplug:"))
    assert "supports torchplug plugin API '>=3.0'" in line and "not loaded" in line


def test_a_deprecated_hook_warns_naming_its_replacement():
    class Spec:
        @spec.deprecated_hookspec("torchplug_new_name", removed_in="2.0")
        def torchplug_old_name(self, engine):
            """Renamed."""

    pm = pluggy.PluginManager(spec.PROJECT)
    pm.add_hookspecs(Spec)

    class Plugin:
        @tpp.hookimpl
        def torchplug_old_name(self, engine):
            return 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.register(Plugin())
    assert any(
        issubclass(w.category, DeprecationWarning)
        and "torchplug_new_name" in str(w.message)
        and "API 2.0" in str(w.message)
        for w in caught
    ), [str(w.message) for w in caught]
    assert pm.hook.torchplug_old_name(engine=None) == [1]  # it still works meanwhile


# -- registration housekeeping ---------------------------------------------------------------------


class Guard:
    @tpp.hookimpl(wrapper=True)
    def torchplug_backward(self, engine, loss, model):
        return (yield)


def test_registering_the_same_plugin_twice_is_a_no_op_and_unregister_takes_the_object():
    guard = Guard()
    name = tp.register(guard)
    assert name == "test_plugin_api:Guard"
    assert tp.register(guard) == name  # a re-run notebook cell
    module = types.ModuleType("inhouse_mod")
    module.torchplug_register_strategies = AnnouncesLogged().torchplug_register_strategies
    assert tp.register(module) == tp.register(module) == "inhouse_mod"
    tp.unregister(guard)
    tp.unregister(module)
    registry = manager.get_registry()
    assert not registry.pm.is_registered(guard) and "logged-ddp" not in registry.strategies
    with pytest.raises(tp.PluginError, match="'test_plugin_api:Guard' is not registered"):
        tp.unregister(guard)


def test_a_class_registered_twice_is_one_plugin():
    assert tp.register(Guard) == tp.register(Guard)
    assert sum(type(p) is Guard for p in manager.get_registry().pm.get_plugins()) == 1
    tp.unregister(Guard)
    assert not any(type(p) is Guard for p in manager.get_registry().pm.get_plugins())


def test_trace_shows_the_final_result_after_wrappers(monkeypatch, capfd):
    class SkipAll:
        @tpp.hookimpl(wrapper=True)
        def torchplug_optimizer_step(self, engine, optimizer, closure):
            with engine.skipping_updates(optimizer, True):
                yield
            return False

    monkeypatch.setenv("TORCHPLUG_TRACE", "1")
    with tp.Engine("single", plugins=[SkipAll()]) as engine:
        model = torch.nn.Linear(2, 1)
        before = model.weight.detach().clone()
        model, opt = engine.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
        engine.backward(model(torch.ones(1, 2)).sum())
        opt.step()
        assert opt.step_was_skipped and torch.equal(model.weight.detach(), before)
    err = capfd.readouterr().err
    assert (
        "torchplug_optimizer_step: answered by torch_distributed "
        "(torchplug.plugins.torch_distributed), "
        "final result after wrapper(s)" in err
    )
    assert "SkipAll" in err and err.split("torchplug_optimizer_step: answered")[1].split("\n")[
        0
    ].endswith("-> False")


# -- hidden plugins --------------------------------------------------------------------------------


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    (tmp_path / "hiddenplug-0.3.dist-info").mkdir()
    (tmp_path / "hiddenplug-0.3.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: hiddenplug\nVersion: 0.3\n"
    )
    (tmp_path / "hiddenplug-0.3.dist-info" / "entry_points.txt").write_text(
        "[torchplug]\nhiddenplug = hiddenplug_mod\n"
    )
    (tmp_path / "hiddenplug_mod.py").write_text(
        textwrap.dedent(
            """
            import torchplug.plugin as tpp
            from torchplug.plugins.single import SingleDevice

            @tpp.hookimpl
            def torchplug_register_strategies(register):
                register(tpp.StrategyInfo(name="hidden-one", factory=SingleDevice,
                                         description="x", distributed=False))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variable", "value", "why"),
    [
        ("TORCHPLUG_PLUGINS", "someother", "not in the allow-list TORCHPLUG_PLUGINS=someother"),
        ("TORCHPLUG_DISABLE_PLUGIN_AUTOLOAD", "1", "autoload is off"),
    ],
)
def test_allow_list_and_autoload_off_say_which_plugins_they_hide(
    installed_plugin, monkeypatch, variable, value, why
):
    monkeypatch.setenv(variable, value)
    registry = manager.get_registry()
    assert why in registry.hidden["hiddenplug"]
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("hidden-one")
    assert "Installed plugins not loaded: " in str(info.value)
    assert f"hiddenplug ({why}" in str(info.value)
    env = {"PYTHONPATH": os.pathsep.join([str(installed_plugin), *sys.path]), variable: value}
    for command in ("plugins", "doctor"):
        run = torchplug(command, env=env, cwd=installed_plugin)
        assert f"hidden: hiddenplug: {why}" in run.stdout, run.stdout + run.stderr


# -- one command line for in-house plugins ---------------------------------------------------------


@pytest.mark.slow
def test_doctor_plugins_and_check_import_an_in_house_plugin_from_the_current_directory(tmp_path):
    (tmp_path / "my_backend.py").write_text((BF16COMM / "torchplug_bf16comm.py").read_text())
    run = torchplug("doctor", "--plugin", "my_backend", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ddp-bf16comm" in run.stdout
    run = torchplug("plugins", "--plugin", "my_backend", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {line.split()[0]: line for line in run.stdout.splitlines() if line.strip()}
    assert "in-house" in rows["ddp-bf16comm"] and rows["ddp-bf16comm"].endswith("usable")
    assert "ddp-bf16comm" not in torchplug("plugins", cwd=tmp_path).stdout  # only when named
    for command in ("doctor", "plugins"):
        run = torchplug(command, "--plugin", "no_such_module", cwd=tmp_path)
        assert run.returncode == 2, (command, run.stdout, run.stderr)
        assert "Plugin module 'no_such_module' could not be loaded" in run.stderr
        assert "Traceback" not in run.stderr
    run = torchplug(
        "check", "ddp-bf16comm", "--plugin", "my_backend", "--precision", "32",
        "--only", "parity", "--only", "resume", "--only", "nan_skip", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 passed, 0 failed" in run.stdout
    assert "max diff 0.00e+00 <= 1e-06" in run.stdout  # resume exact, though tolerance is 1e-2


@pytest.mark.slow
def test_launch_accepts_a_strategy_the_script_registers_in_code(tmp_path):
    (tmp_path / "train.py").write_text(
        textwrap.dedent(
            """
            import os

            import torchplug as tp
            import torchplug.plugin as tpp
            from torchplug.contract.types import StrategyInfo

            class Announce:
                @tpp.hookimpl
                def torchplug_register_strategies(self, register):
                    register(StrategyInfo(name="logged-ddp", factory=tpp.DDPStrategy,
                                          description="x", extends="ddp"))

            tp.register(Announce())
            with tp.Engine() as engine:
                line = f"RANK {engine.rank}/{engine.world_size} {engine.strategy}\\n"
                os.write(1, line.encode())  # one write: the ranks share the pipe
            """
        )
    )
    run = torchplug("launch", "-n", "2", "--strategy", "logged-ddp", "train.py", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(x for x in run.stdout.splitlines() if x.startswith("RANK")) == [
        "RANK 0/2 logged-ddp",
        "RANK 1/2 logged-ddp",
    ]
    assert "the script names it" in run.stderr
    typo = torchplug("launch", "-n", "2", "--strategy", "loged-ddp", "train.py", cwd=tmp_path)
    assert typo.returncode == 2
    assert "Unknown strategy 'loged-ddp'" in typo.stderr and "--plugin MODULE" in typo.stderr


@pytest.mark.slow
def test_a_third_party_ddp_subclass_installed_with_pip_passes_check_and_launches(tmp_path):
    from support.installing import installed

    source = (BF16COMM / "torchplug_bf16comm.py").read_text().splitlines()
    code = [line for line in source if line.strip() and not line.strip().startswith("#")]
    assert len(code) <= 25, len(code)  # lines of Python, blank and comment lines aside
    with installed(BF16COMM):
        env = {"PYTHONPATH": os.environ["PYTHONPATH"]}
        listing = torchplug("plugins", env=env)
        line = next(x for x in listing.stdout.splitlines() if x.startswith("ddp-bf16comm"))
        assert "torchplug-bf16comm 0.1.0" in line and line.endswith("usable")
        run = torchplug("check", "ddp-bf16comm", "--precision", "32", env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        (tmp_path / "train.py").write_text(
            "import os, torchplug as tp\n"
            "with tp.Engine(find_unused_parameters=True) as engine:\n"
            "    line = f'RANK {engine.rank} {engine.strategy} {engine.backend.ddp_kwargs}\\n'\n"
            "    os.write(1, line.encode())\n"
        )
        run = torchplug(
            "launch", "-n", "2", "--strategy", "ddp-bf16comm", "train.py", cwd=tmp_path, env=env
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert "RANK 0 ddp-bf16comm {'find_unused_parameters': True}" in run.stdout


#: An extension module that records every loss backward sees.
LOSS_COUNTER = (
    "import torchplug.plugin as tpp\n"
    "calls = []\n\n"
    "@tpp.hookimpl(wrapper=True)\n"
    "def torchplug_backward(engine, loss, model):\n"
    "    calls.append(loss.item())\n"
    "    return (yield)\n"
)


def test_engine_plugins_accepts_module_names(tmp_path, monkeypatch):
    (tmp_path / "loss_counter.py").write_text(LOSS_COUNTER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "loss_counter", raising=False)
    with tp.Engine("single", plugins=["loss_counter"]) as engine:
        engine.backward(torch.ones(2, requires_grad=True).sum())
    assert sys.modules["loss_counter"].calls == [2.0]
    with pytest.raises(tp.PluginError, match="'no_such_ext'.*could not be imported"):
        tp.Engine("single", plugins=["no_such_ext"])


def test_a_plugin_registered_globally_and_given_to_an_engine_runs_once(tmp_path, monkeypatch):
    """The same extension registered process-wide and passed as ``Engine(plugins=[...])`` (as an
    object, and as its module's name) is one member of the active set: its hook runs once."""
    (tmp_path / "loss_seen.py").write_text(LOSS_COUNTER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "loss_seen", raising=False)
    import loss_seen

    name = tp.register(loss_seen)
    try:
        for given in (loss_seen, "loss_seen"):
            with tp.Engine("single", plugins=[given, given]) as engine:
                engine.backward(torch.ones(2, requires_grad=True).sum())
        assert loss_seen.calls == [2.0, 2.0]  # one call per Engine, not two or three
    finally:
        tp.unregister(name)


def test_specname_implements_the_named_hook_and_is_checked_against_it():
    class Named:
        @tpp.hookimpl(specname="torchplug_backward", wrapper=True)
        def watch(self, engine, loss, model):
            return (yield)

    tp.unregister(tp.register(Named()))

    class Wrong:
        @tpp.hookimpl(specname="torchplug_backward", wrapper=True)
        def watch(self, engine, losses):
            return (yield)

    with pytest.raises(tp.PluginError, match="torchplug_backward takes argument.*'losses'"):
        tp.register(Wrong())


def test_a_second_object_of_a_class_gets_its_own_name_and_a_taken_name_is_refused():
    first, second = Guard(), Guard()
    assert tp.register(first) == "test_plugin_api:Guard"
    assert tp.register(second) == "test_plugin_api:Guard#2"  # e.g. made by a factory function
    with pytest.raises(tp.PluginError, match=r"already registered as 'test_plugin_api:Guard'.*"
                       r"torchplug.unregister\('test_plugin_api:Guard'\)"):  # fmt: skip
        tp.register(Guard(), name="test_plugin_api:Guard")


def test_a_re_run_cell_registering_a_new_object_is_told_how_to_replace_the_old_one():
    tp.register(AnnouncesLogged())
    with pytest.raises(tp.PluginError, match=r"already provided by plugin "
                       r"'test_plugin_api:AnnouncesLogged'.*re-run notebook cell.*"
                       r"torchplug.unregister\('test_plugin_api:AnnouncesLogged'\)"):  # fmt: skip
        tp.register(AnnouncesLogged())
    tp.unregister("test_plugin_api:AnnouncesLogged")
    tp.register(AnnouncesLogged())
    assert "logged-ddp" in manager.get_registry().strategies


def test_the_authors_face_holds_every_author_name_and_imports_no_torch():
    """Issue 26 item 7: ``torchplug.plugin`` is the plugin authors' face; the author names under
    ``torchplug`` are the same objects (they keep working through API 1.x)."""
    import torchplug

    assert set(torchplug.AUTHOR_NAMES) <= set(tpp.__all__)
    assert not set(torchplug.AUTHOR_NAMES) & set(torchplug.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in torchplug.AUTHOR_NAMES:
            assert getattr(torchplug, name) is getattr(tpp, name), name
    for name in set(tpp.__all__) & set(torchplug.__all__):  # register, errors: on both faces
        assert getattr(torchplug, name) is getattr(tpp, name), name
    assert {"hookimpl", "StrategyInfo", "DistributedStrategy", "Deferred", "API_VERSION"} <= set(
        tpp.__all__
    )
    code = "import sys, torchplug.plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(tp.AUTHOR_NAMES))
def test_an_author_name_under_torchplug_warns_once_saying_what_to_import(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(tp, name)
    assert value is getattr(tpp, name)
    assert [(w.category, w.filename) for w in caught] == [(DeprecationWarning, __file__)]
    assert str(caught[0].message) == (
        f"tp.{name} is an author name: import it from torchplug.plugin "
        f"(from torchplug.plugin import {name}); tp.{name} keeps working through API 1.x"
    )
    with warnings.catch_warnings(record=True) as again:  # every use warns (not only the first)
        warnings.simplefilter("always")
        getattr(tp, name)
    assert len(again) == 1


def test_from_torchplug_import_an_author_name_warns_once_at_the_import_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from torchplug import StrategyInfo, hookimpl
    assert (StrategyInfo, hookimpl) == (tpp.StrategyInfo, tpp.hookimpl)
    assert sorted(str(w.message).split(" ")[0] for w in caught) == [
        "tp.StrategyInfo",
        "tp.hookimpl",
    ]
    assert {w.filename for w in caught} == {__file__}


def test_the_faces_own_names_do_not_warn_and_dir_lists_users_names_only():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in tpp.__all__:
            getattr(tpp, name)
        for name in tp.__all__:
            getattr(tp, name)
        listed = dir(tp)
    assert "Engine" in listed and "register" in listed
    assert not set(tp.AUTHOR_NAMES) & set(listed)
    assert set(tpp.__all__) <= set(dir(tpp))


def test_distributed_options_warns_and_extends_is_the_one_way_to_inherit_options():
    from torchplug.plugins.base import _distributed_options

    manager.get_registry()  # built first: only the call itself is under watch
    with pytest.warns(DeprecationWarning, match=r"extends=DistributedStrategy") as caught:
        names = [o.name for o in tpp.distributed_options()]
    assert names == [o.name for o in _distributed_options()] == ["process_group_backend", "timeout"]
    assert [w.filename for w in caught] == [__file__]
    own = Option("every", int, 1, "x")
    # a backend of its own on a process group: the base class's options, then its own
    info = tpp.StrategyInfo(
        name="x", factory=tpp.DistributedStrategy, description="x",
        extends=tpp.DistributedStrategy, options=(own,),
    )  # fmt: skip
    assert [o.name for o in info.options] == ["process_group_backend", "timeout", "every"]
    with pytest.raises(TypeError, match="extends= takes the name of a registered strategy"):
        tpp.StrategyInfo(name="x", factory=object, description="x", extends=object)
    # a third party extending "ddp" gets the distributed options through DDP's
    ddp = manager.get_registry().strategies["ddp"]
    child = tpp.StrategyInfo(name="y", factory=tpp.DDPStrategy, description="y", extends="ddp")
    names = [o.name for o in child.inheriting(ddp).options]
    assert names[:2] == ["process_group_backend", "timeout"] and "static_graph" in names


def test_a_plugin_implementing_the_retired_conversion_hook_warns_at_registration():
    assert spec.RETIRED_HOOKS["torchplug_convert_checkpoint"][0] == "torchplug_read_checkpoint"
    assert "Deprecated since API 1.0" in spec.torchplug_convert_checkpoint.__doc__

    class OldConverter:
        @tpp.hookimpl
        def torchplug_convert_checkpoint(self, source, destination):
            return None

    with pytest.warns(DeprecationWarning, match="implement torchplug_read_checkpoint instead"):
        name = tp.register(OldConverter())
    tp.unregister(name)


#: Our own modules that author plugins: importing them must not use a deprecated spelling.
OWN_PLUGIN_MODULES = [
    "torchplug_powersgd",
    "torchplug_sagemaker",
    "torchplug_mlflow",
    "torchplug_wandb",
    "torchplug_bf16comm",
    "markdown_logger",
    "inhouse_plugin",
    "logger_plugin",
    "torchplug.testing.bodies",
    "torchplug.testing.kit",
    "torchplug.testing.real_model",
    "torchplug.cli.hookdoc",
]


def test_none_of_our_own_plugins_uses_a_deprecated_spelling():
    """tox runs with PYTHONWARNINGS=ignore::DeprecationWarning; here torchplug's deprecation
    warnings are errors while every built-in, contrib and example plugin is imported and
    registered, and the hook reference is rendered."""
    code = textwrap.dedent(
        f"""
        import importlib, sys, warnings
        warnings.filterwarnings(
            "error", category=DeprecationWarning,
            message=r"(tp\\.\\w+ is an author name|options_of\\(|distributed_options\\(|"
                    r"this torchplug hook is deprecated)",
        )
        sys.path[:0] = [{str(ROOT / "examples")!r}, {str(BF16COMM)!r}]
        for name in {OWN_PLUGIN_MODULES!r}:
            importlib.import_module(name)
        from torchplug.cli import hookdoc
        from torchplug.contract import manager
        registry = manager.get_registry()
        for name in {OWN_PLUGIN_MODULES[:6]!r}:
            if name not in ("torchplug_mlflow", "torchplug_wandb"):  # their packages may be absent
                manager.register(importlib.import_module(name))
        hookdoc.render()
        print("strategies", len(registry.strategies))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPLUG_")}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "strategies" in run.stdout


def test_a_backend_written_with_the_authors_face_alone_runs():
    from torchplug.plugin import DistributedStrategy, StrategyInfo, hookimpl, register

    class Plain(DistributedStrategy):
        pass

    class Provider:
        @staticmethod
        @hookimpl
        def torchplug_register_strategies(register):
            register(StrategyInfo(name="face-plain", factory=Plain, description="face"))

    register(Provider, name="face-provider")
    with tp.Engine("face-plain") as engine:
        model = engine.setup(torch.nn.Linear(2, 1))
        engine.backward(model(torch.ones(1, 2)).sum())
        assert model.weight.grad is not None


@pytest.mark.slow
def test_the_mesh_example_in_the_author_guide_passes_the_kit_on_four_ranks(tmp_path):
    """docs/plugins.md's HSDP backend (its own 2-D mesh built in setup), as printed, registered
    from a module next to it and checked by `torchplug check` (issue 35 item 5)."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    at = text.index("class HSDP(tpp.DistributedStrategy):")
    start = text.rindex("```python\n", 0, at) + len("```python\n")
    example = text[start : text.index("```", at)]
    (tmp_path / "hsdp.py").write_text(
        example
        + textwrap.dedent(
            """

            @tpp.hookimpl
            def torchplug_register_strategies(register):
                register(tpp.StrategyInfo(
                    name="hsdp", factory=HSDP, description="replicate x shard",
                    options=(*tpp.DistributedStrategy.strategy_options(),
                             tpp.Option("replicas", int, 2, "replica groups")),
                    shards_parameters=True, shards_optimizer=True, refuses=("reuse",)))
            """
        )
    )
    only = [arg for name in ("parity", "sgd", "checkpoint", "reuse") for arg in ("--only", name)]
    run = subprocess.run(
        [sys.executable, "-m", "torchplug", "check", "hsdp", "-n", "4", "--plugin", "hsdp",
         "--precision", "32", *only],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "4 passed, 0 failed" in run.stdout, run.stdout


SEEN_LOSSES: list[float] = []


@tpp.hookimpl(wrapper=True)
def torchplug_backward(engine, loss, model):
    """A module-level hook function of a script, given on its own as a plugin."""
    SEEN_LOSSES.append(loss.item())
    return (yield)


def test_a_hook_function_given_as_a_plugin_runs_and_a_non_hook_function_is_refused():
    """The README's "a @tpp.hookimpl(wrapper=True) function given as Engine(plugins=[...])": a
    bare function used to be taken without error and never called."""
    SEEN_LOSSES.clear()
    with tp.Engine("single", plugins=[torchplug_backward]) as engine:
        model = engine.setup(torch.nn.Linear(3, 1))
        loss = model(torch.ones(2, 3)).sum()
        engine.backward(loss)
        assert [loss.item()] == SEEN_LOSSES
        assert model.weight.grad is not None  # the backward itself still ran
    with pytest.raises(tp.ConfigurationError, match="is not a hook.*named after the hook"):
        tp.Engine(
            "single",
            plugins=[
                test_a_hook_function_given_as_a_plugin_runs_and_a_non_hook_function_is_refused
            ],
        )


def test_a_file_path_given_as_plugin_module_is_refused_naming_the_module(tmp_path, monkeypatch):
    """``--plugin my_backend.py`` (a file, not a module): one error that names the module to
    pass instead."""
    (tmp_path / "my_backend.py").write_text("")
    monkeypatch.chdir(tmp_path)
    for given in ("my_backend.py", "./my_backend.py"):
        with pytest.raises(tpp.PluginError, match=r"not a file path: --plugin my_backend\)"):
            manager.import_plugin_module(manager.get_registry(), given, strict=True)
    with pytest.raises(tpp.PluginError, match=r"not a file path\) and"):
        manager.import_plugin_module(manager.get_registry(), "no_such_module", strict=True)
