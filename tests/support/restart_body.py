"""A training run that checkpoints, resumes by itself, and can kill one of its ranks.

Run under ``torchplug launch --max-restarts 1`` (the launched script calls :func:`train`) and
uninterrupted in the ``ranks`` pool; the two must end bit-equal. Dropout, Python's ``random`` and
a shuffled loader make every piece of state matter: RNG, loader position, optimizer.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp


def train(
    checkpoint_dir: str,
    steps: int = 16,
    every: int = 3,
    kill_after: int | None = None,
    keep_last: int = 2,
    preempt_marker: str | None = None,
    preempt_after: int = 7,
) -> dict[str, Any]:
    """Train ``steps`` steps, saving every ``every``; rank 1 SIGKILLs itself after step
    ``kill_after`` on the first attempt. Returns the final parameters and where it resumed.

    With ``preempt_marker`` the loop reads ``engine.preempted`` every step, as a script that
    saves on preemption does; a fresh run touches the marker after step ``preempt_after`` and
    then takes as long as a slow step until the notice arrives (so the test knows the step)."""
    torch.manual_seed(0)
    random.seed(0)
    with tp.Engine(
        "ddp", timeout=60.0, checkpoint_dir=checkpoint_dir, resume="latest", keep_last=keep_last
    ) as engine:
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = engine.setup(model, optimizer)
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
        loader = engine.setup_dataloader(DataLoader(data, batch_size=4, shuffle=True))
        state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
        resumed = engine.resume(state)
        step = state["step"]
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        while step < steps:
            for x, y in loader:
                jitter = 1.0 + 0.01 * random.random()
                loss = torch.nn.functional.mse_loss(model(x) * jitter, y)
                engine.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                state["step"] = step
                if step % every == 0:
                    engine.save_checkpoint(state)
                if step == kill_after and attempt == 0 and engine.rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                if preempt_marker and resumed is None and step == preempt_after:
                    if engine.rank == 0:
                        Path(preempt_marker).touch()
                    while not engine.preempted:
                        time.sleep(0.1)
                if preempt_marker and engine.preempted:
                    engine.save_checkpoint(state)
                    return {"preempted": step}
                if step >= steps:
                    break
        params = engine.full_state(model)["model"]
        return {"params": params, "resumed": resumed, "attempt": attempt}
