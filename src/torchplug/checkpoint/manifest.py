"""The manifest: what a checkpoint holds, validated before any of its values is used.

``manifest.json`` is the only description of a checkpoint that torchplug reads: the entries (their
structure in JSON, tensors by name), the index of every tensor chunk (which file, which bytes),
every file's size and digest (BLAKE3, or sha256 before format 3), and a sha256 digest of all of
that. An HMAC-SHA256 signature over the same bytes is added when a checkpoint key is configured
(`torchplug.checkpoint.verify`).

The schema is closed where a value is used: every key torchplug reads has a checked type and
range, dtypes come from an explicit list, and the structure tags (``__tensor__``, ``__tuple__``,
...) admit exactly one form each. Keys torchplug does not know are allowed (a newer writer may add
them) but never read.

Why this module is over 500 lines: the manifest's schema is closed, and every value torchplug reads
from an untrusted file is validated here before use (structure, chunk index, disjoint chunks
covering each tensor); the validation is one security boundary and is kept in one module to be
reviewed as one.
"""

from __future__ import annotations

import bisect
import datetime
import hashlib
import itertools
import json
import operator
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from torchplug.checkpoint.deferred import Deferred
from torchplug.contract.errors import CheckpointError

FORMAT = "torchplug-checkpoint"
#: Version 2: tensor chunks are indexed in the manifest (no pickled metadata is ever read).
#: Version 3: a file's digest may be BLAKE3 (``"blake3"`` beside ``"size"``) instead of sha256.
#: Version 4: the tensor index is in ``manifest.index`` as columns (`torchplug.checkpoint.columns`),
#: described by ``"index"``; ``"tensors"`` is no longer in manifest.json.
FORMAT_VERSION = 4
#: The last version with the tensor index in manifest.json (what `build` writes without a file).
JSON_INDEX_VERSION = 3
MIN_FORMAT_VERSION = 2
LAYOUT = "dcp"
MANIFEST = "manifest.json"
#: Format 4's tensor index, beside manifest.json (`torchplug.checkpoint.columns`).
INDEX = "manifest.index"
#: Where a loaded manifest keeps the reader of its verified bytes (never written to disk).
VERIFIED = "torchplug_verified_files"
TENSORS = "tensors"
#: What `torchplug convert` writes for a plain nn.Module, and what `load_pretrained` reads: one
#: safetensors file, or shards listed by an index (Hugging Face's layout).
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: The digests a file entry may record (at least one), the one new checkpoints write first.
FILE_DIGESTS = ("blake3", "sha256")

#: The kinds of entries the generic loader restores. Plugins may record their own kinds
#: (``[a-z0-9-]+``); the generic loader refuses to restore those into an object.
KINDS = ("module", "optimizer", "stateful", "tensor", "value")

#: dtypes a checkpoint may name; anything else is refused.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex128",
        "complex64",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}
_TAGS = ("__tensor__", "__dtype__", "__tuple__", "__dict__")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_KIND = re.compile(r"[a-z][a-z0-9-]{0,63}")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise CheckpointError(
            f"Cannot checkpoint a tensor of dtype {dtype}: supported dtypes are "
            f"{', '.join(DTYPES)}. Convert it (tensor.to(torch.float32)) before saving."
        ) from None


# -- structure: JSON skeleton + named tensors ------------------------------------------------------


def kind_of(obj: Any, key: str = "") -> str:
    """Classify a state entry, or raise an error saying what can be saved."""
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return "stateful"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    encode(obj, key, {})  # raises a CheckpointError that names what cannot be stored
    return "value"


def encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON skeleton of ``obj``; its tensors go into ``tensors`` under slash-separated paths.

    Tuples, dicts with non-string keys and tensors are tagged so that `decode` restores
    them exactly. Anything else that JSON cannot hold is refused: no pickles.
    """
    if type(obj).__name__ == "ShardedTensor":  # FSDP1's sharded state: neither full nor DTensor
        raise CheckpointError(
            f"State at {path} is a ShardedTensor (FSDP1's sharded state dict); a torchplug "
            f"checkpoint stores plain tensors or DTensors. Have the backend return DTensors "
            f"(FSDP1: ShardedStateDictConfig(_use_dtensor=True)) or full tensors "
            f"(get_model_state_dict(..., options=StateDictOptions(full_state_dict=True)))."
        )
    if isinstance(obj, (torch.Tensor, Deferred)):
        if path in tensors:
            raise CheckpointError(f"Two tensors in the state map to the name {path!r}.")
        dtype_name(obj.dtype)
        tensors[path] = obj
        return {"__tensor__": path}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return {"__dtype__": dtype_name(obj)}
    if isinstance(obj, (list, tuple)):
        items = [encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        pairs = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise CheckpointError(
                    f"State at {path or '/'} has a key of type {type(k).__name__}; checkpoint "
                    f"keys must be strings or numbers."
                )
            pairs.append([k, encode(v, f"{path}/{k}", tensors)])
        return {"__dict__": pairs}
    raise CheckpointError(
        f"Cannot save {type(obj).__name__} at {path or '/'}: expected an nn.Module, an "
        f"optimizer, an object with state_dict()/load_state_dict(), a tensor, or plain data "
        f"(numbers, strings, lists, dicts). Convert it to one of those, or give it a state_dict() "
        f"(a checkpoint stores no pickles)."
    )


def decode(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild what `encode` took apart (from a skeleton `validate` accepted)."""
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__dtype__" in skeleton:
            return DTYPES[skeleton["__dtype__"]]
        if "__tuple__" in skeleton:
            return tuple(decode(v, tensors) for v in skeleton["__tuple__"])
        if "__dict__" in skeleton:
            return {k: decode(v, tensors) for k, v in skeleton["__dict__"]}
        return {k: decode(v, tensors) for k, v in skeleton.items()}
    return skeleton


def tensor_paths(skeleton: Any) -> Iterator[str]:
    """Every tensor name a skeleton refers to."""
    if isinstance(skeleton, list):
        for v in skeleton:
            yield from tensor_paths(v)
    elif isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            yield skeleton["__tensor__"]
            return
        for v in skeleton.values():
            yield from tensor_paths(v)


# -- digest ----------------------------------------------------------------------------------------


def canonical(body: Mapping[str, Any]) -> bytes:
    """The bytes the digest and the signature cover: the body without them, in one spelling."""
    rest = {k: v for k, v in body.items() if k not in ("digest", "signature")}
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def build(
    header: Mapping[str, Any],
    entries: Mapping[str, Any],
    index: Mapping[str, Any],
    files: Mapping[str, Any],
    *,
    index_file: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A complete manifest body with its digest (the signature is added by the caller).

    With ``index_file`` (what `torchplug.checkpoint.columns.write` returned) the body is format
    4 and ``index`` is not in it; without, ``index`` is written as JSON, format 3 (what older
    torchplug reads, and what the tests of old checkpoints make)."""
    body = {
        **json.loads(json.dumps(dict(header), default=repr)),
        "format": FORMAT,
        "format_version": FORMAT_VERSION if index_file is not None else JSON_INDEX_VERSION,
        "layout": LAYOUT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "torch_version": torch.__version__,
        "entries": json.loads(json.dumps(dict(entries))),
        "files": dict(files),
    }
    if index_file is None:
        body["tensors"] = json.loads(json.dumps(dict(index)))
    else:
        body["index"] = dict(index_file)
    body["digest"] = hashlib.sha256(canonical(body)).hexdigest()
    return body


# -- reading and validation ------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen = dict(pairs)  # one call per JSON object: the common case stays at C speed
    if len(seen) != len(pairs):
        keys: set[str] = set()
        repeated = next(k for k, _ in pairs if k in keys or keys.add(k))  # type: ignore[func-returns-value]
        raise CheckpointError(f"manifest.json repeats the key {repeated!r}")
    return seen


def parse(raw: bytes, where: str) -> dict[str, Any]:
    """Parse and validate manifest bytes; every problem is a CheckpointError naming the key."""
    body = load_json(raw, where)
    check(body, where)
    return body


def load_json(raw: bytes, where: str) -> Any:
    """The manifest's JSON, its digest checked: all a signature check needs (linear in the
    bytes). `check` validates it afterwards."""
    try:
        body = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except CheckpointError as exc:
        raise CheckpointError(f"Checkpoint manifest {where} is damaged: {exc}.") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(
            f"Checkpoint manifest {where} is not valid JSON ({str(exc)[:200]}); the checkpoint is "
            f"damaged. Load an earlier checkpoint."
        ) from None
    recorded = body.get("digest") if isinstance(body, dict) else None
    if isinstance(recorded, str):  # corruption first: a flipped byte is not a newer format
        digest = hashlib.sha256(canonical(body)).hexdigest()
        if digest != recorded:
            raise CheckpointError(
                f"Checkpoint manifest {where} fails its digest check (sha256 {digest[:12]}..., "
                f"recorded {recorded[:12]}...): it was altered or corrupted after saving. "
                f"Load an earlier checkpoint."
            )
    return body


def check(
    body: Any, where: str, read_index: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None
) -> None:
    """Validate a manifest body (see `validate`), as a CheckpointError naming the key.
    ``read_index(body)`` reads and validates a format 4 index once the rest is known valid."""
    try:
        validate(body, where, read_index)
    except _Invalid as exc:
        raise CheckpointError(
            f"Checkpoint manifest {where} is invalid: {exc}. The checkpoint is damaged or was not "
            f"written by torchplug; load an earlier checkpoint."
        ) from None
    except RecursionError:
        raise CheckpointError(f"Checkpoint manifest {where} is nested too deeply.") from None


class _Invalid(Exception):
    pass


def _expect(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise _Invalid(f"{where} must be {what}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_ints(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, list) and all(_is_int(v) and v >= minimum for v in value)


def _is_file_record(info: Any) -> bool:
    """A file's record: its size and at least one digest (64 hex digits each)."""
    return (
        isinstance(info, dict)
        and _is_int(info.get("size"))
        and info["size"] >= 0
        and any(d in info for d in FILE_DIGESTS)
        and all(
            isinstance(info[d], str) and bool(_HEX64.fullmatch(info[d]))
            for d in FILE_DIGESTS
            if d in info
        )
    )


