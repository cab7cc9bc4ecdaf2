"""Imports point downward (docs/architecture.md, "Layers"), function bodies included: every
module of src/torchplug is parsed and each import, wherever it is written, is checked against
the layer order. Issue 26 item 6."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

#: Each package's layer: a module may import its own layer and those below it, never above.
LAYERS = {
    "torchplug.core": 0,
    "torchplug.checkpoint": 1,
    "torchplug.loggers": 1,
    "torchplug.plugins": 2,
    "torchplug.trainer": 3,
    "torchplug.testing": 3,
    "torchplug.cli": 4,
    "torchplug": 3,  # the front door (lazy exports of core, trainer, ...): what users import
    "torchplug.__main__": 5,  # ``python -m torchplug``: the command line
}

#: Upward imports still in core, each with the reason and the issue that removes it. The test
#: also fails when one of these is gone, so that the list only shrinks.
KNOWN_UPWARD: set[tuple[str, str]] = set()  # none left (issue 26): keep it so

BACKEND_PACKAGES = ("deepspeed", "fairscale", "torch_xla")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, name: str | None = None) -> set[str]:
    """Every module ``path`` imports, at any depth of its code; ``from pkg import name`` counts
    as ``pkg.name`` when that is a module or package, else as ``pkg``. ``name``: the module's
    name when ``path`` is not under src."""
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
                as_path = SRC / candidate.replace(".", "/")
                is_module = as_path.with_suffix(".py").exists() or as_path.is_dir()
                found.add(candidate if is_module else base)
    return found


def layer_of(module: str) -> int | None:
    owners = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(owners, key=len)] if owners else None


def graph() -> dict[str, set[str]]:
    return {module_name(path): imports(path) for path in sorted((SRC / "torchplug").rglob("*.py"))}


def test_imports_point_downward_everywhere_function_bodies_included():
    upward = set()
    for module, imported in graph().items():
        own = layer_of(module)
        for target in imported:
            layer = layer_of(target)
            if layer is not None and own is not None and layer > own:
                upward.add((module, target))
    unexpected = sorted(upward - KNOWN_UPWARD)
    assert not unexpected, f"imports pointing up a layer: {unexpected}"
    gone = sorted(KNOWN_UPWARD - upward)
    assert not gone, f"no longer imported (remove from KNOWN_UPWARD): {gone}"


def test_core_imports_no_backend_package_anywhere():
    offenders = [
        (module, target)
        for module, imported in graph().items()
        if module.startswith("torchplug.core")
        for target in imported
        if target.split(".")[0] in BACKEND_PACKAGES
    ]
    assert not offenders


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
    found = imports(planted, "torchplug.core.planted")
    assert "torchplug.checkpoint" in found  # `from torchplug.checkpoint import ...` in a function
    assert "torchplug.loggers.builtin" in found  # a relative import, resolved
    assert layer_of("torchplug.checkpoint.io") == 1 and layer_of("torchplug.core.spec") == 0


#: Issue 26 item 5: how the Engine and the plugin manager are split, by job.
SPLIT = {
    "torchplug.core.connector": "settings -> strategy, precision, options, active set",
    "torchplug.core.wrappers": "every change the Engine makes to a user's objects",
    "torchplug.core.collectives": "reduce, gather, barrier and what is built on them",
    "torchplug.core.discovery": "finding plugins (built-ins, entry points, in-house modules)",
    "torchplug.core.validation": "checking a plugin against the hook specification",
    "torchplug.core.installed": "the registry of installed plugins and their names",
}

#: Lines a module may have without saying at its top why it has more.
LONG = 500


def test_the_split_modules_are_core_modules():
    modules = graph()
    for module in SPLIT:
        assert module in modules, f"{module} is gone: update SPLIT and docs/architecture.md"
        assert layer_of(module) == 0


def test_auto_is_decided_in_one_place():
    """`strategy="auto"` becomes a strategy in `core.connector` only: the Engine, the launcher's
    and doctor's checks ask it (three copies of the rule once could disagree)."""
    holders = sorted(
        module_name(path)
        for path in (SRC / "torchplug").rglob("*.py")
        if 'else "single"' in path.read_text()
    )
    assert holders == ["torchplug.core.connector"]


def test_the_engine_patches_no_user_object_itself():
    """What the Engine changes on a user's objects is in `core.wrappers` (undone by close)."""
    source = (SRC / "torchplug" / "core" / "engine.py").read_text()
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
    """Issue 26: docs/architecture.md describes the code as it is. Every module of core and
    checkpoint has its line in the "Layers" layout, and every module the layout names exists."""
    import re

    doc = (SRC.parent / "docs" / "architecture.md").read_text()
    layout = doc.split("## Layers", 1)[1].split("```", 2)[1]
    listed = set(re.findall(r"^\s+(\w+\.py)\b", layout, re.MULTILINE))
    for package in ("core", "checkpoint"):
        modules = {path.name for path in (SRC / "torchplug" / package).glob("*.py")} - {
            "__init__.py"
        }
        missing = sorted(modules - listed)
        assert not missing, f"torchplug/{package}: {missing} not described in docs/architecture.md"
    named = set(re.findall(r"(?<!pytest's )\b(\w+\.py)\b", layout))  # not pytest's hookspec.py
    existing = {path.name for path in (SRC / "torchplug").rglob("*.py")}
    assert named <= existing, (
        f"docs/architecture.md names modules that do not exist: {named - existing}"
    )
