"""Image classification on scikit-learn's bundled digits (1,797 8x8 images; no download).

    torchplug launch -n 2 --strategy ddp examples/digits.py
    torchplug launch -n 2 --strategy fsdp examples/digits.py --trainer --logger csv
    python examples/digits.py --epochs 3                  # one process

Without ``--trainer`` the loop is written by hand on the Engine (the lines marked ``engine``
are torchplug's); with it, the same model is trained by ``torchplug.Trainer``. Needs
``pip install scikit-learn``.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp


def digits() -> tuple[TensorDataset, TensorDataset]:
    """Train and test sets: 80/20 split, pixels scaled to [0, 1], shape (N, 1, 8, 8)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    split = int(0.8 * len(labels))
    train, test = order[:split], order[split:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def engine_loop(args: argparse.Namespace) -> float:
    engine = tp.Engine(loggers=args.logger)  # engine: strategy from launcher, env or config
    train, test = digits()
    model = cnn()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = engine.setup(model, optimizer)  # engine
    train_loader = engine.setup_dataloader(  # engine
        DataLoader(train, batch_size=args.batch_size, shuffle=True)
    )
    test_loader = engine.setup_dataloader(DataLoader(test, batch_size=128))  # engine
    accuracy = 0.0
    for epoch in range(args.epochs):
        model.train()
        for images, labels in train_loader:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            engine.backward(loss)  # engine
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for images, labels in test_loader:
                predicted = engine.gather_for_metrics(model(images).argmax(1))  # engine
                truth = engine.gather_for_metrics(labels)  # engine
                correct += (predicted == truth).sum().item()
                seen += len(truth)
        accuracy = correct / seen
        engine.log({"test_accuracy": accuracy}, step=epoch)  # engine
        engine.print(f"epoch {epoch + 1}  test accuracy {accuracy:.3f} ({seen} images)")
    engine.close()
    return accuracy


def trainer(args: argparse.Namespace) -> float:
    train, test = digits()
    model = cnn()
    result = tp.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        torch.nn.functional.cross_entropy,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(test, batch_size=128),
        max_epochs=args.epochs,
        metrics={"accuracy": tp.accuracy},
        loggers=args.logger,
    ).fit()
    return result["eval_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--trainer", action="store_true", help="use torchplug.Trainer")
    parser.add_argument("--logger", action="append", default=None, help="e.g. csv, tensorboard")
    parser.add_argument("--min-accuracy", type=float, default=0.0, help="fail below this")
    args = parser.parse_args()
    tp.seed_everything(0)
    accuracy = trainer(args) if args.trainer else engine_loop(args)
    if accuracy < args.min_accuracy:
        raise SystemExit(f"test accuracy {accuracy:.3f} is below {args.min_accuracy}")


if __name__ == "__main__":
    main()
