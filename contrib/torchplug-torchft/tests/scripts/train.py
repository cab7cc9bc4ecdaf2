"""The same script for ``ddp`` and ``ft-ddp``: a small model with BatchNorm, AdamW and a
scheduler, a shuffled loader, resumable state; writes each committed step's loss and the final
parameters of this replica to ``--out``.

``--die-at S --die-group G --die-rank R``: that rank kills itself with SIGKILL before its step S,
once (a marker file in ``--out`` says it already died, so the restarted group carries on).
``--checkpoint-every K``: ``save_checkpoint`` every K steps and ``resume="latest"`` (what a
``--max-restarts`` job resumes from). ``--eval-size N``: after training, an evaluation pass over
the first N samples, each batch's indices through ``gather_for_metrics``.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from ft_job import make_data, make_model, make_optimizer
from torch.utils.data import DataLoader

import torchplug as tp

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--die-at", type=int, default=-1)
parser.add_argument("--die-group", type=int, default=1)
parser.add_argument("--die-rank", type=int, default=0)
parser.add_argument("--checkpoint-every", type=int, default=0, help="save_checkpoint every K")
parser.add_argument("--slow", type=float, default=0.0, help="seconds of sleep per step")
parser.add_argument("--eval-size", type=int, default=0, help="then gather N samples' indices")
args = parser.parse_args()
out = Path(args.out)

tp.seed_everything(0)
model = make_model()
optimizer, scheduler = make_optimizer(model)
data = make_data()

group = int(os.environ.get("TORCHPLUG_FT_REPLICA", "0"))
saving = {"checkpoint_dir": out / f"checkpoints{group}", "resume": "latest"}
with tp.Engine(**(saving if args.checkpoint_every else {})) as engine:
    model, optimizer = engine.setup(model, optimizer)
    loader = engine.setup_dataloader(DataLoader(data, batch_size=8, shuffle=True))
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "loader": loader,
        "step": 0,
    }
    engine.resume(state)
    me = f"group{group}_rank{engine.rank}"
    log = out / f"{me}.jsonl"
    died = out / f"died_{group}"
    step = state["step"]
    with log.open("a") as record:
        record.write(json.dumps({"start": step}) + "\n")
        while step < args.steps:
            for x, y, idx in loader:
                dies = (group, engine.rank) == (args.die_group, args.die_rank)
                if step == args.die_at and dies and not died.exists():
                    died.write_text(str(step))
                    os.kill(os.getpid(), signal.SIGKILL)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                engine.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                if optimizer.step_was_skipped:
                    record.write(json.dumps({"skipped": step}) + "\n")
                    record.flush()
                    continue
                scheduler.step()
                entry = {"step": step, "loss": loss.item(), "idx": idx.tolist()}
                entry["epoch"] = loader.epoch
                record.write(json.dumps(entry) + "\n")
                record.flush()
                step += 1
                state["step"] = step
                time.sleep(args.slow)
                if args.checkpoint_every and step % args.checkpoint_every == 0:
                    engine.save_checkpoint(state)
                if step == args.steps:
                    break
    if args.eval_size:  # an evaluation pass: what gather_for_metrics hands every rank
        subset = torch.utils.data.Subset(data, range(args.eval_size))
        evaluated = engine.setup_dataloader(DataLoader(subset, batch_size=4))
        seen = [engine.gather_for_metrics(idx).tolist() for _, _, idx in evaluated]
        (out / f"{me}_eval.json").write_text(json.dumps(seen))
    params = {k: v.tolist() for k, v in engine.full_state(model)["model"].items()}
    (out / f"{me}_final.json").write_text(json.dumps(params))
    engine.save(out / f"checkpoint_group{group}", {"model": model, "optimizer": optimizer})
