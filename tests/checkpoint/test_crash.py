"""A save killed with SIGKILL at any point inside it never costs the previous checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import torchplug as tp

SAVER = textwrap.dedent(
    """
    import os, signal, sys, torch, torchplug as tp
    from torchplug.checkpoint import files as fs

    path, step, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    background = sys.argv[4] == "async"  # the write, fsyncs and swap on the save's own thread
    # The saver kills itself from inside its own save, at a chosen point: the kill_at-th fsync
    # of a file the save wrote (1, 2, ...), or just before the new checkpoint is swapped into
    # place (0). A deterministic stand-in for a SIGKILL "at a random moment".
    armed, calls, before_swap = False, 0, None
    real_fsync, real_swap = fs.fsync, fs.swap_into_place

    def fsync(p):
        global calls
        calls += 1
        if armed and calls == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(p)

    def swap(tmp, final, **options):
        global before_swap
        before_swap = calls if before_swap is None else before_swap
        if armed and kill_at == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_swap(tmp, final, **options)

    fs.fsync, fs.swap_into_place = fsync, swap
    with tp.Engine("single") as engine:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
        optimizer = torch.optim.AdamW(model.parameters())
        model, optimizer = engine.setup(model, optimizer)
        for armed in (False, True):
            step += 1
            calls = 0
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(step))
            state = {"model": model, "optimizer": optimizer, "step": step}
            engine.save(path, state, async_=background)
            engine.wait_for_save()
            print(step, before_swap, flush=True)
    """
)


def run_saver(script, path, last_good: int, kill_at: int, mode: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(script), str(path), str(last_good), str(kill_at), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stdout.split()
    assert len(lines) == 2, f"the saver should die in its second save: {proc.stdout}{proc.stderr}"
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_inside_a_save_always_leaves_the_previous_checkpoint_loadable(tmp_path, mode):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    path = tmp_path / "ckpt"
    last_good = 0
    _, fsyncs = run_saver(script, path, last_good, 0, mode)  # fsyncs of one save before its swap
    last_good = 1
    kill_points = sorted({0, 1, int(fsyncs) // 2, int(fsyncs)})
    assert int(fsyncs) >= 2, "a save fsyncs each file it writes"
    for kill_at in kill_points:
        first, _ = run_saver(script, path, last_good, kill_at, mode)
        assert int(first) == last_good + 1  # the first save of this process completed
        # killed inside the second save: its temporary directory is there, unfinished
        assert any(p.name.startswith(".ckpt.tmp-") for p in tmp_path.iterdir()), kill_at

        manifest = json.loads((path / "manifest.json").read_text())
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
        with tp.Engine("single") as engine:
            state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "step": 0}
            engine.load(path, state)  # verifies every file's size and sha256
        # the last complete save, not the interrupted one
        assert state["step"] == manifest["step"] == last_good + 1, kill_at
        assert all(torch.all(p == state["step"]) for p in model.parameters())  # consistent
        last_good = state["step"]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in {"saver.py", "ckpt"}]
    assert all(name.startswith(".ckpt.tmp-") for name in leftovers), leftovers
