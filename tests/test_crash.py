"""A save killed with SIGKILL at a random moment never costs the previous checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import torchplug as tp

SAVER = textwrap.dedent(
    """
    import sys, torch, torchplug as tp
    path = sys.argv[1]
    with tp.Engine("single") as engine:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
        optimizer = torch.optim.AdamW(model.parameters())
        model, optimizer = engine.setup(model, optimizer)
        step = int(sys.argv[2])
        while True:
            step += 1
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(step))
            engine.save(path, {"model": model, "optimizer": optimizer, "step": step})
            print(step, flush=True)
    """
)


@pytest.mark.slow
def test_sigkill_during_save_always_leaves_the_previous_checkpoint_loadable(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    path = tmp_path / "ckpt"
    rng = random.Random(0)
    last_good, interrupted = 0, 0
    for attempt in range(10):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(path), str(last_good)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # one save completed in this process
        assert first.strip(), f"attempt {attempt}: the saver died before saving"
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        interrupted += any(p.name.startswith(".ckpt.tmp-") for p in tmp_path.iterdir())

        manifest = json.loads((path / "manifest.json").read_text())
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
        with tp.Engine("single") as engine:
            state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "step": 0}
            engine.load(path, state)  # verifies every file's size and sha256
        assert state["step"] == manifest["step"] >= last_good + 1
        assert all(torch.all(p == state["step"]) for p in model.parameters())  # one consistent save
        last_good = state["step"]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in {"saver.py", "ckpt"}]
    assert all(name.startswith(".ckpt.tmp-") for name in leftovers), leftovers
    assert interrupted >= 3, f"only {interrupted} of 10 kills landed inside a save"
