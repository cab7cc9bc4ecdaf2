"""Models that stop fitting: meta-device initialisation, activation checkpointing and
torch.compile, each giving the same numbers as the plain run."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import torchplug as tp
from support.reference import assert_close_dicts
from torchplug.testing import bodies

WIDTH, DEPTH = 128, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Deep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(bodies.FEATURES, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(DEPTH))
        self.out = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def model_bytes(ranks: int = 2) -> tuple[int, int, int]:
    """The model's parameter bytes, 1/ranks of them as FSDP2 shards them (dim 0 rounded up),
    and its largest module's own."""
    model = Deep()
    layers = [sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules()]
    shard = sum(-(-p.shape[0] // ranks) * (p.numel() // p.shape[0]) * 4 for p in model.parameters())
    return sum(layers), shard, max(layers)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live floating-point storage created while active (DTensors: their local
    part): parameters and what is made to fill them, not RNG states or index tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, size: int) -> None:
        self.seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, DTensor):
                tensor = tensor.to_local()
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            if not tensor.is_floating_point():
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self.seen:
                self.seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


def run(strategy: str, empty: bool, steps: int = 4, **engine: Any) -> dict[str, Any]:
    if strategy != "single":
        engine = {"timeout": 120.0, **engine}
    with tp.Engine(strategy, **engine) as eng:
        torch.manual_seed(0)
        tracker = LiveBytes()
        with tracker:
            with eng.init_module(empty=empty):
                model = Deep()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.002)
            model, optimizer = eng.setup(model, optimizer)
        data = bodies.make_dataset(steps * bodies.GLOBAL_BATCH)
        loader = torch.utils.data.DataLoader(data, bodies.GLOBAL_BATCH // eng.data_parallel_size)
        losses = []
        for x, y in eng.setup_dataloader(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            eng.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(eng.reduce(loss.detach(), "mean").item())
        return {
            "losses": losses,
            "params": eng.full_state(model)["model"],
            "peak": tracker.peak,
            "world": eng.world_size,
        }


def test_meta_init_under_fsdp_allocates_a_shard_plus_one_layer_and_trains_like_eager(ranks):
    total, shard, largest = model_bytes()
    eager = ranks.run(run, "fsdp", False, timeout=300)
    empty = ranks.run(run, "fsdp", True, timeout=300)
    for e, m in zip(eager, empty, strict=True):
        assert m["losses"] == e["losses"]
        assert_close_dicts(m["params"], e["params"], atol=0)
        assert e["peak"] >= total  # eager builds the whole model on every rank
        assert m["peak"] <= shard + largest < total, (m["peak"], shard, largest, total)


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_meta_init_under_replicating_backends_equals_eager(ranks, strategy):
    if strategy == "single":
        eager, empty = [run(strategy, False)], [run(strategy, True)]
    else:
        eager, empty = ranks.run(run, strategy, False), ranks.run(run, strategy, True)
    for e, m in zip(eager, empty, strict=True):
        assert m["losses"] == e["losses"]
        assert_close_dicts(m["params"], e["params"], atol=0)


class Custom(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4))


def test_meta_init_refuses_modules_without_reset_parameters():
    with tp.Engine("single") as engine:
        with engine.init_module(empty=True):  # noqa: SIM117 - two steps of one story
            model = torch.nn.Sequential(Custom(), torch.nn.Linear(4, 4))
        with pytest.raises(tp.ConfigurationError, match=r"\['Custom'\] lack"):
            engine.setup(model)


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_activation_checkpointing_gives_the_same_numbers(ranks, strategy):
    def both() -> list[tuple[dict, dict]]:
        if strategy == "single":
            return [(run(strategy, False), run(strategy, False, activation_checkpointing=[Block]))]
        plain = ranks.run(run, strategy, False)
        checkpointed = ranks.run(run, strategy, False, activation_checkpointing=["Block"])
        return list(zip(plain, checkpointed, strict=True))

    for plain, checkpointed in both():
        assert checkpointed["losses"] == pytest.approx(plain["losses"], abs=1e-6)
        assert_close_dicts(checkpointed["params"], plain["params"], atol=1e-6)


def test_activation_checkpointing_names_the_classes_when_nothing_matches():
    engine = tp.Engine("single", activation_checkpointing=["TransformerBlock"])
    with engine, pytest.raises(tp.ConfigurationError, match=r"no submodule of Deep.*'Block'"):
        engine.setup(Deep())


def test_activation_checkpointing_is_undone_by_close():
    model = Deep()
    with tp.Engine("single", activation_checkpointing=[Block]) as engine:
        engine.setup(model)
        assert "forward" in vars(model.blocks[0])
    assert "forward" not in vars(model.blocks[0])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_compile_matches_eager(ranks, strategy):
    if strategy == "single":
        pairs = [(run(strategy, False), run(strategy, False, compile=True))]
    else:
        pairs = list(
            zip(
                ranks.run(run, strategy, False),
                ranks.run(run, strategy, False, compile=True, timeout=600),
                strict=True,
            )
        )
    for eager, compiled in pairs:
        assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-5)
        assert_close_dicts(compiled["params"], eager["params"], atol=1e-5)


def test_compile_is_refused_where_the_backend_cannot_and_checked():
    with pytest.raises(tp.ConfigurationError, match="unknown torch.compile arguments"):
        tp.Engine("single", compile={"modee": "max-autotune"})


class _Tied(torch.nn.Module):
    """An embedding and a head tied either way round, beside BatchNorm buffers."""

    def __init__(self, head_takes_embedding: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10)
        self.norm = torch.nn.BatchNorm1d(4)
        if head_takes_embedding:  # GPT-2's way: the embedding's values are kept
            self.head.weight = self.embed.weight
        else:  # the other way: the head's are
            self.embed.weight = self.head.weight


@pytest.mark.parametrize("head_takes_embedding", [True, False])
def test_meta_init_keeps_ties_and_the_tied_tensors_eager_values(head_takes_embedding):
    """Built empty, a tied model comes out still tied and bit-equal to an eager build: the
    tensor holds its creator's initialisation, and every module drew the RNG as eagerly."""
    with tp.Engine("single") as engine:
        torch.manual_seed(5)
        with engine.init_module(empty=True):
            model = _Tied(head_takes_embedding)
        model, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        torch.manual_seed(5)
        eager = _Tied(head_takes_embedding)
        assert model.head.weight is model.embed.weight
        built = model.state_dict()
        assert [k for k, v in eager.state_dict().items() if not torch.equal(v, built[k])] == []
