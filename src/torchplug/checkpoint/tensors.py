"""The tensor store: tensors written by torch.distributed.checkpoint (DCP), indexed by torchplug.

Each rank writes the tensors it owns with DCP into ``tensors/rank-N/`` on its own (no collective):
rank 0 writes plain (replicated) tensors, every rank writes its shards of sharded DTensors. DCP's
own ``.metadata`` file is a pickle, so it is never written: the chunk index (each tensor's global
shape and dtype, each chunk's offsets, file and byte range) goes into the manifest as JSON, where
it is covered by the digest and the signature. Loading rebuilds DCP's metadata from that index and
reads chunk data with ``torch.load(weights_only=True)`` only; every referenced file must be listed
in the manifest and stay inside the checkpoint directory.

Why this module is over 500 lines: it is the one adapter between torchplug's JSON chunk index and
DCP's storage layer (the writer with its hashing stream, the planner, the reader that rebuilds DCP's
metadata, raw-offset reads); those pieces share DCP's private layout of a chunk, which is kept in
one place so that a torch upgrade is checked against one module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import struct
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from torchplug.checkpoint.columns import ColumnIndex
from torchplug.checkpoint.files import confined, hasher, preferred_digest
from torchplug.checkpoint.manifest import DTYPES, TENSORS, dtype_name
from torchplug.contract.errors import CheckpointError
from torchplug.util import torchprivate


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns when it runs in one process; here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def plain_sizes(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Bytes of each plain (not DTensor) tensor: what `assign` balances over the ranks."""
    from torch.distributed.tensor import DTensor

    return {
        name: t.numel() * t.element_size()
        for name, t in tensors.items()
        if not isinstance(t, DTensor)
    }


def assign(
    sizes_by_rank: list[dict[str, int]], spread_by_rank: list[set[str]] | None = None
) -> dict[str, int]:
    """Which rank writes each plain tensor, the same answer on every rank (all see every rank's
    sizes).

    A tensor every holder declares replicated by construction (``spread_by_rank``: parameters
    and optimizer state under data parallel, which the same all-reduced gradients keep equal)
    goes to the least loaded rank that holds it, the largest first: writing all of them on rank
    0 made rank 0 write and hash the whole model while the others idled, so a save took about
    world-size times as long as plain DCP's, which balances replicated tensors the same way.
    Every other plain tensor (buffers such as BatchNorm's running statistics, which each rank
    updates from its own batches; a user's own tensors) is rank 0's copy, DDP's rule for
    buffers: taking some from one rank and some from another would save a model no rank had.
    Without ``spread_by_rank`` every plain tensor is balanced (the caller vouches for them).
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
        balanced = spread_by_rank is None or all(name in spread_by_rank[r] for r in holders[name])
        # not balanced: the lowest rank holding it (rank 0 for anything every rank has)
        rank = min(holders[name], key=lambda r: (load[r], r) if balanced else (r, 0))
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


@contextlib.contextmanager
def _without_record_crc32() -> Iterator[None]:
    """torch.save's per-record crc32 costs about as much as writing the bytes (~2x a save's time
    on a CPU host) and is never checked by ``torch.load``; every file torchplug writes is covered
    by a digest that a load checks before reading, so the crc adds nothing here."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:
        yield
        return
    previous = get()
    set_(False)
    try:
        yield
    finally:
        set_(previous)


#: Bytes written between two early writebacks (see `_HashingStream`).
_WRITEBACK_EVERY = 16 << 20


