"""Imports point downward (docs/architecture.md, "Layers"), function bodies included: every
module of src/torchplug is parsed and each import, wherever it is written, is checked against
the layer order. Issue 26 item 6."""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import ROOT

SRC = ROOT / "src"

#: Each package's layer (issue 33): a module may import its own layer and those below it, never
#: above: ``util < contract < features, checkpoint < engine < plugins, loggers < trainer <
#: testing, cli``. The two faces sit where what they export does: ``torchplug.plugin`` beside the
#: built-in plugins, ``torchplug`` (the users') above the Trainer.
LAYERS = {
    "torchplug.util": 0,
    "torchplug._lazy": 0,
    "torchplug.contract": 1,
    "torchplug._deprecated": 2,
    "torchplug.features": 2,
    "torchplug.checkpoint": 2,
    "torchplug.engine": 3,
    "torchplug.plugins": 4,
    "torchplug.plugin": 4,
    "torchplug.loggers": 4,
    "torchplug.trainer": 5,
    "torchplug": 6,  # the front door (lazy exports of engine, trainer, ...): what users import
    "torchplug.testing": 7,
    "torchplug.cli": 8,
    "torchplug.__main__": 9,  # ``python -m torchplug``: the command line
    "torchplug.core": 9,  # API 1.x aliases of the old module names (imports nothing itself)
}

BACKEND_PACKAGES = ("deepspeed", "fairscale", "torch_xla")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, name: str | None = None, src: Path = SRC) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (function bodies and ``if
    TYPE_CHECKING:`` blocks included); ``from pkg import name`` counts as ``pkg.name`` when that
    is a module or package, else as ``pkg``. ``name``: the module's name when ``path`` is not
    under ``src``."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                as_path = src / candidate.replace(".", "/")
                is_module = as_path.with_suffix(".py").exists() or as_path.is_dir()
                found.add(candidate if is_module else base)
    return found


def layer_of(module: str) -> int | None:
    owners = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(owners, key=len)] if owners else None


def graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the torchplug modules it imports (a package's ``__init__`` when the import names
    a package), self-imports left out."""
    modules = {
        ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted((src / "torchplug").rglob("*.py"))
    }

    def owner(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    found = {}
    for module, path in modules.items():
        targets = {owner(t) for t in imports(path, module, src) if t.split(".")[0] == "torchplug"}
        found[module] = {t for t in targets if t is not None and t != module}
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``edges``: each strongly connected component of more than one
    module (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The edges of ``edges`` that point to a higher layer than their module's."""
    return sorted(
        (module, target)
        for module, targets in edges.items()
        for target in targets
        if (layer_of(module) or 0) < (layer_of(target) or 0)
    )


def test_every_module_has_a_layer():
    unplaced = sorted(module for module in graph() if layer_of(module) is None)
    assert not unplaced, f"give these a layer in LAYERS and docs/architecture.md: {unplaced}"


def test_imports_point_downward_everywhere_function_bodies_included():
    assert not upward(graph()), f"imports pointing up a layer: {upward(graph())}"


def test_no_import_cycles_type_hints_and_function_bodies_included():
    """Issue 33 item 2: not one cycle, counting imports in function bodies and under ``if
    TYPE_CHECKING:`` (a cycle hidden in a function is still a cycle of design)."""
    found = cycles(graph())
    assert not found, f"import cycles: {found}"


def test_a_planted_cycle_and_a_planted_upward_edge_fail(tmp_path):
    """The checks themselves: a copy of src with two modules planted, one closing a cycle
    through a ``TYPE_CHECKING`` import and one importing up a layer inside a function."""
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(SRC / "torchplug", copy / "torchplug", ignore=shutil.ignore_patterns("*.pyc"))
    assert not cycles(graph(copy)) and not upward(graph(copy))  # the copy is as clean as src
    (copy / "torchplug" / "contract" / "planted_a.py").write_text(
        "from torchplug.contract import planted_b\n"
    )
    (copy / "torchplug" / "contract" / "planted_b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from torchplug.contract.planted_a import X\n"
    )
    (copy / "torchplug" / "features" / "planted_up.py").write_text(
        "def late():\n    from torchplug.engine import engine\n    return engine\n"
    )
    edges = graph(copy)
    assert cycles(edges) == [["torchplug.contract.planted_a", "torchplug.contract.planted_b"]]
    assert upward(edges) == [("torchplug.features.planted_up", "torchplug.engine.engine")]


def test_nothing_below_the_plugins_imports_a_backend_package():
    offenders = [
        (name, target)
        for path in sorted((SRC / "torchplug").rglob("*.py"))
        if (layer_of(name := module_name(path)) or 0) <= LAYERS["torchplug.engine"]
        for target in imports(path)
        if target.split(".")[0] in BACKEND_PACKAGES
    ]
    assert not offenders


