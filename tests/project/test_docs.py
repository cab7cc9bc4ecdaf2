"""Every Python block in README.md and docs/ runs (blocks that cannot are marked, each with its
reason, by a ``<!-- not run: REASON -->`` line right above); the API reference lists every
public name; relative links resolve; each strategy page lists the strategy's options."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torchplug.plugin
from support.paths import ROOT

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*$")


def blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, reason not run or None)`` of every Python block of ``page``."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").splitlines()
        marker = NOT_RUN.search(before[-1]) if before else None
        line = text.count("\n", 0, match.start()) + 1
        found.append((line, match.group(1), marker.group(1) if marker else None))
    return found


#: Pages generated from code whose blocks are signatures, not programs (not run, with the reason).
GENERATED = {DOCS / "hooks.md": "the hook reference, generated from contract/spec.py: signatures"}
RUNNABLE = [
    p for p in PAGES if p not in GENERATED and any(reason is None for _, _, reason in blocks(p))
]


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page, tmp_path):
    """A page's blocks run in order in one fresh process (later blocks may use earlier names)."""
    program = []
    for line, code, reason in blocks(page):
        if reason is None:
            program.append(f"# --- {page.name}:{line}\n{code}")
    script = tmp_path / "page.py"
    script.write_text("\n".join(program))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPLUG_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)})
    # the pages spell nothing deprecated (tox ignores DeprecationWarning; these are errors here)
    ours = ("tp.", "options_of(", "distributed_options(")
    env["PYTHONWARNINGS"] = ",".join(
        [
            *filter(None, [os.environ.get("PYTHONWARNINGS")]),
            *(f"error:{m}:DeprecationWarning" for m in ours),
        ]
    )
    (tmp_path / "my_backend.py").write_text(MY_BACKEND)  # the modules docs/plugins.md imports
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "checks.py").write_text(MY_CHECKS)
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, f"{page}:\n{run.stdout}\n{run.stderr[-4000:]}"


MY_BACKEND = textwrap.dedent(
    """
    import torch
    import torchplug.plugin as tpp

    class OneDevice(tpp.Strategy):
        def __init__(self, device: str = "cpu"):
            self.device = torch.device(device)

        @tpp.hookimpl
        def torchplug_setup(self, engine, cluster):
            return tpp.Runtime(rank=0, world_size=1, local_rank=0, device=self.device)

    @tpp.hookimpl
    def torchplug_register_strategies(register):
        register(tpp.StrategyInfo(
            name="one-device", factory=OneDevice, description="runs on the device you name",
            options=(tpp.Option("device", str, "cpu", "torch device"),), distributed=False,
        ))
    """
)


MY_CHECKS = textwrap.dedent(
    """
    import torchplug.plugin as tpp

    @tpp.hookimpl(wrapper=True)
    def torchplug_backward(engine, loss, model):
        return (yield)
    """
)


def test_blocks_not_run_say_why():
    for page in PAGES:
        for line, _, reason in blocks(page):
            assert reason is None or len(reason) > 10, f"{page}:{line}: give the reason"


def documented_as(name: str) -> str:
    """Where the API reference documents the authors' name ``name``: under the face
    (``torchplug.plugin.X``), or, for what a built-in plugin module defines (the base classes,
    the sharding helpers: modules that import the face themselves, so the face cannot import
    them back for the docs to see), under that module, with a ``torchplug.plugin.X`` anchor."""
    source = torchplug.plugin._EXPORTS[name]
    return (
        f"{source}.{name}"
        if source.startswith("torchplug.plugins.")
        else f"torchplug.plugin.{name}"
    )


def test_every_public_name_is_in_the_api_reference():
    """Both faces: ``torchplug`` (users) and ``torchplug.plugin`` (authors); a name on both is
    documented once, under ``torchplug``."""
    api = (DOCS / "api.md").read_text()
    users = [f"torchplug.{n}" for n in torchplug.__all__ if n != "__version__"]
    authors = [documented_as(n) for n in torchplug.plugin.__all__ if n not in torchplug.__all__]
    missing = [n for n in users + authors if f"::: {n}\n" not in api]
    assert not missing, f"add '::: NAME' to docs/api.md for {missing}"


def test_the_engine_at_a_glance_names_every_public_member():
    """docs/api.md's table is read in the repository too (the entries under it only render on
    the site): a member added to the Engine is added there."""
    api = (DOCS / "api.md").read_text()
    table = api[api.index("## The Engine at a glance") : api.index("## The Engine\n")]
    rows = "\n".join(line for line in table.splitlines() if line.startswith("|"))
    named = set(re.findall(r"`(\w+)", rows))
    members = {n for n in dir(torchplug.Engine) if not n.startswith("_")}
    assert not members - named, f"add to docs/api.md's Engine table: {sorted(members - named)}"
    assert not {n for n in named if n[0].islower()} - members - {"model", "tp", "with"}, (
        "docs/api.md's Engine table names members the Engine does not have: "
        f"{sorted({n for n in named if n[0].islower()} - members - {'model', 'tp', 'with'})}"
    )


