"""The hook contract is enforced: a backend that leaves an action hook unanswered refuses to
start, a hook that answers with the wrong type is named, and close() leaves user objects as
they were found."""

from __future__ import annotations

import pickle
import re

import pluggy
import pytest
import torch

import torchplug as tp
import torchplug.plugin as tpp
from torchplug.engine.engine import Runtime
from torchplug.plugins.base import Strategy
from torchplug.plugins.ddp import DDPStrategy


class OnlyThree:
    """What a third party might write: setup, wrap and backward, nothing else."""

    @tpp.hookimpl
    def torchplug_setup(self, engine, cluster):
        return Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    @tpp.hookimpl
    def torchplug_wrap(self, engine, model, optimizers):
        return model, optimizers

    @tpp.hookimpl
    def torchplug_backward(self, engine, loss, model):
        loss.backward()
        return True


def register(name, factory):
    @tpp.hookimpl
    def torchplug_register_strategies(register):
        register(
            tpp.StrategyInfo(name=name, factory=factory, description="test", distributed=False)
        )

    class Provider:
        pass

    Provider.torchplug_register_strategies = staticmethod(torchplug_register_strategies)
    tp.register(Provider, name=f"provider-{name}")


@pytest.fixture
def defaults_blocked(monkeypatch):
    """The built-in ``torch_distributed`` plugin blocked, as a user would block it."""
    from torchplug.contract import manager

    monkeypatch.setenv("TORCHPLUG_BLOCK_PLUGINS", "torch_distributed")
    manager.reset_registry(forget_blocks=True)
    yield
    monkeypatch.delenv("TORCHPLUG_BLOCK_PLUGINS")
    manager.reset_registry(forget_blocks=True)


def test_a_backend_answers_only_what_it_changes():
    """Issue 26 item 3: the defaults are the built-in plugin ``torch_distributed``, so a backend
    that subclasses nothing and answers three hooks trains like plain PyTorch."""
    from torchplug.contract import manager

    register("only-three", OnlyThree)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    reference = pickle.loads(pickle.dumps(model))
    batches = [torch.randn(5, 4) for _ in range(3)]
    with tp.Engine("only-three") as engine:
        names = [manager.qualified_name(p) for p in engine.plugins]
        assert "torchplug.plugins.torch_distributed" in names, names
        step = engine.hook.torchplug_optimizer_step.get_hookimpls()
        assert [manager.qualified_name(i.plugin) for i in step] == [
            "torchplug.plugins.torch_distributed"
        ]
        wrapped, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        for batch in batches:
            optimizer.zero_grad()
            engine.backward(wrapped(batch).square().mean())
            engine.clip_grad_norm_(wrapped, 0.5, optimizer=optimizer)
            optimizer.step()
        assert engine.reduce(torch.tensor(2.0), "sum").item() == 2.0
    plain = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for batch in batches:
        plain.zero_grad()
        reference(batch).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        plain.step()
    theirs = reference.state_dict()
    assert list(model.state_dict()) == list(theirs)
    for name, ours in model.state_dict().items():
        assert torch.equal(ours, theirs[name]), name


def test_with_the_defaults_blocked_unanswered_hooks_refuse_to_start_naming_them(defaults_blocked):
    register("only-three", OnlyThree)
    with pytest.raises(tp.PluginError) as info:
        tp.Engine("only-three")
    message = str(info.value)
    assert "only-three" in message and "OnlyThree" in message
    for hook in ("torchplug_optimizer_step", "torchplug_reduce"):
        assert hook in message
    # save and load are answered by the built-in checkpoint plugin, whatever the backend
    named = set(re.findall(r"torchplug_\w+", message))
    assert "torchplug_save" not in named and "torchplug_load" not in named, named
    assert "torch_distributed" in message and "TORCHPLUG_BLOCK_PLUGINS" in message


def test_what_a_subclass_inherits_is_not_its_answer(defaults_blocked):
    """Inheriting `Strategy` answers nothing by itself: ``super()`` reaches the defaults, but
    with the plugin blocked, a built-in backend that relies on them is refused, naming them."""
    with pytest.raises(tp.PluginError) as info:
        tp.Engine("single")
    named = set(re.findall(r"torchplug_\w+", str(info.value)))
    assert {"torchplug_optimizer_step", "torchplug_reduce", "torchplug_barrier"} <= named, named


