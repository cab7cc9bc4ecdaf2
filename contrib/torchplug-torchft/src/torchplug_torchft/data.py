"""The data rule of ``ft-ddp``: each step's samples are dealt among the ranks of its quorum.

An epoch's order is ``DistributedSampler``'s for one replica (the same shuffle, for the same
seed and epoch, as ``ddp`` draws), read as a queue. A step takes the next ``batch_size * P``
samples, ``P`` being the ranks of the groups in the step's quorum, and the quorum's rank ``p``
takes every ``P``-th of them from ``p`` on: with every group alive this is ``ddp``'s dealing on
as many ranks, batch for batch. A committed step moves the queue past its samples; a step given
up (a group died during it) deals the same samples again to the next quorum. So within an epoch
every sample is trained on once, whichever groups were alive: a group that is down reads nothing
and the others take its share, and an epoch lasts more steps while fewer groups train. The last
samples of an epoch are padded to a multiple of ``P`` with the first of its order (as
``DistributedSampler`` pads), or dropped with the loader's ``drop_last``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DistributedSampler


class QuorumBatches:
    """A batch sampler that deals each step's samples among the ranks of its quorum.

    Args:
        deal: Starts the step's quorum (once per step) and answers ``(p, P)``: this rank's
            place among the quorum's ranks, and how many they are.
        dataset: The loader's dataset (map-style, sized).
        batch_size: Samples per rank and batch.
        shuffle: Whether the loader shuffled (its sampler was a ``RandomSampler``).
        drop_last: The loader's ``drop_last``: an epoch's last, smaller step is not taken.
        seed: The Engine's data seed.
        ranks: The ranks to expect before the first quorum (for ``len``).
    """

    def __init__(
        self,
        deal: Callable[[], tuple[int, int]],
        dataset: Any,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        seed: int,
        ranks: int,
    ) -> None:
        self.deal = deal
        self.order = DistributedSampler(
            dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=False
        )
        self.size = len(self.order)
        self.batch_size, self.drop_last, self.ranks = batch_size, drop_last, ranks
        self.epoch = 0
        #: Samples of the epoch's order that committed steps trained on.
        self.committed = 0
        #: Samples dealt to the step in progress (trained on only if it commits).
        self.pending = 0
        #: Whether the batch dealt last ends the epoch (if its step commits).
        self.end_of_pass = False
        #: A position was loaded since the last pass started.
        self.loaded = False
        #: Samples ending the batch dealt last that are padding (``gather_for_metrics`` drops
        #: them, as it drops ``ddp``'s ``DistributedSampler`` padding).
        self.batch_padding = 0

    def set_epoch(self, epoch: int) -> None:
        """A pass of ``epoch`` starts: from the queue's start, as ``ddp``'s passes do, unless a
        position was loaded since the last pass (a resumed or healed loader goes on from it)."""
        if epoch != self.epoch or not self.loaded:
            self.epoch, self.committed = epoch, 0
        self.pending, self.loaded = 0, False

    def commit(self, committed: bool) -> None:
        """The step in progress ended: its samples are trained on (``committed``), or are dealt
        again to the next step's quorum."""
        if committed:
            self.committed += self.pending
        self.pending = 0

    def _left(self, start: int, ranks: int) -> int:
        """Samples a step starting at ``start`` takes with ``ranks`` ranks (0: the epoch ends)."""
        take = min(self.size - start, self.batch_size * ranks)
        return 0 if take <= 0 or (self.drop_last and take < self.batch_size * ranks) else take

    def __iter__(self) -> Iterator[list[int]]:
        self.order.set_epoch(self.epoch)
        order = list(self.order)
        while self.committed + self.pending < self.size:  # asks no quorum once all are taken
            rank, ranks = self.deal()
            self.ranks = ranks
            start = self.committed + self.pending
            take = self._left(start, ranks)
            if not take:
                return
            chunk = order[start : start + take]
            short = -take % ranks  # padding, so that every rank gets as many
            chunk += (order * (1 + short // max(self.size, 1)))[:short]
            self.pending += take
            self.end_of_pass = not self._left(start + take, ranks)
            self.batch_padding = sum(1 for i in range(rank, take + short, ranks) if i >= take)
            yield chunk[rank::ranks]

    def __len__(self) -> int:
        """The batches left in this epoch at the last quorum's size."""
        left, per_step = self.size - self.committed, self.batch_size * max(self.ranks, 1)
        return left // per_step if self.drop_last else -(-left // per_step)

    def state_dict(self) -> dict[str, int]:
        """The position: the epoch and the samples it dealt, as a ``ddp`` loader's counts the
        batches it handed out (saved after a step, that is the committed ones; ft-ddp serves
        joiners the position of the last committed step)."""
        return {"epoch": self.epoch, "committed": self.committed + self.pending, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (a peer's position, or a checkpoint's)."""
        self.epoch, self.committed, self.pending = int(state["epoch"]), int(state["committed"]), 0
        self.loaded = True

    def done(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` is at the end of its epoch (nothing left to deal)."""
        return not self._left(int(state["committed"]), max(self.ranks, 1))