def validate(
    body: Any,
    where: str = MANIFEST,
    read_index: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None,
) -> None:
    """Check every key torchplug reads; raise ``_Invalid`` naming the first bad one. A format 4
    body gets its ``tensors`` from ``read_index(body)``, called once the files are validated
    (the index names its files by their place among them)."""
    _expect(isinstance(body, dict), "the manifest", "a JSON object")
    _expect(body.get("format") == FORMAT, "'format'", repr(FORMAT))
    version = body.get("format_version")
    if _is_int(version) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"Checkpoint manifest {where} has format version {version}; this torchplug reads "
            f"versions "
            f"{MIN_FORMAT_VERSION} to {FORMAT_VERSION}. Upgrade torchplug to load it."
        )
    _expect(
        _is_int(version) and MIN_FORMAT_VERSION <= version <= FORMAT_VERSION,
        "'format_version'",
        f"an integer from {MIN_FORMAT_VERSION} to {FORMAT_VERSION} (version 1 checkpoints held a "
        f"pickle and are not read; re-save them with the torchplug that wrote them)",
    )
    _expect(body.get("layout") == LAYOUT, "'layout'", repr(LAYOUT))
    _expect(
        isinstance(body.get("digest"), str) and bool(_HEX64.fullmatch(body["digest"])),
        "'digest'",
        "64 lowercase hex digits",
    )
    strategy = body.get("strategy")
    _expect(
        isinstance(strategy, dict)
        and isinstance(strategy.get("name"), str)
        and isinstance(strategy.get("options", {}), dict),
        "'strategy'",
        "an object with a string 'name' and an 'options' object",
    )
    _expect(
        _is_int(body.get("world_size")) and body["world_size"] >= 1,
        "'world_size'",
        "a positive integer",
    )
    _expect(body.get("step") is None or _is_int(body["step"]), "'step'", "an integer or null")
    _expect(isinstance(body.get("metadata", {}), dict), "'metadata'", "an object")
    signature = body.get("signature")
    if signature is not None:
        _expect(
            isinstance(signature, dict)
            and signature.get("alg") == "hmac-sha256"
            and isinstance(signature.get("value"), str)
            and bool(_HEX64.fullmatch(signature["value"])),
            "'signature'",
            "an object {alg: 'hmac-sha256', value: 64 hex digits}",
        )
    files = body.get("files")
    _expect(isinstance(files, dict), "'files'", "an object")
    for name, info in files.items():
        _expect(
            _is_file_record(info),
            f"files[{name!r}]",
            "an object {size: integer >= 0, blake3 or sha256: 64 hex digits}",
        )
    if version > JSON_INDEX_VERSION:
        _expect("tensors" not in body, "'tensors'", f"absent (format {version}: see {INDEX})")
        info = body.get("index")
        _expect(
            _is_file_record(info) and info.get("file") == INDEX,
            "'index'",
            f"an object {{file: {INDEX!r}, size: integer >= 0, blake3 or sha256: 64 hex digits}}",
        )
        _expect(read_index is not None, "the tensor index", f"read from {INDEX} (format {version})")
        body["tensors"] = tensors = read_index(body)  # type: ignore[misc]
    else:
        tensors = body.get("tensors")
        _expect(isinstance(tensors, dict), "'tensors'", "an object")
        sizes = {name: info["size"] for name, info in files.items()}
        checked = _validate_batch(tensors, sizes)
        for name, meta in tensors.items():
            if name not in checked:
                _validate_tensor(name, meta, files, sizes)
    entries = body.get("entries")
    _expect(isinstance(entries, dict), "'entries'", "an object")
    for key, entry in entries.items():
        where = f"entries[{key!r}]"
        _expect(isinstance(entry, dict) and "data" in entry, where, "an object with 'kind', 'data'")
        _expect(
            isinstance(entry.get("kind"), str) and bool(_KIND.fullmatch(entry["kind"])),
            f"{where}.kind",
            "a kind name such as 'module'",
        )
        _validate_skeleton(entry["data"], f"{where}.data", tensors)


