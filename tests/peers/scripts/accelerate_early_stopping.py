"""Accelerate's ``examples/by_feature/early_stopping.py``, offline.

Changes from upstream, all for running offline and comparing: the data, model and metric come from
`offline`, lr 2e-3 and a warmup of 8, 2 epochs, patience 2 (5 never triggers in so few steps), and
each step's loss (the mean over ranks), where training stopped and the final metrics are recorded.
"""

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from offline import MrpcMetric, Record, collate, mrpc_like, tiny_bert
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

EVAL_BATCH_SIZE = 32


def get_dataloaders(accelerator, batch_size=16):
    with accelerator.main_process_first():
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
    accelerator = Accelerator(cpu=True)
    lr, num_epochs = config["lr"], int(config["num_epochs"])
    seed, batch_size = int(config["seed"]), int(config["batch_size"])
    metric, record = MrpcMetric(), Record()
    record.metrics["stopped"] = []

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = tiny_bert()
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=8,
        num_training_steps=len(train_dataloader) * num_epochs,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch.to(accelerator.device)
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            record.losses.append(accelerator.reduce(loss.detach(), "mean").item())

            # New code
            # Check if we should stop the training on any processes
            if callback.check_early_stopping(loss.item()):
                accelerator.set_trigger()

            # If so, we break the loop
            if accelerator.check_trigger():
                record.metrics["stopped"].append([epoch, step])
                break

        model.eval()
        for batch in eval_dataloader:
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions, references=references)
        eval_metric = metric.compute()
        accelerator.print(f"epoch {epoch}:", eval_metric)
        record.metrics[f"epoch_{epoch}"] = eval_metric
    record.write(accelerator.is_main_process)


if __name__ == "__main__":
    training_function({"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 16})
