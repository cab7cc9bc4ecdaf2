"""Accelerate's ``examples/by_feature/memory.py`` (``find_executable_batch_size``), offline.

Changes from upstream, all for running offline and comparing: the data, model and metric come from
`offline`, lr 2e-3 and a warmup of 8, 2 epochs, a starting batch size of 64, and, since a CPU this
size does not run out of memory on a tiny BERT, the first forward of a batch over 40 samples raises
the CPU allocator's own out-of-memory error (what torch raises there). Each step's loss (the mean
over ranks), the batch sizes tried and the final metrics are recorded.
"""

import torch
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size, set_seed
from offline import MrpcMetric, Record, collate, mrpc_like, tiny_bert
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

EVAL_BATCH_SIZE = 32
FITS = 40


def out_of_memory_past(batch_size):
    if batch_size > FITS:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
            f"you tried to allocate {batch_size * 2**30} bytes."
        )


def get_dataloaders(accelerator, batch_size=16):
    with accelerator.main_process_first():
        train, validation = mrpc_like(160, seed=0), mrpc_like(101, seed=1)
    train_dataloader = DataLoader(train, shuffle=True, collate_fn=collate, batch_size=batch_size)
    eval_dataloader = DataLoader(
        validation, shuffle=False, collate_fn=collate, batch_size=EVAL_BATCH_SIZE
    )
    return train_dataloader, eval_dataloader


def training_function(config):
    accelerator = Accelerator(cpu=True)
    lr, num_epochs = config["lr"], int(config["num_epochs"])
    seed = int(config["seed"])
    metric, record = MrpcMetric(), Record()
    record.metrics["tried"] = []

    # New Code #
    # We now can define an inner training loop function. It should take a batch size as the only
    # parameter, and build the dataloaders in there.
    # It also gets our decorator
    @find_executable_batch_size(starting_batch_size=int(config["batch_size"]))
    def inner_training_loop(batch_size):
        # And now just move everything below under this function
        # We need to bring in the Accelerator object from earlier
        nonlocal accelerator
        # And reset all of its attributes that could hold onto any memory:
        accelerator.free_memory()
        record.metrics["tried"].append(batch_size)
        record.losses.clear()

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
            for batch in train_dataloader:
                batch.to(accelerator.device)
                out_of_memory_past(batch_size)
                outputs = model(**batch)
                loss = outputs.loss
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
                predictions, references = accelerator.gather_for_metrics(
                    (predictions, batch["labels"])
                )
                metric.add_batch(predictions=predictions, references=references)
            eval_metric = metric.compute()
            accelerator.print(f"epoch {epoch}:", eval_metric)
            record.metrics[f"epoch_{epoch}"] = eval_metric

    # New Code #
    # And call it at the end with no arguments
    # Note: You could also refactor this outside of your training loop function
    inner_training_loop()
    record.write(accelerator.is_main_process)


if __name__ == "__main__":
    training_function({"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 64})
