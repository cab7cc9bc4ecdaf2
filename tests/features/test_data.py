"""setup_dataloader: every rank its own share, the same shuffle on every rank, fresh each epoch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

import torchplug as tp
from torchplug.plugin import hookimpl


def epochs_seen(shuffle: bool, custom_batches: bool = False) -> dict:
    data = TensorDataset(torch.arange(20))
    if custom_batches:
        loader = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 3, False))
    else:
        loader = DataLoader(data, batch_size=2, shuffle=shuffle)
    with tp.Engine("ddp", timeout=60.0) as engine:
        loader = engine.setup_dataloader(loader)
        epochs, paddings = [], []
        for _ in range(2):
            seen, pads = [], []
            for b in loader:
                seen.append(b[0].tolist())
                pads.append(loader.batch_padding)
            epochs.append(seen)
            paddings.append(pads)
        return {"epochs": epochs, "len": len(loader), "paddings": paddings}


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def test_sequential_loader_is_split_without_overlap(ranks):
    r0, r1 = ranks.run(epochs_seen, False)
    assert r0["len"] == r1["len"] == 5
    for epoch in range(2):
        a, b = flat(r0["epochs"][epoch]), flat(r1["epochs"][epoch])
        assert sorted(a + b) == list(range(20))
    # together, step i's two batches are the single-process batch i of twice the size
    assert sorted(r0["epochs"][0][0] + r1["epochs"][0][0]) == [0, 1, 2, 3]


def test_shuffled_loader_agrees_across_ranks_and_reshuffles_each_epoch(ranks):
    r0, r1 = ranks.run(epochs_seen, True)
    for epoch in range(2):
        assert sorted(flat(r0["epochs"][epoch]) + flat(r1["epochs"][epoch])) == list(range(20))
    assert r0["epochs"][0] != r0["epochs"][1]
    assert flat(r0["epochs"][0]) != list(range(0, 20, 2))  # really shuffled


def test_custom_batch_sampler_is_sharded_by_batch(ranks):
    r0, r1 = ranks.run(epochs_seen, False, True)
    # 7 batches of 3 (the last one short) in rounds of 2: the odd 7th batch is not dropped
    # (issue 34): rank 0 takes it, rank 1 a repeat of it, marked as padding
    assert r0["len"] == r1["len"] == 4
    assert r0["epochs"][0] == [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19]]
    assert r1["epochs"][0] == [[3, 4, 5], [9, 10, 11], [15, 16, 17], [18, 19]]
    assert r0["paddings"][0] == [0, 0, 0, 0] and r1["paddings"][0] == [0, 0, 0, 2]


def test_single_process_loader_is_unchanged():
    loader = DataLoader(TensorDataset(torch.arange(6)), batch_size=4)
    with tp.Engine("single") as engine:
        wrapped = engine.setup_dataloader(loader)
        assert [b[0].tolist() for b in wrapped] == [[0, 1, 2, 3], [4, 5]]
        assert len(wrapped) == 2 and wrapped.batch_size == 4


def test_a_users_own_sampler_keeps_its_epoch_and_a_probe_shifts_nothing():
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    data = TensorDataset(torch.arange(16))
    with tp.Engine("single") as engine:
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        sampler.set_epoch(7)
        loader = engine.setup_dataloader(DataLoader(data, batch_size=4, sampler=sampler))
        list(loader)
        list(loader)
        assert sampler.epoch == 7  # torchplug never moved the user's sampler
        loader.set_epoch(2)  # ... unless asked to
        assert sampler.epoch == 2

        shuffled = engine.setup_dataloader(DataLoader(data, batch_size=4, shuffle=True))
        next(iter(shuffled))  # a probe
        first = [b[0].tolist() for b in shuffled]
        second = [b[0].tolist() for b in shuffled]
        fresh = engine.setup_dataloader(DataLoader(data, batch_size=4, shuffle=True))
        assert [b[0].tolist() for b in fresh] == first  # the probe shifted nothing
        assert second != first and shuffled.epoch == 2


def samples_of_an_own_sampler(kind: str, n: int = 600, batch: int = 32) -> dict:
    """Issue 34 point 2: a loader with a sampler of the user's own, on every rank; which
    indices each rank's batches hold (the sampler draws from 1,000 items) and what
    ``gather_for_metrics`` of them returns."""
    from torch.utils.data import IterableDataset, SubsetRandomSampler, WeightedRandomSampler

    data = TensorDataset(torch.arange(1000))
    picked = torch.randperm(1000, generator=torch.Generator().manual_seed(5))[:n].tolist()
    if kind == "subset":
        loader = DataLoader(data, batch_size=batch, sampler=SubsetRandomSampler(picked))
    elif kind == "weighted":
        weights = torch.zeros(1000)
        weights[picked] = 1.0
        sampler = WeightedRandomSampler(weights, n, replacement=False)
        loader = DataLoader(data, batch_size=batch, sampler=sampler)
    else:

        class Stream(IterableDataset):
            def __iter__(self):
                return iter(torch.tensor(picked).split(batch))

        loader = DataLoader(Stream(), batch_size=None)
    with tp.Engine("ddp") as engine:
        loader = engine.setup_dataloader(loader)
        rows, gathered, steps = [], [], 0
        for b in loader:
            x = b if kind == "stream" else b[0]
            rows += x.tolist()
            gathered += engine.gather_for_metrics(x).tolist()
            steps += 1
        return {"rows": rows, "gathered": gathered, "steps": steps, "picked": picked}


@pytest.mark.parametrize("kind", ["subset", "weighted", "stream"])
@pytest.mark.parametrize("world", [2, 3])
def test_an_own_sampler_or_a_stream_loses_no_sample_on_any_number_of_ranks(kind, world):
    """600 indices, batch 32, on 2 and 3 ranks: every index the sampler (or stream) yields is
    seen in the epoch, once apart from padding repeats; every rank runs the same number of
    steps; ``gather_for_metrics`` returns each index exactly once (the padding dropped)."""
    from torchplug.testing import RankPool

    with RankPool(world) as pool:
        results = pool.run(samples_of_an_own_sampler, kind, timeout=300)
    picked = sorted(results[0]["picked"])
    seen = sorted({i for r in results for i in r["rows"]})
    assert seen == picked  # nothing dropped (Fabric's kfold: 600 seen, not 576)
    assert len({r["steps"] for r in results}) == 1
    for r in results:
        assert sorted(r["gathered"]) == picked  # each index once: the repeats were padding


def own_sampler_order(diverged: bool) -> dict:
    """A generator-less ``SubsetRandomSampler`` after ``manual_seed(7)`` (``+ rank`` when
    ``diverged``): the indices each rank sees, and a draw from torch's RNG after the pass."""
    from torch.utils.data import SubsetRandomSampler

    data = TensorDataset(torch.arange(100))
    with tp.Engine("ddp", timeout=120.0) as engine:
        torch.manual_seed(7 + (engine.rank if diverged else 0))
        sampler = SubsetRandomSampler(list(range(10, 60)))
        loader = engine.setup_dataloader(DataLoader(data, batch_size=4, sampler=sampler))
        rows, gathered = [], []
        for (x,) in loader:
            rows += x.tolist()
            gathered += engine.gather_for_metrics(x).tolist()
        return {"rows": rows, "gathered": gathered, "after": torch.rand(3).tolist()}