def _explain_chunk(
    where: str, i: int, chunk: Any, shape: list[int], meta: dict, files: Mapping[str, Any]
) -> None:
    """Raise ``_Invalid`` naming what is wrong with a chunk the fast check refused."""
    cw = f"{where}.chunks[{i}]"
    _expect(isinstance(chunk, dict), cw, "an object")
    offsets, sizes = chunk.get("offsets"), chunk.get("sizes")
    _expect(
        _is_ints(offsets) and _is_ints(sizes) and len(offsets) == len(sizes) == len(shape),
        cw,
        f"offsets and sizes of {len(shape)} integers >= 0",
    )
    _expect(
        all(o + s <= d for o, s, d in zip(offsets, sizes, shape, strict=True)),
        cw,
        f"inside the tensor's shape {shape}",
    )
    _expect(
        isinstance(chunk.get("file"), str) and chunk["file"] in files,
        f"{cw}.file",
        "a file listed in 'files'",
    )
    _expect(
        _is_int(chunk.get("offset"))
        and chunk["offset"] >= 0
        and _is_int(chunk.get("length"))
        and chunk["length"] >= 0
        and chunk["offset"] + chunk["length"] <= files[chunk["file"]]["size"],
        cw,
        "a byte range inside its file",
    )
    n = 1
    for s in sizes:
        n *= s
    # The chunk's bytes must hold its elements: no forged shape makes a load allocate more
    # memory than the (hashed) files hold.
    _expect(
        n * _ITEMSIZE[meta["dtype"]] <= chunk["length"],
        cw,
        f"a byte range large enough for its {n} elements",
    )
    if "raw" in chunk:  # where the chunk's row-major bytes start (read without unzipping)
        _expect(
            _is_int(chunk["raw"])
            and chunk["offset"] <= chunk["raw"]
            and chunk["raw"] + n * _ITEMSIZE[meta["dtype"]] <= chunk["offset"] + chunk["length"],
            f"{cw}.raw",
            "a byte position inside the chunk's byte range, with room for its elements",
        )
    raise _Invalid(f"{where}.chunks[{i}] must be a valid chunk")  # not reached: one check fails


def _validate_tensor(
    name: str, meta: Any, files: Mapping[str, Any], sizes: Mapping[str, int] | None = None
) -> None:
    where = f"tensors[{name!r}]"
    _expect(isinstance(meta, dict), where, "an object")
    _expect(meta.get("dtype") in DTYPES, f"{where}.dtype", f"one of {', '.join(DTYPES)}")
    shape = meta.get("shape")
    _expect(_is_ints(shape), f"{where}.shape", "a list of integers >= 0")
    chunks = meta.get("chunks")
    _expect(isinstance(chunks, list), f"{where}.chunks", "a list")
    itemsize = _ITEMSIZE[meta["dtype"]]
    total = 1
    for d in shape:
        total *= d
    if sizes is None:
        sizes = {name: info["size"] for name, info in files.items()}
    fast = _columns(shape, total, chunks, itemsize, sizes)
    if fast is not None:  # every chunk well-formed: only the layout is left to check
        volume, starts, sizes = fast
        _expect(
            volume == total and _disjoint_columns(shape, starts, sizes),
            f"{where}.chunks",
            "pieces that cover the tensor exactly once",
        )
        return
    volume = 0
    boxes = []
    dims = len(shape)
    for i, chunk in enumerate(chunks):
        # One pass of plain comparisons per chunk (a manifest holds ranks x tensors of them);
        # the first failure is explained by the detailed check below.
        n = 1
        try:
            offsets, sizes = chunk["offsets"], chunk["sizes"]
            offset, length, info = chunk["offset"], chunk["length"], files[chunk["file"]]
            ok = (
                type(offsets) is list
                and type(sizes) is list
                and len(offsets) == dims == len(sizes)
                and type(offset) is int
                and type(length) is int
                and offset >= 0
                and length >= 0
                and offset + length <= info["size"]
                and type(chunk["file"]) is str
            )
            if ok:
                for o, size, d in zip(offsets, sizes, shape, strict=True):
                    if type(o) is not int or type(size) is not int or o < 0 or size < 0:
                        ok = False
                        break
                    if o + size > d:
                        ok = False
                        break
                    n *= size
            ok = ok and n * itemsize <= length
            if ok and "raw" in chunk:
                raw = chunk["raw"]
                ok = type(raw) is int and offset <= raw and raw + n * itemsize <= offset + length
        except (TypeError, KeyError):
            ok = False
        if not ok:
            _explain_chunk(where, i, chunk, shape, meta, files)
        volume += n
        boxes.append((offsets, sizes))
    _expect(
        volume == total and _disjoint(shape, boxes),
        f"{where}.chunks",
        "pieces that cover the tensor exactly once",
    )


