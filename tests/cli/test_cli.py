"""The torchplug command: launch (through torchrun), plugins, help; import cost."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from support.commands import torchplug
from support.paths import ROOT

EXAMPLE = ROOT / "examples" / "train.py"


def epoch_losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"epoch +\d+ +loss ([0-9.]+)", output)]


@pytest.mark.slow
def test_launch_two_processes_trains_the_example_with_decreasing_loss():
    run = torchplug("launch", "-n", "2", "--strategy", "ddp", str(EXAMPLE), "--epochs", "4")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "strategy='ddp'" in run.stdout and "world_size=2" in run.stdout
    losses = epoch_losses(run.stdout)
    assert len(losses) == 4  # printed once (rank 0), not once per rank
    assert losses[-1] < losses[0] / 2
    assert "samples/s" in run.stdout


@pytest.mark.slow
def test_launch_flags_reach_engine_auto_and_torchrun_flags_pass_through():
    run = torchplug(
        "launch",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--strategy",
        "ddp",
        "--precision",
        "bf16",
        str(EXAMPLE),
        "--epochs",
        "1",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Engine(strategy='ddp', precision='bf16', rank=0, world_size=2" in run.stdout


def test_launch_rejects_an_unknown_strategy_before_starting_processes():
    run = torchplug("launch", "-n", "2", "--strategy", "dpp", str(EXAMPLE))
    assert run.returncode == 2
    assert "Unknown strategy 'dpp'. Did you mean 'ddp'?" in run.stderr


def test_launch_reports_a_failing_script(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys; sys.exit(3)\n")
    run = torchplug("launch", "-n", "1", str(script))
    assert run.returncode == 1
    assert "fail.py" in run.stderr


def test_help_is_fast_and_imports_no_torch():
    probe = (
        "import sys\n"
        "from torchplug.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "launch" in run.stdout and "plugins" in run.stdout and "doctor" in run.stdout


def test_no_backend_package_is_imported_by_torchplug(tmp_path):
    """Even with deepspeed/fairscale/torch_xla importable, none is imported unless selected."""
    for name in ("deepspeed", "fairscale", "torch_xla"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise SystemExit('{name} was imported')\n")
    code = (
        "import sys, torch, torchplug as tp\n"
        "from torchplug.cli.plugins import plugins\n"
        "with tp.Engine('single', precision='bf16') as e: pass\n"
        "plugins(verbose=True)\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('deepspeed', 'fairscale', 'torch_xla')]\n"
        "assert not heavy, heavy\n"
    )
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in run.stderr.splitlines()}
    assert not imported & {"deepspeed", "fairscale", "torch_xla"}


def test_import_torchplug_alone_imports_no_torch():
    code = "import sys, torchplug; assert 'torch' not in sys.modules; print(torchplug.__version__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_plugins_table_lists_built_ins_with_package_and_status():
    run = torchplug("plugins")
    assert run.returncode == 0, run.stderr
    rows = {line.split()[0]: line for line in run.stdout.splitlines() if line.strip()}
    assert "torchplug 0.1.0 (ddp)" in rows["ddp"] and rows["ddp"].endswith("usable")
    assert "single-device" in rows["single"]
    assert "amp" in rows["bf16"] and "amp" in rows["fp16"]


def test_config_never_writes_through_a_planted_name_and_every_failure_is_one_line(tmp_path):
    """Issue 36 item 5: a symlink or FIFO planted at the old temporary name is never followed
    or opened (the temporary file is made exclusively); a directory, a missing parent and the
    end of input under --ask are one line and exit 2, nothing written."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "torchplug.toml.tmp").symlink_to(victim)
    made = torchplug("config", "--strategy", "ddp", cwd=tmp_path, timeout=120)
    assert made.returncode == 0, made.stderr
    assert victim.read_text() == "precious"  # the planted link was not written through
    assert 'strategy = "ddp"' in (tmp_path / "torchplug.toml").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".torchplug.toml.")]
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "torchplug.toml.tmp")  # opening it for writing would block forever
    made = torchplug("config", "--strategy", "ddp", cwd=fifo, timeout=120)
    assert made.returncode == 0 and (fifo / "torchplug.toml").is_file(), made.stderr
    (tmp_path / "adir").mkdir()
    cases = {
        "directory": ("config", "--strategy", "ddp", "-o", "adir", "--force"),
        "parent": ("config", "--strategy", "ddp", "-o", "no/such/dir/torchplug.toml"),
        "eof": ("config", "--ask", "-o", "asked.toml"),
    }
    for case, args in cases.items():
        done = torchplug(*args, cwd=tmp_path, timeout=120, input="")
        assert done.returncode == 2, (case, done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in done.stderr, (case, done.stderr)
    assert not (tmp_path / "asked.toml").exists()


def test_a_config_file_that_cannot_be_read_is_an_error_not_silence(tmp_path):
    """Issue 36 item 5: a dangling torchplug.toml link and a deeply nested file are one
    ConfigurationError each (they used to drop every setting silently, or raise
    RecursionError)."""
    import torchplug as tp
    from torchplug.engine.config import find_config

    (tmp_path / "torchplug.toml").symlink_to(tmp_path / "gone.toml")
    with pytest.raises(tp.ConfigurationError, match="does not exist: its settings would"):
        find_config(cwd=tmp_path, env={})
    (tmp_path / "torchplug.toml").unlink()
    (tmp_path / "torchplug.toml").write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(tp.ConfigurationError, match="torchplug.toml"):
        find_config(cwd=tmp_path, env={})


def test_plugins_lists_the_cluster_environments_in_the_order_asked_and_which_answers():
    """Issue 26 item 8: cluster plugins are listed, with what each answers here."""
    plain = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    plain.pop("TORCHELASTIC_RUN_ID", None)
    out = subprocess.run(
        [sys.executable, "-m", "torchplug", "plugins"],
        capture_output=True, text=True, timeout=180, env=plain,
    ).stdout  # fmt: skip
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "cluster environment (asked in order)" in out
    assert "not this environment" in rows["slurm"]
    assert "not this environment" in rows["environment"]
    assert "rank 0 of 1" in rows["(none"]
    slurm = {
        "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5", "SLURM_NNODES": "1",
        "SLURM_STEP_NODELIST": "localhost", "SLURM_NODEID": "0", "SLURM_LOCALID": "1",
        "SLURM_STEP_ID": "0",
    }  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "torchplug", "plugins"],
        capture_output=True, text=True, timeout=180,
        env={**plain, **slurm, "RANK": "0", "WORLD_SIZE": "3"},
    ).stdout  # fmt: skip
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "answers: rank 1 of 2" in rows["slurm"], out
    assert "earlier one" in rows["environment"]  # RANK/WORLD_SIZE by hand: asked last
    assert "not this environment" in rows["torchrun"]
    names = [n for n in rows if n in ("torchrun", "slurm", "environment")]
    assert names == ["torchrun", "slurm", "environment"]
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "2", "WORLD_SIZE": "4"}
    out = subprocess.run(
        [sys.executable, "-m", "torchplug", "plugins"],
        capture_output=True, text=True, timeout=180, env={**plain, **slurm, **torchrun},
    ).stdout  # fmt: skip
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "answers: rank 2 of 4" in rows["torchrun"], out  # in torchrun's workers, first
    assert "answers" not in rows["slurm"]