@pytest.mark.parametrize("name", ["single", "ddp", "tp", "only-three"])
def test_the_plugins_listing_names_what_the_engine_would_refuse(defaults_blocked, name, capsys):
    """`torchplug plugins` does not call a strategy usable that the Engine refuses to start:
    its static reading of a class backend names exactly the hooks the Engine's check names."""
    from torchplug.cli.plugins import plugins, unanswered_hooks
    from torchplug.contract import manager

    if name == "only-three":
        register(name, OnlyThree)
    with pytest.raises(tp.PluginError) as info:
        tp.Engine(name)
    refused = sorted(set(re.findall(r"torchplug_\w+", str(info.value))))
    registry = manager.get_registry()
    assert unanswered_hooks(registry, registry.strategies[name].factory) == refused
    plugins()
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(name))
    assert f"unusable: leaves {len(refused)} action hooks" in row, row
    assert "torch_distributed, the default, is blocked): remove it from" in row, row


def test_plugins_verbose_says_what_answers_each_hook_the_checkpoint_defaults_included():
    from torchplug.cli.plugins import hook_answers
    from torchplug.contract import manager
    from torchplug.plugins.single import SingleDevice

    answers = dict(hook_answers(manager.get_registry(), SingleDevice))
    assert answers["torchplug_setup"] == "torchplug.plugins.single:SingleDevice"
    for hook in ("torchplug_save", "torchplug_load", "torchplug_load_pretrained"):
        assert answers[hook].startswith("checkpoint (the built-in default"), answers
    assert answers["torchplug_reduce"].startswith("torch_distributed (the built-in default")
    assert not any(where.startswith("UNANSWERED") for where in answers.values()), answers


def test_the_plugins_listing_calls_a_backend_answering_everything_usable(defaults_blocked, capsys):
    from torchplug.cli.plugins import plugins, unanswered_hooks
    from torchplug.contract import manager
    from torchplug.plugins import torch_distributed as defaults

    class Everything(OnlyThree):
        pass

    for name in dir(defaults):
        if name.startswith("torchplug_") and not hasattr(OnlyThree, name):
            setattr(Everything, name, tpp.hookimpl(staticmethod(getattr(defaults, name))))
    register("everything", Everything)
    assert unanswered_hooks(manager.get_registry(), Everything) == []
    plugins()
    row = next(line for line in capsys.readouterr().out.splitlines() if "everything" in line)
    assert row.rstrip().endswith("usable") and "unusable" not in row, row


def test_the_checkpoint_defaults_are_a_plugin_that_can_be_blocked(monkeypatch):
    """Issue 26 item 3: the portable save/load is the built-in plugin `checkpoint` (listed,
    blockable), not a base-class method: blocked, a backend that does not answer save/load
    itself is refused naming them."""
    from torchplug.contract import manager

    with tp.Engine("single") as engine:
        names = [manager.qualified_name(p) for p in engine.plugins]
        assert "torchplug.checkpoint.defaults" in names, names
    monkeypatch.setenv("TORCHPLUG_BLOCK_PLUGINS", "checkpoint")
    manager.reset_registry(forget_blocks=True)
    try:
        with pytest.raises(tp.PluginError) as info:
            tp.Engine("single")
        named = set(re.findall(r"torchplug_\w+", str(info.value)))
        assert {"torchplug_save", "torchplug_load"} <= named, named
    finally:
        monkeypatch.delenv("TORCHPLUG_BLOCK_PLUGINS")
        manager.reset_registry(forget_blocks=True)


def test_a_plain_object_answering_every_hook_works(defaults_blocked):
    from torchplug.plugins import torch_distributed as defaults

    class Everything(OnlyThree):
        pass

    for name in dir(defaults):  # every default, as a hand-written backend would write them
        if name.startswith("torchplug_") and not hasattr(OnlyThree, name):
            function = getattr(defaults, name)
            setattr(Everything, name, tpp.hookimpl(staticmethod(function)))
    register("everything", Everything)
    with tp.Engine("everything") as engine:
        assert engine.reduce(torch.tensor(2.0), "sum").item() == 2.0


