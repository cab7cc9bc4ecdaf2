"""Generate the hook reference (docs/hooks.md) from the hook specification.

``python -m torchplug.cli.hookdoc > docs/hooks.md``. Every hook found in
`torchplug.contract.spec` is listed, with its signature, return value, calling semantics
(firstresult or not, wrappers), who calls it on which ranks (the contract declared with it),
its default implementation and an example, so the reference cannot drift from the
specification (a test compares them).
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from torchplug.contract import spec

#: Hand-written examples; other hooks get one made from their signature.
EXAMPLES: dict[str, str] = {
    "torchplug_register_strategies": """\
        @tpp.hookimpl
        def torchplug_register_strategies(register):
            register(tpp.StrategyInfo(
                name="ddp-bf16comm", factory=MyDDP, extends="ddp",
                description="DDP with bf16-compressed all-reduce", tolerance=1e-2,
            ))
        """,
    "torchplug_cluster_environment": """\
        @tpp.hookimpl
        def torchplug_cluster_environment(env):
            if "MY_SCHED_RANK" not in env:
                return None                      # not my scheduler: let the others answer
            return tpp.ClusterInfo(
                rank=int(env["MY_SCHED_RANK"]), world_size=int(env["MY_SCHED_SIZE"]),
                master_addr=env["MY_SCHED_HEAD"], master_port=29500, source="my scheduler",
            )
        """,
    "torchplug_wrap": """\
        class MyDDP(tpp.DDPStrategy):
            @tpp.hookimpl
            def torchplug_wrap(self, engine, model, optimizers):
                model, optimizers = super().torchplug_wrap(engine, model, optimizers)
                if hasattr(model, "register_comm_hook"):  # a frozen model: not wrapped
                    model.register_comm_hook(None, my_hook)
                return model, optimizers
        """,
    "torchplug_optimizer_step": """\
        class NaNGuard:
            \"\"\"Skip the update when any rank's gradients hold NaN/inf.\"\"\"

            @tpp.hookimpl(wrapper=True)
            def torchplug_optimizer_step(self, engine, optimizer, closure):
                bad = any(not p.grad.isfinite().all() for g in optimizer.param_groups
                          for p in g["params"] if p.grad is not None)
                bad = engine.reduce(torch.tensor(float(bad)), op="max").item() > 0
                with engine.skipping_updates(optimizer, bad):   # the real step does nothing
                    stepped = yield                             # the backend still runs
                return stepped and not bad                      # False: "skipped"
        """,
    "torchplug_backward": """\
        class LossLogger:
            @tpp.hookimpl(wrapper=True)
            def torchplug_backward(self, engine, loss, model):
                print(f"rank {engine.rank}: loss {loss.item():.4f}")
                return (yield)
        """,
}


def _kind(name: str) -> str:
    return spec.CONTRACTS[name].kind


def hooks() -> list[tuple[str, Callable[..., Any]]]:
    """Every hook of the specification, in the order spec.py defines them."""
    return [
        (name, value)
        for name, value in vars(spec).items()
        if name.startswith("torchplug_")
        and callable(value)
        and getattr(value, f"{spec.PROJECT}_spec", None) is not None
    ]


def _default(name: str) -> str:
    """Where torchplug's default answer lives, if any."""
    import importlib

    from torchplug.contract import manager
    from torchplug.plugins import torchrun
    from torchplug.plugins.base import DistributedStrategy, Strategy

    modules = manager.builtin_modules()
    for plugin in sorted(manager.DEFAULT_ANSWERS):  # built-in plugins, loaded as plugins are
        module = importlib.import_module(modules[plugin])
        if callable(getattr(module, name, None)):
            delegate = (
                f" In a `torchplug.plugin.Strategy` subclass, `super().{name}(...)` calls it."
                if name in vars(Strategy)
                else ""
            )
            return (
                f"`{module.__name__}.{name}`: the built-in plugin `{plugin}`, in every "
                f"Engine's active set, registered before the backend and marked `trylast`, "
                f"so any answer of the backend's wins (block it with "
                f"`TORCHPLUG_BLOCK_PLUGINS={plugin}`).{delegate}"
            )

    if name in vars(DistributedStrategy):
        return (
            f"`{DistributedStrategy.__module__}.DistributedStrategy.{name}` (subclass "
            f"`torchplug.plugin.DistributedStrategy` to inherit it: a process group of its own)."
        )
    if hasattr(torchrun, name):
        return (
            "`torchplug.plugins.torchrun` reads torchrun's variables (`RANK`, `WORLD_SIZE`, "
            "`LOCAL_RANK`, `MASTER_ADDR`, ...): first inside a worker torchrun started (a "
            "scheduler's variables there were inherited from the launcher), last otherwise; "
            "without them the process is rank 0 of 1. Built-in schedulers: SLURM, Kubeflow "
            "PyTorchJob, LSF, mpirun."
        )
    if name == "torchplug_init_module":
        return (
            "the Engine's: build on the meta device, materialise in `setup` (each rank's "
            "shards after the wrap when the backend takes meta modules, else all before it)."
        )
    if name == "torchplug_compile":
        return (
            "the Engine's: `model.compile(**options)` on the wrapped model (in place). FSDP "
            "compiles each unit; DeepSpeed and XLA refuse."
        )
    return "None: a plugin that does not implement it is simply not called."


