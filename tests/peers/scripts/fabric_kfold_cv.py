"""Lightning Fabric's ``examples/fabric/kfold_cv/train_fabric.py`` (``SubsetRandomSampler`` per
fold), offline.

Changes from upstream, all for running offline and comparing: 200 1x8x8 images from `offline`
and the example's network scaled to them (torchvision does not import here, nor can MNIST be
fetched), accuracy counted by hand and summed over ranks (torchmetrics' ``Accuracy`` is not
installed with lightning-fabric), batch size 16, 2 epochs, ``Fabric(accelerator="cpu",
devices=2, strategy="ddp")`` in place of the command line's settings, and each step's loss (the
mean over ranks) and each epoch's average accuracy are recorded.
"""

import torch
import torch.nn.functional as F  # noqa: N812
import torch.optim as optim
from lightning_fabric import Fabric, seed_everything
from offline import Net, Record, images
from sklearn import model_selection
from torch.utils.data import DataLoader, SubsetRandomSampler


def train_dataloader(model, data_loader, optimizer, fabric, record):
    model.train()
    for data, target in data_loader:
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        fabric.backward(loss)  # instead of loss.backward()
        optimizer.step()
        record.losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())


def validate_dataloader(model, data_loader, fabric):
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

    # all_gather is used to aggregate the value across processes
    loss = fabric.all_gather(loss).sum() / len(data_loader.dataset)
    acc = fabric.all_reduce(correct, reduce_op="sum") / fabric.all_reduce(seen, reduce_op="sum")
    return acc * 100, loss


def run(hparams):
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    record = Record()

    seed_everything(hparams["seed"])  # instead of torch.manual_seed(...)

    with fabric.rank_zero_first():
        dataset = images(200, seed=4)

    # Loop over different folds (shuffle = False by default so reproducible)
    kfold = model_selection.KFold(n_splits=hparams["folds"])

    # initialize n_splits models and optimizers
    models = [Net() for _ in range(kfold.n_splits)]
    optimizers = [optim.Adadelta(model.parameters(), lr=hparams["lr"]) for model in models]

    # fabric setup for models and optimizers
    for i in range(kfold.n_splits):
        models[i], optimizers[i] = fabric.setup(models[i], optimizers[i])

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
            train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)
            model, optimizer = models[fold], optimizers[fold]
            train_dataloader(model, train_loader, optimizer, fabric, record)
            acc, loss = validate_dataloader(model, val_loader, fabric)
            epoch_acc += acc
            record.metrics[f"epoch_{epoch}_fold_{fold}"] = {"loss": loss.item(), "acc": acc.item()}
        fabric.print(f"Epoch {epoch} - Average acc: {epoch_acc / kfold.n_splits}")
        record.metrics[f"epoch_{epoch}"] = (epoch_acc / kfold.n_splits).item()
    record.write(fabric.is_global_zero)


if __name__ == "__main__":
    run({"batch_size": 16, "epochs": 2, "lr": 1.0, "seed": 1, "folds": 5})