class WrongAnswers(Strategy):
    @tpp.hookimpl
    def torchplug_setup(self, engine, cluster):
        return Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    @tpp.hookimpl
    def torchplug_reduce(self, engine, tensor, op):
        return tensor.item()  # a float, not a tensor

    @tpp.hookimpl
    def torchplug_optimizer_step(self, engine, optimizer, closure):
        optimizer.step()
        return "done"


def test_a_wrong_answer_is_refused_naming_the_hook():
    register("wrong-answers", WrongAnswers)
    with tp.Engine("wrong-answers") as engine:
        with pytest.raises(tp.PluginError, match="answered torchplug_reduce with 2.0; it must"):
            engine.reduce(torch.tensor(2.0))
        model = torch.nn.Linear(2, 1)
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(tp.PluginError, match="torchplug_optimizer_step with 'done'"):
            optimizer.step()


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_close_leaves_user_objects_as_found(precision):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)  # made before setup: it wraps step
    found = vars(optimizer)["step"]
    engine = tp.Engine("single", precision=precision)
    same_model, same_optimizer = engine.setup(model, optimizer)
    assert same_model is model and same_optimizer is optimizer  # single wraps nothing
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    engine.close()
    assert "forward" not in vars(model)
    assert vars(optimizer)["step"] is found
    assert not hasattr(optimizer, "step_was_skipped")
    pickle.dumps(model)  # a patched forward (a closure) would not pickle
    before = model.weight.detach().clone()
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()  # the optimizer's own step again
    assert not torch.equal(model.weight, before)


def test_lr_scheduler_made_before_setup_does_not_warn(recwarn):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    with tp.Engine("single") as engine:
        model, optimizer = engine.setup(model, optimizer)
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    assert not [
        w for w in recwarn if "lr_scheduler" in str(w.message) or "overridden" in str(w.message)
    ]


def test_the_private_scheduler_protocol_the_engine_relies_on_is_still_torchs():
    """Issue 26 item 5: the Engine's optimizer.step sets two private names torch's LR schedulers
    read (``_wrapped_by_lr_sched`` on the step, ``_opt_called`` on the optimizer) so that a
    scheduler made before or after setup neither warns nor miscounts. If a torch release renames
    them, this fails naming the version, instead of users seeing false warnings."""
    import inspect

    source = inspect.getsource(torch.optim.lr_scheduler)
    for name in ("_wrapped_by_lr_sched", "_opt_called"):
        assert name in source, (
            f"torch {torch.__version__}'s LR schedulers no longer use {name}: update "
            f"torchplug.engine.wrappers.route_step to what they use now"
        )
    # and what the names are for, observed: the scheduler stepped after the optimizer's step,
    # in the right order, says nothing; stepped first, it warns (torch's own check still works)
    model = torch.nn.Linear(2, 1)
    with tp.Engine("single") as engine:
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        with pytest.warns(UserWarning, match="lr_scheduler.step()"):
            scheduler.step()  # before any optimizer.step(): torch's warning, as without us


def test_no_sync_answer_must_be_a_context_manager():
    class BadNoSync(WrongAnswers):
        @tpp.hookimpl
        def torchplug_reduce(self, engine, tensor, op):
            return tensor

        @tpp.hookimpl
        def torchplug_no_sync(self, engine, model):
            return 42

    register("bad-no-sync", BadNoSync)
    with (
        tp.Engine("bad-no-sync") as engine,
        pytest.raises(tp.PluginError, match="torchplug_no_sync"),
        engine.no_sync(torch.nn.Linear(1, 1)),
    ):
        pass


class RecordingStep(Strategy):
    """A backend whose step does work of its own around the update (a sync, a flush)."""

    calls = 0

    @tpp.hookimpl
    def torchplug_setup(self, engine, cluster):
        return Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    @tpp.hookimpl
    def torchplug_optimizer_step(self, engine, optimizer, closure):
        RecordingStep.calls += 1
        optimizer.step()
        return True


