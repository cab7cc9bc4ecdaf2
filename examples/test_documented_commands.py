"""Every ``torchplug launch`` command that README.md, docs/ and examples/README.md show for an
example script runs as written (for fewer steps: `SHORTER`) and prints no warning of torchplug's
or the example's own (``tox -e examples``). Warnings that torch itself prints are not ours to
silence (FSDP2 in torch 2.13 warns when a sharded module returns a view, which tensor
parallelism's local outputs are)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent
ROOT = EXAMPLES.parent
PAGES = [ROOT / "README.md", EXAMPLES / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COMMAND = re.compile(r"(?:cd examples && )?torchplug launch [^`\n#|]*?\.py[^`\n#|]*")


def documented() -> list[str]:
    """The commands, one each, that run an example script as the page writes it."""
    found: dict[str, None] = {}
    for page in PAGES:
        for match in COMMAND.finditer(page.read_text()):
            command = " ".join(match.group(0).split())
            inside = command.startswith("cd examples && ")
            script = next(w for w in shlex.split(command) if w.endswith(".py"))
            if (EXAMPLES / script if inside else ROOT / script).is_file():
                found[command] = None
    return list(found)


COMMANDS = documented()

#: Each command runs as written with these flags appended (argparse keeps the last value): what
#: is checked is that the documented flags parse, the script runs on them to its end and prints no
#: warning of ours; full-length training would only repeat that for minutes (CI's budget is 35
#: minutes, issue 37). How far each script gets is checked in test_examples.py.
SHORTER = {
    "char_lm.py": ["--steps", "20"],
    "gpt_fsdp_tp.py": ["--steps", "10"],
    "digits.py": ["--epochs", "2"],
    "train.py": ["--epochs", "2"],
}


def test_the_pages_show_example_commands():
    assert len(COMMANDS) >= 10, COMMANDS  # the pattern still finds what the pages show


@pytest.mark.parametrize("command", COMMANDS)
def test_a_documented_command_runs_as_written_without_a_warning(command, tmp_path):
    pytest.importorskip("sklearn")  # digits.py's data set (the examples extra)
    inside = command.startswith("cd examples && ")
    words = shlex.split(command.removeprefix("cd examples && "))
    assert words[:2] == ["torchplug", "launch"]
    if inside:  # it writes logs/ beside the script: run a copy of the folder
        cwd = tmp_path / "examples"
        shutil.copytree(EXAMPLES, cwd, ignore=shutil.ignore_patterns("logs", "__pycache__"))
    else:
        cwd = tmp_path
        words = [str(ROOT / w) if w.startswith("examples/") else w for w in words]
    script = next(Path(w).name for w in words if w.endswith(".py"))
    words += SHORTER.get(script, [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPLUG_")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "torchplug", *words[1:]],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert not our_warnings(output), output


#: ``PATH:LINE: SomeWarning: ...``, as Python's warnings module prints them.
WARNING_AT = re.compile(r"^(?:\[rank\d+\]:)?\s*(\S+?):\d+: \w*Warning: .*$", re.MULTILINE)
#: torchplug's own warning lines (``torchplug launch: warning: ...``).
OWN_LINE = re.compile(r"torchplug[\w ]*: warning", re.IGNORECASE)


def our_warnings(output: str) -> list[str]:
    """The warnings raised in torchplug's package or in an example script, and torchplug's own
    warning lines; torch's and other libraries' warnings are not counted."""
    import torchplug

    ours = (str(Path(torchplug.__file__).resolve().parent) + os.sep, str(EXAMPLES) + os.sep)
    found = [m.group(0) for m in WARNING_AT.finditer(output) if m.group(1).startswith(ours)]
    return found + [line for line in output.splitlines() if OWN_LINE.search(line)]


def test_the_warning_filter_finds_ours_and_only_ours():
    import torchplug

    package = Path(torchplug.__file__).resolve().parent
    torchs = "/x/.tox/examples/lib/site-packages/torch/a.py:3: UserWarning: returned a view"
    mine = f"{package / 'core' / 'engine.py'}:9: UserWarning: something of ours"
    script = f"[rank1]: {EXAMPLES / 'train.py'}:5: DeprecationWarning: old"
    launcher = "torchplug launch: warning: '--n' comes after the script"
    found = our_warnings("\n".join([torchs, mine, script, launcher, "a warning in prose"]))
    assert found == [mine, script, launcher]
