"""Accelerate's ``examples/by_feature/cross_validation.py`` (``StratifiedKFold``, the test set's
predictions averaged over the folds), offline.

Changes from upstream, all for running offline and comparing: the data, model and metric come from
`offline` (160 MRPC-like pairs split into the folds, 101 as the test set; GLUE MRPC's accuracy/F1),
lr 2e-3 and a warmup of 8 for a model this small, 2 epochs, and each step's loss (the mean over
ranks), each fold's epochs' metrics and final learning rate, and the test metrics are recorded.
``--num_folds`` is upstream's argument (default 3).
"""

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from offline import MrpcMetric, Record, argument, collate, mrpc_like, tiny_bert
from sklearn.model_selection import StratifiedKFold
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

MAX_GPU_BATCH_SIZE = 16
EVAL_BATCH_SIZE = 32


def get_fold_dataloaders(accelerator, dataset, train_idxs, valid_idxs, batch_size=16):
    with accelerator.main_process_first():
        datasets = {
            "train": [dataset["train"][i] for i in train_idxs],
            "validation": [dataset["train"][i] for i in valid_idxs],
            "test": dataset["validation"],
        }
    train_dataloader = DataLoader(
        datasets["train"], shuffle=True, collate_fn=collate, batch_size=batch_size
    )
    eval_dataloader = DataLoader(
        datasets["validation"], shuffle=False, collate_fn=collate, batch_size=EVAL_BATCH_SIZE
    )
    test_dataloader = DataLoader(
        datasets["test"], shuffle=False, collate_fn=collate, batch_size=EVAL_BATCH_SIZE
    )
    return train_dataloader, eval_dataloader, test_dataloader


def training_function(config, args):
    test_predictions = []
    datasets = {"train": mrpc_like(160, seed=0), "validation": mrpc_like(101, seed=1)}
    kfold = StratifiedKFold(n_splits=int(args["num_folds"]))
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

    # New Code #
    # Create our folds:
    labels = [row["labels"] for row in datasets["train"]]
    folds = kfold.split(np.zeros(len(datasets["train"])), labels)
    test_references = []
    # Iterate over them
    for i, (train_idxs, valid_idxs) in enumerate(folds):
        train_dataloader, eval_dataloader, test_dataloader = get_fold_dataloaders(
            accelerator,
            datasets,
            train_idxs,
            valid_idxs,
        )
        model = tiny_bert()
        model = model.to(accelerator.device)
        optimizer = AdamW(params=model.parameters(), lr=lr)
        lr_scheduler = get_linear_schedule_with_warmup(
            optimizer=optimizer,
            num_warmup_steps=8,
            num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps,
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
                loss = loss / gradient_accumulation_steps
                accelerator.backward(loss)
                if step % gradient_accumulation_steps == 0:
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
                predictions, references = accelerator.gather_for_metrics(
                    (predictions, batch["labels"])
                )
                metric.add_batch(predictions=predictions, references=references)
            eval_metric = metric.compute()
            accelerator.print(f"epoch {epoch}:", eval_metric)
            record.metrics[f"fold_{i}_epoch_{epoch}"] = eval_metric
        record.metrics[f"fold_{i}_lr"] = lr_scheduler.get_last_lr()[0]

        # New Code #
        # We also run predictions on the test set at the very end
        fold_predictions = []
        for batch in test_dataloader:
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            fold_predictions.append(predictions.cpu())
            if i == 0:
                # We need all of the test predictions
                test_references.append(references.cpu())
        # Use accelerator.print to print only on the main process.
        test_predictions.append(torch.cat(fold_predictions, dim=0))
        # We now need to release all our memory and get rid of the current model, optimizer, etc
        model, optimizer = accelerator.free_memory(model, optimizer)
    # New Code #
    # Finally we check the accuracy of our folded results:
    test_references = torch.cat(test_references, dim=0)
    preds = torch.stack(test_predictions, dim=0).sum(dim=0).div(int(args["num_folds"]))
    preds = preds.argmax(dim=-1)
    test_metric = metric.compute(predictions=preds, references=test_references)
    accelerator.print("Average test metrics from all folds:", test_metric)
    record.metrics["test"] = test_metric
    record.write(accelerator.is_main_process)


if __name__ == "__main__":
    config = {"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 16}
    training_function(config, {"num_folds": argument("num_folds", "3")})