def _example(name: str, function: Callable[..., Any], firstresult: bool) -> str:
    if name in EXAMPLES:
        return textwrap.dedent(EXAMPLES[name])
    args = ", ".join(inspect.signature(function).parameters)
    if firstresult and _kind(name) == "strategy":
        return (
            f"class Watch:\n"
            f"    @tpp.hookimpl(wrapper=True)          # runs around the backend's answer\n"
            f"    def {name}(self, {args}):\n"
            f"        result = yield                  # the backend (or the next wrapper)\n"
            f"        return result                   # or a changed answer\n"
        )
    return f"@tpp.hookimpl\ndef {name}({args}):\n    ...\n"


def _semantics(name: str, opts: dict[str, Any]) -> str:
    if opts.get("historic"):
        return "historic: also called for plugins registered later."
    if opts.get("firstresult"):
        text = (
            "firstresult: implementations are called last-registered first, and the first "
            "answer that is not `None` is the result. Wrappers (`@hookimpl(wrapper=True)`) run "
            "around it: code before `yield` runs first, `yield` returns the answer (or raises "
            "its exception), and the wrapper returns the final result, which may differ."
        )
        if spec.CONTRACTS[name].required:
            text += " The Engine refuses to start when no plugin of its active set answers it."
        elif _kind(name) == "strategy":
            text += " Optional: the Engine has its own answer when no plugin gives one."
        return text
    return (
        "every implementation is called; the results (other than `None`) come back as a list, "
        "and an exception in one stops the call."
    )


def _signature(name: str, function: Callable[..., Any]) -> str:
    from torchplug.contract.manager import hook_signature

    params = inspect.signature(function).parameters
    if len(hook_signature(name)) <= 96:
        return hook_signature(name)
    lines = [
        f"    {p.name}: {p.annotation}," if p.annotation is not inspect.Parameter.empty else p.name
        for p in params.values()
    ]
    returns = inspect.signature(function).return_annotation
    shown = "" if returns is inspect.Signature.empty else f" -> {returns}"
    return f"{name}(\n" + "\n".join(lines) + f"\n){shown}"


def _split_args(doc: str) -> tuple[str, list[str]]:
    """A hook's docstring without its Google-style ``Args:`` section, and that section's
    entries as Markdown list items (``- `name`: text``)."""
    prose: list[str] = []
    entries: list[str] = []
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != "Args:":
            prose.append(lines[i])
            i += 1
            continue
        i += 1
        while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
            line = lines[i]
            if line.startswith("        ") and entries:  # continues the entry above
                entries[-1] += " " + line.strip()
            elif line.strip():
                name, _, text = line.strip().partition(": ")
                entries.append(f"- `{name}`: {text}")
            i += 1
    return "\n".join(prose).strip("\n"), entries


