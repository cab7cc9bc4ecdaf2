"""The torchplug port of `accelerate_checkpointing` (Accelerate's
``examples/by_feature/checkpointing.py``), made with docs/migration-accelerate.md alone."""

import os

import torch
from offline import MrpcMetric, Record, argument, collate, mrpc_like, tiny_bert
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

import torchplug as tp

EVAL_BATCH_SIZE = 32


def get_dataloaders(engine, batch_size=16):
    with engine.main_process_first():
        train, validation = mrpc_like(160, seed=0), mrpc_like(101, seed=1)
    train_dataloader = DataLoader(train, shuffle=True, collate_fn=collate, batch_size=batch_size)
    eval_dataloader = DataLoader(
        validation, shuffle=False, collate_fn=collate, batch_size=EVAL_BATCH_SIZE
    )
    return train_dataloader, eval_dataloader


def training_function(config, args):
    engine = tp.Engine()
    lr, num_epochs = config["lr"], int(config["num_epochs"])
    seed, batch_size = int(config["seed"]), int(config["batch_size"])
    metric, record = MrpcMetric(), Record()

    tp.seed_everything(seed)
    train_dataloader, eval_dataloader = get_dataloaders(engine, batch_size)
    model = tiny_bert()
    optimizer = AdamW(params=model.parameters(), lr=lr)
    model, optimizer = engine.setup(model, optimizer)
    batches = len(train_dataloader)  # before setup: what upstream sizes its schedule with
    train_dataloader = engine.setup_dataloader(train_dataloader, shard_by="batch")
    eval_dataloader = engine.setup_dataloader(eval_dataloader, shard_by="batch")
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=8 / engine.world_size,
        num_training_steps=batches * num_epochs / engine.world_size,
    )
    # what save_state keeps: the prepared objects and the RNG states
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": lr_scheduler,
        "rng": tp.RNGState(engine),
    }

    overall_step = 0
    starting_epoch = 0
    if args["resume_from_checkpoint"]:
        engine.print(f"Resumed from checkpoint: {args['resume_from_checkpoint']}")
        engine.load(args["resume_from_checkpoint"], state)
        path = os.path.basename(args["resume_from_checkpoint"])
        starting_epoch = int(path.replace("epoch_", "")) + 1
        overall_step = starting_epoch * len(train_dataloader)

    for epoch in range(starting_epoch, num_epochs):
        model.train()
        for batch in train_dataloader:
            outputs = model(**batch)
            loss = outputs.loss
            engine.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            record.losses.append(engine.reduce(loss.detach(), "mean").item())

        model.eval()
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = engine.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions, references=references)
        eval_metric = metric.compute()
        engine.print(f"epoch {epoch}:", eval_metric)
        record.metrics[f"epoch_{epoch}"] = eval_metric

        output_dir = os.path.join(args["output_dir"], f"epoch_{epoch}")
        engine.save(output_dir, state)
    record.metrics["lr"] = lr_scheduler.get_last_lr()[0]
    record.metrics["overall_step"] = overall_step
    engine.barrier()
    record.write(engine.is_main)
    engine.close()


if __name__ == "__main__":
    config = {"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 16}
    args = {
        "output_dir": argument("output_dir"),
        "resume_from_checkpoint": argument("resume_from_checkpoint"),
    }
    training_function(config, args)
