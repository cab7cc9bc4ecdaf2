"""Data loaders for many processes: each rank sees its own share, on its own device.

Map-style datasets with the default samplers get a `DistributedSampler` (shuffling is kept,
with one seed on every rank; in one process too, so that the global batches are the same on any
number of processes). The shuffle's epoch is an explicit counter: ``loader.set_epoch(e)``
sets it, each *completed* pass advances it by one, and it is part of the loader's state, so a
resumed run shuffles as the uninterrupted one did. Starting a pass does not count (a
``next(iter(loader))`` probe shifts nothing), and a sampler you built yourself is left to you
(torchplug never calls its ``set_epoch`` unless you call ``loader.set_epoch``).

How a loader is dealt to ranks (by sample, by batch, with padding): `torchplug.features.samplers`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
)

from torchplug.features.samplers import (
    BatchShards,
    ShardedSampler,
    batch_size_of,
    default_sampler,
    padding_per_batch,
    part_of,
    per_rank_batch,
    with_batch_shards,
    with_dealer,
    with_distributed_sampler,
    with_sharded_sampler,
)
from torchplug.util.nested import map_tensors

#: The end of a pass (a batch may be ``None``).
_END = object()


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``.

    Args:
        batch: A tensor or containers of tensors.
        device: Where to move them.
    """
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


