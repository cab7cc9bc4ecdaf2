"""ft-ddp's data rule (`torchplug_torchft.data.QuorumBatches`) on its own: every group's sampler
is driven through the same sequence of quorums and commits as a real job's would be, against
torch's ``DistributedSampler`` (the ``ddp`` reference) and the rule's promise (every sample of an
epoch trained on once, whichever groups were alive)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DistributedSampler

pytest.importorskip("torchplug_torchft")

from torchplug_torchft.data import QuorumBatches  # noqa: E402


class Quorums:
    """The quorums of a job, step by step: ``alive[s]`` is the groups taking part in step ``s``
    (each one rank); ``deal`` answers a group's place among them."""

    def __init__(self, alive: list[list[int]]) -> None:
        self.alive, self.step = alive, 0

    def dealer(self, group: int):
        def deal() -> tuple[int, int]:
            members = self.alive[min(self.step, len(self.alive) - 1)]
            return members.index(group), len(members)

        return deal


def samplers(quorums: Quorums, groups: int, size: int, batch: int, **options) -> list:
    dataset = list(range(size))
    made = []
    for group in range(groups):
        made.append(
            QuorumBatches(
                quorums.dealer(group),
                dataset,
                batch,
                shuffle=options.get("shuffle", True),
                drop_last=options.get("drop_last", False),
                seed=options.get("seed", 3),
                ranks=groups,
            )
        )
    return made


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("size", "batch", "ranks"), [(96, 8, 2), (50, 4, 3), (7, 2, 4), (5, 8, 2)])
def test_with_every_group_alive_it_deals_as_distributed_sampler(size, batch, ranks, drop_last):
    """Every group alive every step: rank p's batches are those of ``DistributedSampler(rank=p)``
    batched by ``batch`` (``ddp``'s loader), padding and ``drop_last`` included, for two epochs."""
    quorums = Quorums([list(range(ranks))])
    ours = samplers(quorums, ranks, size, batch, drop_last=drop_last)
    for epoch in range(2):
        theirs = []
        for rank in range(ranks):
            sampler = DistributedSampler(
                list(range(size)), ranks, rank, shuffle=True, seed=3, drop_last=drop_last
            )
            sampler.set_epoch(epoch)
            order = list(sampler)
            batches = [order[i : i + batch] for i in range(0, len(order), batch)]
            if drop_last and batches and len(batches[-1]) < batch:
                batches.pop()
            theirs.append(batches)
        for sampler in ours:
            sampler.set_epoch(epoch)
        assert [len(s) for s in ours] == [len(t) for t in theirs]
        iterators = [iter(s) for s in ours]
        dealt: list[list[list[int]]] = [[] for _ in range(ranks)]
        while True:
            step = [next(it, None) for it in iterators]
            if step[0] is None:
                assert all(b is None for b in step)
                break
            for rank, indices in enumerate(step):
                dealt[rank].append(indices)
            for sampler in ours:
                sampler.commit(True)
        assert dealt == theirs, epoch


def run_job(
    alive: list[list[int]], groups: int, size: int, batch: int, given_up=(), trim=False, **options
):
    """Drive every alive group's sampler step by step (``given_up``: steps whose quorum fails,
    so no group commits them); a dead group's sampler is re-made from a live peer's position
    when it rejoins, as ft-ddp heals. Returns each epoch's committed samples (``trim``: less
    each batch's ``batch_padding``, as ``gather_for_metrics`` takes them)."""
    quorums = Quorums(alive)
    made = samplers(quorums, groups, size, batch, **options)
    iterators = {g: iter(made[g]) for g in range(groups)}
    committed: dict[int, list[int]] = {}
    epoch = 0
    step = attempt = 0
    while step < len(alive):
        quorums.step = step
        members = alive[step]
        for group in members:
            if group not in iterators:  # rejoins: a peer's position, then a fresh pass
                peer = made[alive[step - 1][0]]
                made[group].load_state_dict(peer.state_dict())
                made[group].set_epoch(peer.epoch)
                iterators[group] = iter(made[group])
        for group in list(iterators):
            if group not in members:
                del iterators[group]  # died: its pass is gone with it
        batches = {g: next(iterators[g], None) for g in members}
        if all(b is None for b in batches.values()):  # the epoch ended for every group
            epoch += 1
            for group in members:
                made[group].set_epoch(epoch)
                iterators[group] = iter(made[group])
            continue
        assert None not in batches.values(), (step, batches)
        ok = attempt not in given_up
        attempt += 1
        for group in members:
            made[group].commit(ok)
        if trim:
            batches = {g: b[: len(b) - made[g].batch_padding] for g, b in batches.items()}
        if ok:
            committed.setdefault(epoch, []).extend(i for b in batches.values() for i in b)
            step += 1
    return committed


