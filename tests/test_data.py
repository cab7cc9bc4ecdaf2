"""setup_dataloader: every rank its own share, the same shuffle on every rank, fresh each epoch."""

from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import torchplug as tp


def epochs_seen(shuffle: bool, custom_batches: bool = False) -> dict:
    data = TensorDataset(torch.arange(20))
    if custom_batches:
        loader = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 3, False))
    else:
        loader = DataLoader(data, batch_size=2, shuffle=shuffle)
    with tp.Engine("ddp", timeout=60.0) as engine:
        loader = engine.setup_dataloader(loader)
        epochs = [[b[0].tolist() for b in loader] for _ in range(2)]
        return {"epochs": epochs, "len": len(loader)}


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
    # 7 batches of 3 (last one short): rounds of 2 -> 3 each, the odd 7th batch dropped
    assert r0["len"] == r1["len"] == 3
    assert r0["epochs"][0] == [[0, 1, 2], [6, 7, 8], [12, 13, 14]]
    assert r1["epochs"][0] == [[3, 4, 5], [9, 10, 11], [15, 16, 17]]


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
