"""The torchplug port of `accelerate_schedule_free` (Accelerate's
``examples/by_feature/schedule_free.py``), made with docs/migration-accelerate.md alone."""

import schedulefree
import torch
from offline import MrpcMetric, Record, collate, mrpc_like, tiny_bert
from torch.utils.data import DataLoader

import torchplug as tp

MAX_GPU_BATCH_SIZE = 16
EVAL_BATCH_SIZE = 32


def get_dataloaders(engine, batch_size=16):
    with engine.main_process_first():
        train, validation = mrpc_like(160, seed=0), mrpc_like(101, seed=1)
    train_dataloader = DataLoader(
        train, shuffle=True, collate_fn=collate, batch_size=batch_size, drop_last=True
    )
    eval_dataloader = DataLoader(
        validation,
        shuffle=False,
        collate_fn=collate,
        batch_size=EVAL_BATCH_SIZE,
        drop_last=(engine.precision == "fp8"),
    )
    return train_dataloader, eval_dataloader


def training_function(config):
    engine = tp.Engine()
    lr, num_epochs = config["lr"], int(config["num_epochs"])
    seed, batch_size = int(config["seed"]), int(config["batch_size"])
    metric, record = MrpcMetric(), Record()

    # If the batch size is too big we use gradient accumulation
    gradient_accumulation_steps = 1
    if batch_size > MAX_GPU_BATCH_SIZE:
        gradient_accumulation_steps = batch_size // MAX_GPU_BATCH_SIZE
        batch_size = MAX_GPU_BATCH_SIZE

    tp.seed_everything(seed)
    train_dataloader, eval_dataloader = get_dataloaders(engine, batch_size)
    model = tiny_bert()
    # Instantiate optimizer with warmup steps (the optimizer's own count of its steps)
    optimizer = schedulefree.AdamWScheduleFree(model.parameters(), lr=lr, warmup_steps=8)
    model, optimizer = engine.setup(model, optimizer)
    train_dataloader = engine.setup_dataloader(train_dataloader, shard_by="batch")
    eval_dataloader = engine.setup_dataloader(eval_dataloader, shard_by="batch")

    for epoch in range(num_epochs):
        model.train()
        optimizer.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / gradient_accumulation_steps
            engine.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
            record.losses.append(engine.reduce(loss.detach(), "mean").item())

        model.eval()
        optimizer.eval()
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = engine.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions, references=references)
        eval_metric = metric.compute()
        engine.print(f"epoch {epoch}:", eval_metric)
        record.metrics[f"epoch_{epoch}"] = eval_metric
    record.write(engine.is_main)
    engine.close()


if __name__ == "__main__":
    training_function({"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 16})