@pytest.mark.parametrize("shuffle", [True, False])
def test_no_sample_is_lost_or_seen_twice_while_groups_die_and_rejoin(shuffle):
    """Three groups; group 2 dies at step 3 and rejoins at step 9, group 1 dies at step 5 for
    two steps, two steps' quorums fail (given up, dealt again): each completed epoch trains on
    every sample exactly once; the last, partial one on none twice."""
    every = [0, 1, 2]
    alive = [every] * 3 + [[0, 1]] * 2 + [[0]] * 2 + [[0, 1]] * 2 + [every] * 20
    committed = run_job(alive, 3, 96, 8, given_up={4, 11}, shuffle=shuffle)
    epochs = sorted(committed)
    assert len(epochs) >= 3
    for epoch in epochs[:-1]:
        assert sorted(committed[epoch]) == list(range(96)), epoch
    last = committed[epochs[-1]]
    assert len(last) == len(set(last))


@pytest.mark.parametrize(("size", "batch"), [(50, 4), (7, 2), (100, 3)])
def test_uneven_tails_are_padded_as_distributed_sampler_pads(size, batch):
    """Quorums of 1 to 3 groups in turn over an epoch whose size no quorum divides: every sample
    is trained on; only the last step repeats samples (padding to a multiple of its ranks), and
    only as many as that needs; with ``drop_last`` nothing repeats and only the tail is left."""
    alive = [[0, 1, 2], [0], [0, 2], [1, 2], [0, 1, 2]] * 40
    committed = run_job(alive, 3, size, batch)
    for epoch in sorted(committed)[:-1]:
        seen = committed[epoch]
        assert set(seen) == set(range(size))
        assert len(seen) - size < 3
    # what gather_for_metrics keeps: each sample once, the padding dropped (issue 33's note)
    for epoch, seen in sorted(run_job(alive, 3, size, batch, trim=True).items())[:-1]:
        assert sorted(seen) == list(range(size)), epoch
    dropped = run_job(alive, 3, size, batch, drop_last=True)
    for epoch in sorted(dropped)[:-1]:
        seen = dropped[epoch]
        assert len(seen) == len(set(seen)) and size - len(seen) < 3 * batch


def test_the_position_is_the_queue_not_the_batches():
    """A loaded position goes on from its committed samples (a pass of the same epoch), a fresh
    pass without one starts the epoch over (as ``ddp``'s), and ``done`` says when nothing is
    left (ft-ddp then serves the next epoch's start)."""
    quorums = Quorums([[0, 1]])
    first, second = samplers(quorums, 2, 40, 4)
    taken = list(itertools.islice(iter(first), 3))
    first.commit(True)
    state = first.state_dict()
    assert state == {"epoch": 0, "committed": 24, "size": 40}
    second.load_state_dict(state)
    second.set_epoch(0)
    rest = list(iter(second))
    order = list(DistributedSampler(list(range(40)), 1, 0, shuffle=True, seed=3))
    assert sorted(i for b in rest for i in b) == sorted(order[24:][1::2])  # rank 1's share
    assert not second.done(state) and second.done({"epoch": 0, "committed": 40})
    first.set_epoch(0)  # no position loaded: the epoch starts over
    assert next(iter(first)) == taken[0]
    assert torch.equal(torch.tensor(taken[0]), torch.tensor(order[0:8][0::2]))
