"""A small GPT-style language model trained with 2-D parallelism (FSDP2 × tensor parallel).

    torchplug launch -n 4 --strategy fsdp-tp --option tp_size=2 examples/gpt_fsdp_tp.py  # 2 × 2
    torchplug launch -n 2 --strategy fsdp examples/gpt_fsdp_tp.py        # or any other strategy

The text is the Zen of Python (it ships with Python, in the ``this`` module), one character per
token. The model is built on the meta device (no memory) and materialised by ``engine.setup``:
under ``fsdp``/``fsdp-tp`` each rank allocates only its shards. Each block's activations are
recomputed in backward (``activation_checkpointing``). ``GPT.tp_plan`` splits attention and MLP
the Megatron way: q/k/v and the MLP's up projection by columns, the output projections by rows.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io

with contextlib.redirect_stdout(io.StringIO()):  # importing it prints the text
    import this

import torch
from torch.nn import functional as F

import torchplug as tp

TEXT = codecs.decode(this.s, "rot13")
VOCAB = sorted(set(TEXT))


class Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a share of the heads
        q, k, v = (
            f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(torch.nn.Module):
    #: Read by the tp/fsdp-tp strategies (other strategies ignore it).
    tp_plan = {
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.o": "rowwise",
        "blocks.*.up": "colwise",
        "blocks.*.down": "rowwise",
    }

    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, depth: int = 2, ctx: int = 32):
        super().__init__()
        self.tokens, self.positions = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(ctx, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ctx", type=int, default=32)
    args = parser.parse_args()

    with tp.Engine("auto", activation_checkpointing=[Block]) as engine:
        torch.manual_seed(0)
        with engine.init_module(empty=engine.info.shards_parameters):
            model = GPT(len(VOCAB), ctx=args.ctx)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, optimizer = engine.setup(model, optimizer)

        ids = torch.tensor([VOCAB.index(c) for c in TEXT])
        windows = ids.unfold(0, args.ctx + 1, 3)  # overlapping (input, next-token) windows
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(windows), batch_size=16, shuffle=True, drop_last=True
        )
        loader = engine.setup_dataloader(loader)
        step = 0
        while step < args.steps:
            for (batch,) in loader:
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].flatten())
                engine.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if step % 20 == 0 or step == args.steps:
                    mean = engine.reduce(loss.detach(), "mean").item()
                    engine.print(f"step {step:4d}  loss {mean:.3f}  ({engine.strategy})")
                if step == args.steps:
                    break


if __name__ == "__main__":
    main()