class _HashingStream(io.RawIOBase):
    """A write-only file that hashes what passes through it, so a file is hashed while it is
    written instead of being read back afterwards.

    Every ``_WRITEBACK_EVERY`` bytes it also starts the disk writing what is written so far
    (``fdatasync`` on a background thread, which waits on the disk without the GIL) while this
    thread goes on hashing and writing: the final fsync then has only the tail left, so the
    hash costs no extra time over a plain save that fsyncs. Durability is unchanged: the writer
    still fsyncs the whole file at the end (through `fileno`)."""

    def __init__(self, raw: Any, digest: Any) -> None:
        super().__init__()
        self._raw = raw
        self._digest = digest
        self._unsynced = 0
        self._syncing: threading.Thread | None = None
        self._sync_error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._digest.update(data)
        written = self._raw.write(data)
        self._unsynced += written
        if self._unsynced >= _WRITEBACK_EVERY and not (self._syncing and self._syncing.is_alive()):
            self._raise_sync_error()
            self._raw.flush()
            self._unsynced = 0
            self._syncing = threading.Thread(target=self._writeback, daemon=True)
            self._syncing.start()
        return written

    def _writeback(self) -> None:
        try:
            os.fdatasync(self._raw.fileno())
        except OSError as exc:  # raised in the writing thread (the next write or the end)
            self._sync_error = exc

    def _raise_sync_error(self) -> None:
        if self._sync_error is not None:
            raise self._sync_error

    def join(self) -> None:
        """Wait for the early writeback: none may outlive the file descriptor."""
        if self._syncing is not None:
            self._syncing.join()
            self._syncing = None

    def finish(self) -> None:
        """Wait for the early writeback and raise its error, if it had one."""
        self.join()
        self._raise_sync_error()

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:  # DCP fsyncs through it: what is buffered must reach the OS first
        self._raw.flush()
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()


def _hashing_file_system(digests: dict[str, dict[str, str]]) -> Any:
    """A DCP file system that records the digest of every file it writes in ``digests``."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    algorithm = preferred_digest()

    class HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            digest = hasher(algorithm)
            with Path(path).open(mode) as raw:
                stream = _HashingStream(raw, digest)
                try:
                    yield stream
                    raw.flush()
                    stream.finish()
                finally:
                    stream.join()
            digests[Path(path).name] = {algorithm: digest.hexdigest()}

    return HashingFileSystem()


def write(
    root: Path, tensors: dict[str, torch.Tensor], rank: int
) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """Write this rank's ``tensors`` under ``root/tensors/rank-N``; return their JSON index and
    the digest of each file written (by path from ``root``), taken while writing."""
    if not tensors:
        return {}, {}
    import torch.distributed.checkpoint as dcp

    relative = f"{TENSORS}/rank-{rank}"
    directory = root / relative

    class IndexingWriter(dcp.FileSystemWriter):
        """Keeps DCP's metadata in memory instead of pickling it to ``.metadata``."""

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
            self.metadata = metadata

    writer = IndexingWriter(directory, sync_files=True)
    digests: dict[str, dict[str, str]] = {}
    writer.fs = _hashing_file_system(digests)
    with _quiet_single_process(), _without_record_crc32():
        dcp.save(tensors, storage_writer=writer, planner=_contiguous_planner(), no_dist=True)
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
    _record_raw_offsets(root, index)
    for path in directory.iterdir():  # anything else DCP left (no pickled .metadata is written)
        if path.name not in kept:
            path.unlink()
    return index, {f"{relative}/{name}": digests[name] for name in kept if name in digests}


def _record_raw_offsets(root: Path, index: dict[str, Any]) -> None:
    """Add ``"raw"`` to each chunk of ``index`` whose bytes can be read raw (each file opened
    once)."""
    by_file: dict[str, list[tuple[dict[str, Any], int]]] = {}
    for meta in index.values():
        itemsize = DTYPES[meta["dtype"]].itemsize
        for chunk in meta["chunks"]:
            nbytes = torch.Size(chunk["sizes"]).numel() * itemsize
            by_file.setdefault(chunk["file"], []).append((chunk, nbytes))
    for name, chunks in by_file.items():
        with (root / name).open("rb") as handle:
            for chunk, nbytes in chunks:
                raw = _raw_offset(handle, chunk["offset"], chunk["length"], nbytes)
                if raw is not None:
                    chunk["raw"] = raw


