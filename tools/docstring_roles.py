"""Rewrite reST cross-reference roles in Python sources as Markdown code spans.

The API reference renders docstrings as Markdown (mkdocstrings, Google style), where a reST role
such as :meth:`log` shows up raw. This rewrites every ``:role:`target``` as `` `target` ``
(``~a.b.C`` -> ``C``, except modules, which keep their dotted name; ``.mod`` -> ``mod``;
``title <target>`` -> ``title``).

    python tools/docstring_roles.py [PATH ...]      # default: src/ and contrib/; rewrites in place
    python tools/docstring_roles.py --check [PATH ...]  # exit 1 listing what it would rewrite
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLE = re.compile(r":(?:py:)?(?:meth|class|func|attr|data|mod|exc|obj|ref|const):`([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    target = match.group(1).strip()
    titled = re.fullmatch(r"(.+?)\s*<[^>]+>", target)
    if titled:
        return f"`{titled.group(1)}`"
    target = target.lstrip("!")
    if match.group(0).startswith(":mod:"):  # a module keeps its dotted name
        target = target.lstrip("~")
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target.lstrip('.')}`"


def rewrite(text: str) -> str:
    return ROLE.sub(_plain, text)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if a != "--check"] or [ROOT / "src", ROOT / "contrib"]
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    found = 0
    for file in files:
        text = file.read_text()
        new = rewrite(text)
        if new != text:
            found += len(ROLE.findall(text))
            print(f"{file}: {len(ROLE.findall(text))} role(s)")
            if not check:
                file.write_text(new)
    return 1 if check and found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
