"""A small transformer language model, character by character, on text that ships with Python
(the Zen of Python and the docstrings of a few standard-library modules; no download).

    torchplug launch -n 2 --strategy ddp examples/char_lm.py
    torchplug launch -n 2 --strategy fsdp examples/char_lm.py --trainer
    python examples/char_lm.py --steps 200 --precision bf16

Without ``--trainer`` the loop is the Engine's, with gradient accumulation through
``engine.accumulate`` and a cosine LR schedule stepped once per optimizer step; with it,
``torchplug.Trainer`` runs the same training. At the end rank 0 prints a sample.
"""

from __future__ import annotations

import argparse
import codecs
import math

import torch
from torch.utils.data import DataLoader, Dataset

import torchplug as tp


def corpus() -> str:
    import argparse as argparse_module
    import collections
    import contextlib
    import io
    import json

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    zen = codecs.decode(this.s, "rot13")
    docs = [m.__doc__ or "" for m in (json, collections, argparse_module, codecs, math)]
    return "\n\n".join([zen, *docs])


class Chunks(Dataset):
    """Every ``context + 1`` characters starting at a multiple of ``stride``."""

    def __init__(self, ids: torch.Tensor, context: int, stride: int) -> None:
        self.ids, self.context = ids, context
        self.starts = list(range(0, len(ids) - context - 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        chunk = self.ids[s : s + self.context + 1]
        return chunk[:-1], chunk[1:]


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int, context: int, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.zeros(context, width))
        layer = torch.nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=4 * width, dropout=0.0, batch_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.embed(ids) + self.position[:t]
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: str, chars: list[str], context: int, n: int) -> str:
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([[index[c] for c in prompt if c in index]])
    device = next(model.parameters()).device
    for _ in range(n):
        logits = model(ids[:, -context:].to(device))[0, -1].float()
        ids = torch.cat([ids, logits.argmax().view(1, 1).cpu()], dim=1)
    return "".join(chars[i] for i in ids[0].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="per process, per micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precision", default=None)
    parser.add_argument("--trainer", action="store_true", help="use torchplug.Trainer")
    parser.add_argument("--max-loss", type=float, default=None, help="fail above this final loss")
    args = parser.parse_args()

    tp.seed_everything(0)
    text = corpus()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    data = Chunks(ids, args.context, stride=args.context // 2)
    model = TinyGPT(len(chars), args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # A schedule sized in optimizer steps: torchplug steps it once per step (Accelerate would
    # step it once per process per step and expect steps x processes here).
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / args.steps, 1)))
    )
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)

    if args.trainer:
        trainer = tp.Trainer(
            model,
            optimizer,
            lm_loss,
            loader,
            precision=args.precision,
            max_epochs=10**6,
            max_steps=args.steps,
            grad_accum=args.accumulate,
            scheduler=scheduler,
            log_every=25,
        )
        final = trainer.fit()["train_loss"]
        engine, model = trainer.engine, trainer.model
    else:
        engine = tp.Engine(precision=args.precision)
        model, optimizer = engine.setup(model, optimizer)
        loader = engine.setup_dataloader(loader)
        step, losses = 0, []
        while step < args.steps:
            for x, y in loader:
                with engine.accumulate(model, args.accumulate):
                    loss = lm_loss(model(x), y)
                    engine.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.item())
                if optimizer.step_was_skipped:
                    continue  # an accumulation micro-batch
                scheduler.step()
                step += 1
                if step % 25 == 0:
                    mean = engine.reduce(sum(losses) / len(losses), "mean").item()
                    engine.print(
                        f"step {step:4d}  loss {mean:.3f}  lr {scheduler.get_last_lr()[0]:.2e}"
                    )
                    final, losses = mean, []
                if step == args.steps:
                    break
    # Every rank runs the model (a sharded model needs them all); rank 0 prints.
    text = sample(model, "Beautiful is ", chars, args.context, 60)
    engine.print("sample:", repr(text))
    engine.close()
    if args.max_loss is not None and final > args.max_loss:
        raise SystemExit(f"final loss {final:.3f} is above {args.max_loss}")


if __name__ == "__main__":
    main()
