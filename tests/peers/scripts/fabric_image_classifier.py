"""Lightning Fabric's ``examples/fabric/image_classifier/train_fabric.py``, offline.

Changes from upstream, all for running offline and comparing: 1x8x8 images from `offline` (256
to train, 101 to test, so the last test batch is short and the sampler pads) and the example's
network scaled to them (torchvision does not import here, nor can MNIST be fetched), the
accuracy the upstream comment gives "WITHOUT TorchMetrics" (summed over ranks), batch size 16, 2
epochs, ``Fabric(accelerator="cpu", devices=2, strategy="ddp")`` in place of the command line's
settings, and each step's loss (the mean over ranks) and the test results are recorded.
"""

import torch
import torch.nn.functional as F  # noqa: N812
import torch.optim as optim
from lightning_fabric import Fabric, seed_everything
from offline import Net, Record, images
from torch.optim.lr_scheduler import StepLR


def run(hparams):
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    record = Record()

    seed_everything(hparams["seed"])  # instead of torch.manual_seed(...)

    with fabric.rank_zero_first(local=False):
        train_dataset, test_dataset = images(256, seed=2), images(101, seed=3)

    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=hparams["batch_size"])
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=hparams["batch_size"])

    # don't forget to call `setup_dataloaders` to prepare for dataloaders for distributed training.
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)

    model = Net()  # remove call to .to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=hparams["lr"])

    # don't forget to call `setup` to prepare for model / optimizer for distributed training.
    model, optimizer = fabric.setup(model, optimizer)

    scheduler = StepLR(optimizer, step_size=1, gamma=hparams["gamma"])

    for epoch in range(1, hparams["epochs"] + 1):
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            fabric.backward(loss)  # instead of loss.backward()
            optimizer.step()
            record.losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())

        scheduler.step()

        model.eval()
        test_loss = 0
        correct = 0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.argmax(dim=1, keepdim=True)
                correct += pred.eq(target.view_as(pred)).sum().item()

        # all_gather is used to aggregated the value across processes
        test_loss = fabric.all_gather(test_loss).sum() / len(test_loader.dataset)
        correct = fabric.all_reduce(torch.tensor(correct), reduce_op="sum")
        accuracy = correct.item() / len(test_loader.dataset)
        fabric.print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: ({accuracy:.0%})\n")
        record.metrics[f"epoch_{epoch}"] = {"test_loss": test_loss.item(), "accuracy": accuracy}
    record.metrics["lr"] = scheduler.get_last_lr()[0]
    record.write(fabric.is_global_zero)


if __name__ == "__main__":
    run({"batch_size": 16, "epochs": 2, "lr": 1.0, "gamma": 0.7, "seed": 1})
