"""torchplug.launch: ranks started from Python through the elastic launcher API, from a script
and from an executed notebook; a rank's exception reaches the caller with its traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import torchplug as tp
from support.paths import ROOT

SCRIPT = textwrap.dedent(
    """
    import os, torch, torchplug as tp

    def work(scale, offset=0):
        with tp.Engine() as engine:
            total = engine.reduce(torch.tensor(float(engine.rank + 1)), "sum").item()
            return [engine.rank, engine.world_size, engine.strategy, total * scale + offset]

    def fails():
        if os.environ["RANK"] == "1":
            raise ValueError("rank one is unhappy")

    if __name__ == "__main__":
        print("result", tp.launch(work, 2.0, nprocs=2, offset=1), flush=True)
        try:
            tp.launch(fails, nprocs=2)
        except tp.RankFailedError as error:
            print("rank", error.rank, "said", repr(str(error)), flush=True)
    """
)


@pytest.mark.slow
def test_launch_from_a_script_returns_rank_zero_and_raises_a_ranks_error(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPLUG_")}
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "result [0, 2, 'ddp', 7.0]" in run.stdout
    line = next(line for line in run.stdout.splitlines() if line.startswith("rank "))
    assert line.startswith("rank 1 said 'Rank 1 of 2 failed: ValueError: rank one is unhappy")
    assert 'in fails\\n    raise ValueError(\\"rank one is unhappy\\")' in line or (
        "in fails" in line and "raise ValueError" in line
    )


def test_launch_checks_its_arguments():
    with pytest.raises(tp.ConfigurationError, match="nprocs=0 is not a number of processes"):
        tp.launch(print, nprocs=0)
    with pytest.raises(tp.ConfigurationError, match="start_method='thread'"):
        tp.launch(print, nprocs=1, start_method="thread")


def test_launch_from_an_executed_notebook():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebook = nbformat.read(ROOT / "examples" / "launch_notebook.ipynb", as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3")
    client.execute(cwd=str(ROOT))
    printed = "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "stream"
    )
    assert "2 ddp True" in printed
    assert "caught from rank 1 - Rank 1 of 2 failed: ValueError: rank 1 cannot go on" in printed
