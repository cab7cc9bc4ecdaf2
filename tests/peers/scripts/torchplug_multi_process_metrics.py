"""The torchplug port of `accelerate_multi_process_metrics` (Accelerate's
``examples/by_feature/multi_process_metrics.py``), made with docs/migration-accelerate.md alone."""

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


def training_function(config):
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

    for epoch in range(num_epochs):
        model.train()
        for batch in train_dataloader:
            outputs = model(**batch)
            loss = outputs.loss
            engine.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            record.losses.append(engine.reduce(loss.detach(), "mean").item())

        model.eval()
        samples_seen = 0
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = engine.gather((predictions, batch["labels"]), concat=True)
            # New Code #
            # First we check if it's a distributed system
            if engine.world_size > 1:
                # Then see if we're on the last batch of our eval dataloader
                if step == len(eval_dataloader) - 1:
                    # Last batch needs to be truncated on distributed systems as it contains
                    # additional samples
                    predictions = predictions[: len(eval_dataloader.dataset) - samples_seen]
                    references = references[: len(eval_dataloader.dataset) - samples_seen]
                else:
                    # Otherwise we add the number of samples seen
                    samples_seen += references.shape[0]
            metric.add_batch(predictions=predictions, references=references)
        eval_metric = metric.compute()
        engine.print(f"epoch {epoch}:", eval_metric)
        record.metrics[f"epoch_{epoch}"] = eval_metric
    record.write(engine.is_main)
    engine.close()


if __name__ == "__main__":
    training_function({"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 16})