_FIELDS = tuple(operator.itemgetter(k) for k in ("offsets", "sizes", "offset", "length", "file"))
_RAW = operator.itemgetter("raw")
#: Tensors whose byte size reaches this are checked chunk by chunk (no int64 column could hold
#: their sums); no real tensor is that large.
_COLUMN_LIMIT = 2**62


def _columns(
    shape: list[int], total: int, chunks: list[Any], itemsize: int, file_sizes: Mapping[str, int]
) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """Every check of `_validate_tensor`'s per-chunk loop, done column-wise: a manifest
    holds ranks x tensors chunks, and a Python loop over a million of them takes seconds. Each
    field of every chunk is gathered at C speed (``map(itemgetter)``), the numbers packed into
    one int64 array (which refuses anything but integers, and integers beyond int64), then
    checked as tensors. Returns the volume and the chunks' offsets and sizes as ``(n, dims)``
    tensors, or ``None`` if anything is off, so that the loop finds and explains the first bad
    chunk. (JSON's ``true``/``false`` pack as 1/0 here: the same numbers, so in range.)"""
    dims, count = len(shape), len(chunks)
    if not dims or not count or total * itemsize >= _COLUMN_LIMIT:
        return None
    try:
        offs, sizes, offset, length, names = (list(map(f, chunks)) for f in _FIELDS)
        room = struct.pack(f"{count}q", *map(file_sizes.__getitem__, names))
        if set(map(len, offs)) != {dims} or set(map(len, sizes)) != {dims}:
            return None
        try:
            raws: list[Any] = list(map(_RAW, chunks))
        except KeyError:
            if any(map(operator.contains, chunks, itertools.repeat("raw"))):
                return None  # some with a raw position, some without
            raws = []
        flat = itertools.chain.from_iterable
        numbers = (2 * dims + 2 + bool(raws)) * count
        # struct packs from an argument tuple at C speed (array.array from an iterator went
        # one element at a time, most of the time here); it refuses non-integers and overflow
        column = torch.frombuffer(
            bytearray(
                struct.pack(f"{numbers}q", *flat(offs), *flat(sizes), *offset, *length, *raws)
            ),
            dtype=torch.int64,
        )
    except (KeyError, TypeError, OverflowError, struct.error):
        return None
    cells = count * dims
    o = column[:cells].view(count, dims)
    s = column[cells : 2 * cells].view(count, dims)
    start = column[2 * cells : 2 * cells + count]
    span = column[2 * cells + count : 2 * cells + 2 * count]
    bound = torch.tensor(shape, dtype=torch.int64)
    room_column = torch.frombuffer(bytearray(room), dtype=torch.int64)
    raw = column[2 * cells + 2 * count :] if raws else None
    nbytes = _chunks_fit(column, o, s, start, span, room_column, raw, bound, itemsize)
    if nbytes is None:
        return None
    return int(nbytes.sum()) // itemsize, o, s


def _chunks_fit(
    column: torch.Tensor,
    o: torch.Tensor,
    s: torch.Tensor,
    start: torch.Tensor,
    span: torch.Tensor,
    room: torch.Tensor,
    raw: torch.Tensor | None,
    bound: torch.Tensor,
    itemsize: int | torch.Tensor,
) -> torch.Tensor | None:
    """Each chunk's byte count if every chunk (offsets ``o``, sizes ``s``, bytes ``start`` +
    ``span`` in a file of ``room`` bytes, row-major bytes at ``raw``) lies inside its tensor
    (``bound``) and its file with room for its elements; else ``None``. Every number >= 0 and
    each offset and size at most its dimension first (one min over ``column``, the packed
    numbers, no overflow: differences of non-negative int64s), then the sums, compared without
    overflow; sizes <= shape, so a product is at most the tensor's bytes."""
    if int(torch.cat([column, (bound - s).flatten(), (bound - o).flatten()]).min()) < 0:
        return None
    nbytes = s.prod(dim=1) * itemsize
    ok = (o <= bound - s).all(dim=1)
    ok &= start <= room - span
    ok &= nbytes <= span
    if raw is not None:
        ok &= start <= raw
        ok &= raw - start <= span - nbytes
    return nbytes if bool(ok.all()) else None


