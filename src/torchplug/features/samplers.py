"""How a loader is dealt to ranks: nothing dropped, nothing seen twice, every rank as many steps.

A sampler of your own (``SubsetRandomSampler``, ``WeightedRandomSampler``, any ``Sampler``) is
sharded by index, as Fabric's ``DistributedSamplerWrapper`` does: each pass's indices are drawn
once, padded by repeating from the start to a multiple of the ranks, and rank ``r`` of ``N``
takes positions ``r, r+N, ...``: every index is seen, the repeats are padding that
``gather_for_metrics`` drops. A torch sampler without a generator draws from torch's global RNG,
as it does in one process (and under Fabric); every rank draws rank 0's order (when the ranks'
RNGs differ, from a generator in rank 0's state), so no index is seen twice. Batch samplers and
iterable datasets are sharded by batch: rank ``r`` takes batches ``r, r+N, ...``; a last
incomplete round is completed by repeating its batches (marked as padding), so no sample is
dropped and every rank runs the same number of steps (no collective waits forever).

``shard_by="batch"`` deals a map-style loader's own batches as Accelerate's ``prepare`` does:
rank ``r`` takes whole batches ``r, r+N, ...`` of the loader as it is; a shuffling sampler
without a generator gets one, seeded by a draw from torch's RNG when the loader is set up and
set to rank 0's state at the start of every pass; a short last round is completed with samples
from the start of the pass (``even_batches``), which ``gather_for_metrics`` drops.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from torchplug.util.nested import map_tensors


def with_distributed_sampler(
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


def with_dealer(loader: DataLoader, dealer: Any) -> DataLoader:
    """``loader`` asking ``dealer`` (a strategy's `torchplug_batch_sampler`) for each batch's
    indices when the loop needs it, in the main process: worker processes would ask ahead, before
    the step's ranks are known."""
    if loader.num_workers > 0:
        warnings.warn(
            f"The strategy deals each step's samples once the step's ranks are known, so this "
            f"loader fetches in the main process: its num_workers={loader.num_workers} is not "
            f"used. Make the loader with num_workers=0 to silence this.",
            stacklevel=4,
        )
    return DataLoader(
        loader.dataset,
        batch_sampler=dealer,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        generator=loader.generator,
    )


def _rebuilt(loader: DataLoader, sampler: Any, batch_size: int | None = None) -> DataLoader:
    """``loader`` with another sampler (and batch size), everything else kept."""
    size = loader.batch_size if batch_size is None else batch_size
    return _rebuilt_with(loader, sampler=sampler, batch_size=size, drop_last=loader.drop_last)


def _rebuilt_with(loader: DataLoader, **batching: Any) -> DataLoader:
    """``loader`` batching as ``batching`` says (a sampler and batch size, or a batch
    sampler), everything else kept."""
    kwargs: dict[str, Any] = {
        **batching,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
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
        gather: Gathers a tensor from every rank (``Engine.gather``): a torch sampler without a
            generator draws rank 0's order from it.
    """

    def __init__(
        self,
        sampler: Any,
        num_replicas: int,
        rank: int,
        gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.sampler, self.num_replicas, self.rank = sampler, num_replicas, rank
        self.gather = gather
        self.epoch = 0
        #: How many indices the last pass drew (the rest of this rank's share is padding).
        self.drawn = len(sampler) if hasattr(sampler, "__len__") else 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        inner = getattr(self.sampler, "set_epoch", None)
        if callable(inner):
            inner(epoch)

    def _draw(self) -> list[Any]:
        if getattr(self.sampler, "generator", False) is not None or self.gather is None:
            return list(self.sampler)
        # No generator: the order comes from torch's RNG, as in one process; rank 0's decides.
        own = torch.get_rng_state()
        lead = self.gather(own)[0].to(own.device, own.dtype)
        if torch.equal(lead, own):
            return list(self.sampler)
        self.sampler.generator = torch.Generator().set_state(lead)
        try:
            return list(self.sampler)
        finally:
            self.sampler.generator = None

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


def with_sharded_sampler(
    loader: DataLoader,
    num_replicas: int,
    rank: int,
    gather: Callable[[torch.Tensor], torch.Tensor] | None,
) -> DataLoader:
    """``loader`` with its own sampler replaced by this rank's `ShardedSampler` of it."""
    return _rebuilt(loader, ShardedSampler(loader.sampler, num_replicas, rank, gather))


class BatchShards(torch.utils.data.Sampler):
    """This rank's whole batches of a batch sampler, as Accelerate's ``prepare`` deals them:
    batch ``rank`` of every round of ``N`` full batches; a last round that is short (unless
    ``drop_last``) is filled with indices from the start of the pass and cut into ``N`` batches
    again (Accelerate's ``even_batches``), so every rank takes as many.

    Args:
        batch_sampler: The loader's batch sampler (a fixed ``batch_size``, a sized sampler).
        num_replicas: The data-parallel ranks.
        rank: This rank's data-parallel index.
    """

    def __init__(self, batch_sampler: Any, num_replicas: int, rank: int) -> None:
        self.batch_sampler, self.num_replicas, self.rank = batch_sampler, num_replicas, rank
        self.batch_size: int = batch_sampler.batch_size
        self.drop_last: bool = batch_sampler.drop_last

    def __iter__(self) -> Iterator[list[Any]]:
        n, size = self.num_replicas, self.batch_size
        head: list[Any] = []  # the first round's indices: what a short last round is filled with
        round_: list[list[Any]] = []
        for batch in self.batch_sampler:
            if len(head) < n * size:
                head += batch
            round_.append(batch)
            if len(round_) == n and len(batch) == size:
                yield round_[self.rank]
                round_ = []
        if self.drop_last or not round_:
            return
        flat = [index for batch in round_ for index in batch]
        flat += [head[j % len(head)] for j in range(n * size - len(flat))]
        yield flat[self.rank * size : (self.rank + 1) * size]

    def __len__(self) -> int:
        batches = len(self.batch_sampler)
        return batches // self.num_replicas if self.drop_last else -(-batches // self.num_replicas)

    def padding(self, i: int) -> int:
        """How many samples of this rank's batch ``i`` are filling (the last round's)."""
        if self.drop_last:
            return 0
        n, size = self.num_replicas, self.batch_size
        real = len(self.batch_sampler.sampler) - (i * n + self.rank) * size
        return size - min(max(real, 0), size)


def with_batch_shards(
    loader: DataLoader,
    num_replicas: int,
    rank: int,
) -> tuple[DataLoader, torch.Generator | None]:
    """``loader`` dealing its own batches to ranks (`BatchShards`), and the generator its
    sampler shuffles with (one is lent, seeded from torch's RNG, to a sampler without one)."""
    sampler = loader.sampler
    if hasattr(sampler, "generator") and sampler.generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        sampler.generator = torch.Generator().manual_seed(seed)
    generator = getattr(sampler, "generator", None)
    shards = BatchShards(loader.batch_sampler, num_replicas, rank)
    return _rebuilt_with(loader, batch_sampler=shards), (
        generator if isinstance(generator, torch.Generator) else None
    ) if isinstance(generator, torch.Generator) else None


def batch_size_of(batch: Any) -> int:
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


def default_sampler(loader: DataLoader) -> bool:
    sampler = loader.sampler
    if isinstance(sampler, SequentialSampler):
        return True
    return (
        isinstance(sampler, RandomSampler)
        and not sampler.replacement
        and sampler._num_samples is None  # noqa: SLF001 - only way to see num_samples was not set
    )


def per_rank_batch(batch_size: int, num_replicas: int) -> int:
    """``split_batches``: the per-rank batch that makes ``batch_size`` the global one."""
    if batch_size % num_replicas:
        from torchplug.contract.errors import ConfigurationError

        raise ConfigurationError(
            f"setup_dataloader(split_batches=True): batch_size={batch_size} is the global "
            f"batch, which must divide evenly over the {num_replicas} data-parallel ranks. Use "
            f"a multiple of {num_replicas}, or split_batches=False (batch_size per rank)."
        )
    return batch_size // num_replicas


def part_of(batch: Any, rank: int, parts: int) -> Any:
    """Part ``rank`` of ``parts`` of every tensor in ``batch`` along dimension 0."""

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            return tensor
        size = per_rank_batch(tensor.shape[0], parts)
        return tensor[rank * size : (rank + 1) * size]

    return map_tensors(batch, cut)
