"""Data loaders for many processes: each rank sees its own share, on its own device.

Map-style datasets with the default samplers get a `DistributedSampler` (shuffling is kept,
with one seed on every rank; in one process too, so that the global batches are the same on any
number of processes). The shuffle's epoch is an explicit counter: ``loader.set_epoch(e)``
sets it, each *completed* pass advances it by one, and it is part of the loader's state, so a
resumed run shuffles as the uninterrupted one did. Starting a pass does not count (a
``next(iter(loader))`` probe shifts nothing), and a sampler you built yourself is left to you
(torchplug never calls its ``set_epoch`` unless you call ``loader.set_epoch``).

A sampler of your own (``SubsetRandomSampler``, ``WeightedRandomSampler``, any ``Sampler``) is
sharded by index, as Fabric's ``DistributedSamplerWrapper`` does: each pass's indices are drawn
once (the same on every rank: a torch sampler without a generator gets one seeded from the
seed and the epoch), padded by repeating from the start to a multiple of the ranks, and rank
``r`` of ``N`` takes positions ``r, r+N, ...``: every index is seen, the repeats are padding that
``gather_for_metrics`` drops. Batch samplers and iterable datasets are sharded by batch: rank
``r`` takes batches ``r, r+N, ...``; a last incomplete round is completed by repeating its
batches (marked as padding), so no sample is dropped and every rank runs the same number of
steps (no collective waits forever).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
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


def _with_distributed_sampler(
    loader: DataLoader, num_replicas: int, rank: int, seed: int, batch_size: int | None = None
) -> DataLoader:
    sampler = DistributedSampler(
        loader.dataset,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=seed,
        drop_last=loader.drop_last,
    )
    return _rebuilt(loader, sampler, batch_size)


def _rebuilt(loader: DataLoader, sampler: Any, batch_size: int | None = None) -> DataLoader:
    """``loader`` with another sampler (and batch size), everything else kept."""
    kwargs: dict[str, Any] = {
        "batch_size": loader.batch_size if batch_size is None else batch_size,
        "sampler": sampler,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn or _worker_seeding(loader),
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs)


def _worker_seeding(loader: DataLoader) -> Callable[[int], None] | None:
    """``seed_worker`` for a loader with workers after ``seed_everything(..., workers=True)``."""
    from torchplug.features.seeding import seed_worker, seeding_workers

    return seed_worker if loader.num_workers > 0 and seeding_workers() else None


class ShardedSampler(torch.utils.data.Sampler):
    """This rank's share of another sampler's indices: each pass's indices, padded by repeating
    from the start to a multiple of ``num_replicas``, at positions ``rank, rank + N, ...``.

    Args:
        sampler: The loader's own sampler (anything that yields dataset indices).
        num_replicas: The data-parallel ranks.
        rank: This rank's data-parallel index.
        seed: Seeds a torch sampler that has no generator of its own (with the epoch), so every
            rank draws the same order.
    """

    def __init__(self, sampler: Any, num_replicas: int, rank: int, seed: int = 0) -> None:
        self.sampler, self.num_replicas, self.rank, self.seed = sampler, num_replicas, rank, seed
        self.epoch = 0
        #: How many indices the last pass drew (the rest of this rank's share is padding).
        self.drawn = len(sampler) if hasattr(sampler, "__len__") else 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        inner = getattr(self.sampler, "set_epoch", None)
        if callable(inner):
            inner(epoch)

    def _draw(self) -> list[Any]:
        if hasattr(self.sampler, "generator") and self.sampler.generator is None:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self.sampler.generator = generator  # one order on every rank, this pass only
            try:
                return list(self.sampler)
            finally:
                self.sampler.generator = None
        return list(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        indices = self._draw()
        self.drawn = len(indices)
        if not indices:
            return iter(())
        total = -(-len(indices) // self.num_replicas) * self.num_replicas
        while len(indices) < total:
            indices += indices[: total - len(indices)]
        return iter(indices[self.rank : total : self.num_replicas])

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.num_replicas)

    def real(self) -> int:
        """How many of this rank's indices in the last pass were not padding."""
        return len(range(self.rank, self.drawn, self.num_replicas))


def _with_sharded_sampler(
    loader: DataLoader, num_replicas: int, rank: int, seed: int
) -> DataLoader:
    """``loader`` with its own sampler replaced by this rank's `ShardedSampler` of it."""
    return _rebuilt(loader, ShardedSampler(loader.sampler, num_replicas, rank, seed))