def test_core_imports_neither_the_command_line_nor_the_testing_kit():
    """Imports point downward: cli/ and testing/ sit above core/, never below it."""
    import ast

    offenders = []
    for path in (ROOT / "src" / "torchplug" / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.name}: {n}"
                for n in names
                if n.startswith(("torchplug.cli", "torchplug.testing"))
            ]
    assert not offenders
    assert not (ROOT / "src" / "torchplug" / "core" / "cli.py").exists()


def test_config_writes_a_file_that_engine_and_launch_read(tmp_path):
    """Issue 27 item 9: `torchplug config` writes torchplug.toml; Engine() takes its strategy,
    precision, options and loggers, and `torchplug launch` its process count."""
    made = torchplug(
        "config", "--strategy", "ddp", "--precision", "bf16", "-n", "2", "--logger", "csv",
        "--option", "timeout=60", cwd=tmp_path,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    text = (tmp_path / "torchplug.toml").read_text()
    assert 'strategy = "ddp"' in text and "processes = 2" in text and "timeout = 60" in text
    (tmp_path / "show.py").write_text(
        "import os, torchplug as tp\n"
        "with tp.Engine() as engine:\n"
        "    line = (f'rank {engine.rank} of {engine.world_size} {engine.info.name} '\n"
        "            f'{engine.precision} {engine.collective_timeout:g}\\n')\n"
        "    os.write(1, line.encode())  # one write: print's text and newline can interleave\n"
        "    engine.log({'x': 1.0}, step=0)\n"
    )
    run = torchplug("launch", "show.py", cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0 of 2 ddp bf16 60", "rank 1 of 2 ddp bf16 60"], run.stdout
    assert "x" in (tmp_path / "logs" / "metrics.csv").read_text()
    again = torchplug("config", "--strategy", "ddp", cwd=tmp_path)
    assert again.returncode == 2 and "--force" in again.stderr  # nothing replaced silently
    wrong = torchplug("config", "--strategy", "dpp", "--force", cwd=tmp_path)
    assert wrong.returncode == 2 and "Did you mean 'ddp'" in wrong.stderr
    assert 'strategy = "ddp"' in (tmp_path / "torchplug.toml").read_text()  # left as it was
