"""Checks of the built documentation site (``tox -e docs`` builds it, then runs these).

``TORCHPLUG_SITE_DIR`` names the directory ``mkdocs build`` wrote; without it the tests skip.
By hand: ``mkdocs build --strict --site-dir /tmp/site && TORCHPLUG_SITE_DIR=/tmp/site pytest
tests/project/test_site.py``.

- no page shows a raw reST role (``:meth:`log```) or an unparsed ``Args:`` section:
  docstrings are Markdown, Google style;
- every relative link and asset of every page resolves to a file of the site, and a link's
  ``#anchor`` to an element of the page it points at;
- the API reference shows every public name of ``torchplug`` with a description and, for
  functions and classes with a constructor, its signature; and every parameter of every
  callable it documents (each ``:::`` entry of docs/api.md: functions, constructors, public
  methods, and the functions and classes of the modules listed) has a description in the
  object's Parameters table, which names no parameter the signature lacks.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

import torchplug.plugin
from support.paths import ROOT

SITE = os.environ.get("TORCHPLUG_SITE_DIR")
pytestmark = pytest.mark.skipif(
    not SITE, reason="TORCHPLUG_SITE_DIR is not set: run by `tox -e docs` after mkdocs build"
)

#: A reST role as it shows once rendered: ":meth:" before the code span (the backticks are gone).
ROLE = re.compile(r"(?<![\w:]):(?:py:)?(?:meth|class|func|attr|data|mod|exc|obj|ref|const|term):")
#: A Google-style section mkdocstrings did not parse (parsed ones show as "Parameters:").
UNPARSED = re.compile(r"^\s*Args:")
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}  # fmt: skip


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element | str] = field(default_factory=list)

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def walk(self):
        yield self
        for child in self.children:
            if isinstance(child, Element):
                yield from child.walk()

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(element)
        if tag not in VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):  # tolerate unclosed elements
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def parse(path: Path) -> Element:
    builder = _TreeBuilder()
    builder.feed(path.read_text(encoding="utf-8"))
    builder.close()
    return builder.root


def visible_text(element: Element) -> str:
    if element.tag in {"script", "style", "template"}:
        return ""
    return " ".join(c if isinstance(c, str) else visible_text(c) for c in element.children)


@pytest.fixture(scope="module")
def site() -> Path:
    root = Path(SITE)
    assert (root / "index.html").is_file(), f"{root} holds no built site (mkdocs build first)"
    return root


@pytest.fixture(scope="module")
def pages(site) -> dict[Path, Element]:
    return {page: parse(page) for page in sorted(site.rglob("*.html"))}


def test_no_raw_rest_roles(site, pages):
    found, unparsed = [], []
    for page, tree in pages.items():
        for line in visible_text(tree).splitlines():
            if ROLE.search(line):
                found.append(f"{page.relative_to(site)}: {line.strip()[:120]}")
            if UNPARSED.search(line):
                unparsed.append(f"{page.relative_to(site)}: {line.strip()[:120]}")
    assert not found, "raw reST roles (write `name` or [`name`][torchplug.name]):\n" + "\n".join(
        found
    )
    assert not unparsed, "docstring sections shown as text (indent them as Google style):\n" + (
        "\n".join(unparsed)
    )


def _target(site: Path, page: Path, url: str) -> tuple[Path, str] | None:
    """The file and fragment a relative ``url`` of ``page`` points at; None when external."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or url.startswith(("mailto:", "javascript:", "data:")):
        return None
    if not parts.path:
        return page, unquote(parts.fragment)
    base = site if parts.path.startswith("/") else page.parent  # 404.html: root-absolute
    target = (base / unquote(parts.path).lstrip("/")).resolve()
    if parts.path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target, unquote(parts.fragment)


def test_internal_links_resolve(site, pages):
    ids = {page: {e.attrs["id"] for e in tree.walk() if "id" in e.attrs} for page, tree in
           pages.items()}  # fmt: skip
    dead = []
    for page, tree in pages.items():
        for element in tree.walk():
            for attr in ("href", "src"):
                url = element.attrs.get(attr)
                if not url:
                    continue
                target = _target(site, page, url)
                if target is None:
                    continue
                file, fragment = target
                where = f"{page.relative_to(site)}: <{element.tag} {attr}={url!r}>"
                if not file.is_file() or site.resolve() not in file.parents:
                    dead.append(f"{where}: no such file in the site")
                elif fragment and file.suffix == ".html" and fragment not in ids.get(file, set()):
                    dead.append(f"{where}: no element with id {fragment!r}")
    assert not dead, "dead internal links:\n" + "\n".join(dead)


# -- the API reference ---------------------------------------------------------------------------


def _documented_objects() -> list[tuple[str, object]]:
    """``(identifier, object)`` of each ``::: name`` entry of docs/api.md."""
    import importlib

    found = []
    for name in re.findall(r"^::: ([\w.]+)\s*$", (ROOT / "docs" / "api.md").read_text(), re.M):
        try:
            obj = importlib.import_module(name)
        except ImportError:
            module, _, attr = name.rpartition(".")
            obj = getattr(importlib.import_module(module), attr)
        found.append((name, obj))
    return found


