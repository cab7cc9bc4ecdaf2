"""The torchplug port of `accelerate_memory` (Accelerate's ``examples/by_feature/memory.py``),
made with docs/migration-accelerate.md alone."""

import torch
from offline import MrpcMetric, Record, collate, mrpc_like, tiny_bert
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

import torchplug as tp

EVAL_BATCH_SIZE = 32
FITS = 40


def out_of_memory_past(batch_size):
    if batch_size > FITS:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
            f"you tried to allocate {batch_size * 2**30} bytes."
        )


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
    seed = int(config["seed"])
    metric, record = MrpcMetric(), Record()
    record.metrics["tried"] = []

    # New Code #
    # We now can define an inner training loop function. It should take a batch size as the only
    # parameter, and build the dataloaders in there.
    # It also gets our decorator
    @tp.find_executable_batch_size(starting_batch_size=int(config["batch_size"]))
    def inner_training_loop(batch_size):
        # And now just move everything below under this function
        record.metrics["tried"].append(batch_size)
        record.losses.clear()

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
                out_of_memory_past(batch_size)
                outputs = model(**batch)
                loss = outputs.loss
                engine.backward(loss)
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
            record.metrics[f"epoch_{epoch}"] = eval_metric

    # New Code #
    # And call it at the end with no arguments
    # Note: You could also refactor this outside of your training loop function
    inner_training_loop()
    record.write(engine.is_main)
    engine.close()


if __name__ == "__main__":
    training_function({"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 64})