def render() -> str:
    """The whole of docs/hooks.md."""
    out = [
        "# Hook reference",
        "",
        "<!-- Generated by `python -m torchplug.cli.hookdoc > docs/hooks.md` from",
        "     src/torchplug/contract/spec.py; do not edit by hand (a test compares them). -->",
        "",
        f"Plugin API version **{spec.API_VERSION}** (`torchplug.plugin.API_VERSION`). A plugin "
        "is a module, class or object whose functions are named like the hooks below and marked "
        "`@hookimpl` from `torchplug.plugin`, the plugin authors' face (unmarked `torchplug_*` "
        "functions are accepted too). The examples write `tpp.` for "
        "`import torchplug.plugin as tpp`.",
        "",
        "- **Arguments are passed by name.** An implementation accepts any subset of the hook's "
        "arguments, spelled as below; an argument the hook does not pass is refused at "
        "registration, naming the plugin and showing the expected signature.",
        "- **firstresult hooks** have one answer: the first implementation returning something "
        "other than `None`. Wrappers (`@hookimpl(wrapper=True)`) surround it; a wrapper cannot "
        "skip the backend (it must `yield` exactly once), but it may change the answer, e.g. "
        "return `False` from `torchplug_optimizer_step` to report a skipped step (the update "
        "itself is skipped with `engine.skipping_updates`).",
        "- **Order**: the last registered implementation runs first; `tryfirst`/`trylast` "
        "change that. torchplug's defaults are `trylast`.",
        "- **Which ranks**: every strategy hook runs on every rank; the collectives (reduce, "
        "gather, barrier, save, load) must be called by all ranks in the same order.",
        "- `TORCHPLUG_TRACE=1` prints each call, the wrappers around it and the final result.",
        "",
        "Renamed or retired hooks keep working, with a `DeprecationWarning` (pluggy's "
        "`warn_on_impl`) naming the replacement, until the next major API version, which "
        "removes them (a minor version only adds; see [plugins.md](plugins.md#8-versioning)).",
        "",
    ]
    if spec.RETIRED_HOOKS:
        out += ["| deprecated hook | replacement | removed in API |", "| --- | --- | --- |"]
        out += [
            f"| `{old}` | {f'`{new}`' if new else '(none)'} | {removed} |"
            for old, (new, removed) in sorted(spec.RETIRED_HOOKS.items())
        ]
        out.append("")
    listed = hooks()
    out += ["## Contents", ""]
    out += [f"- [`{name}`](#{name}) ({_kind(name)})" for name, _ in listed]
    out.append("")
    for name, function in listed:
        opts = getattr(function, f"{spec.PROJECT}_spec", {}) or {}
        returns = inspect.signature(function).return_annotation
        doc, arguments = _split_args(inspect.getdoc(function) or "(undocumented)")
        out += [
            f"## {name}",
            "",
            "<!-- not run: the hook's signature, not a program -->",
            "```python",
            _signature(name, function),
            "```",
            "",
            doc,
            "",
        ]
        if arguments:
            out += ["- **Arguments**:", *(f"    {entry}" for entry in arguments)]
        out += [
            f"- **Kind**: {_kind(name)} hook."
            if _kind(name) != "installed plugins"
            else "- **Kind**: called on every installed plugin (not on an Engine's active set).",
            f"- **Returns**: `{returns}`.",
            f"- **Semantics**: {_semantics(name, opts)}",
            f"- **Called**: {spec.CONTRACTS[name].called}",
            f"- **Default implementation**: {_default(name)}",
        ]
        if opts.get("warn_on_impl") is not None:
            out.append(f"- **Deprecated**: {opts['warn_on_impl']}")
        out += ["", "Example:", "", "<!-- not run: a hook implementation, for a plugin -->"]
        out += ["```python", _example(name, function, opts.get("firstresult"))]
        out[-1] = out[-1].rstrip("\n")
        out += ["```", ""]
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(render())
