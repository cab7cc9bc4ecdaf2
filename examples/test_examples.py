"""Run the examples on 2 CPU ranks in the ways the pages do not show (``tox -e examples``); the
runs the pages show, with what each must print, are in test_documented_commands.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent


def run(*command: str, cwd: Path, timeout: float = 120) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPLUG_")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def launch(strategy: str, script: str, *args: str, cwd: Path, n: int = 2) -> str:
    return run(
        sys.executable, "-m", "torchplug", "launch", "-n", str(n), "--strategy", strategy,
        str(EXAMPLES / script), *args, cwd=cwd,
    )  # fmt: skip


@pytest.mark.parametrize(("strategy", "n", "options"), [("ddp", 2, [])])
def test_gpt_fsdp_tp(strategy, n, options, tmp_path):
    out = run(
        sys.executable, "-m", "torchplug", "launch", "-n", str(n), "--strategy", strategy,
        *options, str(EXAMPLES / "gpt_fsdp_tp.py"), "--steps", "40", cwd=tmp_path, timeout=300,
    )  # fmt: skip
    losses = [
        float(line.split("loss")[1].split()[0]) for line in out.splitlines() if "loss" in line
    ]
    assert len(losses) == 2 and losses[-1] < 2.3, out


@pytest.mark.parametrize("strategy", ["ddp"])
def test_inhouse_plugin(strategy, tmp_path):
    out = launch(strategy, "inhouse_plugin.py", cwd=tmp_path)
    assert "steps skipped by the guard: 1; weights finite: True" in out


def test_checkpoint_resume_across_strategies(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = launch("ddp", "checkpoint_resume.py", "--dir", ckpt, "--steps", "20", cwd=tmp_path)
    assert "ddp on 2 rank(s): starting from scratch" in first
    second = launch("fsdp", "checkpoint_resume.py", "--dir", ckpt, "--steps", "40", cwd=tmp_path)
    assert "fsdp on 2 rank(s): resumed at step 20" in second
    third = run(
        sys.executable, str(EXAMPLES / "checkpoint_resume.py"), "--dir", ckpt, "--steps", "50",
        cwd=tmp_path,
    )  # fmt: skip
    assert "single on 1 rank(s): resumed at step 40" in third
    manifest = json.loads((Path(ckpt) / "step-50" / "manifest.json").read_text())
    assert manifest["step"] == 50


def test_notebook(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(EXAMPLES / "launch_notebook.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3").execute(cwd=str(tmp_path))
    text = "".join(
        o.get("text", "") for c in notebook.cells for o in c.get("outputs", []) if "text" in o
    )
    assert "2 ddp True" in text and "caught from rank 1" in text