def _repository_url() -> str:
    """The one project URL: pyproject's [project.urls] Repository, which mkdocs.yml repeats."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    url = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    assert f"repo_url: {url}\n" in (ROOT / "mkdocs.yml").read_text(), "mkdocs.yml: repo_url"
    return url


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_resolve():
    """README.md links into the repository (GitHub shows it there); a docs page links to pages
    and files of the site only, since its relative links must resolve in the built site."""
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:|#", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            inside = ROOT if page.parent == ROOT else DOCS
            if not path.exists() or inside.resolve() not in (path, *path.parents):
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "link the repository's files as REPOSITORY/blob/main/PATH:\n" + "\n".join(
        broken
    )


def test_links_to_the_repository_name_existing_files():
    """``REPOSITORY/blob/main/PATH`` (a file) and ``REPOSITORY/tree/main/PATH`` (a directory)
    links name paths that exist in this checkout; other links to the repository are refused."""
    repository = _repository_url()
    found, broken = 0, []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if not target.startswith(repository):
                continue
            found += 1
            match = re.fullmatch(
                re.escape(repository) + r"/(blob|tree)/main/([^#?]+)(#.*)?", target
            )
            path = ROOT / match.group(2) if match else None
            if path is None or not (path.is_file() if match.group(1) == "blob" else path.is_dir()):
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert found, "no links to the repository found: is the pattern still right?"
    assert not broken, f"links to the repository that do not resolve here: {broken}"


def test_landing_page_code_fits_the_column():
    """The home page's blocks show whole, without a scroll bar (lines of at most 88 columns)."""
    long = [
        line
        for _, code, _ in blocks(DOCS / "index.md")
        for line in code.splitlines()
        if len(line) > 88
    ]
    assert not long, f"docs/index.md: wrap these lines to 88 columns: {long}"


def test_docstrings_have_no_rest_roles():
    """Docstrings are Markdown (mkdocstrings, Google style): a reST role such as :meth:`x`
    would show raw on the API page and in docs/hooks.md."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "docstring_roles.py"), "--check"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, (
        f"reST roles in docstrings; rewrite them: python tools/docstring_roles.py\n{run.stdout}"
    )


def test_nav_lists_existing_pages_only():
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert nav and all((DOCS / page).is_file() for page in nav)


PAGE_OF = {
    "single": "single", "ddp": "ddp", "local-sgd": "local-sgd", "fsdp": "fsdp", "xla": "xla",
    "tp": "tp", "fsdp-tp": "tp",
    "fairscale-oss": "fairscale", "fairscale-sdp": "fairscale", "fairscale-fsdp": "fairscale",
    "deepspeed": "deepspeed", "deepspeed-zero1": "deepspeed", "deepspeed-zero2": "deepspeed",
    "deepspeed-zero3": "deepspeed", "deepspeed-zero3-offload": "deepspeed",
}  # fmt: skip


def test_each_builtin_strategy_page_lists_its_options():
    from torchplug.contract.manager import get_registry

    registry = get_registry()
    for name, page in PAGE_OF.items():
        text = (DOCS / "strategies" / f"{page}.md").read_text()
        info = registry.strategies[name]
        assert f"### `{name}`" in text, f"{page}.md lacks {name}"
        for option in info.options:
            assert f"| `{option.name}` |" in text, f"{page}.md lacks option {option.name}"


def test_the_example_backend_shown_whole_is_the_file_and_its_length_is_right():
    """docs/plugins.md shows examples/plugins/torchplug-bf16comm's module "whole" and README.md
    says how long it is: both must stay what the file is (an outsider found they had drifted)."""
    source = ROOT / "examples" / "plugins" / "torchplug-bf16comm" / "torchplug_bf16comm.py"
    code = source.read_text()
    length = len(code.splitlines())
    page = (DOCS / "plugins.md").read_text()
    said = re.search(
        r"a (\d+)-line file plus its pyproject\) is:\n\n```python\n(.*?)```", page, re.S
    )
    assert said, "the whole-file block is gone from docs/plugins.md"
    assert said.group(2) == code
    assert int(said.group(1)) == length
    readme = (ROOT / "README.md").read_text()
    assert f"a {length}-line file plus its pyproject" in readme
