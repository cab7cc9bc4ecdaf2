"""Accelerate's ``examples/by_feature/local_sgd.py`` (``LocalSGD``), offline.

Changes from upstream, all for running offline and comparing: the data, model and metric come from
`offline` (MRPC-like pairs, a tiny BERT, GLUE MRPC's accuracy/F1), lr 2e-3 and a warmup of 8 for a
model this small, 2 epochs, and each step's loss (the mean over ranks) and the final metrics are
recorded. Upstream's defaults are kept: ``--gradient_accumulation_steps 1``,
``--local_sgd_steps 8``.
"""

import torch
from accelerate import Accelerator
from accelerate.local_sgd import LocalSGD
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
    # New Code #
    gradient_accumulation_steps = int(args["gradient_accumulation_steps"])
    local_sgd_steps = int(args["local_sgd_steps"])
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gradient_accumulation_steps)
    lr, num_epochs = config["lr"], int(config["num_epochs"])
    seed, batch_size = int(config["seed"]), int(config["batch_size"])
    metric, record = MrpcMetric(), Record()

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
        with LocalSGD(
            accelerator=accelerator,
            model=model,
            local_sgd_steps=local_sgd_steps,
            enabled=local_sgd_steps is not None,
        ) as local_sgd:
            for batch in train_dataloader:
                batch.to(accelerator.device)
                # New code #
                # We use the new `accumulate` context manager to perform gradient accumulation
                with accelerator.accumulate(model):
                    output = model(**batch)
                    loss = output.loss
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                    # LocalSGD-specific line
                    local_sgd.step()
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
        record.metrics[f"epoch_{epoch}"] = eval_metric
    record.metrics["lr"] = lr_scheduler.get_last_lr()[0]
    record.write(accelerator.is_main_process)


if __name__ == "__main__":
    config = {"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 16}
    args = {
        "gradient_accumulation_steps": argument("gradient_accumulation_steps", "1"),
        "local_sgd_steps": argument("local_sgd_steps", "8"),
    }
    training_function(config, args)