def test_amp_wraps_the_backends_step_instead_of_replacing_it():
    register("recording-step", RecordingStep)
    with tp.Engine(
        "recording-step", precision="fp16", precision_options={"init_scale": 256.0}
    ) as engine:
        model = torch.nn.Linear(2, 1)
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        engine.backward(model(torch.ones(1, 2)).sum())
        optimizer.step()
        assert RecordingStep.calls == 1 and not optimizer.step_was_skipped
        optimizer.zero_grad()
        before = model.weight.detach().clone()
        engine.backward(model(torch.ones(1, 2)).sum() * float("inf"))
        optimizer.step()
        assert RecordingStep.calls == 2  # the backend's step ran (its syncs and flushes) ...
        assert optimizer.step_was_skipped  # ... but the update did not
        assert torch.equal(model.weight, before)


def test_every_hook_declares_its_contract_beside_its_specification():
    """Issue 26 item 1: spec.py holds the whole contract; the manager, the Engine's dispatch and
    answer checks and docs/hooks.md read it from there (the sets below are what each held
    before, written out so that a changed contract is a visible change)."""
    from torchplug.cli import hookdoc
    from torchplug.contract import hooks, manager, spec

    specified = {name for name, _ in hookdoc.hooks()}
    assert set(spec.CONTRACTS) == specified
    assert {c.kind for c in spec.CONTRACTS.values()} == {
        "registration", "strategy", "installed plugins"
    }  # fmt: skip
    assert spec.hooks_where(kind="installed plugins") == {
        "torchplug_cluster_environment", "torchplug_convert_checkpoint",
        "torchplug_read_checkpoint",
    }  # fmt: skip
    optional = {
        "torchplug_teardown", "torchplug_compile", "torchplug_init_module",
        "torchplug_checkpoint_state", "torchplug_checkpoint_metadata",
        "torchplug_load_pretrained", "torchplug_resume", "torchplug_forward_backward",
        "torchplug_batch_sampler",
    }  # fmt: skip
    assert spec.hooks_where(kind="strategy") == manager.STRATEGY_HOOKS
    assert manager.STRATEGY_HOOKS - optional == manager.ACTION_HOOKS
    specified_pm = pluggy.PluginManager(spec.PROJECT)
    specified_pm.add_hookspecs(spec)
    assert set(hooks.per_step_hooks(specified_pm)) == spec.hooks_where(per_step=True) == {
        "torchplug_backward", "torchplug_optimizer_step", "torchplug_reduce",
        "torchplug_gather", "torchplug_place_batch", "torchplug_clip_grad_norm",
        "torchplug_no_sync", "torchplug_autocast", "torchplug_barrier",
    }  # fmt: skip
    for name, declared in spec.CONTRACTS.items():
        assert declared.called, name
        assert declared.required <= (declared.kind == "strategy"), name
        if declared.answer is not None:
            assert isinstance(hooks.ANSWER_TYPES[declared.answer], type), name
            assert declared.answer_text, name


def test_plugins_given_as_a_generator_all_join_the_active_set():
    class Marker:
        @tpp.hookimpl(wrapper=True)
        def torchplug_reduce(self, engine, tensor, op):
            self.called = True
            return (yield)

    markers = [Marker(), Marker()]
    with tp.Engine("single", plugins=(m for m in markers)) as engine:
        assert all(m in engine.plugins for m in markers)
        engine.reduce(torch.tensor(1.0))
    assert all(getattr(m, "called", False) for m in markers)


