"""The kit's real-model shape and what it runs with it: buffers, norms, a tied embedding.

The small MLP of `torchplug.testing.bodies` keeps the numeric properties cheap, but it has
no buffers, no normalisation layer, no tied weight and no layer other than ``nn.Linear``, which
is where real models broke backends silently (BatchNorm statistics mixed across ranks in
checkpoints, ranks holding different buffers). `KitNet` has all of them, and the
``real_model`` and ``replicas`` properties train and compare it.

What a data-parallel rank's BatchNorm statistics are: each rank normalises its own share of
the batch, so its running statistics follow its share. A backend either leaves each rank its
own (FSDP, DeepSpeed) or, as DDP does, gives every rank rank 0's before each forward. Either
way rank 0's statistics are those of rank 0's shares alone, and that is what a checkpoint holds
(``docs/checkpoints.md``). `reference` computes all of them in plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp
from torchplug.testing import bodies
from torchplug.util import torchprivate

VOCAB = 24
DIM = 8
CONTEXT = 6
STEPS = 6
GLOBAL_BATCH = 16
LR = 0.05
#: Rank r builds the model from seed ``SEED + r`` (the Engine must give every rank rank 0's).
SEED = 300


class Shift(torch.nn.Module):
    """A fixed random offset added to the embeddings: a buffer drawn from the RNG (as a model's
    fixed random features are), so a rank left with its own buffers shows at once."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("offset", torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.offset.normal_(0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In the activations' dtype, as model code casts its buffers: under fsdp bf16 the
        # parameters (and so the activations) are bf16 while buffers stay fp32.
        return x + self.offset.to(x.dtype)


class KitNet(torch.nn.Module):
    """Token classifier: a tied embedding/head, a random buffer, a convolution, BatchNorm (fp32
    running statistics and an int64 counter), and two Linear layers named ``0`` and ``2`` as in
    the kit's MLP, so a tensor-parallel plan written for the one fits the other."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        # Tied as GPT-2 ties them: the embedding made first, the head's own weight replaced
        # by it (its initialisation drawn, then dropped). A meta-device build must keep the
        # embedding's values, as this eager build does.
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.shift = Shift(DIM)
        self.conv = torch.nn.Conv1d(DIM, DIM, 3, padding=1)
        self.norm = torch.nn.BatchNorm1d(DIM)
        self.add_module("0", torch.nn.Linear(DIM, width))
        self.add_module("1", torch.nn.Tanh())
        self.add_module("2", torch.nn.Linear(width, DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.shift(self.embed(tokens)).transpose(1, 2)  # (batch, DIM, CONTEXT)
        h = self.norm(self.conv(h)).mean(dim=2)
        for name in ("0", "1", "2"):
            h = self.get_submodule(name)(h)
        return self.head(h)


def build(seed: int = SEED) -> KitNet:
    torch.manual_seed(seed)
    return KitNet()


def dataset(n: int = STEPS * GLOBAL_BATCH, seed: int = 5) -> TensorDataset:
    """Token rows whose label is their first token modulo 4 (learnable, so a lossy backend's
    loss visibly falls). Even rows draw from the first half of the vocabulary, odd rows from
    the second: ranks' shares (rows r, r + world, ...) then differ as real shards often do, and
    so do their BatchNorm statistics, by far more than rounding."""
    g = torch.Generator().manual_seed(seed)
    half = VOCAB // 2
    tokens = torch.randint(0, half, (n, CONTEXT), generator=g)
    tokens += half * (torch.arange(n) % 2).unsqueeze(1)
    return TensorDataset(tokens, tokens[:, 0] % 4)


def reference(world: int, precision: str = "32") -> dict[str, Any]:
    """Plain PyTorch, one process: each step's global batch split into ``world`` shares as a
    DistributedSampler splits it (share r: rows r, r + world, ...), one forward per share with
    its own batch statistics, the shares' mean loss backpropagated (what averaged gradients
    give). BatchNorm statistics are followed per rank: ``own[r]`` if each rank keeps its own,
    ``ddp[r]`` if rank 0's are broadcast before each forward (as DDP does); ``params`` holds
    rank 0's (the same under both rules)."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    dtype, scaler = bodies.reference_amp(precision)
    names = [n for n, _ in model.named_buffers() if _is_stat(model, n)]
    start = _read(model, names)
    own = [dict(start) for _ in range(world)]
    ddp = [dict(start) for _ in range(world)]
    losses = []
    for x, y in DataLoader(dataset(), batch_size=GLOBAL_BATCH):
        total = torch.zeros(())
        rank_zero_before = dict(own[0])
        for r in range(world):
            # In training mode the output uses the share's own batch statistics, not the
            # running ones: both rules' forwards give the same loss; one graph is kept.
            for chains, before in ((ddp, rank_zero_before), (own, own[r])):
                _put(model, before)
                with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                    out = model(x[r::world])
                loss = torch.nn.functional.cross_entropy(out.float(), y[r::world])
                chains[r] = _read(model, names)
            total = total + loss / world
        bodies.reference_step(total, opt, scaler)
        losses.append(total.item())
    _put(model, own[0])
    return {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "own": own,
        "ddp": ddp,
    }


