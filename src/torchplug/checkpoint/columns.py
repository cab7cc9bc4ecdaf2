"""The tensor index in columns: where every chunk of every tensor lies, as fixed-width arrays.

Why: a checkpoint of R ranks x T tensors has R x T chunks. As JSON (format 3's ``tensors``) that
is about 125 bytes a chunk, parsed whole into Python objects by every rank: 11.6 s per load at
1,024 ranks x 1,000 tensors before the first byte of data is read. Format 4 keeps the index in
``manifest.index``: a small header, then little-endian columns (one number per chunk per field,
names stored once), 28-40 bytes a chunk. Every rank reads it in one call, checks its size and
BLAKE3 digest against ``manifest.json`` (which the digest and the signature cover) before looking
at any of it, then validates all of it with tensor operations. Nothing in it is executable, and
nothing is unpickled.

The file is read into the process's own memory, not mapped: a mapping would let the file change
between the digest check and the use of the numbers (a single read costs ~10 ms at 1,024 ranks).
Python objects are made only for the tensors a rank asks for (`ColumnIndex`).

It is over 500 lines because the layout, its writer and its checks change together: one
module, so that a change to the layout cannot miss one of them.

Layout (every count and offset little-endian; each section starts at a multiple of 8)::

    b"TPLUGIX\\x01"                                 magic and layout version
    T, C, E, K, N, F, G, W  (8 x uint64)             tensors, chunks, shape cells, chunk cells,
                                                     name bytes, files, file name bytes, widths
                                                     (bit 0: length, bit 1: raw, bit 2: chunk
                                                     cells are int64; else int32)
    dtype  uint8[T]   ndim  uint8[T]                 an index into `DTYPE_ORDER`; dimensions
    count  int64[T]   name_len  int32[T]             chunks of each tensor (in tensor order)
    names  uint8[N]                                  UTF-8, concatenated
    file_name_len  int32[F]   file_names  uint8[G]   the data files, by path in the checkpoint
    shape  int64[E]                                  E = sum of ndim
    file   int32[C]   start int64[C]                 an index into the file names
    length int32|64[C]   raw int32|64[C]             raw: where the row-major bytes start, from
                                                     ``start`` (-1: not recorded)
    offsets, sizes  int32|64[K] each                 K = sum over chunks of their tensor's ndim
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from torchplug.checkpoint import files as fs
from torchplug.checkpoint.manifest import _COLUMN_LIMIT, _ITEMSIZE, DTYPES, INDEX, covered_once
from torchplug.contract.errors import CheckpointError

MAGIC = b"TPLUGIX\x01"
_HEADER = struct.Struct("<8s8Q")
#: The dtype codes of the file: positions in this tuple (new dtypes are only ever appended).
DTYPE_ORDER = tuple(DTYPES)
_CODES = {name: i for i, name in enumerate(DTYPE_ORDER)}
#: More dimensions than torch allows a tensor: refused before anything is allocated.
MAX_DIMS = 64
_INT32_MAX = 2**31 - 1
#: Chunks checked together in the layout checks: blocks that stay in cache (a whole 8,192-rank
#: index at once took 1.5x the time per chunk of a 1,024-rank one); a tensor is never split.
_BLOCK = 2**18


def _pad(n: int) -> int:
    return -n % 8


def _sections(
    t: int, c: int, e: int, k: int, n: int, f: int, g: int, widths: int
) -> list[tuple[str, str, int]]:
    """(name, torch-style dtype letter, count) of every section, in file order."""
    wide = {True: "q", False: "i"}
    return [
        ("dtype", "B", t),
        ("ndim", "B", t),
        ("count", "q", t),
        ("name_len", "i", t),
        ("names", "B", n),
        ("file_name_len", "i", f),
        ("file_names", "B", g),
        ("shape", "q", e),
        ("file", "i", c),
        ("start", "q", c),
        ("length", wide[bool(widths & 1)], c),
        ("raw", wide[bool(widths & 2)], c),
        ("offsets", wide[bool(widths & 4)], k),
        ("sizes", wide[bool(widths & 4)], k),
    ]


_TORCH = {"B": torch.uint8, "i": torch.int32, "q": torch.int64}
_SIZE = {"B": 1, "i": 4, "q": 8}


def encode(index: Mapping[str, Any]) -> bytes:
    """The index (format 3's ``tensors``: name -> dtype, shape, chunks) as column bytes."""
    position: dict[str, int] = {}
    dtype: list[int] = []
    ndim: list[int] = []
    count: list[int] = []
    name_len: list[int] = []
    shape: list[int] = []
    names = bytearray()
    file: list[int] = []
    start: list[int] = []
    length: list[int] = []
    raw: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    for name, meta in index.items():
        encoded = name.encode("utf-8")
        names += encoded
        name_len.append(len(encoded))
        dtype.append(_CODES[meta["dtype"]])
        ndim.append(len(meta["shape"]))
        shape += meta["shape"]
        count.append(len(meta["chunks"]))
        for chunk in meta["chunks"]:
            file.append(position.setdefault(chunk["file"], len(position)))
            start.append(chunk["offset"])
            length.append(chunk["length"])
            if "raw" in chunk:
                if not chunk["offset"] <= chunk["raw"]:  # -1 and below mean "not recorded"
                    raise ValueError(f"{name}: a chunk's raw position precedes its bytes")
                raw.append(chunk["raw"] - chunk["offset"])
            else:
                raw.append(-1)
            offsets += chunk["offsets"]
            sizes += chunk["sizes"]
    return pack(
        dtype=dtype, ndim=ndim, count=count, name_len=name_len, names=names, shape=shape,
        file=file, start=start, length=length, raw=raw, offsets=offsets, sizes=sizes,
        file_name_len=[len(n.encode("utf-8")) for n in position],
        file_names="".join(position).encode("utf-8"),
    )  # fmt: skip


def pack(**values: Any) -> bytes:
    """The file's bytes from its columns (each a list of ints or an int64 tensor; ``names`` the
    UTF-8 bytes), each at the narrowest width the layout allows for its values."""

    def biggest(name: str) -> int:
        column = values[name]
        if isinstance(column, torch.Tensor):
            return int(column.max()) if column.numel() else 0
        return max(column, default=0)

    widths = (
        (biggest("length") > _INT32_MAX)
        | (biggest("raw") > _INT32_MAX) << 1
        | (max(biggest("offsets"), biggest("sizes")) > _INT32_MAX) << 2
    )
    counts = [
        len(values[k])
        for k in ("count", "file", "shape", "offsets", "names", "file_name_len", "file_names")
    ]
    out = bytearray(_HEADER.pack(MAGIC, *counts, widths))
    for section, letter, n in _sections(*counts, widths):
        column = values[section]
        if isinstance(column, (bytes, bytearray)):
            out += column
        elif isinstance(column, torch.Tensor):
            out += column.numpy().astype(f"<{letter}", copy=False).tobytes()
        else:  # struct refuses what is not an integer or does not fit (numpy would round)
            out += struct.pack(f"<{n}{letter}", *column)
        out += bytes(_pad(len(out)))
    return bytes(out)


def write(directory: Path, index: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``manifest.index`` (fsynced); return what manifest.json records of it."""
    data = encode(index)
    name = fs.preferred_digest()
    digest = fs.hasher(name)
    digest.update(data)
    path = directory / INDEX
    with path.open("wb") as handle:
        handle.write(data)
    fs.fsync(path)
    return {"file": INDEX, "size": len(data), name: digest.hexdigest()}


class _Bad(Exception):
    pass


def read(root: Path, recorded: Mapping[str, Any], file_sizes: Mapping[str, int]) -> ColumnIndex:
    """The validated index of the checkpoint at ``root``. ``recorded`` is manifest.json's
    ``index`` entry (already validated and covered by its digest and signature): the file's size
    and digest are checked before any of its bytes is interpreted."""
    where = root / INDEX
    size = recorded["size"]
    try:
        with fs.confined(root, INDEX, "the tensor index").open("rb") as handle:
            # the size first: a forged size in manifest.json allocates nothing
            got = os.fstat(handle.fileno()).st_size
            data = bytearray(size) if got == size else None
            if data is not None:
                got = handle.readinto(data)
    except OSError as exc:
        raise CheckpointError(f"Cannot read {where}: {fs.describe_os_error(exc)}.") from None
    if data is None or got != size:
        raise CheckpointError(
            f"Checkpoint index {where} has {got} bytes, but manifest.json records {size}: it was "
            f"truncated or altered after saving. Load an earlier checkpoint."
        )
    name, expected = fs.expected_digest(recorded)
    digest = fs.hasher(name)
    digest.update(data)
    if digest.hexdigest() != expected:
        raise CheckpointError(
            f"Checkpoint index {where} fails its {name} check (recorded in manifest.json): it was "
            f"altered or corrupted after saving. Load an earlier checkpoint."
        )
    try:
        return ColumnIndex(data, file_sizes)
    except _Bad as exc:  # only a forged file gets here: its digest matched
        raise CheckpointError(
            f"Checkpoint index {where} is invalid: {exc}. The checkpoint was not written by "
            f"torchplug; load an earlier checkpoint."
        ) from None


def _strings(lengths: torch.Tensor, data: bytes, what: str) -> list[str]:
    """UTF-8 strings stored as their lengths and their bytes, concatenated."""
    lengths = lengths.to(torch.int64)
    _expect(bool((lengths >= 0).all()), f"a {what} length is negative")
    _expect(int(lengths.sum()) == len(data), f"its {what} lengths add up to {len(data)} bytes")
    out = []
    at = 0
    for length in lengths.tolist():
        try:
            out.append(data[at : at + length].decode("utf-8"))
        except UnicodeDecodeError:
            raise _Bad(f"{what} {len(out)} is not UTF-8") from None
        at += length
    return out


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise _Bad(what)


class ColumnIndex(Mapping[str, dict[str, Any]]):
    """The tensor index read from ``manifest.index``, validated whole on construction (every
    check format 3's JSON index gets, done with tensor operations); a tensor's entry (``dtype``,
    ``shape``, ``chunks`` as format 3 spells them) is made only when it is asked for."""

    def __init__(self, data: bytearray, file_sizes: Mapping[str, int]) -> None:
        _expect(len(data) >= _HEADER.size, "it is shorter than its header")
        magic, t, c, e, k, n, f, g, widths = _HEADER.unpack_from(data)
        _expect(magic == MAGIC, f"it does not start with {MAGIC!r}")
        _expect(widths < 8, "its widths field must be below 8")
        # The counts must add up to the file's own size before anything is allocated: a forged
        # count cannot make a load reserve more memory than the (hashed) file holds.
        sections = _sections(t, c, e, k, n, f, g, widths)
        at = _HEADER.size
        self._columns: dict[str, torch.Tensor] = {}
        text: dict[str, bytes] = {}  # the names' bytes (no numpy: torch's bridge may be absent)
        for section, letter, count in sections:
            end = at + count * _SIZE[letter]
            _expect(end <= len(data), f"its {section} section runs past the end of the file")
            if section in ("names", "file_names"):
                text[section] = bytes(data[at:end])
            self._columns[section] = (
                torch.frombuffer(data, dtype=_TORCH[letter], count=count, offset=at)
                if count
                else torch.empty(0, dtype=_TORCH[letter])
            )
            at = end + _pad(end)
        _expect(at == len(data), f"it holds {len(data) - at} bytes after its last section")
        self._data = data  # the columns are views of it
        self._names = _strings(self._columns["name_len"], text["names"], "tensor name")
        _expect(len(set(self._names)) == t, "a tensor name appears twice")
        self._position = {name: i for i, name in enumerate(self._names)}
        self._files = _strings(self._columns["file_name_len"], text["file_names"], "file name")
        # a file manifest.json does not list has no size: -1 fails every chunk naming it
        self._validate(t, c, e, k, [file_sizes.get(name, -1) for name in self._files])
        self._made: dict[str, dict[str, Any]] = {}

    # -- validation ------------------------------------------------------------------------------

    def _validate(self, t: int, c: int, e: int, k: int, file_sizes: list[int]) -> None:
        col = self._columns
        dtype = col["dtype"].to(torch.int64)
        ndim = col["ndim"].to(torch.int64)
        count = col["count"]
        self._tensor_fault(dtype >= len(DTYPE_ORDER), "dtype", f"one of {', '.join(DTYPE_ORDER)}")
        self._tensor_fault(ndim > MAX_DIMS, "shape", f"at most {MAX_DIMS} dimensions")
        # each count at most the chunks there are before summing: forged counts cannot wrap
        self._tensor_fault((count < 0) | (count > c), "chunks", f"a list of at most {c} chunks")
        _expect(int(count.sum()) == c, f"its tensors' chunk counts add up to {c} chunks")
        _expect(int(ndim.sum()) == e, f"its tensors' dimensions add up to {e} shape entries")
        _expect(int((count * ndim).sum()) == k, f"its chunks' dimensions add up to {k} entries")
        shape = col["shape"]
        shape_owner = torch.repeat_interleave(torch.arange(t), ndim)
        negative = torch.zeros(t, dtype=torch.bool).index_fill_(0, shape_owner[shape < 0], True)
        self._tensor_fault(negative, "shape", "a list of integers >= 0")
        itemsize = torch.tensor([_ITEMSIZE[name] for name in DTYPE_ORDER])[dtype]
        # Each tensor's bytes below 2**62 (then no sum or product below overflows): checked in
        # floating point first, where a forged shape cannot overflow.
        logs = torch.zeros(t, dtype=torch.float64).index_add_(
            0, shape_owner, torch.log2(shape.double().clamp(min=1))
        )
        has_zero = torch.zeros(t, dtype=torch.int64).index_add_(0, shape_owner, (shape == 0).long())
        self._tensor_fault(
            (logs + torch.log2(itemsize.double()) >= 61.5) & (has_zero == 0),
            "shape",
            "a shape whose bytes a file can hold (below 2**61)",
        )
        tensor_cell = torch.cumsum(ndim, 0) - ndim  # each tensor's first shape cell
        numel = torch.ones(t, dtype=torch.int64)
        for d in range(int(ndim.max()) if t else 0):  # product over each tensor's dimensions
            has = ndim > d
            numel[has] *= shape[tensor_cell[has] + d]
        self._tensor_fault(numel * itemsize >= _COLUMN_LIMIT, "shape", "a shape below 2**62 bytes")
        self._chunk_end = torch.cumsum(count, 0)
        chunk_start = self._chunk_end - count
        cells = count * ndim
        first_cell = torch.cumsum(cells, 0) - cells  # each tensor's first chunk's first cell
        # Per chunk, a block of tensors of one dimensionality at a time, the narrow columns
        # widened only there: no temporary the size of a column (at 8,192 ranks those cost more
        # per chunk than the checks, in page faults and cache misses).
        sizes_of = torch.tensor(file_sizes, dtype=torch.int64)
        for d in torch.unique(ndim).tolist():
            of_d = torch.nonzero(ndim == d).flatten()
            first = held = 0
            for i, n in enumerate(count[of_d].tolist()):
                held += n
                if held >= _BLOCK or i == len(of_d) - 1:
                    self._chunks_fit(d, of_d[first : i + 1], count, shape, tensor_cell,
                                     chunk_start, first_cell, numel, itemsize,
                                     sizes_of)  # fmt: skip
                    first, held = i + 1, 0
        self._shape, self._dtype, self._count, self._ndim = shape, dtype, count, ndim
        self._tensor_cell, self._first_cell = tensor_cell, first_cell
        self._chunk_start = chunk_start

    def _chunks_fit(
        self,
        d: int,
        tensors: torch.Tensor,
        count: torch.Tensor,
        shape: torch.Tensor,
        tensor_cell: torch.Tensor,
        chunk_start: torch.Tensor,
        first_cell: torch.Tensor,
        numel: torch.Tensor,
        itemsize: torch.Tensor,
        sizes_of: torch.Tensor,
    ) -> None:
        """The chunks of some ``d``-dimensional tensors: inside their tensor, each tensor covered
        exactly once (`manifest.covered_once`), in a listed file, with a byte range inside it
        large enough for their elements, a raw position inside the range. Where a save wrote
        them (tensors of one dimensionality together) the rows are one slice, not a gather."""
        col = self._columns
        counts = count[tensors]
        n = int(counts.sum())
        first = int(chunk_start[tensors[0]])
        local = torch.repeat_interleave(torch.arange(len(tensors)), counts)
        rows: torch.Tensor | slice
        if int(chunk_start[tensors[-1]] + counts[-1]) - first == n:  # one run of rows
            rows = slice(first, first + n)
            cell = int(first_cell[tensors[0]])
            o = col["offsets"][cell : cell + n * d].view(n, d).to(torch.int64)
            s = col["sizes"][cell : cell + n * d].view(n, d).to(torch.int64)
        else:
            these = torch.zeros(len(count), dtype=torch.bool).index_fill_(0, tensors, True)
            rows = torch.nonzero(torch.repeat_interleave(these, count)).flatten()
            within = torch.arange(n) - (torch.cumsum(counts, 0) - counts)[local]
            at = (first_cell[tensors][local] + within * d).unsqueeze(1) + torch.arange(d)
            o, s = col["offsets"][at].to(torch.int64), col["sizes"][at].to(torch.int64)
        shapes = shape[tensor_cell[tensors].unsqueeze(1) + torch.arange(d)]
        bound = shapes[local]
        outside = ((o < 0) | (s < 0) | (o > bound - s)).any(dim=1)
        self._chunk_fault(outside, "inside the tensor's shape", rows=rows)
        nbytes = s.prod(dim=1) * itemsize[tensors][local]  # sizes <= shape: no overflow
        if d == 0:  # a scalar: exactly one chunk
            bad = torch.zeros(len(count), dtype=torch.bool)
            bad[tensors] = counts != 1
            self._tensor_fault(bad, "chunks", "one chunk (the tensor is a scalar)")
        else:
            self._covered(tensors, o, s, local, bound, numel, shapes, counts)
        file = col["file"][rows]
        start = col["start"][rows]
        length = col["length"][rows].to(torch.int64)
        raw = col["raw"][rows].to(torch.int64)
        unknown = (file < 0) | (file >= len(sizes_of))
        unknown[~unknown] = sizes_of[file[~unknown]] < 0  # named, but not listed in 'files'
        self._chunk_fault(unknown, "a file listed in 'files'", ".file", rows)
        room = sizes_of[file]
        self._chunk_fault(
            (start < 0) | (length < 0) | (start > room - length), "a byte range inside its file",
            rows=rows,
        )  # fmt: skip
        self._chunk_fault(nbytes > length, "a byte range large enough for its elements", rows=rows)
        self._chunk_fault(
            (raw != -1) & ((raw < 0) | (raw > length - nbytes)),
            "a byte position inside the chunk's byte range, with room for its elements",
            ".raw",
            rows,
        )

    def _covered(
        self,
        tensors: torch.Tensor,
        o: torch.Tensor,
        s: torch.Tensor,
        local: torch.Tensor,
        bound: torch.Tensor,
        numel: torch.Tensor,
        shapes: torch.Tensor,
        counts: torch.Tensor,
    ) -> None:
        """Each of ``tensors`` covered exactly once by its chunks; else the first that is not."""
        try:
            ok = covered_once(o, s, local, bound, numel[tensors], shapes.tolist(), counts.tolist())
        except Exception as exc:  # manifest's irregular-layout refusal
            raise _Bad(str(exc)) from None
        if ok:
            return
        for i, tensor in enumerate(tensors.tolist()):  # which one, for the message
            mine = local == i
            one = torch.zeros(int(mine.sum()), dtype=torch.int64)
            if not covered_once(
                o[mine], s[mine], one, bound[mine], numel[tensor].reshape(1),
                [shapes[i].tolist()], [len(one)],
            ):  # fmt: skip
                raise _Bad(
                    f"tensors[{self._names[tensor]!r}].chunks must be pieces that cover the "
                    f"tensor exactly once"
                )
        raise _Bad("the chunks of a tensor must cover it exactly once")

    def _tensor_fault(self, bad: torch.Tensor, field: str, what: str) -> None:
        """Raise naming the first tensor ``bad`` marks (a mask over the tensors)."""
        if bool(bad.any()):
            t = int(torch.nonzero(bad)[0])
            raise _Bad(f"tensors[{self._names[t]!r}].{field} must be {what}")

    def _chunk_fault(
        self,
        bad: torch.Tensor,
        what: str,
        field: str = "",
        rows: slice | torch.Tensor = slice(0, 0),
    ) -> None:
        """Raise naming the first chunk ``bad`` marks (a mask over ``rows``: a slice of the
        chunks, or their ascending numbers), as format 3's ``tensors[name].chunks[i]``."""
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            row = rows.start + i if isinstance(rows, slice) else int(rows[i])
            t = int(torch.searchsorted(self._chunk_end, row, right=True))
            i = row - int(self._chunk_end[t] - self._columns["count"][t])
            raise _Bad(f"tensors[{self._names[t]!r}].chunks[{i}]{field} must be {what}")

    # -- the mapping -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._position

    def __getitem__(self, name: str) -> dict[str, Any]:
        made = self._made.get(name)
        if made is None:
            made = self._made[name] = self._entry(self._position[name])
        return made

    def head(self, name: str) -> dict[str, Any]:
        """A tensor's dtype and shape, without its chunks (what allocating a target needs)."""
        return self._head(self._position[name])

    def _head(self, t: int) -> dict[str, Any]:
        first, d = int(self._tensor_cell[t]), int(self._ndim[t])
        return {
            "dtype": DTYPE_ORDER[int(self._dtype[t])],
            "shape": self._shape[first : first + d].tolist(),
        }

    def over(self, name: str, boxes: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
        """A tensor's entry with only the chunks that overlap one of ``boxes`` (offsets, sizes:
        the pieces a rank holds), by the test DCP's resharding applies: at 1,024 ranks a rank of
        a sharded load makes objects for its own few chunks instead of every rank's."""
        t = self._position[name]
        d = int(self._ndim[t])
        n = int(self._count[t])
        if not boxes:
            return self._entry(t, torch.zeros(n, dtype=torch.bool))
        if d == 0:  # a scalar: its one chunk
            return self._entry(t)
        cells = int(self._first_cell[t])
        o = self._columns["offsets"][cells : cells + d * n].view(n, d).to(torch.int64)
        s = self._columns["sizes"][cells : cells + d * n].view(n, d).to(torch.int64)
        keep = torch.zeros(n, dtype=torch.bool)
        for offsets, sizes in boxes:
            bo, bs = torch.tensor(offsets).view(1, d), torch.tensor(sizes).view(1, d)
            keep |= ((o < bo + bs) & (bo < o + s)).all(dim=1)
        return self._entry(t, keep)

    def _entry(self, t: int, keep: torch.Tensor | None = None) -> dict[str, Any]:
        """Tensor ``t``'s entry as format 3 spells it; with ``keep``, only the chunks it marks
        (selected before any Python object is made: a rank's entry at 8,192 ranks costs its own
        chunks, not every rank's)."""
        d = int(self._ndim[t])
        lo = int(self._chunk_start[t])
        hi = lo + int(self._count[t])
        cells = int(self._first_cell[t])
        col = self._columns
        picked = [
            col["offsets"][cells : cells + d * (hi - lo)].view(hi - lo, d),
            col["sizes"][cells : cells + d * (hi - lo)].view(hi - lo, d),
            *(col[name][lo:hi] for name in ("file", "start", "length", "raw")),
        ]
        if keep is not None:
            rows = torch.nonzero(keep).flatten()
            picked = [column[rows] for column in picked]
        offsets, sizes, files, starts, lengths, raws = (column.tolist() for column in picked)
        chunks = []
        for i in range(len(files)):
            file, start, length, raw = files[i], starts[i], lengths[i], raws[i]
            chunk = {
                "offsets": offsets[i], "sizes": sizes[i], "file": self._files[file],
                "offset": start, "length": length,
            }  # fmt: skip
            if raw >= 0:
                chunk["raw"] = start + raw
            chunks.append(chunk)
        return {**self._head(t), "chunks": chunks}
