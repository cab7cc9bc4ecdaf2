"""Accelerate's ``examples/by_feature/automatic_gradient_accumulation.py``
(``find_executable_batch_size`` with ``accumulate``), offline.

Changes from upstream, all for running offline and comparing: the data, model and metric come from
`offline`, lr 2e-3 and a warmup of 8, 2 epochs, an observed batch size of 64, and, since a CPU this
size does not run out of memory on a tiny BERT, the first forward of a batch over 16 samples raises
the CPU allocator's own out-of-memory error (what torch raises there): the batch size found is 15,
so 4 batches are accumulated. Each step's loss (the mean over ranks), the batch sizes tried, the
final learning rate and the final metrics are recorded.
"""

import torch
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size, set_seed
from offline import MrpcMetric, Record, collate, mrpc_like, tiny_bert
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

EVAL_BATCH_SIZE = 32
FITS = 16


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
    observed_batch_size = int(config["batch_size"])
    metric, record = MrpcMetric(), Record()
    record.metrics["tried"] = []

    # New Code #
    # We use the `find_executable_batch_size` decorator, passing in the desired observed batch size
    # to train on. If a device OOM error occurs, it will retry this loop cutting the batch size
    # each time. From this, we can calculate the number of gradient accumulation steps needed
    # and modify the Accelerator object as a result
    @find_executable_batch_size(starting_batch_size=int(observed_batch_size))
    def inner_training_loop(batch_size):
        # Since we need to modify the outside accelerator object, we need to bring it
        # to the local scope
        nonlocal accelerator
        record.metrics["tried"].append(batch_size)
        record.losses.clear()

        # We can calculate the number of gradient accumulation steps based on the current
        # batch size vs the starting batch size
        num_gradient_accumulation_steps = observed_batch_size // batch_size

        # And then set it in the Accelerator directly:
        accelerator.gradient_accumulation_steps = num_gradient_accumulation_steps

        # Next we need to free all of the stored model references in the Accelerator each time
        accelerator.free_memory()

        # And set the seed so our results are reproducable each reset
        set_seed(seed)

        model = tiny_bert()
        model = model.to(accelerator.device)
        optimizer = AdamW(params=model.parameters(), lr=lr)
        train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
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
                # And perform gradient accumulation
                with accelerator.accumulate(model):
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
        record.metrics["lr"] = lr_scheduler.get_last_lr()[0]

    # New Code #
    # And call it at the end with no arguments
    # Note: You could also refactor this outside of your training loop function
    inner_training_loop()
    record.write(accelerator.is_main_process)


if __name__ == "__main__":
    training_function({"lr": 2e-3, "num_epochs": 2, "seed": 42, "batch_size": 64})
