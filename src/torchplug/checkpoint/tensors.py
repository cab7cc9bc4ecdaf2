"""The tensor store: tensors written by torch.distributed.checkpoint (DCP), indexed by torchplug.

Each rank writes the tensors it owns with DCP into ``tensors/rank-N/`` on its own (no collective):
rank 0 writes plain (replicated) tensors, every rank writes its shards of sharded DTensors. DCP's
own ``.metadata`` file is a pickle, so it is never written: the chunk index (each tensor's global
shape and dtype, each chunk's offsets, file and byte range) goes into the manifest as JSON, where
it is covered by the digest and the signature. Loading rebuilds DCP's metadata from that index and
reads chunk data with ``torch.load(weights_only=True)`` only; every referenced file must be listed
in the manifest and stay inside the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from torchplug.checkpoint.files import confined
from torchplug.checkpoint.manifest import DTYPES, TENSORS, dtype_name
from torchplug.core.errors import CheckpointError


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns when it runs in one process; here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def plain_sizes(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Bytes of each plain (not DTensor) tensor: what :func:`assign` balances over the ranks."""
    from torch.distributed.tensor import DTensor

    return {
        name: t.numel() * t.element_size()
        for name, t in tensors.items()
        if not isinstance(t, DTensor)
    }


def assign(sizes_by_rank: list[dict[str, int]]) -> dict[str, int]:
    """Which rank writes each plain tensor: the largest first, each to the least loaded rank that
    holds it, the same answer on every rank (all see every rank's sizes).

    A plain tensor is a full replica on every rank that holds it (DDP, ZeRO-1/2 state gathered
    to full tensors); writing all of them on rank 0 made rank 0 write and hash the whole model
    while the others idled, so a save took about world-size times as long as plain DCP's, which
    balances replicated tensors the same way.
    """
    load = [0] * len(sizes_by_rank)
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for rank, sizes in enumerate(sizes_by_rank):
        for name, nbytes in sizes.items():
            holders.setdefault(name, []).append(rank)
            size[name] = max(size.get(name, 0), nbytes)
    owner: dict[str, int] = {}
    for name in sorted(size, key=lambda n: (-size[n], n)):
        rank = min(holders[name], key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += size[name]
    return owner


def owned(
    tensors: Mapping[str, torch.Tensor], rank: int, owners: Mapping[str, int] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors this rank writes: its shards of DTensors (one replica of each), and the plain
    tensors ``owners`` gives it (without ``owners``: every plain tensor on rank 0)."""
    from torch.distributed.tensor import DTensor

    mine = {}
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            coordinate = tensor.device_mesh.get_coordinate() or []
            replica = any(
                p.is_replicate() and c != 0
                for p, c in zip(tensor.placements, coordinate, strict=False)
            )
            if not replica:
                mine[name] = tensor
        elif (owners.get(name, 0) if owners is not None else 0) == rank:
            mine[name] = tensor
    return mine


def write(root: Path, tensors: dict[str, torch.Tensor], rank: int) -> dict[str, Any]:
    """Write this rank's ``tensors`` under ``root/tensors/rank-N``; return their JSON index."""
    if not tensors:
        return {}
    import torch.distributed.checkpoint as dcp

    relative = f"{TENSORS}/rank-{rank}"
    directory = root / relative

    class IndexingWriter(dcp.FileSystemWriter):
        """Keeps DCP's metadata in memory instead of pickling it to ``.metadata``."""

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
            self.metadata = metadata

    writer = IndexingWriter(directory, sync_files=True)
    with _quiet_single_process():
        dcp.save(tensors, storage_writer=writer, no_dist=True)
    metadata = writer.metadata
    kept = set()
    index: dict[str, Any] = {}
    for name, meta in metadata.state_dict_metadata.items():
        chunks = []
        for i, chunk in enumerate(meta.chunks):
            info = _storage(metadata.storage_data, name, chunk.offsets, i)
            kept.add(info.relative_path)
            chunks.append(
                {
                    "offsets": list(chunk.offsets),
                    "sizes": list(chunk.sizes),
                    "file": f"{relative}/{info.relative_path}",
                    "offset": info.offset,
                    "length": info.length,
                }
            )
        index[name] = {
            "dtype": dtype_name(meta.properties.dtype),
            "shape": list(meta.size),
            "chunks": chunks,
        }
    for path in directory.iterdir():  # anything else DCP left (no pickled .metadata is written)
        if path.name not in kept:
            path.unlink()
    return index


def _storage(storage_data: Mapping[Any, Any], name: str, offsets: Any, index: int) -> Any:
    for key, info in storage_data.items():
        if key.fqn == name and tuple(key.offset) == tuple(offsets):
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"DCP wrote {name} with transforms torchplug cannot index.")
            return info
    raise CheckpointError(f"DCP wrote no storage record for chunk {index} of {name}.")


def merge(indexes: list[dict[str, Any]]) -> dict[str, Any]:
    """One index from every rank's: chunks of the same tensor together, each place once."""
    merged: dict[str, Any] = {}
    for index in indexes:
        for name, meta in index.items():
            into = merged.setdefault(name, {**meta, "chunks": []})
            places = {(tuple(c["offsets"]), tuple(c["sizes"])) for c in into["chunks"]}
            for chunk in meta["chunks"]:
                if (tuple(chunk["offsets"]), tuple(chunk["sizes"])) not in places:
                    into["chunks"].append(chunk)
    return merged


def reader(root: Path, index: Mapping[str, Any]) -> Any:
    """A DCP storage reader whose metadata comes from the manifest's index, never from a file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    state_dict_metadata = {}
    storage_data = {}
    for name, meta in index.items():
        chunks = []
        for i, chunk in enumerate(meta["chunks"]):
            confined(root, chunk["file"], f"tensor {name!r} refers to file")
            offsets = torch.Size(chunk["offsets"])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunk["sizes"])))
            storage_data[MetadataIndex(name, offsets, i)] = _StorageInfo(
                relative_path=chunk["file"], offset=chunk["offset"], length=chunk["length"]
            )
        state_dict_metadata[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=DTYPES[meta["dtype"]]),
            size=torch.Size(meta["shape"]),
            chunks=chunks,
        )

    class IndexedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return Metadata(
                state_dict_metadata=state_dict_metadata,
                storage_data=storage_data,
                storage_meta=StorageMeta(load_id=self.load_id),
            )

    return IndexedReader(root)


def read(root: Path, index: Mapping[str, Any], targets: dict[str, torch.Tensor]) -> None:
    """Fill ``targets`` in place from the store (resharding as needed); no collective."""
    if not targets:
        return
    import torch.distributed.checkpoint as dcp

    wanted = {name: index[name] for name in targets}
    with _quiet_single_process():
        dcp.load(targets, storage_reader=reader(root, wanted), no_dist=True)


def allocate(index: Mapping[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
    """Empty CPU tensors to read the named tensors into."""
    return {n: torch.empty(index[n]["shape"], dtype=DTYPES[index[n]["dtype"]]) for n in names}
