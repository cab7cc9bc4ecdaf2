"""What the peers' examples download, made here: the offline half of every script in this folder.

Accelerate's ``by_feature`` examples fine-tune ``bert-base-cased`` on GLUE MRPC and score it with
``evaluate.load("glue", "mrpc")``; Fabric's examples train a CNN on MNIST through torchvision. None
of that can be fetched here, and torchvision does not import with this torch, so both sides of
every pair take the same stand-ins from this module:

* `mrpc_like`: seeded sentence pairs of token ids (a paraphrase is a lightly edited copy) with the
  keys the tokenizer gives (``input_ids``, ``token_type_ids``, ``attention_mask``, ``labels``),
  and `collate`, the tokenizer's ``pad(padding="longest")``;
* `tiny_bert`: ``BertForSequenceClassification`` from a config (hidden 32, 2 layers, BERT's
  dropout);
* `MrpcMetric`: GLUE MRPC's accuracy and F1, with ``add_batch``/``compute`` as ``evaluate`` has;
* `images` and `Net`: 1x8x8 images with a learnable mark and the MNIST example's CNN, scaled down;
* `Record`: the per-step losses and final metrics each script writes as JSON for the test.
"""

from __future__ import annotations

import atexit
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 (the examples' own spelling)
from torch.utils.data import TensorDataset

VOCAB, CLS, SEP, PAD = 64, 1, 2, 0


@atexit.register
def _release_the_process_group() -> None:
    """The examples leave their process group to interpreter exit, where gloo's threads are
    torn down in no set order and a rank may abort ("terminate called without an active
    exception") after its numbers are written; releasing it first keeps the exit clean. The
    group is only gone once what still holds it (a DDP model in a reference cycle) is collected:
    else a gloo thread finishing a gather decrefs its tensors during finalization and aborts."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def mrpc_like(n: int, seed: int) -> list[dict[str, list[int] | int]]:
    """``n`` tokenized sentence pairs, as ``datasets.map(tokenize_function)`` leaves MRPC."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 10, (), generator=g))
        label = int(torch.randint(0, 2, (), generator=g))
        low, high = (3, 40) if label else (24, VOCAB)  # words that lean one way, to learn fast
        first = torch.randint(low, high, (length,), generator=g)
        if label:  # a paraphrase: the same words, one changed
            second = first.clone()
            second[int(torch.randint(0, length, (), generator=g))] = int(
                torch.randint(low, high, (), generator=g)
            )
        else:
            second = torch.randint(
                low, high, (int(torch.randint(4, 10, (), generator=g)),), generator=g
            )
        ids = [CLS, *first.tolist(), SEP, *second.tolist(), SEP]
        types = [0] * (length + 2) + [1] * (len(second) + 1)
        rows.append(
            {
                "input_ids": ids,
                "token_type_ids": types,
                "attention_mask": [1] * len(ids),
                "labels": label,
            }
        )
    return rows


def collate(examples: list[dict[str, Any]]) -> Any:
    """``tokenizer.pad(examples, padding="longest", return_tensors="pt")``: a ``BatchEncoding``."""
    from transformers import BatchEncoding

    longest = max(len(e["input_ids"]) for e in examples)
    batch: dict[str, torch.Tensor] = {}
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        batch[key] = torch.tensor([e[key] + [PAD] * (longest - len(e[key])) for e in examples])
    batch["labels"] = torch.tensor([e["labels"] for e in examples])
    return BatchEncoding(batch)


def tiny_bert() -> nn.Module:
    """``AutoModelForSequenceClassification.from_pretrained("bert-base-cased")``, made small."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


class MrpcMetric:
    """``evaluate.load("glue", "mrpc")``: accuracy and F1 of the positive class (and how many
    pairs were scored)."""

    def __init__(self) -> None:
        self.predictions: list[int] = []
        self.references: list[int] = []

    def add_batch(self, predictions: torch.Tensor, references: torch.Tensor) -> None:
        self.predictions += predictions.tolist()
        self.references += references.tolist()

    def compute(
        self, predictions: torch.Tensor | None = None, references: torch.Tensor | None = None
    ) -> dict[str, float]:
        if predictions is not None:  # ``evaluate``'s compute(predictions=..., references=...)
            self.add_batch(predictions, references)
        pairs = list(zip(self.predictions, self.references, strict=True))
        self.predictions, self.references = [], []
        tp = sum(p == r == 1 for p, r in pairs)
        fp = sum(p == 1 and r == 0 for p, r in pairs)
        fn = sum(p == 0 and r == 1 for p, r in pairs)
        accuracy = sum(p == r for p, r in pairs) / len(pairs)
        f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
        return {"accuracy": accuracy, "f1": f1, "count": len(pairs)}


def images(n: int, seed: int) -> TensorDataset:
    """``n`` normalised 1x8x8 "digits": noise plus a bright pixel placed by the label."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    pixels = torch.randn(n, 1, 8, 8, generator=g) * 0.5
    pixels[torch.arange(n), 0, labels % 8, labels // 2] += 3.0
    return TensorDataset(pixels, labels)


class Net(nn.Module):
    """The MNIST example's network for 8x8 inputs: two 3x3 convolutions, max-pooling, dropout
    0.25 and 0.5, two linear layers, log-softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def out_path() -> Path:
    """Where the script writes its record: the argument after ``--out``."""
    return Path(sys.argv[sys.argv.index("--out") + 1])


def argument(name: str, default: str | None = None) -> str | None:
    """The value after ``--name`` on the command line, or ``default``."""
    flag = f"--{name}"
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default


class Record:
    """Per-step losses (the mean over ranks) and final metrics, written once by rank 0."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.metrics: dict[str, Any] = {}

    def write(self, main: bool) -> None:
        if main:
            out_path().write_text(json.dumps({"losses": self.losses, "metrics": self.metrics}))