#: Issue 33 item 4: what a module under plugins/ may import of torchplug besides the authors' face
#: (``torchplug.plugin``) and its own package. ``plugins.base`` is what the face's ``Strategy``
#: is: its ``super()`` answers delegate to the default plugin, ``torch_distributed``.
PLUGIN_EXCEPTIONS = {"torchplug.plugins.base": {"torchplug.plugins.torch_distributed"}}


def plugin_imports(src: Path = SRC) -> list[tuple[str, str]]:
    """Every (module, import) under ``plugins/`` that reaches past the authors' face: a torchplug
    module other than ``torchplug.plugin``, the module's own package (``plugins.deepspeed.*``
    for ``plugins/deepspeed/``) and `PLUGIN_EXCEPTIONS`."""
    found = []
    for path in sorted((src / "torchplug" / "plugins").rglob("*.py")):
        name = (
            module_name(path)
            if src == SRC
            else ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        )
        if name == "torchplug.plugins":
            continue
        own = ".".join(name.split(".")[:3])  # torchplug.plugins.<plugin>
        for target in imports(path, name, src):
            if target.split(".")[0] != "torchplug" or target == "torchplug.plugin":
                continue
            if target == own or target.startswith(own + "."):
                continue  # its own package
            if target in PLUGIN_EXCEPTIONS.get(name, ()):
                continue
            found.append((name, target))
    return found


def test_built_in_plugins_import_only_the_authors_face():
    """Built-ins are written as a third party writes a plugin: ``from torchplug.plugin import
    ...`` (plus torch and their own package), nothing from contract/, engine/, features/ or
    another built-in."""
    offenders = plugin_imports()
    assert not offenders, (
        f"reach past torchplug.plugin (put what they need on the face): {offenders}"
    )


def test_a_plugin_reaching_past_the_face_fails(tmp_path):
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(SRC / "torchplug", copy / "torchplug", ignore=shutil.ignore_patterns("*.pyc"))
    assert not plugin_imports(copy)
    (copy / "torchplug" / "plugins" / "planted.py").write_text(
        "from torchplug.plugin import hookimpl\n"
        "def f():\n    from torchplug.engine.engine import Engine\n"
    )
    (copy / "torchplug" / "plugins" / "deepspeed" / "planted.py").write_text(
        "from torchplug.plugins.deepspeed import state\nfrom torchplug.plugins import ddp\n"
    )
    assert plugin_imports(copy) == [
        ("torchplug.plugins.deepspeed.planted", "torchplug.plugins.ddp"),
        ("torchplug.plugins.planted", "torchplug.engine.engine"),
    ]


def engine_privates() -> set[str]:
    """The Engine's private attributes: every ``self._name`` its class assigns."""
    tree = ast.parse((SRC / "torchplug" / "engine" / "engine.py").read_text())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    }


def private_reads(src: Path = SRC) -> list[str]:
    """``module:line name`` for each read or write of an Engine private (``x._name`` with
    ``x`` not ``self``/``cls``) in a module outside the Engine's own package."""
    private = engine_privates()
    found = []
    for path in sorted((src / "torchplug").rglob("*.py")):
        if path.is_relative_to(src / "torchplug" / "engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.relative_to(src).as_posix()}:{node.lineno} {node.attr}")
    return found


def test_state_has_owners_no_engine_private_is_touched_outside_its_package():
    """Issue 33 item 3: the checkpoint package, the contract, features, plugins and the command
    line reach the Engine through its public members or their HookContext only (ruff's SLF001,
    configured in pyproject.toml, says the same for every private name)."""
    assert len(engine_privates()) > 10  # the check sees the Engine's privates
    assert not private_reads(), private_reads()


def test_a_planted_engine_private_read_fails(tmp_path):
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(SRC / "torchplug", copy / "torchplug", ignore=shutil.ignore_patterns("*.pyc"))
    (copy / "torchplug" / "checkpoint" / "planted.py").write_text(
        "def hooks_of(engine):\n    return engine._hooks\n"
    )
    assert private_reads(copy) == ["torchplug/checkpoint/planted.py:2 _hooks"]


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function and a relative import are found (a
    checker that saw only module-level imports passed the old layering while core imported the
    checkpoint package in function bodies)."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def late():\n"
        "    from torchplug.checkpoint import read_manifest\n"
        "    from ..loggers import builtin\n"
        "    return read_manifest, builtin\n"
    )
    found = imports(planted, "torchplug.contract.planted")
    assert "torchplug.checkpoint" in found  # `from torchplug.checkpoint import ...` in a function
    assert "torchplug.loggers.builtin" in found  # a relative import, resolved
    assert layer_of("torchplug.checkpoint.io") == 2 and layer_of("torchplug.contract.spec") == 1


