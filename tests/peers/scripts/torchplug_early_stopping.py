"""The torchplug port of `accelerate_early_stopping` (Accelerate's
``examples/by_feature/early_stopping.py``), made with docs/migration-accelerate.md alone."""

import torch
from offline import MrpcMetric, Record, collate, mrpc_like, tiny_bert
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


class EarlyStoppingCallback:
    "A callback class that helps with early stopping"

    def __init__(self, min_delta=0, patience=2):
        self.min_delta = min_delta
        self.patience = patience
        self.counter = 0
        self.lowest_loss = float("inf")

    def check_early_stopping(self, eval_loss):
        delta = self.lowest_loss - eval_loss
        if delta >= self.min_delta:
            self.lowest_loss = eval_loss
            self.counter = 0
        else:
            self.counter += 1
            if self.counter >= self.patience:
                return True
        return False


callback = EarlyStoppingCallback()


def training_function(config):
    engine = tp.Engine()
    lr, num_epochs = config["lr"], int(config["num_epochs"])
    seed, batch_size = int(config["seed"]), int(config["batch_size"])
    metric, record = MrpcMetric(), Record()
    record.metrics["stopped"] = []

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

    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            engine.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            record.losses.append(engine.reduce(loss.detach(), "mean").item())

            # New code
            # Check if we should stop the training on any processes
            # If so, we break the loop
            if engine.any(callback.check_early_stopping(loss.item())):
                record.metrics["stopped"].append([epoch, step])
                break

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
    record.write(engine.is_main)
    engine.close()


if __name__ == "__main__":
    training_function({"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 16})