def test_an_own_sampler_without_a_generator_draws_from_torchs_rng_as_in_one_process(ranks):
    """Issue 34: as in one process (and under Fabric), the order is the sampler's draw from
    torch's RNG, which advances by it; rank r takes positions r, r+N, ... of it."""
    from torch.utils.data import SubsetRandomSampler

    torch.manual_seed(7)  # one process: the loader's pass draws its order, then training goes on
    sampler = SubsetRandomSampler(list(range(10, 60)))
    one = DataLoader(TensorDataset(torch.arange(100)), batch_size=4, sampler=sampler)
    order = [i for (x,) in one for i in x.tolist()]
    after = torch.rand(3).tolist()
    r0, r1 = ranks.run(own_sampler_order, False)
    assert r0["rows"] == order[0::2] and r1["rows"] == order[1::2]
    assert r0["after"] == after and r1["after"] == after
    assert sorted(r0["gathered"]) == sorted(order)


def test_ranks_whose_rng_differs_all_take_rank_0s_order(ranks):
    """Seeded per rank, the ranks would draw other orders and see indices twice: every rank
    takes rank 0's order instead, so each index is seen exactly once."""
    from torch.utils.data import SubsetRandomSampler

    torch.manual_seed(7)
    sampler = SubsetRandomSampler(list(range(10, 60)))
    one = DataLoader(TensorDataset(torch.arange(100)), batch_size=4, sampler=sampler)
    order = [i for (x,) in one for i in x.tolist()]
    r0, r1 = ranks.run(own_sampler_order, True)
    assert r0["rows"] == order[0::2] and r1["rows"] == order[1::2]
    assert sorted(r0["gathered"]) == sorted(order) == list(range(10, 60))


def batches_dealt(n: int, batch: int, drop_last: bool, shuffle: bool) -> dict:
    data = TensorDataset(torch.arange(n))
    with tp.Engine("ddp", timeout=120.0) as engine:
        torch.manual_seed(3)
        loader = DataLoader(data, batch_size=batch, shuffle=shuffle, drop_last=drop_last)
        loader = engine.setup_dataloader(loader, shard_by="batch")
        epochs, gathered = [], []
        for _ in range(2):
            epochs.append([])
            gathered.append([])
            for (x,) in loader:
                epochs[-1].append(x.tolist())
                gathered[-1].append(engine.gather_for_metrics(x).tolist())
        return {"epochs": epochs, "gathered": gathered, "len": len(loader)}