def _validate_batch(tensors: Mapping[str, Any], file_sizes: Mapping[str, int]) -> set[str]:
    """The names of the tensors that pass every check of `_validate_tensor`, checked for
    all tensors of one dimensionality at once: a manifest of R ranks x T tensors holds R x T
    chunks, and per-tensor tensor operations cost T times their overhead (most of the time at
    1024 ranks). Only a clean pass accepts: a group with anything off (a bad chunk, a volume
    that differs, an overlap) is left to `_validate_tensor`, tensor by tensor, which finds
    and words the problem; a layout split other than by its first dimension is checked per
    tensor by `_disjoint_columns`."""
    groups: dict[int, list[tuple[str, list[int], int, list[Any]]]] = {}
    for name, meta in tensors.items():
        try:
            dtype, shape, chunks = meta["dtype"], meta["shape"], meta["chunks"]
            itemsize = _ITEMSIZE[dtype]
        except (TypeError, KeyError):
            continue
        if type(shape) is not list or type(chunks) is not list or not shape or not chunks:
            continue
        if not all(type(d) is int and d >= 0 for d in shape):
            continue
        total = 1
        for d in shape:
            total *= d
        if total * itemsize >= _COLUMN_LIMIT:
            continue
        groups.setdefault(len(shape), []).append((name, shape, itemsize, chunks))
    accepted: set[str] = set()
    for dims, group in groups.items():
        accepted.update(_validate_group(dims, group, file_sizes))
    return accepted


def _validate_group(
    dims: int, group: list[tuple[str, list[int], int, list[Any]]], file_sizes: Mapping[str, int]
) -> list[str]:
    """`_validate_batch` for the tensors of ``dims`` dimensions; all of them or none.
    Each tensor's fields are gathered as in `_columns` (small argument tuples, at C
    speed) into one int64 buffer, field by field, and checked together."""
    count = sum(len(g[3]) for g in group)
    with_raw = "raw" in group[0][3][0] if isinstance(group[0][3][0], dict) else False
    fields = 2 * dims + 3 + with_raw  # offsets, sizes, start, span, file size[, raw]
    buffer = bytearray(8 * fields * count)
    cells = count * dims
    at = 0
    flat = itertools.chain.from_iterable
    try:
        for _, _, _, chunks in group:
            n = len(chunks)
            offs, sizes, offset, length, names = (list(map(f, chunks)) for f in _FIELDS)
            if set(map(len, offs)) != {dims} or set(map(len, sizes)) != {dims}:
                return []
            struct.pack_into(f"{n * dims}q", buffer, 8 * at * dims, *flat(offs))
            struct.pack_into(f"{n * dims}q", buffer, 8 * (cells + at * dims), *flat(sizes))
            base = 2 * cells + at
            struct.pack_into(f"{n}q", buffer, 8 * base, *offset)
            struct.pack_into(f"{n}q", buffer, 8 * (base + count), *length)
            struct.pack_into(
                f"{n}q", buffer, 8 * (base + 2 * count), *map(file_sizes.__getitem__, names)
            )
            if with_raw:
                struct.pack_into(f"{n}q", buffer, 8 * (base + 3 * count), *map(_RAW, chunks))
            elif any(map(operator.contains, chunks, itertools.repeat("raw"))):
                return []  # some with a raw position, some without
            at += n
    except (KeyError, TypeError, OverflowError, struct.error):
        return []
    column = torch.frombuffer(buffer, dtype=torch.int64)
    cells = count * dims
    o = column[:cells].view(count, dims)
    s = column[cells : 2 * cells].view(count, dims)
    start = column[2 * cells : 2 * cells + count]
    span = column[2 * cells + count : 2 * cells + 2 * count]
    room = column[2 * cells + 2 * count : 2 * cells + 3 * count]
    owner = torch.repeat_interleave(
        torch.arange(len(group)), torch.tensor([len(g[3]) for g in group])
    )
    shapes = torch.tensor([g[1] for g in group], dtype=torch.int64)
    bound = shapes[owner]
    itemsize = torch.tensor([g[2] for g in group], dtype=torch.int64)[owner]
    raw = column[2 * cells + 3 * count :] if with_raw else None
    nbytes = _chunks_fit(column, o, s, start, span, room, raw, bound, itemsize)
    if nbytes is None:
        return []
    shape_lists = [g[1] for g in group]
    counts = [len(g[3]) for g in group]
    if not covered_once(o, s, owner, bound, shapes.prod(dim=1), shape_lists, counts):
        return []
    return [g[0] for g in group]


