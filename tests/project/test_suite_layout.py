"""The suite mirrors the source layout (issue 33 item 8, tests/README.md): each test module sits in
the folder of the layer it tests, what tests share lives in tests/support, and no test module
imports another (a helper two modules need moves to tests/support)."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from support.paths import ROOT, TESTS

#: Folders of tests/ named after a layer of src/torchplug; tests/plugins/<name> for each plugin
#: of src/torchplug/plugins.
LAYERS = ("checkpoint", "cli", "contract", "engine", "features", "testing", "trainer", "util")
#: Folders that test no single layer: whole runs across the layers (e2e), the repository
#: itself (project: the docs and the built site, the import layering, the benchmark runner) and
#: the peers' own example scripts against their ports (peers: its own tox env, tox -e peers).
ACROSS = ("e2e", "project", "peers")
#: Test modules allowed directly in tests/ (conftest.py and support/ are not test modules).
TOP_LEVEL: frozenset[str] = frozenset()

#: An import at the start of a line, also inside code the tests write for a subprocess.
IMPORT_LINE = re.compile(r"^\s*(?:from\s+(\.*[\w.]+)\s+import|import\s+([\w.]+))", re.M)


def modules_under(tests: Path) -> list[Path]:
    """Every test module under ``tests`` (support/ holds none)."""
    return sorted(tests.rglob("test_*.py"))


def imported_test_modules(path: Path) -> list[str]:
    """The test modules (``test_*``, at any depth of a dotted name) the file at ``path`` imports:
    its import statements wherever they are, and import lines in the code it writes out."""
    source = path.read_text()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names.add(module)
            if not module:  # from . import test_x
                names |= {alias.name for alias in node.names}
    names |= {a or b for a, b in IMPORT_LINE.findall(source)}
    return sorted(
        name
        for name in names
        if any(part.startswith("test_") for part in name.lstrip(".").split("."))
    )


def misplaced(tests: Path, src: Path) -> list[str]:
    """Test modules outside the layout, relative to ``tests``: not in a layer's folder, in
    tests/plugins/<name> for no plugin of ``src``/torchplug/plugins, or directly in tests/."""
    plugins = src / "torchplug" / "plugins"
    names = {p.stem for p in plugins.glob("*.py")} | {
        p.name for p in plugins.iterdir() if (p / "__init__.py").is_file()
    }
    allowed = {*LAYERS, *ACROSS, *(f"plugins/{name}" for name in names)}
    wrong = []
    for path in modules_under(tests):
        folder = path.parent.relative_to(tests).as_posix()
        if folder == "." and path.name in TOP_LEVEL:
            continue
        if folder not in allowed:
            wrong.append(path.relative_to(tests).as_posix())
    return wrong


def test_no_test_module_imports_another():
    """Nor does a support module or conftest.py import a test module."""
    found = {
        path.relative_to(TESTS).as_posix(): imported_test_modules(path)
        for path in sorted(TESTS.rglob("*.py"))
    }
    assert {path: names for path, names in found.items() if names} == {}
    assert len(found) > 60  # every module was read


def test_a_planted_import_of_a_test_module_is_caught(tmp_path):
    """Each way of importing a test module is found: at the top, inside a function, by package
    path, relatively, and in code written out for a subprocess (names made here, so this
    file itself holds no such import)."""
    parity, cli, resume, layers, restart = (
        f"test_{name}" for name in ("parity", "cli", "resume", "layers", "restart")
    )
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        textwrap.dedent(
            f"""
            import os
            from support.reference import train
            from {parity} import assert_close_dicts

            def test_x():
                import {cli}, json
                from tests.e2e.{resume} import run
                from . import {layers}

            SCRIPT = '''
            import sys
            from {restart} import train
            '''
            """
        )
    )
    assert imported_test_modules(planted) == [
        cli, layers, parity, restart, f"tests.e2e.{resume}"
    ]  # fmt: skip
    clean = tmp_path / "test_clean.py"
    clean.write_text("import os\nfrom support.reference import train\nimport testing\n")
    assert imported_test_modules(clean) == []


def test_every_test_module_lives_in_the_folder_of_its_layer():
    assert misplaced(TESTS, ROOT / "src") == []
    for layer in LAYERS:  # each folder mirrors a package of the source
        assert (ROOT / "src" / "torchplug" / layer / "__init__.py").is_file(), layer


def test_a_test_module_outside_the_layout_is_caught(tmp_path):
    src, tests = tmp_path / "src", tmp_path / "tests"
    (src / "torchplug" / "plugins" / "deepspeed").mkdir(parents=True)
    (src / "torchplug" / "plugins" / "deepspeed" / "__init__.py").write_text("")
    (src / "torchplug" / "plugins" / "fsdp.py").write_text("")
    for name in (
        "test_stray.py",
        "engine/test_fine.py",
        "plugins/fsdp/test_fsdp.py",
        "plugins/deepspeed/test_zero.py",
        "plugins/nosuch/test_nosuch.py",
        "plugins/test_between.py",
        "misc/test_misc.py",
        "engine/deeper/test_deeper.py",
    ):
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text("")
    assert misplaced(tests, src) == [
        "engine/deeper/test_deeper.py",
        "misc/test_misc.py",
        "plugins/nosuch/test_nosuch.py",
        "plugins/test_between.py",
        "test_stray.py",
    ]


def test_no_two_test_modules_share_a_name():
    """pytest imports a test module by its file name (tests/ folders are no packages), so two of
    one name in different folders would collide."""
    names = [path.name for path in modules_under(TESTS)]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []
