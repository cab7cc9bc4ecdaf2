"""The torchplug port of `fabric_kfold_cv` (Lightning Fabric's
``examples/fabric/kfold_cv/train_fabric.py``), made with docs/migration-fabric.md alone."""

import torch
import torch.nn.functional as F  # noqa: N812
import torch.optim as optim
from offline import Net, Record, images
from sklearn import model_selection
from torch.utils.data import DataLoader, SubsetRandomSampler

import torchplug as tp


def train_dataloader(model, data_loader, optimizer, engine, record):
    model.train()
    for data, target in data_loader:
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        engine.backward(loss)
        optimizer.step()
        record.losses.append(engine.reduce(loss.detach(), "mean").item())


def validate_dataloader(model, data_loader, engine):
    model.eval()
    loss = 0
    correct = torch.zeros(())
    seen = torch.zeros(())
    with torch.no_grad():
        for data, target in data_loader:
            output = model(data)
            loss += F.nll_loss(output, target, reduction="sum").item()
            correct += (output.argmax(dim=1) == target).sum()
            seen += target.numel()

    loss = engine.gather(loss).sum() / len(data_loader.dataset)
    acc = engine.reduce(correct, "sum") / engine.reduce(seen, "sum")
    return acc * 100, loss


def run(hparams):
    engine = tp.Engine()  # the strategy and the processes: torchplug launch -n 2 --strategy ...
    record = Record()

    tp.seed_everything(hparams["seed"])

    with engine.main_process_first():
        dataset = images(200, seed=4)

    # Loop over different folds (shuffle = False by default so reproducible)
    kfold = model_selection.KFold(n_splits=hparams["folds"])

    # initialize n_splits models and optimizers
    models = [Net() for _ in range(kfold.n_splits)]
    optimizers = [optim.Adadelta(model.parameters(), lr=hparams["lr"]) for model in models]

    for i in range(kfold.n_splits):
        models[i], optimizers[i] = engine.setup(models[i], optimizers[i])

    for epoch in range(1, hparams["epochs"] + 1):
        epoch_acc = 0
        for fold, (train_ids, val_ids) in enumerate(kfold.split(dataset)):
            batch_size = hparams["batch_size"]
            train_loader = DataLoader(
                dataset, batch_size=batch_size, sampler=SubsetRandomSampler(train_ids)
            )
            val_loader = DataLoader(
                dataset, batch_size=batch_size, sampler=SubsetRandomSampler(val_ids)
            )
            train_loader = engine.setup_dataloader(train_loader)
            val_loader = engine.setup_dataloader(val_loader)
            model, optimizer = models[fold], optimizers[fold]
            train_dataloader(model, train_loader, optimizer, engine, record)
            acc, loss = validate_dataloader(model, val_loader, engine)
            epoch_acc += acc
            record.metrics[f"epoch_{epoch}_fold_{fold}"] = {"loss": loss.item(), "acc": acc.item()}
        engine.print(f"Epoch {epoch} - Average acc: {epoch_acc / kfold.n_splits}")
        record.metrics[f"epoch_{epoch}"] = (epoch_acc / kfold.n_splits).item()
    record.write(engine.is_main)
    engine.close()


if __name__ == "__main__":
    run({"batch_size": 16, "epochs": 2, "lr": 1.0, "seed": 1, "folds": 5})
