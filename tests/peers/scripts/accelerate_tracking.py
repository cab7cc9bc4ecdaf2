"""Accelerate's ``examples/by_feature/tracking.py`` (``--with_tracking``), offline.

Changes from upstream, all for running offline and comparing: the data, model and metric come from
`offline`, lr 2e-3 and a warmup of 8, 2 epochs, TensorBoard as the tracker (``log_with="all"``
would reach for online services), and each step's loss (the mean over ranks), the logged values and
the final metrics are recorded.
"""

import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from offline import MrpcMetric, Record, argument, collate, mrpc_like, tiny_bert
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


def training_function(config, args):
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=args["project_dir"])
    lr, num_epochs = config["lr"], int(config["num_epochs"])
    seed, batch_size = int(config["seed"]), int(config["batch_size"])
    metric, record = MrpcMetric(), Record()
    record.metrics["logged"] = []

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

    # New Code #
    # The trackers initialize themselves on the main process only
    run = os.path.split(__file__)[-1].split(".")[0]
    accelerator.init_trackers(run, config)

    for epoch in range(num_epochs):
        model.train()
        total_loss = 0
        for batch in train_dataloader:
            batch.to(accelerator.device)
            outputs = model(**batch)
            loss = outputs.loss
            # New Code #
            # For our tracking example, we will log the total loss of each epoch
            total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            record.losses.append(accelerator.reduce(loss.detach(), "mean").item())

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

        # New Code #
        # To actually log, we call `Accelerator.log`
        # The values passed can be of `str`, `int`, `float` or `dict` of `str` to `float`/`int`
        logged = {
            "accuracy": eval_metric["accuracy"],
            "f1": eval_metric["f1"],
            "train_loss": total_loss.item() / len(train_dataloader),
            "epoch": epoch,
        }
        accelerator.log(logged, step=epoch)
        record.metrics["logged"].append(logged)

    # New Code #
    # When a run is finished, you should call `accelerator.end_training()`
    # to close all of the open trackers
    accelerator.end_training()
    record.write(accelerator.is_main_process)


if __name__ == "__main__":
    config = {"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 16}
    training_function(config, {"project_dir": argument("project_dir")})