def _contiguous_planner() -> Any:
    """DCP's save planner, handing DCP every tensor contiguous, so each chunk's bytes are stored
    in row-major order and a load can read them straight into place (see `_raw_offset`)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class ContiguousSavePlanner(DefaultSavePlanner):
        def transform_object(self, write_item: Any, object: Any) -> Any:
            data = super().transform_object(write_item, object)
            if isinstance(data, torch.Tensor) and not data.is_contiguous():
                data = data.contiguous()
            return data

    return ContiguousSavePlanner()


class _Slice(io.RawIOBase):
    """A read-only view of ``length`` bytes at ``offset`` of an open file (for ``zipfile``)."""

    def __init__(self, handle: Any, offset: int, length: int) -> None:
        super().__init__()
        self._handle, self._start, self._length, self._pos = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        self._handle.seek(self._start + self._pos)
        got = self._handle.readinto(view[:n])
        self._pos += got
        return got


def _raw_offset(handle: Any, offset: int, length: int, nbytes: int) -> int | None:
    """Where in the file open as ``handle`` the raw bytes of the tensor chunk stored at
    ``[offset, offset+length)`` begin, or None when they cannot be read raw.

    DCP stores each chunk as a ``torch.save`` zip. Its one storage record holds the chunk's
    bytes uncompressed; with a contiguous chunk (`_contiguous_planner`), a little-endian
    byte order and exactly ``nbytes`` bytes, those bytes are the chunk in row-major order, so a
    load can read them into the target tensor in one copy instead of unzipping into a temporary
    and copying again (what made loading slower than hashing the same bytes).
    """
    import zipfile

    if sys.byteorder != "little":
        return None
    try:
        with zipfile.ZipFile(_Slice(handle, offset, length)) as archive:
            names = archive.namelist()
            storages = [n for n in names if n.rsplit("/", 2)[-2:-1] == ["data"]]
            order = [n for n in names if n.endswith("/byteorder")]
            if len(storages) != 1 or len(order) != 1:
                return None
            info, order_info = archive.getinfo(storages[0]), archive.getinfo(order[0])
        if any(i.compress_type != zipfile.ZIP_STORED for i in (info, order_info)):
            return None
        # read raw: torchplug writes without the per-record crc32, which zipfile would check
        handle.seek(_member_start(handle, offset, order_info))
        if info.file_size != nbytes or handle.read(order_info.file_size) != b"little":
            return None
        start = _member_start(handle, offset, info)
    except (OSError, zipfile.BadZipFile, KeyError, ValueError, struct.error):
        return None
    return start if start + nbytes <= offset + length else None


def _member_start(handle: Any, offset: int, info: Any) -> int:
    """Where a zip member's data begins: after its local header, name and extra field."""
    handle.seek(offset + info.header_offset)
    header = handle.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError("not a zip local file header")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return offset + info.header_offset + 30 + name_length + extra_length


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


#: Where a load's bytes come from (`verify.VerifiedBytes` with a checkpoint key: the bytes
#: hashed, in memory; `verify.PinnedFiles` without: the files checked to be the ones hashed):
#: ``stream(name)`` for DCP's reads, ``filler(name)`` giving ``fill(start, tensor)`` for raw ones.
Source = Any


