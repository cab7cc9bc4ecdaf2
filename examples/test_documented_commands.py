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
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
#: is checked is that the documented flags parse, the script runs on them to its end, prints no
#: warning of ours, and does what the script promises (`EXPECT`); full-length training would only
#: repeat that for minutes (CI's budget is 35 minutes, issue 37).
SHORTER = {
    "char_lm.py": ["--steps", "40", "--max-loss", "3.3"],
    "gpt_fsdp_tp.py": ["--steps", "40"],
    "digits.py": ["--epochs", "3", "--min-accuracy", "0.8"],
    "train.py": ["--epochs", "2"],
}


def _gpt_learns(out: str, cwd: Path) -> None:
    losses = [
        float(line.split("loss")[1].split()[0]) for line in out.splitlines() if "loss" in line
    ]
    assert len(losses) == 2 and losses[-1] < 2.3, out


def _markdown_table(path: str, header: str, rows: int | None = None) -> Any:
    def check(out: str, cwd: Path) -> None:
        table = (cwd / path).read_text().splitlines()
        assert table[0] == header, table
        assert rows is None or len(table) == rows, table

    return check


#: What a documented command's run must show besides running cleanly: the checks that
#: test_examples.py made of these same runs before they were merged here (one run, not two).
#: Every key must be a command the pages show (`test_every_expectation_is_a_documented_command`).
EXPECT: dict[str, Callable[[str, Path], None]] = {
    "torchplug launch -n 2 --strategy ddp examples/train.py": lambda out, cwd: _has(
        out, "epoch  2"
    ),
    "torchplug launch -n 2 --strategy ddp examples/digits.py": lambda out, cwd: _digits(out),
    "torchplug launch -n 2 --strategy fsdp examples/digits.py --trainer --logger csv": (
        lambda out, cwd: (_digits(out), _has_file(cwd / "logs" / "metrics.csv"))
    ),
    "torchplug launch -n 2 --strategy ddp examples/char_lm.py": (
        lambda out, cwd: _has(out, "sample: 'Beautiful is ")
    ),
    "torchplug launch -n 2 --strategy fsdp examples/char_lm.py --trainer": (
        lambda out, cwd: _has(out, "sample: 'Beautiful is ")
    ),
    "torchplug launch -n 4 --strategy fsdp-tp --option tp_size=2 examples/gpt_fsdp_tp.py": (
        _gpt_learns
    ),
    "torchplug launch -n 2 --strategy fsdp examples/gpt_fsdp_tp.py": _gpt_learns,
    "torchplug launch -n 2 --strategy fsdp examples/inhouse_plugin.py": (
        lambda out, cwd: _has(out, "steps skipped by the guard: 1; weights finite: True")
    ),
    "torchplug launch -n 2 --strategy ddp examples/logger_plugin.py": lambda out, cwd: (
        _has(out, "loggers ['markdown', 'csv']"),
        _markdown_table("logs/logger_plugin/metrics.md", "| step | loss |", rows=7)(out, cwd),
    ),
    "cd examples && torchplug launch -n 2 --plugin markdown_logger --logger markdown digits.py": (
        _markdown_table("logs/metrics.md", "| step | test_accuracy |")
    ),
}


def _has(out: str, text: str) -> None:
    assert text in out, out


def _has_file(path: Path) -> None:
    assert path.is_file(), path


def _digits(out: str) -> None:
    """digits.py evaluated the 360 test images (its own loop or the Trainer's eval)."""
    assert "360" in out or "eval_accuracy" in out, out


def test_every_expectation_is_a_documented_command():
    assert set(EXPECT) <= set(COMMANDS), sorted(set(EXPECT) - set(COMMANDS))


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
    if command in EXPECT:
        EXPECT[command](done.stdout, cwd)


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