class EngineDataLoader:
    """What `Engine.setup_dataloader` returns: iterate it like the loader it wraps."""

    def __init__(
        self,
        loader: DataLoader,
        place: Callable[[Any], Any] | None,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        use_distributed_sampler: bool = True,
        gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
        on_batch: Callable[[EngineDataLoader], None] | None = None,
        split_batches: bool = False,
        shard_by: str = "sample",
        deal: Callable[[DataLoader, int], Any] | None = None,
    ) -> None:
        if shard_by not in ("sample", "batch"):
            from torchplug.contract.errors import ConfigurationError

            raise ConfigurationError(
                f"setup_dataloader(shard_by={shard_by!r}): expected 'sample' (each rank takes "
                "samples r, r+N, ..., as DistributedSampler and Fabric) or 'batch' (each rank "
                "takes whole batches r, r+N, ... of the loader, as Accelerate's prepare)."
            )
        self._shard_batches = 1
        #: ``shard_by="batch"``: the generator the loader's sampler shuffles with, set to rank
        #: 0's state when a pass starts.
        self._synced: torch.Generator | None = None
        #: ``split_batches``: each batch the loader makes is cut into ``num_replicas`` parts,
        #: this rank taking part ``rank`` (a loader whose order torchplug does not own).
        self._split = 1
        self._on_batch = on_batch
        #: Samples at the end of the batch handed out last that are padding (repeats the
        #: distributed sampler added); ``engine.gather_for_metrics`` drops them.
        self.batch_padding = 0
        self._gather = gather
        self._rank = rank
        self._own_sampler = False
        #: The strategy's batch sampler dealing each step's samples (`torchplug_batch_sampler`).
        self._dealer: Any = None
        if use_distributed_sampler and shard_by == "batch" and not split_batches:
            if num_replicas == 1:
                pass  # as Accelerate on one process: the loader as it is
            elif (
                isinstance(loader, DataLoader)
                and loader.batch_size is not None
                and not isinstance(loader.dataset, IterableDataset)
                and hasattr(loader.sampler, "__len__")
            ):
                loader, self._synced = with_batch_shards(loader, num_replicas, rank)
                self._own_sampler = True
            else:
                self._shard_batches = num_replicas
        elif use_distributed_sampler:
            if (
                isinstance(loader, DataLoader)
                and loader.batch_size is not None
                and not isinstance(loader.dataset, torch.utils.data.IterableDataset)
                and default_sampler(loader)
            ):
                # One process too: the shuffle then depends on (seed, epoch) only, so every world
                # size sees the same global batches, step for step.
                per_rank = None
                if split_batches:
                    per_rank = per_rank_batch(loader.batch_size, num_replicas)
                elif deal is not None:
                    self._dealer = deal(loader, seed)
                if self._dealer is not None:
                    loader = with_dealer(loader, self._dealer)
                else:
                    loader = with_distributed_sampler(loader, num_replicas, rank, seed, per_rank)
                self._own_sampler = True
            elif num_replicas > 1 and not isinstance(
                getattr(loader, "sampler", None), DistributedSampler
            ):
                if split_batches:
                    self._split = num_replicas
                elif (
                    isinstance(loader, DataLoader)
                    and loader.batch_size is not None
                    and not isinstance(loader.dataset, IterableDataset)
                    and hasattr(loader.sampler, "__len__")
                ):  # a sampler of the user's own: sharded by index, nothing dropped
                    loader = with_sharded_sampler(loader, num_replicas, rank, gather)
                    self._own_sampler = True
                else:
                    self._shard_batches = num_replicas
        self.loader = loader
        self.place = place
        shards = getattr(loader, "batch_sampler", None)
        self._padding = (
            shards.padding
            if isinstance(shards, BatchShards)
            else padding_per_batch(
                getattr(loader, "sampler", None),
                getattr(loader, "batch_size", None),
                bool(getattr(loader, "drop_last", False)),
            )
        )
        self.epoch = 0
        #: Batches handed out in the pass in progress (``None``: no pass in progress).
        self._consumed: int | None = None
        #: The torch RNG state (and the loader's own generator's) when the pass in progress
        #: started: samplers draw their order from them when a pass starts.
        self._epoch_rng: dict[str, torch.Tensor] | None = None
        self._skip = 0
        self._replay_rng: dict[str, torch.Tensor] = {}
        #: Whether the batch handed out last is the last of its pass (what ``engine.accumulate``
        #: completes a group on, as Accelerate's ``sync_with_dataloader``).
        self.end_of_pass = False

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: epoch and batches consumed (for resuming mid-epoch).

        Put the loader in the checkpoint state (``{"loader": loader, ...}``); call it on every
        rank, as saving does: the RNG state the pass started with is gathered from each rank.
        """
        in_pass = self._consumed is not None
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "batches": self._consumed if in_pass else 0,
        }
        if in_pass and self._epoch_rng is not None:
            for key, rng in self._epoch_rng.items():
                state[key] = self._gather(rng) if self._gather is not None else rng[None]
        if self._dealer is not None:  # the position is the dealer's (the batches vary per rank)
            state["sampler"] = self._dealer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``: the next pass is that epoch, skipping the batches consumed."""
        self.epoch = int(state["epoch"])
        if self._dealer is not None and "sampler" in state:  # the dealer's position: a pass in
            self._dealer.load_state_dict(state["sampler"])  # progress (a peer's) goes on from it
            return
        self._skip = int(state.get("batches", 0))
        self._consumed = None
        self._replay_rng = {
            key: state[key][self._rank % len(state[key])].clone()
            for key in ("epoch_rng", "epoch_generator", "epoch_sampler_generator")
            if key in state
        }

    @property
    def resumes_at(self) -> int:
        """Batches of its epoch the next pass skips (a loader restored mid-epoch), else 0."""
        return self._skip

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch the next pass shuffles for (it otherwise advances by one per completed
        pass); forwarded to a ``DistributedSampler`` you built yourself."""
        self.epoch = epoch
        sampler = getattr(self.loader, "sampler", None)
        if not self._own_sampler and isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self.loader, "sampler", None)
        if self._own_sampler and isinstance(sampler, (DistributedSampler, ShardedSampler)):
            sampler.set_epoch(self.epoch)
        dealing = self._dealer is not None
        if dealing:
            self._dealer.set_epoch(self.epoch)
        skip, self._skip = self._skip, 0
        replay, self._replay_rng = self._replay_rng, {}
        generator = getattr(self.loader, "generator", None)
        if not isinstance(generator, torch.Generator):
            generator = None
        resume_rng = None
        if skip and replay:
            # Replay the pass from its start: samplers draw their order from the RNG as it was
            # then; afterwards the global RNG goes back to where the checkpoint left it.
            resume_rng = torch.get_rng_state()
            if "epoch_rng" in replay:
                torch.set_rng_state(replay["epoch_rng"])
            if generator is not None and "epoch_generator" in replay:
                generator.set_state(replay["epoch_generator"])
        self._epoch_rng = {"epoch_rng": torch.get_rng_state()}
        if self._synced is not None:  # every rank shuffles with rank 0's generator state
            if "epoch_sampler_generator" in replay:
                self._synced.set_state(replay["epoch_sampler_generator"])
            elif self._gather is not None:
                own = self._synced.get_state()
                self._synced.set_state(self._gather(own)[0].to(own.device, own.dtype))
            self._epoch_rng["epoch_sampler_generator"] = self._synced.get_state()
        if generator is not None:
            self._epoch_rng["epoch_generator"] = generator.get_state()
        self._consumed = 0
        self.end_of_pass = False
        total: int | None = None  # unknown: the last batch is known by looking one ahead
        # (a dealer says itself: looking ahead would start the next step)
        if not dealing and not isinstance(getattr(self.loader, "dataset", None), IterableDataset):
            try:  # a sized loader: its last batch is known by count (none fetched early)
                total = len(self)
            except TypeError:
                total = None
        batches = self._pass(skip, resume_rng)
        pending = next(batches, _END)
        while pending is not _END:
            ahead = total is None and not dealing
            following = next(batches, _END) if ahead else _END
            batch, repeated = pending
            self.batch_padding = batch_size_of(batch) if repeated else self._padding(self._consumed)
            self._consumed += 1
            if dealing:
                self.end_of_pass = bool(self._dealer.end_of_pass)
                self.batch_padding = int(getattr(self._dealer, "batch_padding", 0) or 0)
            else:
                self.end_of_pass = (
                    self._consumed >= total if total is not None else following is _END
                )
            if self._on_batch is not None:
                self._on_batch(self)
            yield self.place(batch) if self.place is not None else batch
            pending = following if ahead else next(batches, _END)
        self.end_of_pass = False
        self._consumed = None
        self.batch_padding = 0  # a gather after the pass (another loader's batches) trims nothing
        self.epoch += 1  # a completed pass: the next one shuffles for the next epoch

    def _pass(self, skip: int, resume_rng: Any) -> Iterator[tuple[Any, bool]]:
        """This rank's batches of one pass, after the ``skip`` a resumed pass skips (counted in
        ``_consumed``; the global RNG goes back to the checkpoint's once they are skipped), each
        with whether it is a whole batch of padding (a repeat completing the last round)."""
        n, rank = self._shard_batches, self._rank
        round_: list[Any] = []
        for batch in self.loader:
            if n > 1:
                round_.append(batch)
                if len(round_) < n:
                    continue
                batch, round_ = round_[rank], []
            if self._split > 1:
                batch = part_of(batch, rank, self._split)
            if skip:
                skip -= 1
                self._consumed = (self._consumed or 0) + 1
                if not skip and resume_rng is not None:
                    torch.set_rng_state(resume_rng)
                    resume_rng = None
                continue
            yield batch, False
        if round_ and not skip:  # a last incomplete round: its batches repeated, as padding
            yield round_[rank % len(round_)], rank >= len(round_)
        if resume_rng is not None:  # the pass was shorter than the batches to skip
            torch.set_rng_state(resume_rng)

    def __len__(self) -> int:
        return -(-len(self.loader) // self._shard_batches)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "_on_batch"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
