"""Hooks get a narrow context (issue 26 item 4): a `HookContext` as their ``engine`` argument,
which answers what a backend may read and call, and reaches the rest of the Engine only with a
warning (through API 1.x)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchplug as tp
import torchplug.plugin as tpp
from torchplug.contract.context import HookContext, iter_members
from torchplug.engine.engine import BACKEND_ONLY
from torchplug.plugin import HookContextWarning


class Recorder:
    """An extension that records what each hook receives as ``engine``."""

    def __init__(self) -> None:
        self.seen: dict[str, object] = {}

    @tpp.hookimpl(wrapper=True)
    def torchplug_wrap(self, engine, model, optimizers):
        self.seen["wrap"] = engine
        return (yield)

    @tpp.hookimpl(wrapper=True)
    def torchplug_backward(self, engine, loss, model):
        self.seen["backward"] = engine
        return (yield)

    @tpp.hookimpl(wrapper=True)
    def torchplug_optimizer_step(self, engine, optimizer, closure):
        self.seen["optimizer_step"] = engine
        return (yield)

    @tpp.hookimpl(wrapper=True)
    def torchplug_reduce(self, engine, tensor, op):
        self.seen["reduce"] = engine
        return (yield)

    @tpp.hookimpl(wrapper=True)
    def torchplug_save(self, engine, path, state, metadata):
        self.seen["save"] = engine
        return (yield)


def test_every_hook_gets_the_context_not_the_engine(tmp_path):
    recorder = Recorder()
    with tp.Engine("single", plugins=[recorder]) as engine:
        model = torch.nn.Linear(3, 2)
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        engine.backward(model(torch.ones(2, 3)).sum())
        optimizer.step()
        engine.reduce(torch.tensor(1.0))
        engine.save(tmp_path / "ckpt", {"model": model})
    assert set(recorder.seen) == {"wrap", "backward", "optimizer_step", "reduce", "save"}
    for hook, received in recorder.seen.items():
        assert type(received) is HookContext, hook
        assert received is recorder.seen["wrap"], hook  # one context per Engine


def test_every_member_answers_what_the_engine_answers():
    with tp.Engine("single") as engine:
        context = engine._context
        names = list(iter_members())
        assert {"rank", "device", "mesh", "options", "reduce", "hook"} <= set(names)
        with warnings.catch_warnings():
            warnings.simplefilter("error", HookContextWarning)
            for name in names:
                ours = getattr(context, name)
                if name == "hooks":
                    theirs = engine._hooks
                elif name in BACKEND_ONLY:  # the backend's calls: owned apart from the Engine
                    theirs = getattr(engine._backend, name)
                else:
                    theirs = getattr(engine, name)
                if callable(theirs) and not isinstance(theirs, torch.device):
                    assert callable(ours), name
                else:
                    assert ours == theirs or ours is theirs, name
        assert context.reduce(torch.tensor(3.0), "sum").item() == 3.0


def test_the_backend_only_members_left_the_engine_and_warn_for_one_cycle():
    """Issue 33 item 3: what only a backend calls is the context's (owned by the Engine's
    BackendState), gone from the user's Engine and its reference; an API 1.x plugin or script
    that calls it on the Engine still works, with a DeprecationWarning naming the replacement."""
    model = torch.nn.Linear(2, 1)
    with tp.Engine("single") as engine:
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for name in BACKEND_ONLY:
            assert name not in dir(tp.Engine) and name in set(iter_members()), name
        with pytest.warns(DeprecationWarning, match=r"engine\.model_of is a backend's call"):
            found = engine.model_of(optimizer, {})
        assert found is model is engine._context.model_of(optimizer, {})
        with pytest.warns(DeprecationWarning, match="skipping_updates"):
            skipping = engine.skipping_updates(optimizer, True)
        before = model.weight.detach().clone()
        engine.backward(model(torch.ones(1, 2)).sum())
        with skipping:  # the alias is the real thing: the update is skipped
            optimizer.step()
        assert torch.equal(model.weight, before)
        with pytest.raises(AttributeError, match="no attribute 'no_such_member'"):
            engine.no_such_member  # noqa: B018


def _reachable_from(root: object, limit: int = 500_000) -> list[object]:
    """Every object reachable from ``root`` by strong references, modules, classes and
    functions' globals left out (they reach everything)."""
    import gc
    import sys
    import types

    module_dicts = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    seen: set[int] = set()
    found: list[object] = []
    todo = [root]
    while todo and len(found) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)) or id(obj) in module_dicts:
            continue
        seen.add(id(obj))
        found.append(obj)
        if isinstance(obj, types.FunctionType):
            todo += [c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not c]
            todo += list(obj.__defaults__ or ())
        else:
            todo += gc.get_referents(obj)
    return found


def test_the_context_holds_no_engine_reference():
    """Issue 33 item 3: the context is built from the objects that own the Engine's state
    (selection, collectives, BackendState, typed hooks), not from the Engine; nothing a hook
    can reach holds the Engine strongly (API 1.x's fall-through goes through a weak reference),
    and neither does the user's optimizer after setup."""
    with tp.Engine("single") as engine:
        model = torch.nn.Linear(3, 2)
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        engine.backward(model(torch.ones(2, 3)).sum())
        optimizer.step()
        reachable = _reachable_from(engine._context)
        assert any(obj is engine._backend for obj in reachable)  # the walk does reach owners
        assert not any(obj is engine for obj in reachable)
        assert not any(obj is engine for obj in _reachable_from(optimizer))
    # and a planted back-pointer is found
    engine._backend.planted = engine
    assert any(obj is engine for obj in _reachable_from(engine._context))


