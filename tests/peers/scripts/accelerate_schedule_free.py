"""Accelerate's ``examples/by_feature/schedule_free.py`` (``schedulefree.AdamWScheduleFree``),
offline.

Changes from upstream, all for running offline and comparing: the data, model and metric come from
`offline` (MRPC-like pairs, a tiny BERT, GLUE MRPC's accuracy/F1), lr 2e-3 and the optimizer's
warmup of 8 steps for a model this small, 2 epochs, and each step's loss (the mean over ranks) and
the final metrics are recorded.
"""

import schedulefree
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from offline import MrpcMetric, Record, collate, mrpc_like, tiny_bert
from torch.utils.data import DataLoader

MAX_GPU_BATCH_SIZE = 16
EVAL_BATCH_SIZE = 32


def get_dataloaders(accelerator, batch_size=16):
    with accelerator.main_process_first():
        train, validation = mrpc_like(160, seed=0), mrpc_like(101, seed=1)
    train_dataloader = DataLoader(
        train, shuffle=True, collate_fn=collate, batch_size=batch_size, drop_last=True
    )
    eval_dataloader = DataLoader(
        validation,
        shuffle=False,
        collate_fn=collate,
        batch_size=EVAL_BATCH_SIZE,
        drop_last=(accelerator.mixed_precision == "fp8"),
    )
    return train_dataloader, eval_dataloader


def training_function(config):
    accelerator = Accelerator(cpu=True)
    lr, num_epochs = config["lr"], int(config["num_epochs"])
    seed, batch_size = int(config["seed"]), int(config["batch_size"])
    metric, record = MrpcMetric(), Record()

    # If the batch size is too big we use gradient accumulation
    gradient_accumulation_steps = 1
    if batch_size > MAX_GPU_BATCH_SIZE:
        gradient_accumulation_steps = batch_size // MAX_GPU_BATCH_SIZE
        batch_size = MAX_GPU_BATCH_SIZE

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = tiny_bert()
    model = model.to(accelerator.device)
    # Instantiate optimizer with warmup steps
    optimizer = schedulefree.AdamWScheduleFree(model.parameters(), lr=lr, warmup_steps=8)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )

    for epoch in range(num_epochs):
        model.train()
        optimizer.train()
        for step, batch in enumerate(train_dataloader):
            batch.to(accelerator.device)
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
            record.losses.append(accelerator.reduce(loss.detach(), "mean").item())

        model.eval()
        optimizer.eval()
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