#: Issue 26 item 5: how the Engine and the plugin manager are split, by job.
SPLIT = {
    "torchplug.engine.connector": "settings -> strategy, precision, options, active set",
    "torchplug.engine.wrappers": "every change the Engine makes to a user's objects",
    "torchplug.engine.collectives": "reduce, gather, barrier and what is built on them",
    "torchplug.contract.discovery": "finding plugins (built-ins, entry points, in-house modules)",
    "torchplug.contract.validation": "checking a plugin against the hook specification",
    "torchplug.contract.registry": "the registry of installed plugins and their names",
}

#: Lines a module may have without saying at its top why it has more.
LONG = 500


def test_the_split_modules_are_contract_or_engine_modules():
    modules = graph()
    for module in SPLIT:
        assert module in modules, f"{module} is gone: update SPLIT and docs/architecture.md"
        assert layer_of(module) in (LAYERS["torchplug.contract"], LAYERS["torchplug.engine"])


def test_auto_is_decided_in_one_place():
    """`strategy="auto"` becomes a strategy in `engine.config` only: the Engine, the launcher's
    and doctor's checks ask it (three copies of the rule once could disagree)."""
    holders = sorted(
        module_name(path)
        for path in (SRC / "torchplug").rglob("*.py")
        if 'else "single"' in path.read_text()
    )
    assert holders == ["torchplug.engine.config"]


def test_the_engine_patches_no_user_object_itself():
    """What the Engine changes on a user's objects is in `engine.wrappers` (undone by close)."""
    source = (SRC / "torchplug" / "engine" / "engine.py").read_text()
    for patch in ("types.MethodType", "object.__setattr__", "_wrapped_by_lr_sched"):
        assert patch not in source, f"engine.py patches user objects ({patch}): move it to wrappers"


def test_long_modules_say_why():
    """No module in src is over ~500 lines without a reason written at its top (issue 26)."""
    silent = []
    for path in sorted((SRC / "torchplug").rglob("*.py")):
        if len(path.read_text().splitlines()) <= LONG:
            continue
        top = "\n".join(path.read_text().splitlines()[:60])  # the docstring, or a comment
        if "over 500 lines" not in top:
            silent.append(f"{module_name(path)} ({len(path.read_text().splitlines())} lines)")
    assert not silent, f"say at the top why these are over {LONG} lines: {silent}"


def test_the_layout_in_docs_architecture_md_is_the_code():
    """Issues 26 and 33: docs/architecture.md describes the code as it is. Every package has its
    line in the "Layers" layout; every module of the packages below the plugins has its own
    line under its package; every module the layout names exists."""
    import re

    doc = (SRC.parent / "docs" / "architecture.md").read_text()
    layout = doc.split("## Layers", 1)[1].split("```", 2)[1]
    packages = {p.name for p in (SRC / "torchplug").iterdir() if (p / "__init__.py").exists()}
    shown = set(re.findall(r"^  (\w+)/", layout, re.MULTILINE))
    assert packages == shown, f"packages: {sorted(packages ^ shown)}"
    blocks = re.split(r"^  (\w+)/", layout, flags=re.MULTILINE)[1:]
    listed = {
        package: set(re.findall(r"^    (\w+\.py)\b", body, re.MULTILINE))
        for package, body in zip(blocks[::2], blocks[1::2], strict=True)
    }
    for package in ("util", "contract", "features", "checkpoint", "engine"):
        modules = {p.name for p in (SRC / "torchplug" / package).glob("*.py")} - {"__init__.py"}
        assert modules == listed[package], (
            f"torchplug/{package}: described but missing {sorted(listed[package] - modules)}, "
            f"not described {sorted(modules - listed[package])} in docs/architecture.md"
        )
    named = set(re.findall(r"(?<!pytest's )\b(\w+\.py)\b", layout))  # not pytest's hookspec.py
    existing = {path.name for path in (SRC / "torchplug").rglob("*.py")}
    assert named <= existing, (
        f"docs/architecture.md names modules that do not exist: {named - existing}"
    )


def test_the_engine_is_a_facade_and_the_contract_stays_small():
    """Issue 33: the Engine façade (its public members and their docstrings, delegating to the
    objects that own its state) stays within 800 lines, the contract package within 3,000."""
    engine = len((SRC / "torchplug" / "engine" / "engine.py").read_text().splitlines())
    assert engine <= 800, f"engine/engine.py has {engine} lines: move work to its owners"
    contract = sum(
        len(p.read_text().splitlines()) for p in (SRC / "torchplug" / "contract").glob("*.py")
    )
    assert contract <= 3000, f"contract/ has {contract} lines: what no author builds on moves out"