def _verified_file_system(root: Path, source: Source) -> Any:
    """A DCP file system whose streams come from ``source``, never opened here."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class VerifiedFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with source.stream(Path(path).relative_to(root).as_posix()) as stream:
                yield stream

    return VerifiedFileSystem()


def reader(root: Path, index: Mapping[str, Any], source: Source) -> Any:
    """A DCP storage reader whose metadata comes from the manifest's index, never from a file,
    and which reads only verified bytes in memory (``source``), never a file."""
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
        def __init__(self, path: Any) -> None:
            super().__init__(path)
            self.fs = _verified_file_system(Path(self.path), source)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return Metadata(
                state_dict_metadata=state_dict_metadata,
                storage_data=storage_data,
                storage_meta=StorageMeta(load_id=self.load_id),
            )

        def read_data(self, plan: Any, planner: Any) -> Any:
            from torch.distributed.checkpoint.planner import LoadItemType

            direct, rest = [], []
            for item in plan.items:
                raw = item.type == LoadItemType.TENSOR and item.storage_index in raw_chunks
                (direct if raw else rest).append(item)
            if direct:
                _read_raw(root, direct, raw_chunks, planner, source)
            return super().read_data(dataclasses.replace(plan, items=rest), planner)

    raw_chunks: dict[Any, tuple[str, int, torch.Size, torch.dtype]] = {}
    for name, meta in index.items():
        for i, chunk in enumerate(meta["chunks"]):
            if "raw" in chunk:
                key = MetadataIndex(name, torch.Size(chunk["offsets"]), i)
                raw_chunks[key] = (
                    chunk["file"],
                    chunk["raw"],
                    torch.Size(chunk["sizes"]),
                    DTYPES[meta["dtype"]],
                )
    return IndexedReader(root)


def _read_raw(
    root: Path,
    items: list[Any],
    raw_chunks: Mapping[Any, tuple[str, int, torch.Size, torch.dtype]],
    planner: Any,
    source: Source,
) -> None:
    """Read chunks whose bytes are stored raw: straight into the target when it is the whole
    chunk, contiguous and of the same dtype on the CPU; otherwise into a temporary, then the
    requested part is copied (resharding, casting, a device)."""
    by_file: dict[str, list[Any]] = {}
    for item in items:
        by_file.setdefault(raw_chunks[item.storage_index][0], []).append(item)
    for name, wanted in by_file.items():
        wanted.sort(key=lambda item: raw_chunks[item.storage_index][1])
        with source.filler(name) as fill:
            for item in wanted:
                _, start, sizes, dtype = raw_chunks[item.storage_index]
                target = planner.resolve_tensor(item).detach()
                in_place = (
                    not any(item.storage_offsets)
                    and tuple(item.lengths) == tuple(sizes)
                    and target.device.type == "cpu"
                    and target.dtype == dtype
                    and target.is_contiguous()
                    and target.shape == sizes
                    and not target.is_conj()
                    and not target.is_neg()
                )
                into = target if in_place else torch.empty(sizes, dtype=dtype)
                fill(start, into)
                if not in_place:
                    part = torchprivate.narrow_by_index(into, item.storage_offsets, item.lengths)
                    if part.shape != target.shape:
                        raise CheckpointError(
                            f"Checkpoint {root}: chunk of {item.storage_index.fqn} has shape "
                            f"{tuple(part.shape)} where {tuple(target.shape)} is expected."
                        )
                    target.copy_(part)
                planner.commit_tensor(item, target)


def read(
    root: Path,
    index: Mapping[str, Any],
    targets: dict[str, torch.Tensor],
    source: Source,
    wanted: Mapping[str, Any] | None = None,
) -> None:
    """Fill ``targets`` in place from the store (resharding as needed); no collective. Every
    byte comes from ``source``: the verified bytes in memory, never the files. ``wanted`` is
    `needed`'s plan when the caller made it already."""
    if not targets:
        return
    import torch.distributed.checkpoint as dcp

    if wanted is None:
        wanted = plan(index, targets)
    with _quiet_single_process():
        dcp.load(targets, storage_reader=reader(root, wanted, source), no_dist=True)


def plan(index: Mapping[str, Any], targets: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Each target's entry with only the chunks it overlaps (what `read` reads)."""
    return {name: _over(index, name, target) for name, target in targets.items()}


def needed(wanted: Mapping[str, Any]) -> set[str]:
    """The files a plan reads from."""
    return {chunk["file"] for entry in wanted.values() for chunk in entry["chunks"]}


def head(index: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """A tensor's ``dtype`` and ``shape`` (format 4's index makes no chunk objects for it)."""
    return index.head(name) if isinstance(index, ColumnIndex) else index[name]


def _over(index: Mapping[str, Any], name: str, target: Any) -> Mapping[str, Any]:
    """A tensor's entry with only the chunks that overlap what ``target`` holds: its local
    pieces where it has them (a DTensor's shard, as DCP's planner asks for them), else all of
    it. DCP reads the same chunks either way; each rank then plans over its own few chunks,
    not over every rank's (1,024 per tensor at 1,024 ranks)."""
    make = getattr(target, "__create_chunk_list__", None)
    boxes = (
        [(list(c.offsets), list(c.sizes)) for c in make()]
        if make is not None
        else [([0] * target.dim(), list(target.shape))]
    )
    if isinstance(index, ColumnIndex):
        return index.over(name, boxes)
    meta = index[name]

    def overlaps(chunk: Mapping[str, Any]) -> bool:  # DCP's test: no side entirely apart
        return any(
            all(
                a < b + m and b < a + n
                for a, n, b, m in zip(chunk["offsets"], chunk["sizes"], offsets, sizes, strict=True)
            )
            for offsets, sizes in boxes
        )

    return {**meta, "chunks": [c for c in meta["chunks"] if overlaps(c)]}


def allocate(index: Mapping[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
    """Empty CPU tensors to read the named tensors into."""
    heads = {n: head(index, n) for n in names}
    return {n: torch.empty(h["shape"], dtype=DTYPES[h["dtype"]]) for n, h in heads.items()}