def test_load_pretrained_and_resume_s_step_check_go_through_hooks(tmp_path):
    """Issue 26: core reads no checkpoint format itself; `engine.load_pretrained` and resume's
    step check ask the active set (the built-in `checkpoint` plugin answers both)."""
    from safetensors.torch import save_file

    seen = []

    class Watch:
        @tpp.hookimpl(wrapper=True)
        def torchplug_load_pretrained(self, engine, model, path, strict):
            seen.append("load_pretrained")
            return (yield)

        @tpp.hookimpl(wrapper=True)
        def torchplug_checkpoint_metadata(self, engine, path):
            seen.append("checkpoint_metadata")
            return (yield)

    source = torch.nn.Linear(3, 2)
    save_file(
        {k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "w.safetensors"
    )
    with tp.Engine("single", plugins=[Watch()], checkpoint_dir=tmp_path / "ckpt") as engine:
        model = engine.setup(torch.nn.Linear(3, 2))
        result = engine.load_pretrained(model, tmp_path / "w.safetensors")
        assert sorted(result["loaded"]) == ["bias", "weight"]
        assert torch.equal(model.weight.detach(), source.weight.detach())
        engine.save_checkpoint({"model": model}, step=3)
    (tmp_path / "ckpt" / "step-3").rename(tmp_path / "ckpt" / "step-9")
    with pytest.raises(
        tp.CheckpointError, match="its name says step 9, but its metadata says step 3"
    ):
        tp.Engine(
            "single", plugins=[Watch()], checkpoint_dir=tmp_path / "ckpt", resume="latest"
        ).resume({"model": torch.nn.Linear(3, 2)})
    assert seen == ["load_pretrained", "checkpoint_metadata"]


def test_load_pretrained_with_the_checkpoint_plugin_blocked_says_how_to_fix_it(
    monkeypatch, tmp_path
):
    from torchplug.contract import manager

    monkeypatch.setenv("TORCHPLUG_BLOCK_PLUGINS", "checkpoint")
    manager.reset_registry(forget_blocks=True)
    try:

        class SavesItself(OnlyThree):
            @tpp.hookimpl
            def torchplug_save(self, engine, path, state, metadata):
                return True

            @tpp.hookimpl
            def torchplug_load(self, engine, path, state, strict):
                return {}

        register("saves-itself", SavesItself)
        with tp.Engine("saves-itself") as engine:
            model = engine.setup(torch.nn.Linear(3, 2))
            with pytest.raises(tp.PluginError, match="unblock it"):
                engine.load_pretrained(model, tmp_path / "absent.safetensors")
    finally:
        monkeypatch.delenv("TORCHPLUG_BLOCK_PLUGINS")
        manager.reset_registry(forget_blocks=True)


def test_every_strategy_hook_has_one_method_on_the_typed_facade():
    """Issue 26 item 2: one channel. Every strategy hook torchplug calls has its method on
    `Hooks` (tox's typed façade), and no module of torchplug calls a strategy hook through
    pluggy's relay (``.hook.torchplug_...``) any more."""
    import pathlib

    from torchplug.contract import hooks, manager

    methods = {name for name in vars(hooks.Hooks) if not name.startswith("_")}
    for hook in manager.STRATEGY_HOOKS:
        assert hook.removeprefix("torchplug_") in methods, hook
    src = pathlib.Path(hooks.__file__).resolve().parent.parent
    strategy = "|".join(sorted(manager.STRATEGY_HOOKS))
    pattern = re.compile(rf"\.hook\.({strategy})\(")
    callers = sorted(
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        if path.name != "hooks.py" and pattern.search(path.read_text())
    )
    assert not callers, callers


def _annotated_factory(**options) -> DDPStrategy:  # as a plugin module writes a factory
    return DDPStrategy(**options)


def test_the_backend_class_is_read_from_a_class_a_partial_a_wrapper_or_an_annotation():
    import functools

    from torchplug.cli.plugins import backend_class

    @functools.wraps(DDPStrategy)
    def wrapped(**options):
        return DDPStrategy(**options)

    assert backend_class(DDPStrategy) is DDPStrategy
    assert backend_class(functools.partial(DDPStrategy, timeout=5.0)) is DDPStrategy
    assert backend_class(wrapped) is DDPStrategy
    assert backend_class(_annotated_factory) is DDPStrategy
    assert backend_class(lambda **options: DDPStrategy(**options)) is None


def test_first_line_says_when_it_cut_and_never_cuts_inside_a_word_or_path_part():
    from torchplug.contract.errors import first_line

    assert first_line("short and whole") == "short and whole"
    assert first_line("first\nsecond", rest="X") == "first ... (cut: X)"
    words = first_line("alpha " * 100, limit=50, rest="X")
    assert words == "alpha alpha alpha alpha alpha alpha alpha alpha ... (cut: X)"
    path = first_line("no file at " + "/some/dir" * 40, limit=60, rest="X")
    assert re.search(r"(/some/dir)+/ \.\.\. \(cut: X\)$", path), path
    assert len(first_line("y" * 500, limit=50)) < 100
