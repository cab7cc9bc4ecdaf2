"""The torchplug port of `fabric_image_classifier` (Lightning Fabric's
``examples/fabric/image_classifier/train_fabric.py``), made with docs/migration-fabric.md alone."""

import torch
import torch.nn.functional as F  # noqa: N812
import torch.optim as optim
from offline import Net, Record, images
from torch.optim.lr_scheduler import StepLR

import torchplug as tp


def run(hparams):
    engine = tp.Engine()  # the strategy and the processes: torchplug launch -n 2 --strategy ...
    record = Record()

    tp.seed_everything(hparams["seed"])

    with engine.main_process_first():
        train_dataset, test_dataset = images(256, seed=2), images(101, seed=3)

    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=hparams["batch_size"])
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=hparams["batch_size"])
    train_loader = engine.setup_dataloader(train_loader)
    test_loader = engine.setup_dataloader(test_loader)

    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=hparams["lr"])
    model, optimizer = engine.setup(model, optimizer)

    scheduler = StepLR(optimizer, step_size=1, gamma=hparams["gamma"])

    for epoch in range(1, hparams["epochs"] + 1):
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            engine.backward(loss)
            optimizer.step()
            record.losses.append(engine.reduce(loss.detach(), "mean").item())

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

        test_loss = engine.gather(test_loss).sum() / len(test_loader.dataset)
        correct = engine.reduce(torch.tensor(correct), "sum")
        accuracy = correct.item() / len(test_loader.dataset)
        engine.print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: ({accuracy:.0%})\n")
        record.metrics[f"epoch_{epoch}"] = {"test_loss": test_loss.item(), "accuracy": accuracy}
    record.metrics["lr"] = scheduler.get_last_lr()[0]
    record.write(engine.is_main)
    engine.close()


if __name__ == "__main__":
    run({"batch_size": 16, "epochs": 2, "lr": 1.0, "gamma": 0.7, "seed": 1})