def _callables_of(identifier: str, obj: object) -> list[tuple[str, object]]:
    if inspect.isfunction(obj):
        return [(identifier, obj)]
    if inspect.ismodule(obj):
        return [
            found
            for attr, value in vars(obj).items()
            if not attr.startswith("_")
            and (inspect.isfunction(value) or inspect.isclass(value))
            and value.__module__ == obj.__name__  # defined there, not imported
            for found in _callables_of(f"{identifier}.{attr}", value)
        ]
    if not inspect.isclass(obj):
        return []
    found = [(identifier, obj)] if "__init__" in vars(obj) else []
    for attr, value in vars(obj).items():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if (
            not attr.startswith("_")
            and inspect.isfunction(value)
            and not getattr(value, "torchplug_impl", None)  # a hook implementation
            # Strategy's delegates to the defaults: their arguments are the hook's (docs/hooks.md)
            and not getattr(value, "torchplug_inherited_default", None)
        ):
            found.append((f"{identifier}.{attr}", value))
    return found


def public_callables() -> list[tuple[str, object]]:
    """``(identifier on the API page, callable)`` of everything whose parameters the reference
    must list: each ``:::`` entry of docs/api.md that is a function, a class's constructor (when
    the class defines one) and the public methods the class itself defines (not its hook
    implementations, which docs/hooks.md documents), and the same for the functions and classes
    a documented module defines."""
    return [found for name, obj in _documented_objects() for found in _callables_of(name, obj)]


def parameters(obj: object) -> list[str]:
    params = inspect.signature(obj).parameters.values()
    return [p.name for p in params if p.name not in {"self", "cls"}]


def object_section(tree: Element, identifier: str) -> Element | None:
    """The ``doc-object`` element of the API page whose heading has id ``identifier``."""
    for element in tree.walk():
        if "doc-object" in element.classes():
            for child in element.children:
                if isinstance(child, Element) and child.attrs.get("id") == identifier:
                    return element
    return None


def documented_parameters(section: Element) -> dict[str, str]:
    """``{name: description}`` from the Parameters tables of ``section`` itself (not of the
    members nested in it)."""
    contents = next(
        c for c in section.children if isinstance(c, Element) and "doc-contents" in c.classes()
    )
    found: dict[str, str] = {}
    title = None
    for child in contents.children:
        if not isinstance(child, Element) or "doc-children" in child.classes():
            continue  # text, or the members' own sections
        titles = [e for e in child.walk() if "doc-section-title" in e.classes()]
        if titles:
            title = titles[0].text().strip().rstrip(":")
        if child.tag == "table" and title in {"Parameters", "Other Parameters"}:
            header = [th.text().strip() for th in child.walk() if th.tag == "th"]
            column = header.index("Description")
            for row in (e for e in child.walk() if e.tag == "tr"):
                cells = [td for td in row.children if isinstance(td, Element) and td.tag == "td"]
                if len(cells) > column:
                    name = cells[0].text().strip().lstrip("*")
                    found[name] = cells[column].text().strip()
    return found


@pytest.fixture(scope="module")
def api_page(site, pages) -> Element:
    return pages[site / "api" / "index.html"]


def _has_signature(obj: object) -> bool:
    """Functions, and classes with a constructor of their own (not an exception's)."""
    return inspect.isfunction(obj) or inspect.isclass(obj) and "__init__" in vars(obj)


def test_every_public_name_is_on_the_api_page_described_with_its_signature(api_page):
    missing, unsigned, undescribed = [], [], []
    faces = [(f"torchplug.{n}", getattr(torchplug, n)) for n in torchplug.__all__]
    faces += [  # the authors' face; a name on both is documented under torchplug
        (_documented_as(n), getattr(torchplug.plugin, n))
        for n in torchplug.plugin.__all__
        if n not in torchplug.__all__
    ]
    for name, obj in faces:
        if name == "torchplug.__version__":
            continue
        section = object_section(api_page, name)
        if section is None:
            missing.append(name)
            continue
        contents = [c for c in section.children if isinstance(c, Element)]
        if not any("doc-contents" in c.classes() and visible_text(c).strip() for c in contents):
            undescribed.append(name)
        elif _has_signature(obj) and not any(
            "doc-signature" in e.classes() for e in section.walk()
        ):
            unsigned.append(name)
    assert not missing, f"not on the API page: {missing}"
    assert not unsigned, f"shown without a signature: {unsigned}"
    assert not undescribed, f"shown without a description (give it a docstring): {undescribed}"


def _documented_as(name: str) -> str:
    """The authors' name ``name`` as the API page documents it: ``torchplug.plugin.X``, or the
    built-in plugin module defining it (which imports the face, so the face cannot import it
    back for the docs), with a ``torchplug.plugin.X`` anchor beside it."""
    source = torchplug.plugin._EXPORTS[name]
    return (
        f"{source}.{name}"
        if source.startswith("torchplug.plugins.")
        else f"torchplug.plugin.{name}"
    )


def test_every_public_parameter_is_documented(api_page):
    problems = []
    for qualname, obj in public_callables():
        wanted = parameters(obj)
        if not wanted:
            continue
        section = object_section(api_page, qualname)
        if section is None:
            problems.append(f"{qualname}: not on the API page (give it a docstring)")
            continue
        documented = documented_parameters(section)
        for name in wanted:
            if not documented.get(name):
                problems.append(f"{qualname}: parameter {name!r} is not documented (Args:)")
        for name in documented.keys() - set(wanted):
            problems.append(f"{qualname}: documents {name!r}, which is not a parameter")
    assert not problems, "\n".join(problems)
