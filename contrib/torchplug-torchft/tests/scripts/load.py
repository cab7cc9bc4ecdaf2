"""Load an ft-ddp group's checkpoint under whatever strategy launches this script; write the
model's full state (rank 0) to ``--out`` as JSON."""

import argparse
import json
from pathlib import Path

import torch

import torchplug as tp

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

model = torch.nn.Sequential(
    torch.nn.Linear(6, 16, bias=False),
    torch.nn.BatchNorm1d(16),
    torch.nn.ReLU(),
    torch.nn.Linear(16, 3),
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
with tp.Engine() as engine:
    model, optimizer = engine.setup(model, optimizer)
    engine.load(args.checkpoint, {"model": model, "optimizer": optimizer})
    state = engine.full_state(model, optimizer)
    if engine.is_main:
        params = {k: v.tolist() for k, v in state["model"].items()}
        moments = {
            f"{name}.{key}": value.tolist()
            for name, entry in state["optimizer"]["state"].items()
            for key, value in entry.items()
            if torch.is_tensor(value) and value.dim() > 0
        }
        Path(args.out).write_text(json.dumps({"model": params, "moments": moments}))