def _read(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    buffers = dict(model.named_buffers())
    return {n: buffers[n].detach().clone() for n in names}


def _put(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    """New buffer tensors, not copies into the old ones: an earlier share's graph saved
    those (BatchNorm's backward reads its running statistics' version)."""
    for name, value in values.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value.clone()  # noqa: SLF001


def _is_stat(model: torch.nn.Module, name: str) -> bool:
    owner = name.rpartition(".")[0]
    return isinstance(model.get_submodule(owner), torchprivate.batch_norm_base())


def train(
    strategy: str,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    precision: str | None = None,
    save_to: str | None = None,
    loop: str = "backward",
) -> dict[str, Any]:
    """`reference`'s run as a user writes it, every rank building the model from its own
    seed: this rank's losses, its full state after training (parameters and rank 0's
    buffers as the Engine gathers them), its own BatchNorm statistics, and its data-parallel
    rank. ``save_to``: the checkpoint written at the end."""
    bodies.register(plugins)
    extra = bodies.kit_scale(strategy, precision)
    with tp.Engine(strategy, precision=precision, **extra, **(options or {})) as engine:
        model = build(SEED + engine.rank)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        model, opt = engine.setup(model, opt)
        loader = engine.setup_dataloader(
            DataLoader(dataset(), batch_size=GLOBAL_BATCH // engine.data_parallel_size)
        )
        losses = []
        for x, y in loader:
            loss = bodies.user_step(engine, model, x, y, loop, loss_fn=_cross_entropy)
            opt.step()
            opt.zero_grad()
            losses.append(engine.reduce(loss, "mean").item())
        own = {n: b.detach().cpu().clone() for n, b in _named_stats(model)}
        if save_to is not None:
            engine.save(save_to, {"model": model, "optimizer": opt})
        return {
            "losses": losses,
            "params": {k: v.detach().cpu() for k, v in engine.full_state(model)["model"].items()},
            "stats": own,
            "dp_rank": engine.data_parallel_rank,
            "dp_size": engine.data_parallel_size,
        }


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.float(), target)


def _named_stats(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """This rank's own BatchNorm buffers by their name in `KitNet` (wrapper prefixes
    such as DDP's ``module.`` left out; none where this rank's pipeline stages hold no
    BatchNorm, whose buffers are then empty placeholders)."""
    from torchplug.checkpoint.io import unwrapped

    return [
        (unwrapped(n), b)
        for n, b in model.named_buffers()
        if n.split(".")[-2] == "norm" and b.numel() > 0
    ]


def load(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint loaded into a fresh, differently seeded KitNet in this process
    (``single``): what a user gets back."""
    with tp.Engine("single") as engine:
        model = build(seed=7)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        model, opt = engine.setup(model, opt)
        engine.load(path, {"model": model, "optimizer": opt})
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def replicas(
    strategy: str,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    precision: str | None = None,
    empty: bool = False,
) -> dict[str, torch.Tensor]:
    """`KitNet` built from a different seed on every rank (as a script that seeds per
    rank, or not at all, does), eagerly or on the meta device: its full parameters and buffers
    after setup, and whether the embedding and head are still one tensor. Every rank must hold
    rank 0's model (the caller compares them with an eager build from rank 0's seed)."""
    bodies.register(plugins)
    with tp.Engine(strategy, precision=precision, **(options or {})) as engine:
        torch.manual_seed(REPLICA_SEED + engine.rank)
        if empty:
            with engine.init_module(empty=True):
                model = KitNet()
        else:
            model = KitNet()
        model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        state = {k: v.float() for k, v in engine.full_state(model)["model"].items()}
        tied = _find(model, "head").weight is _find(model, "embed").weight
        return {"state": state, "tied": tied}


def _find(model: torch.nn.Module, name: str) -> torch.nn.Module:
    for path, module in model.named_modules():
        if path.split(".")[-1] == name:
            return module
    raise LookupError(name)


#: Rank r of `replicas` seeds ``REPLICA_SEED + r``.
REPLICA_SEED = 100


def replica_reference() -> dict[str, torch.Tensor]:
    """Rank 0's model of `replicas`, built eagerly in this process."""
    torch.manual_seed(REPLICA_SEED)
    return {k: v.float() for k, v in KitNet().state_dict().items()}


def materialized(
    strategy: str,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    precision: str | None = None,
    empty: bool = True,
) -> dict[str, torch.Tensor]:
    """`KitNet` after setup, built on the meta device (``empty``) or eagerly on the CPU,
    after the same seed: its full parameters and buffers by name (the two must be equal, the
    tied embedding holding the embedding's initialisation in both)."""
    bodies.register(plugins)
    with tp.Engine(strategy, precision=precision, **(options or {})) as engine:
        torch.manual_seed(11)
        if empty:
            with engine.init_module(empty=True):
                model = KitNet()
        else:  # as users build models: on the CPU
            model = KitNet()
        model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return {k: v.float() for k, v in engine.full_state(model)["model"].items()}
