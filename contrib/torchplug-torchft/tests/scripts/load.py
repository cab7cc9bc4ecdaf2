"""Load an ft-ddp group's checkpoint under whatever strategy launches this script; write the
model's full state (rank 0) to ``--out`` as JSON."""

import argparse
import json
from pathlib import Path

import torch
from ft_job import make_model, make_optimizer

import torchplug as tp

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

model = make_model()
optimizer, _ = make_optimizer(model)
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