def covered_once(
    o: torch.Tensor,
    s: torch.Tensor,
    owner: torch.Tensor,
    bound: torch.Tensor,
    numel: torch.Tensor,
    shapes: list[list[int]],
    counts: list[int],
) -> bool:
    """Whether the chunks of every tensor cover it exactly once: their volumes add up to its
    ``numel`` and no two overlap. The chunks (offsets ``o``, sizes ``s``, already known to lie
    inside their tensor of shape ``bound``) are rows grouped by tensor: ``owner`` numbers each
    row's tensor, ``counts`` says how many rows each has. Pieces split along the first dimension
    only (fsdp's rows), empty ones aside, are checked for all tensors at once, sorted by (tensor,
    first row) in two stable sorts: each must end where the next starts; any other split goes to
    `_disjoint_columns`, tensor by tensor."""
    volume = torch.zeros(len(counts), dtype=torch.int64).index_add_(0, owner, s.prod(dim=1))
    if not torch.equal(volume, numel):
        return False
    full = (s > 0).all(dim=1)
    rows = full & (o[:, 1:] == 0).all(dim=1) & (s[:, 1:] == bound[:, 1:]).all(dim=1)
    other = torch.zeros(len(counts), dtype=torch.int64).index_add_(0, owner, (full & ~rows).long())
    keep = rows & (other[owner] == 0)
    first, last, who = o[keep, 0], o[keep, 0] + s[keep, 0], owner[keep]
    if not bool(((who[:-1] < who[1:]) | ((who[:-1] == who[1:]) & (first[:-1] <= first[1:]))).all()):
        order = torch.sort(first, stable=True).indices  # a save writes them in order already
        order = order[torch.sort(who[order], stable=True).indices]
        first, last, who = first[order], last[order], who[order]
    if not bool(((last[:-1] <= first[1:]) | (who[:-1] != who[1:])).all()):
        return False
    at = 0
    for shape, count, split in zip(shapes, counts, other.tolist(), strict=True):
        lo, at = at, at + count  # each tensor's chunks lie together
        if split and not _disjoint_columns(shape, o[lo:at], s[lo:at]):
            return False
    return True


def _disjoint_columns(shape: list[int], starts: torch.Tensor, sizes: torch.Tensor) -> bool:
    """`_disjoint` for chunks held as ``(n, dims)`` tensors: the grid check in tensor
    operations (each piece's cell in the grid every piece's edges cut, cells compared by their
    linear index); any other layout goes to `_disjoint`."""
    keep = (sizes > 0).all(dim=1)
    if not bool(keep.all()):
        starts, sizes = starts[keep], sizes[keep]
    count = len(starts)
    if count < 2:
        return True
    ends = starts + sizes
    if len(shape) == 1 or (
        bool((starts[:, 1:] == 0).all())
        and bool((sizes[:, 1:] == torch.tensor(shape[1:], dtype=torch.int64)).all())
    ):  # split along the first dimension only (fsdp's rows): each ends where the next starts
        first, order = torch.sort(starts[:, 0])
        return bool((ends[order, 0][:-1] <= first[1:]).all())
    cells = 1
    linear = torch.zeros(count, dtype=torch.int64)
    for k, n in enumerate(shape):
        edges = torch.cat([torch.tensor([0, n], dtype=torch.int64), starts[:, k], ends[:, k]])
        cut = torch.unique(edges)  # sorted
        cells *= len(cut) - 1
        if cells > count:
            break
        first = torch.searchsorted(cut, starts[:, k].contiguous())
        if not torch.equal(torch.searchsorted(cut, ends[:, k].contiguous()), first + 1):
            break  # a piece spans several cells
        linear = linear * (len(cut) - 1) + first
    else:
        if cells == count:
            return len(torch.unique(linear)) == count
    return _disjoint(shape, list(zip(starts.tolist(), sizes.tolist(), strict=True)))


#: Irregular (non-grid) layouts of 3 or more dimensions are compared pairwise; torchplug and
#: DCP write grids (every DTensor placement is one), so more pieces than this is not a layout
#: any save produced.
IRREGULAR_LIMIT = 2048

Box = tuple[list[int], list[int]]


