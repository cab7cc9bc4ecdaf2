"""The torchplug port of `accelerate_cross_validation` (Accelerate's
``examples/by_feature/cross_validation.py``), made with docs/migration-accelerate.md alone."""

import numpy as np
import torch
from offline import MrpcMetric, Record, argument, collate, mrpc_like, tiny_bert
from sklearn.model_selection import StratifiedKFold
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

import torchplug as tp

MAX_GPU_BATCH_SIZE = 16
EVAL_BATCH_SIZE = 32


def get_fold_dataloaders(engine, dataset, train_idxs, valid_idxs, batch_size=16):
    with engine.main_process_first():
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

    # New Code #
    # Create our folds:
    labels = [row["labels"] for row in datasets["train"]]
    folds = kfold.split(np.zeros(len(datasets["train"])), labels)
    test_references = []
    # Iterate over them
    for i, (train_idxs, valid_idxs) in enumerate(folds):
        train_dataloader, eval_dataloader, test_dataloader = get_fold_dataloaders(
            engine,
            datasets,
            train_idxs,
            valid_idxs,
        )
        model = tiny_bert()
        optimizer = AdamW(params=model.parameters(), lr=lr)
        # the schedule as upstream sizes it, divided by the processes (the guide's row)
        lr_scheduler = get_linear_schedule_with_warmup(
            optimizer=optimizer,
            num_warmup_steps=8 / engine.world_size,
            num_training_steps=(len(train_dataloader) * num_epochs)
            // gradient_accumulation_steps
            / engine.world_size,
        )
        model, optimizer = engine.setup(model, optimizer)
        train_dataloader = engine.setup_dataloader(train_dataloader, shard_by="batch")
        eval_dataloader = engine.setup_dataloader(eval_dataloader, shard_by="batch")

        for epoch in range(num_epochs):
            model.train()
            for step, batch in enumerate(train_dataloader):
                outputs = model(**batch)
                loss = outputs.loss
                loss = loss / gradient_accumulation_steps
                engine.backward(loss)
                if step % gradient_accumulation_steps == 0:
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
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
            record.metrics[f"fold_{i}_epoch_{epoch}"] = eval_metric
        record.metrics[f"fold_{i}_lr"] = lr_scheduler.get_last_lr()[0]

        # New Code #
        # We also run predictions on the test set at the very end (a loader upstream does not
        # prepare: every rank predicts all of it)
        fold_predictions = []
        for batch in test_dataloader:
            batch = engine.place_batch(batch)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits
            predictions, references = engine.gather_for_metrics((predictions, batch["labels"]))
            fold_predictions.append(predictions.cpu())
            if i == 0:
                # We need all of the test predictions
                test_references.append(references.cpu())
        test_predictions.append(torch.cat(fold_predictions, dim=0))
        # upstream's accelerator.free_memory(model, optimizer), as the guide maps it
        del model, optimizer
    # New Code #
    # Finally we check the accuracy of our folded results:
    test_references = torch.cat(test_references, dim=0)
    preds = torch.stack(test_predictions, dim=0).sum(dim=0).div(int(args["num_folds"]))
    preds = preds.argmax(dim=-1)
    test_metric = metric.compute(predictions=preds, references=test_references)
    engine.print("Average test metrics from all folds:", test_metric)
    record.metrics["test"] = test_metric
    record.write(engine.is_main)
    engine.close()


if __name__ == "__main__":
    config = {"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 16}
    training_function(config, {"num_folds": argument("num_folds", "3")})
