"""A GPT-style model of 8 blocks (tied embedding and head, LayerNorm, position embedding) and a
Hugging Face Llama, trained with ``engine.forward_backward`` under any strategy, and the plain
PyTorch reference on the global batch they are compared with."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, WIDTH, SEQ, BATCH = 32, 16, 6, 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln(x))))


class GPT(nn.Module):
    #: What ``tp_size`` splits when no ``tp_plan`` is given: each block's MLP (Megatron's split)
    tp_plan = {"layers.*.fc": "colwise", "layers.*.out": "rowwise"}

    def __init__(self, blocks: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.layers = nn.ModuleList(Block(WIDTH) for _ in range(blocks))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: the two ends live on different stages

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class LlamaLogits(nn.Module):
    """A Hugging Face LlamaForCausalLM returning its logits (no KV cache: it traces)."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            tie_word_embeddings=False, use_cache=False, bos_token_id=0, eos_token_id=1,
        )  # fmt: skip
        self.lm = LlamaForCausalLM(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx).logits


def make(kind: str = "gpt", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return GPT() if kind == "gpt" else LlamaLogits()


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batch(step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (size, SEQ), generator=generator)
    return x, torch.roll(x, -1, dims=1)


def _optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def reference(
    kind: str = "gpt", steps: int = 4, accumulate: int = 1, clip: float | None = 0.5,
    precision: str = "32",
) -> dict[str, Any]:  # fmt: skip
    """Plain PyTorch on the whole batch: ``accumulate`` micro-batches per step, the loss of
    each divided by ``accumulate``, clipping, a StepLR schedule; SGD with momentum (AdamW would
    turn rounding noise in near-zero gradients into lr-sized steps)."""
    model = make(kind)
    optimizer, scheduler = _optimizer(model)
    dtype = torch.bfloat16 if precision == "bf16" else None
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(accumulate):
            x, y = batch(step * accumulate + micro)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(model(x), y)
            (loss / accumulate).backward()
            total += loss.item() / accumulate
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        evaluated = model(batch(99)[0])
    return {
        "losses": losses, "norms": norms, "eval": evaluated,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }  # fmt: skip


def train(
    strategy: str,
    options: dict[str, Any],
    kind: str = "gpt",
    steps: int = 4,
    accumulate: int = 1,
    clip: float | None = 0.5,
    precision: str = "32",
    save_to: str | None = None,
    load_from: str | None = None,
    first_step: int = 0,
    reload_from: str | None = None,
) -> dict[str, Any]:
    """The reference's loop with ``engine.forward_backward``, unchanged for every strategy:
    each data-parallel rank takes its share of every batch."""
    import torchplug as tp

    with tp.Engine(strategy, precision=precision, **options) as engine:
        model = make(kind)
        optimizer, scheduler = _optimizer(model)
        model, optimizer = engine.setup(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        if load_from is not None:
            engine.load(load_from, state)
        share = engine.data_parallel_rank, engine.data_parallel_size
        losses, norms = [], []
        for step in range(first_step, first_step + steps):
            total = 0.0
            with engine.accumulate(model, accumulate):
                for micro in range(accumulate):
                    x, y = (t.chunk(share[1])[share[0]] for t in batch(step * accumulate + micro))
                    loss = engine.forward_backward(model, x, target=y, loss_fn=loss_fn)
                    total += engine.reduce(loss, "mean").item() / accumulate
            if clip is not None:
                norms.append(engine.clip_grad_norm_(model, clip, optimizer=optimizer).item())
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            losses.append(total)
        if save_to is not None:
            engine.save(save_to, state)
        if reload_from is not None:  # into a model already split (and sharded) by its steps
            engine.load(reload_from, state)
        model.eval()
        with torch.no_grad():
            evaluated = model(batch(99)[0].chunk(share[1])[share[0]])
        full = engine.full_state(model, optimizer)
        held = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
        )
        return {
            "held": held,
            "losses": losses, "norms": norms, "eval": evaluated, "share": share,
            "gathered": engine.gather_for_metrics(evaluated),
            "params": full["model"], "optimizer": full["optimizer"],
        }  # fmt: skip


def training_forward_error(options: dict[str, Any]) -> str:
    """What ``model(x)`` in training mode says under ``pp``."""
    import torchplug as tp

    with tp.Engine("pp", **options) as engine:
        model = engine.setup(make())
        try:
            model(batch(0)[0])
        except tp.ConfigurationError as exc:
            return str(exc)
    return ""


def uneven_batch_error(options: dict[str, Any]) -> str:
    """What a batch that does not split into the micro-batches says under ``pp``."""
    import torchplug as tp

    with tp.Engine("pp", **options) as engine:
        model = engine.setup(make())
        x, y = batch(0, size=5)
        try:
            engine.forward_backward(model, x, target=y, loss_fn=loss_fn)
        except tp.ConfigurationError as exc:
            return str(exc)
    return ""


def measured_bytes(options: dict[str, Any]) -> dict[str, Any]:
    """This rank's live bytes under ``pp`` after one AdamW step and the next backward (every
    state made): what ``torchplug estimate-memory`` is checked against."""
    import torchplug as tp
    from torchplug.features import memory

    before = memory.live_storages()
    with tp.Engine("pp", **options) as engine:
        model = make()
        model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for step in range(2):
            x, y = batch(step)
            engine.forward_backward(model, x, target=y, loss_fn=loss_fn)
            if step == 0:
                optimizer.step()
                optimizer.zero_grad()
        return memory.count_live(model, optimizer, before)


class Scaled(nn.Module):
    """Blocks in an ``nn.Sequential`` and a forward with keyword inputs that a later stage
    reads: a per-sample tensor ``scale`` and a plain number ``temperature``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(4))
        )
        self.head = nn.Linear(12, 5)

    def forward(
        self, x: torch.Tensor, scale: torch.Tensor | None = None, temperature: float = 1.0
    ) -> torch.Tensor:
        h = self.blocks(x)
        if scale is not None:
            h = h * scale
        return self.head(h) / temperature


def keyword_inputs(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """Three SGD steps and an evaluation of `Scaled` with keyword inputs (a different
    ``temperature`` each step), under ``strategy`` (``"plain"``: no torchplug)."""
    import torchplug as tp

    torch.manual_seed(0)
    model = Scaled()
    g = torch.Generator().manual_seed(5)
    x, y, scale = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g), None
    scale = torch.rand(8, 1, generator=g) + 0.5
    ce = nn.functional.cross_entropy
    losses = []
    if strategy == "plain":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step, t in enumerate((2.0, 4.0, 0.5)):
            loss = ce(model(x + step, scale=scale, temperature=t), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            return {"losses": losses, "eval": model.eval()(x, scale=scale, temperature=3.0)}
    with tp.Engine(strategy, **options) as engine:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = engine.setup(model, optimizer)
        for step, t in enumerate((2.0, 4.0, 0.5)):
            loss = engine.forward_backward(
                model, x + step, target=y, loss_fn=ce, scale=scale, temperature=t
            )
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            return {"losses": losses, "eval": model(x, scale=scale, temperature=3.0)}