def _disjoint(shape: list[int], boxes: list[Box]) -> bool:
    """No element is in two of ``boxes`` (offsets, sizes). With the volume check beside it: the
    boxes cover the tensor exactly once. O(n log n) in the number of pieces for every layout a
    save writes (a grid: each piece one cell of the grid its own edges cut), and for any layout
    of one or two dimensions (a sweep); pairwise only for small irregular ones."""
    boxes = [(o, s) for o, s in boxes if all(x > 0 for x in s)]  # empty pieces hold nothing
    if len(boxes) < 2:
        return True
    cells = _grid_cells(shape, boxes)
    if cells is not None:
        return len(set(cells)) == len(cells)
    if len(shape) == 1:
        ordered = sorted((o[0], o[0] + s[0]) for o, s in boxes)
        return all(end <= start for (_, end), (start, _) in itertools.pairwise(ordered))
    if len(shape) == 2:
        return _sweep(boxes)
    if len(boxes) > IRREGULAR_LIMIT:
        raise _Invalid(
            f"an irregular layout of {len(boxes)} pieces (not one a save writes: at most "
            f"{IRREGULAR_LIMIT} pieces of 3 or more dimensions that are not a grid)"
        )
    return not any(
        all(max(a, b) < min(a + x, b + y) for a, x, b, y in zip(oa, sa, ob, sb, strict=True))
        for i, (oa, sa) in enumerate(boxes)
        for ob, sb in boxes[i + 1 :]
    )


def _grid_cells(shape: list[int], boxes: list[Box]) -> list[tuple[int, ...]] | None:
    """Each box's cell in the grid cut by every box's edges, if there are as many cells as boxes
    and each box is exactly one cell (then they tile iff the cells differ); else ``None``."""
    starts = list(zip(*(o for o, _ in boxes), strict=True))  # per dimension, C-speed
    ends = [
        list(map(operator.add, a, b))
        for a, b in zip(starts, zip(*(s for _, s in boxes), strict=True), strict=True)
    ]
    count = 1
    cuts = []
    for k, n in enumerate(shape):
        cut = sorted({0, n, *starts[k], *ends[k]})
        count *= len(cut) - 1
        if count > len(boxes):
            return None
        cuts.append(cut)
    if count != len(boxes):
        return None
    cells = []
    for k, cut in enumerate(cuts):
        where = {v: i for i, v in enumerate(cut)}
        first = list(map(where.__getitem__, starts[k]))
        if list(map(where.__getitem__, ends[k])) != [c + 1 for c in first]:
            return None  # a box spans several cells: not one cell each
        cells.append(first)
    return list(zip(*cells, strict=True))


def _sweep(boxes: list[Box]) -> bool:
    """Two-dimensional boxes disjoint: a sweep along dimension 0 keeps the active boxes' spans
    of dimension 1 sorted and disjoint; a new box need only be compared with its neighbours."""
    events = []
    for i, (offsets, sizes) in enumerate(boxes):
        events.append((offsets[0], 1, i))
        events.append((offsets[0] + sizes[0], 0, i))  # at one position: leave before enter
    events.sort()
    starts: list[int] = []
    ends: list[int] = []
    for _, enter, i in events:
        low = boxes[i][0][1]
        high = low + boxes[i][1][1]
        at = bisect.bisect_left(starts, low)
        if not enter:
            del starts[at], ends[at]
            continue
        if (at > 0 and ends[at - 1] > low) or (at < len(starts) and starts[at] < high):
            return False
        starts.insert(at, low)
        ends.insert(at, high)
    return True


def _validate_skeleton(node: Any, where: str, tensors: Mapping[str, Any]) -> None:
    if node is None or isinstance(node, (bool, int, float, str)):
        return
    if isinstance(node, list):
        for i, item in enumerate(node):
            _validate_skeleton(item, f"{where}[{i}]", tensors)
        return
    _expect(isinstance(node, dict), where, "JSON data")
    tags = [k for k in node if k.startswith("__")]
    if not tags:
        for k, v in node.items():
            _validate_skeleton(v, f"{where}[{k!r}]", tensors)
        return
    _expect(
        len(node) == 1 and tags[0] in _TAGS,
        where,
        f"a plain object or exactly one of {', '.join(_TAGS)}",
    )
    tag, value = tags[0], node[tags[0]]
    if tag == "__tensor__":
        _expect(
            isinstance(value, str) and value in tensors,
            where,
            "a reference to a tensor listed in 'tensors'",
        )
    elif tag == "__dtype__":
        _expect(value in DTYPES, where, f"a dtype among {', '.join(DTYPES)}")
    elif tag == "__tuple__":
        _expect(isinstance(value, list), where, "a list")
        _validate_skeleton(value, where, tensors)
    else:
        _expect(isinstance(value, list), where, "a list of [key, value] pairs")
        for i, pair in enumerate(value):
            _expect(
                isinstance(pair, list)
                and len(pair) == 2
                and (pair[0] is None or isinstance(pair[0], (str, int, float, bool))),
                f"{where}[{i}]",
                "a [key, value] pair with a string or number key",
            )
            _validate_skeleton(pair[1], f"{where}[{i}]", tensors)