class ReadsTheLogDir(tpp.Strategy):
    """An API 1.0 plugin that reads an Engine member the context does not offer."""

    @tpp.hookimpl
    def torchplug_setup(self, engine, cluster):
        self.log_dir = engine.loggers  # not a HookContext member
        return tpp.Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_an_engine_member_outside_the_context_still_works_with_a_warning_naming_it():
    @tpp.hookimpl
    def torchplug_register_strategies(register):
        register(
            tpp.StrategyInfo(
                name="reads-log-dir", factory=ReadsTheLogDir, description="t", distributed=False
            )
        )

    class Provider:
        pass

    Provider.torchplug_register_strategies = staticmethod(torchplug_register_strategies)
    tp.register(Provider, name="provider-reads-log-dir")
    with pytest.warns(HookContextWarning, match=r"engine\.loggers in a hook") as caught:
        engine = tp.Engine("reads-log-dir")
    try:
        assert engine.backend.log_dir is engine.loggers  # it reached the Engine's own
        assert caught[0].filename == __file__  # pointed at the plugin's line
    finally:
        engine.close()
    with pytest.raises(AttributeError):
        engine._context.no_such_member  # noqa: B018


def _train_strict(strategy: str, path: str, precision: str = "32") -> float:
    """A few steps, a clip, an accumulation, a save and a load, where any built-in plugin's
    read outside the context is an error."""
    warnings.simplefilter("error", HookContextWarning)
    torch.manual_seed(0)
    with tp.Engine(strategy, precision=precision) as engine:
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)
        )
        model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        for _ in range(4):
            with engine.accumulate(model, 2):
                loss = model(torch.randn(6, 4)).square().mean()
                engine.backward(loss)
                engine.clip_grad_norm_(model, 1.0, optimizer=optimizer)
                optimizer.step()
                optimizer.zero_grad()
        engine.save(path, {"model": model, "optimizer": optimizer, "step": 4})
        engine.load(path, {"model": model, "optimizer": optimizer})
        engine.full_state(model, optimizer)
        return float(engine.reduce(loss.detach(), "mean"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_built_in_backends_stay_inside_the_context(ranks, tmp_path, strategy):
    losses = ranks.run(_train_strict, strategy, str(tmp_path / "ckpt"), timeout=300)
    assert losses[0] == losses[1]


@pytest.mark.parametrize("precision", ["32", "bf16", "fp16"])
def test_the_single_backend_and_amp_stay_inside_the_context(tmp_path, precision):
    from torchplug.util.capabilities import cpu_kernels_missing

    if precision != "32" and cpu_kernels_missing(precision):
        pytest.skip(f"{precision}: {cpu_kernels_missing(precision)}")
    with warnings.catch_warnings():
        _train_strict("single", str(tmp_path / "ckpt"), precision)


POKES = (
    "import torch\n"
    "import torchplug.plugin as tpp\n"
    "class Pokes:\n"
    "    @tpp.hookimpl(wrapper=True)\n"
    "    def torchplug_reduce(self, engine, tensor, op):\n"
    "        engine.loggers\n"
    "        return (yield)\n"
)
POKED = (
    "import torch, torchplug as tp, pokes\n"
    "with tp.Engine('single', plugins=[pokes.Pokes()]) as engine:\n"
    "    engine.reduce(torch.tensor(1.0))\n"
)


def run_poked(tmp_path, *options: str, warnings_env: str | None = None):
    """The script above in a fresh interpreter, with the given -W options / PYTHONWARNINGS."""
    import os
    import subprocess
    import sys

    (tmp_path / "pokes.py").write_text(POKES)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    if warnings_env is not None:
        env["PYTHONWARNINGS"] = warnings_env
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run(
        [sys.executable, *options, "-c", POKED], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip


def test_the_warning_is_shown_by_default_outside_main(tmp_path):
    """A hook never runs in ``__main__``, where Python shows DeprecationWarnings; torchplug shows
    this one anyway, or an author would never see it under launch or check."""
    done = run_poked(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "pokes.py:6: HookContextWarning: engine.loggers in a hook" in done.stderr, done.stderr


@pytest.mark.parametrize("option", ["error", "error::DeprecationWarning"])
def test_python_dash_w_error_makes_it_an_error(tmp_path, option):
    """The user's own warning filter decides (an outsider found ``-W error`` had no effect)."""
    done = run_poked(tmp_path, "-W", option)
    assert done.returncode != 0, done.stderr
    assert "HookContextWarning: engine.loggers in a hook" in done.stderr, done.stderr
    assert "Traceback" in done.stderr, done.stderr


def test_pythonwarnings_can_hide_it(tmp_path):
    done = run_poked(tmp_path, warnings_env="ignore::DeprecationWarning")
    assert done.returncode == 0, done.stderr
    assert "HookContextWarning" not in done.stderr, done.stderr