def test_shard_by_batch_deals_whole_batches_as_accelerate(ranks):
    """``shard_by="batch"``: rank r takes batches r, r+N, ...; the short last round (batches
    [6, 7, 8] and [9]) is filled from the start of the pass, [9, 0, 1], and
    ``gather_for_metrics`` drops the filling (Accelerate's ``even_batches``)."""
    r0, r1 = ranks.run(batches_dealt, 10, 3, False, False)
    assert r0["epochs"][0] == [[0, 1, 2], [6, 7, 8]]
    assert r1["epochs"][0] == [[3, 4, 5], [9, 0, 1]]
    assert r0["len"] == r1["len"] == 2
    assert [i for step in r0["gathered"][0] for i in step] == list(range(10))
    dropped = ranks.run(batches_dealt, 10, 3, True, False)
    assert [r["epochs"][0] for r in dropped] == [[[0, 1, 2]], [[3, 4, 5]]]  # the round of 6-8


def test_shard_by_batch_shuffles_once_for_all_ranks_and_again_each_pass(ranks):
    """A shuffled loader: the order is the loader's own (a generator seeded by a draw from
    torch's RNG at setup, as Accelerate's prepare), the same on every rank, new each pass."""
    r0, r1 = ranks.run(batches_dealt, 12, 3, False, True)
    torch.manual_seed(3)
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    generator = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.arange(12))
    reference = DataLoader(data, batch_size=3, sampler=RandomSampler(data, generator=generator))
    for epoch in range(2):
        batches = [x.tolist() for (x,) in reference]
        assert r0["epochs"][epoch] == batches[0::2] and r1["epochs"][epoch] == batches[1::2]
    assert r0["epochs"][0] != r0["epochs"][1]


def test_shard_by_must_be_sample_or_batch():
    from torchplug.contract.errors import ConfigurationError

    with tp.Engine("single") as engine, pytest.raises(ConfigurationError, match="'sample'"):
        engine.setup_dataloader(DataLoader(TensorDataset(torch.arange(4))), shard_by="rank")


class CountingDealer:
    """A strategy's per-step batch sampler (`torchplug_batch_sampler`): pairs of indices in
    order, each asked for only when the loop needs it (recorded in ``events``)."""

    def __init__(self, size: int, events: list[str]) -> None:
        self.size, self.events = size, events
        self.epoch = self.taken = 0
        self.end_of_pass = False

    def set_epoch(self, epoch: int) -> None:
        self.events.append(f"epoch {epoch}")
        if epoch != self.epoch:
            self.epoch, self.taken = epoch, 0

    def __iter__(self):
        while self.taken < self.size:
            self.events.append("deal")
            batch = list(range(self.taken, min(self.taken + 2, self.size)))
            self.taken += len(batch)
            self.end_of_pass = self.taken >= self.size
            yield batch

    def __len__(self) -> int:
        return -(-(self.size - self.taken) // 2)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.taken = state["epoch"], state["taken"]


class Dealing:
    """An in-house extension plugin answering the hook for every loader it is offered."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.offered: list = []

    @hookimpl
    def torchplug_batch_sampler(self, engine, loader, seed):
        self.offered.append((loader, seed))
        return CountingDealer(len(loader.dataset), self.events)


def test_a_strategy_that_deals_per_step_is_asked_for_each_batch_only_when_the_loop_needs_it():
    """``torchplug_batch_sampler``: the loader asks the strategy's sampler for a batch only as
    the loop takes it (no look-ahead, which would start the next step early), ends the pass
    where the sampler says, keeps the sampler's position in its state and resumes from it, and
    fetches in the main process (a loader with workers is told so). A loader with a sampler of
    the user's own is not offered (its shares stay the Engine's)."""
    data = TensorDataset(torch.arange(6))
    dealing = Dealing()
    with tp.Engine("single", plugins=[dealing], seed=5) as engine:
        loader = engine.setup_dataloader(DataLoader(data, batch_size=4, shuffle=True))
        assert dealing.offered[0][1] == 5 and dealing.offered[0][0].batch_size == 4
        seen, ends = [], []
        for (x,) in loader:
            dealing.events.append(f"step {x.tolist()}")
            seen.append(x.tolist())
            ends.append(loader.end_of_pass)
            if len(seen) == 2:
                state = loader.state_dict()
        assert seen == [[0, 1], [2, 3], [4, 5]] and ends == [False, False, True]
        assert dealing.events == [
            "epoch 0",
            "deal",
            "step [0, 1]",
            "deal",
            "step [2, 3]",
            "deal",
            "step [4, 5]",
        ]
        assert state["sampler"] == {"epoch": 0, "taken": 4}

        other = engine.setup_dataloader(DataLoader(data, batch_size=4))
        other.load_state_dict(state)
        assert [x.tolist() for (x,) in other] == [[4, 5]]  # the dealer's position, not batches

        with pytest.warns(UserWarning, match="num_workers=2 is not used"):
            workers = engine.setup_dataloader(DataLoader(data, batch_size=4, num_workers=2))
        assert workers.num_workers == 0 and [x.tolist() for (x,) in workers][0] == [0, 1]

        offered = len(dealing.offered)
        own = DataLoader(data, sampler=[5, 4, 3, 2, 1, 0], batch_size=4)
        assert [x.tolist() for (x,) in engine.setup_dataloader(own)] == [[5, 4, 3, 2], [1, 0]]
        assert len(dealing.offered) == offered
