"""Run every example briefly on 2 CPU ranks, as examples/README.md says (``tox -e examples``)."""

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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_train(strategy, tmp_path):
    out = launch(strategy, "train.py", "--epochs", "2", cwd=tmp_path)
    assert "epoch  2" in out


@pytest.mark.parametrize(("strategy", "trainer"), [("ddp", False), ("fsdp", True)])
def test_digits(strategy, trainer, tmp_path):
    pytest.importorskip("sklearn")
    args = ["--epochs", "3", "--min-accuracy", "0.8", "--logger", "csv"]
    out = launch(strategy, "digits.py", *args, *(["--trainer"] if trainer else []), cwd=tmp_path)
    assert "360" in out or "eval_accuracy" in out
    assert (tmp_path / "logs" / "metrics.csv").is_file()


@pytest.mark.parametrize(("strategy", "trainer"), [("ddp", False), ("fsdp", True)])
def test_char_lm(strategy, trainer, tmp_path):
    args = ["--steps", "40", "--max-loss", "3.3", *(["--trainer"] if trainer else [])]
    out = launch(strategy, "char_lm.py", *args, cwd=tmp_path)
    assert "sample: 'Beautiful is " in out


@pytest.mark.parametrize(
    ("strategy", "n", "options"), [("fsdp-tp", 4, ["--option", "tp_size=2"]), ("ddp", 2, [])]
)
def test_gpt_fsdp_tp(strategy, n, options, tmp_path):
    out = run(
        sys.executable, "-m", "torchplug", "launch", "-n", str(n), "--strategy", strategy,
        *options, str(EXAMPLES / "gpt_fsdp_tp.py"), "--steps", "40", cwd=tmp_path, timeout=300,
    )  # fmt: skip
    losses = [
        float(line.split("loss")[1].split()[0]) for line in out.splitlines() if "loss" in line
    ]
    assert len(losses) == 2 and losses[-1] < 2.3, out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_inhouse_plugin(strategy, tmp_path):
    out = launch(strategy, "inhouse_plugin.py", cwd=tmp_path)
    assert "steps skipped by the guard: 1; weights finite: True" in out


def test_logger_plugin(tmp_path):
    out = launch("ddp", "logger_plugin.py", cwd=tmp_path)
    assert "loggers ['markdown', 'csv']" in out
    table = (tmp_path / "logs" / "logger_plugin" / "metrics.md").read_text().splitlines()
    assert table[0] == "| step | loss |" and len(table) == 7


def test_logger_plugin_through_the_launcher(tmp_path):
    pytest.importorskip("sklearn")
    run(
        sys.executable, "-m", "torchplug", "launch", "-n", "2", "--plugin", "markdown_logger",
        "--logger", "markdown", "digits.py", "--epochs", "1", "--min-accuracy", "0.3",
        cwd=EXAMPLES,
    )  # fmt: skip
    table = EXAMPLES / "logs" / "metrics.md"
    try:
        assert table.read_text().splitlines()[0] == "| step | test_accuracy |"
    finally:
        table.unlink(missing_ok=True)


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