def _batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor."""
    found: list[int] = []

    def first(tensor: torch.Tensor) -> torch.Tensor:
        if not found and tensor.dim() > 0:
            found.append(tensor.shape[0])
        return tensor

    map_tensors(batch, first)
    return found[0] if found else (len(batch) if hasattr(batch, "__len__") else 1)


def padding_per_batch(
    sampler: Any, batch_size: int | None, drop_last: bool
) -> Callable[[int], int]:
    """For batch ``i`` of this rank, how many of its samples are padding: ``DistributedSampler``
    repeats samples so every rank gets as many; those repeats sit at the end of the ranks whose
    share is short, one each, and must not be counted twice in metrics."""
    if isinstance(sampler, ShardedSampler) and batch_size:

        def sharded(i: int) -> int:
            start, end = i * batch_size, min((i + 1) * batch_size, len(sampler))
            if drop_last and end - start < batch_size:
                return 0
            return max(0, end - max(start, sampler.real()))

        return sharded
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last or not batch_size:
        return lambda i: 0
    size = len(sampler.dataset)  # type: ignore[arg-type]
    real = len(range(sampler.rank, size, sampler.num_replicas))
    total = sampler.num_samples

    def padding(i: int) -> int:
        start = i * batch_size
        end = min(start + batch_size, total)
        if drop_last and end - start < batch_size:
            return 0
        return max(0, end - max(start, real))

    return padding


def _default_sampler(loader: DataLoader) -> bool:
    sampler = loader.sampler
    if isinstance(sampler, SequentialSampler):
        return True
    return (
        isinstance(sampler, RandomSampler)
        and not sampler.replacement
        and sampler._num_samples is None  # noqa: SLF001 - only way to see num_samples was not set
    )


def _per_rank_batch(batch_size: int, num_replicas: int) -> int:
    """``split_batches``: the per-rank batch that makes ``batch_size`` the global one."""
    if batch_size % num_replicas:
        from torchplug.contract.errors import ConfigurationError

        raise ConfigurationError(
            f"setup_dataloader(split_batches=True): batch_size={batch_size} is the global "
            f"batch, which must divide evenly over the {num_replicas} data-parallel ranks. Use "
            f"a multiple of {num_replicas}, or split_batches=False (batch_size per rank)."
        )
    return batch_size // num_replicas


def _part_of(batch: Any, rank: int, parts: int) -> Any:
    """Part ``rank`` of ``parts`` of every tensor in ``batch`` along dimension 0."""

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            return tensor
        size = _per_rank_batch(tensor.shape[0], parts)
        return tensor[rank * size : (rank + 1) * size]

    return map_tensors(batch, cut)


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
    ) -> None:
        self._shard_batches = 1
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
        if use_distributed_sampler:
            if (
                isinstance(loader, DataLoader)
                and loader.batch_size is not None
                and not isinstance(loader.dataset, torch.utils.data.IterableDataset)
                and _default_sampler(loader)
            ):
                # One process too: the shuffle then depends on (seed, epoch) only, so every world
                # size sees the same global batches, step for step.
                per_rank = None
                if split_batches:
                    per_rank = _per_rank_batch(loader.batch_size, num_replicas)
                loader = _with_distributed_sampler(loader, num_replicas, rank, seed, per_rank)
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
                    loader = _with_sharded_sampler(loader, num_replicas, rank, seed)
                    self._own_sampler = True
                else:
                    self._shard_batches = num_replicas
        self.loader = loader
        self.place = place
        self._padding = padding_per_batch(
            getattr(loader, "sampler", None),
            getattr(loader, "batch_size", None),
            bool(getattr(loader, "drop_last", False)),
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
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``: the next pass is that epoch, skipping the batches consumed."""
        self.epoch = int(state["epoch"])
        self._skip = int(state.get("batches", 0))
        self._consumed = None
        self._replay_rng = {
            key: state[key][self._rank % len(state[key])].clone()
            for key in ("epoch_rng", "epoch_generator")
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
        if generator is not None:
            self._epoch_rng["epoch_generator"] = generator.get_state()
        self._consumed = 0
        self.end_of_pass = False
        total: int | None = None  # unknown: the last batch is known by looking one ahead
        if not isinstance(getattr(self.loader, "dataset", None), IterableDataset):
            try:  # a sized loader: its last batch is known by count (none fetched early)
                total = len(self)
            except TypeError:
                total = None
        batches = self._pass(skip, resume_rng)
        pending = next(batches, _END)
        while pending is not _END:
            following = _END if total is not None else next(batches, _END)
            batch, repeated = pending
            self.batch_padding = (
                _batch_size_of(batch) if repeated else self._padding(self._consumed)
            )
            self._consumed += 1
            self.end_of_pass = self._consumed >= total if total is not None else following is _END
            if self._on_batch is not None:
                self._on_batch(self)
            yield self.place(batch) if self.place is not None else batch
            pending = next(batches, _END) if total is not None else following
        self.end_of_pass = False
        self._consumed = None
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
                batch = _part_of(batch, rank, self._split)
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
