"""Format 4's tensor index (manifest.index, columns): what a save writes, that it agrees with
format 3's JSON index chunk for chunk, and that a forged one is refused naming what is wrong,
before anything is allocated from its numbers, while a signed checkpoint refuses it before
reading it at all.

The forgeries re-record the index in manifest.json (its size and digest, and the manifest's own
digest), as someone without the signing key can; otherwise the digest check alone would refuse
them and nothing below it would be exercised."""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch

import torchplug as tp
from support.checkpoint_attacks import (
    Loader,
    _random_tensor,
    as_format3,
    forge_columns,
    forge_index_bytes,
    load_state,
    no_unpickling,
    read_columns,
    same,
)
from support.paths import ROOT
from support.reference import train
from torchplug.checkpoint import columns, read_manifest
from torchplug.checkpoint import manifest as mf

KEY = "k" * 32


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("index") / "ckpt"
    return path, train("single", steps=2, save_to=str(path))


@pytest.fixture(scope="module")
def sharded(ranks, tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("index-fsdp") / "ckpt"
    return path, ranks.run(train, "fsdp", steps=2, save_to=str(path))[0]


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(saved[0], target)
    return target


def expect_same(loaded: dict, trained: dict) -> None:
    assert same(loaded["params"], trained["params"])
    assert same(loaded["optimizer"], trained["optimizer"])


def test_a_save_writes_the_index_as_columns_that_agree_with_the_json_index(sharded, tmp_path):
    path, trained = sharded
    body = json.loads((path / "manifest.json").read_text())
    assert body["format_version"] == 4 and "tensors" not in body
    index = read_manifest(path)["tensors"]
    chunks = sum(len(index[name]["chunks"]) for name in index)
    # fsdp on two ranks: every sharded tensor in two chunks, each in its rank's file
    weight = index["model/0.weight"]
    assert weight["shape"] == [16, 8] and weight["dtype"] == "float32"
    assert sorted(c["file"] for c in weight["chunks"]) == [
        "tensors/rank-0/__0_0.distcp",
        "tensors/rank-1/__0_0.distcp",
    ]
    assert [c["offsets"] for c in weight["chunks"]] == [[0, 0], [8, 0]]
    assert all(c["sizes"] == [8, 8] and "raw" in c for c in weight["chunks"])
    # small: names once, fixed-width numbers
    assert body["index"]["size"] <= 40 * chunks + sum(len(n) + 4 for n in index) + 400
    # the same checkpoint as format 3 (the index as JSON): the same entries, the same load
    old = tmp_path / "old"
    shutil.copytree(path, old)
    as_format3(old)
    assert not (old / "manifest.index").exists()
    json_index = json.loads((old / "manifest.json").read_text())["tensors"]
    assert {name: index[name] for name in index} == json_index
    expect_same(load_state(str(old)), trained)
    expect_same(load_state(str(path)), trained)


def test_random_layouts_are_accepted_as_columns_exactly_when_the_json_checks_accept_them():
    """1,500 random tensors (grids, rows, irregular; spoiled and not) that can be written as
    columns: the column checks and format 3's JSON checks accept the same ones."""
    rng = random.Random(2)
    outcomes = {True: 0, False: 0}
    tried = 0
    while tried < 1500:
        meta, files = _random_tensor(rng)
        try:
            data = columns.encode({"t": meta})
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError, struct.error):
            continue  # a spoil no fixed-width column can hold (a string, a float, None, 2**70)
        tried += 1
        sizes = {name: info["size"] for name, info in files.items()}
        try:
            mf._validate_tensor("t", meta, files, sizes)
            by_json = True
        except (tp.CheckpointError, mf._Invalid):
            by_json = False
        try:
            columns.ColumnIndex(bytearray(data), sizes)
            by_columns = True
        except columns._Bad:
            by_columns = False
        assert by_json == by_columns, meta
        outcomes[by_json] += 1
    assert min(outcomes.values()) > 150, outcomes


def test_many_tensors_checked_in_small_blocks_name_the_same_tensor_as_the_json_checks(monkeypatch):
    """Indexes of 2-6 random tensors of mixed dimensionality (the chunks of one dimensionality
    are then not one run of rows), checked in blocks of 4 chunks: accepted exactly when format
    3's JSON checks accept every tensor, and refused naming the one tensor that is spoiled."""
    monkeypatch.setattr(columns, "_BLOCK", 4)
    rng = random.Random(5)
    outcomes = {True: 0, False: 0}
    tried = 0
    while tried < 400:
        index, bad = {}, []
        for t in range(rng.randint(2, 6)):
            meta, files = _random_tensor(rng)
            sizes = {name: info["size"] for name, info in files.items()}
            try:
                columns.encode({"t": meta})
                mf._validate_tensor(f"t{t}", meta, files, sizes)
            except (KeyError, TypeError, ValueError, OverflowError, AttributeError, struct.error):
                continue  # a spoil no fixed-width column can hold
            except (tp.CheckpointError, mf._Invalid):
                bad.append(f"t{t}")
            index[f"t{t}"] = meta
        if len(bad) > 1 or not index:
            continue
        tried += 1
        try:
            columns.ColumnIndex(bytearray(columns.encode(index)), sizes)
            refused = None
        except columns._Bad as exc:
            refused = str(exc)
        assert (refused is None) == (not bad), (refused, bad, index)
        if bad:
            assert f"tensors[{bad[0]!r}]" in refused, (refused, bad)
        outcomes[not bad] += 1
    assert min(outcomes.values()) > 100, outcomes


def _names(cols: dict) -> list[bytes]:
    out, at = [], 0
    for length in cols["name_len"]:
        out.append(cols["names"][at : at + length])
        at += length
    return out


def _rename(cols: dict, i: int, name: bytes) -> None:
    names = _names(cols)
    names[i] = name
    cols.update(names=b"".join(names), name_len=[len(n) for n in names])


def _set(column, at, value):
    def change(cols):
        cols[column][at] = value

    return change


#: (change to the columns, what the error must say). Tensor 0 of the index is model/0.weight
#: (shape [16, 8], one chunk): every message names the tensor and the chunk as format 3 does.
FORGERIES = {
    "unknown dtype code": (_set("dtype", 0, 200), r"tensors\['model/0.weight'\].dtype must be"),
    "chunk outside the tensor": (_set("offsets", 0, 1), r"chunks\[0\] must be inside the tensor"),
    "chunk not covering the tensor": (_set("sizes", 0, 15), "cover the tensor exactly once"),
    "byte range past the file": (_set("length", 0, 10**9), "a byte range inside its file"),
    "negative byte offset": (_set("start", 0, -8), "a byte range inside its file"),
    "raw data before its chunk": (_set("raw", 0, -5), r"chunks\[0\].raw must be"),
    "raw data past its chunk": (_set("raw", 0, 10**6), r"chunks\[0\].raw must be"),
    "file index past the file names": (_set("file", 0, 7), r"chunks\[0\].file must be a file"),
    "negative file index": (_set("file", 0, -1), r"chunks\[0\].file must be a file"),
    "negative shape": (_set("shape", 0, -16), r"model/0.weight'\].shape must be"),
    "more dimensions than torch allows": (_set("ndim", 0, 65), "dimensions"),
    "chunk counts that do not add up": (_set("count", 0, 2), "chunk"),
    "chunk count that would wrap the sum": (_set("count", 0, 2**62), r"model/0.weight'\].chunks"),
    "a name twice": (lambda cols: _rename(cols, 1, _names(cols)[0]), "appears twice"),
    "a name not UTF-8": (
        lambda cols: cols.update(names=b"\xff" + cols["names"][1:]),
        "tensor name 0 is not UTF-8",
    ),
    "a file not listed in manifest.json": (
        lambda cols: cols.update(
            file_names=cols["file_names"].replace(b"tensors/rank-0/", b"tensors/rank-9/")
        ),
        r"chunks\[0\].file must be a file listed in 'files'",
    ),
    "a shape larger than any file": (
        lambda cols: (cols["shape"].__setitem__(0, 2**40), cols["sizes"].__setitem__(0, 2**40)),
        r"a byte range (inside its file|large enough)",
    ),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_forged_index_is_refused_naming_the_tensor_and_chunk(copy, name):
    change, message = FORGERIES[name]
    cols = read_columns(copy)
    assert cols["names"].startswith(b"model/0.weight")  # tensor 0, as the table assumes
    forge_columns(copy, change)
    with pytest.raises(tp.CheckpointError, match="manifest.index is invalid: .*" + message):
        load_state(str(copy))


def _header_field(i: int, value: int):
    def change(data: bytearray) -> None:
        columns._HEADER.pack_into(data, 0, *(lambda h: h[:i] + (value,) + h[i + 1 :])(
            columns._HEADER.unpack_from(data)
        ))  # fmt: skip

    return change


BYTE_FORGERIES = {
    "another magic": (lambda d: d.__setitem__(slice(0, 8), b"NOTMAGIC"), "does not start with"),
    # counts claiming 2**40-2**60 entries: refused from the file's size, nothing allocated
    "a huge tensor count": (_header_field(1, 2**60), "runs past the end"),
    "a huge chunk count": (_header_field(2, 2**40), "runs past the end"),
    "a huge cell count": (_header_field(4, 2**58), "runs past the end"),
    "a huge name length total": (_header_field(5, 2**50), "runs past the end"),
    "unknown widths": (_header_field(8, 9), "widths"),
    "a shorter chunk count": (_header_field(2, 0), "bytes after its last section|add up"),
    "bytes appended": (lambda d: d + b"\0" * 8, "bytes after its last section"),
    "truncated": (lambda d: d[: len(d) // 2], "runs past the end"),
    "only the header's start": (lambda d: d[:20], "shorter than its header"),
    "empty": (lambda d: b"", "shorter than its header"),
}


@pytest.mark.parametrize("name", sorted(BYTE_FORGERIES))
def test_a_forged_index_layout_is_refused_before_anything_is_allocated(copy, name):
    change, message = BYTE_FORGERIES[name]
    forge_index_bytes(copy, change)
    with pytest.raises(tp.CheckpointError, match=f"manifest.index is invalid: .*({message})"):
        load_state(str(copy))


def test_an_altered_or_swapped_index_fails_its_digest_or_size_check(copy, saved):
    data = bytearray((copy / "manifest.index").read_bytes())
    data[len(data) // 2] ^= 0x01
    (copy / "manifest.index").write_bytes(bytes(data))
    with pytest.raises(tp.CheckpointError, match=r"manifest.index fails its blake3 check"):
        load_state(str(copy))
    (copy / "manifest.index").write_bytes(bytes(data) + b"\0")
    with pytest.raises(tp.CheckpointError, match=r"has \d+ bytes, but manifest.json records"):
        load_state(str(copy))
    (copy / "manifest.index").unlink()
    with pytest.raises(tp.CheckpointError, match="Cannot read .*manifest.index"):
        load_state(str(copy))


def test_with_a_key_a_forged_index_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "signed"
    trained = train("single", steps=1, save_to=str(path), checkpoint_key=KEY)
    expect_same(load_state(str(path), checkpoint_key=KEY), trained)
    forge_columns(path, _set("offsets", 0, 1))  # re-recorded, but the signature cannot be
    monkeypatch.setattr(columns, "read", lambda *a: pytest.fail("the index was read"))
    with pytest.raises(tp.CheckpointError, match="signature that does not match"):
        load_state(str(path), checkpoint_key=KEY)


def test_every_byte_of_the_index_flipped_and_re_recorded_is_refused_or_loads(copy, saved):
    """Each byte flipped (the low, high or a middle bit, in turn), the index re-recorded as a
    forger without the key would: every load fails with a CheckpointError naming the manifest or
    the data it points to, or loads (a forger who can rewrite the manifest can rewrite the data
    too, so what loads may differ: a signed checkpoint is the defence against that). Never another
    exception, never an allocation the files cannot back, nothing unpickled. Flips without a new
    digest: the test above and tests/checkpoint/test_checkpoint_fuzz.py."""
    original = (copy / "manifest.index").read_bytes()
    counts = {"refused": 0, "loaded": 0}
    load = Loader()  # one Engine for every load
    with no_unpickling():
        for i in range(len(original)):
            mask = (0x01, 0x80, 0x10)[i % 3]  # low, high and middle bits, byte by byte
            data = bytearray(original)
            data[i] ^= mask
            forge_index_bytes(copy, lambda d, data=data: data)
            try:
                load(copy)
            except tp.CheckpointError as exc:
                assert "manifest." in str(exc) or "tensors/" in str(exc), (i, mask, exc)
                counts["refused"] += 1
                continue
            counts["loaded"] += 1
    load.engine.close()
    assert counts["refused"] > len(original) // 2, counts


def _section_at(data: bytes, name: str) -> int:
    """Where section ``name`` starts in index bytes."""
    _, *counts = columns._HEADER.unpack_from(data)
    at = columns._HEADER.size
    for section, letter, count in columns._sections(*counts):
        if section == name:
            return at
        at += count * {"B": 1, "i": 4, "q": 8}[letter]
        at += -at % 8
    raise KeyError(name)


def test_an_index_of_thousands_of_ranks_makes_no_python_objects_per_chunk():
    """The benchmark's fsdp index at 2,048 ranks x 50 tensors (102,400 chunks): accepted, 28-40
    bytes a chunk, and no entry made until asked for; one overlapping chunk in it is refused."""
    sys.path.insert(0, str(ROOT))  # the checkout's benchmarks/
    try:
        from benchmarks.validation import fsdp_index
    finally:
        sys.path.pop(0)

    data, sizes = fsdp_index(2048, 50)
    assert len(data) / (2048 * 50) <= 40
    index = columns.ColumnIndex(bytearray(data), sizes)
    assert len(index) == 50 and index._made == {}
    entry = index["model.layers.7.weight"]
    assert entry["shape"] == [4096, 8] and len(entry["chunks"]) == 2048
    assert entry["chunks"][5] == {
        "offsets": [10, 0], "sizes": [2, 8], "file": "tensors/__5_0.distcp",
        "offset": 7 * 4096, "length": 4096, "raw": 7 * 4096 + 64,
    }  # fmt: skip
    assert list(index._made) == ["model.layers.7.weight"]
    spoiled = bytearray(data)
    view = torch.frombuffer(
        spoiled, dtype=torch.int32, count=4, offset=_section_at(data, "offsets")
    )
    assert view.tolist() == [0, 0, 2, 0]  # int32 cells: chunk 0 at row 0, chunk 1 at row 2
    view[2] = 1  # chunk 1 of tensor 0 starts at row 1: it overlaps chunk 0
    with pytest.raises(columns._Bad, match=r"model.layers.0.weight'\].chunks must be pieces"):
        columns.ColumnIndex(spoiled, sizes)


def test_a_rank_gets_the_chunks_dcp_would_read_for_its_pieces():
    """`ColumnIndex.over` and format 3's filter keep exactly the chunks that DCP's resharding
    test (`_check_shard_metadata_pair_overlap`) finds overlapping one of a rank's pieces, on
    random layouts and random pieces (empty ones too)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.resharding import _check_shard_metadata_pair_overlap

    from torchplug.checkpoint import tensors

    def box(offsets, sizes):
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))

    rng = random.Random(7)
    kept = tried = 0
    while tried < 300:
        meta, files = _random_tensor(rng)
        sizes = {name: info["size"] for name, info in files.items()}
        try:
            index = columns.ColumnIndex(bytearray(columns.encode({"t": meta})), sizes)
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError, struct.error):
            continue
        except columns._Bad:
            continue  # a spoiled layout is refused before any load plans over it
        tried += 1
        shape = meta["shape"]
        pieces = []
        for _ in range(rng.randint(1, 3)):
            lo = [rng.randint(0, n) for n in shape]
            pieces.append((lo, [rng.randint(0, n - a) for a, n in zip(lo, shape, strict=True)]))
        expected = [
            (c["offsets"], c["sizes"])
            for c in meta["chunks"]
            if any(_check_shard_metadata_pair_overlap(box(*p), box(c["offsets"], c["sizes"]))
                   for p in pieces)
        ]  # fmt: skip
        got = [(c["offsets"], c["sizes"]) for c in index.over("t", pieces)["chunks"]]
        assert got == expected, (meta, pieces)

        class Piece:  # what DCP's planner asks a target for
            def __init__(self, pieces):
                self.pieces = pieces

            def __create_chunk_list__(self):
                return [box(*p) for p in self.pieces]

        by_json = tensors._over({"t": meta}, "t", Piece(pieces))
        assert [(c["offsets"], c["sizes"]) for c in by_json["chunks"]] == expected
        kept += 0 < len(expected) < len(meta["chunks"])
    assert kept > 30  # many cases keep some chunks and drop others


def load_counting_chunks(path: str) -> dict:
    """Load the fsdp checkpoint on fsdp; what was loaded and how many chunks of each tensor
    this rank's reader was given."""
    from torchplug.checkpoint import tensors

    given: dict[str, int] = {}
    real = tensors.reader

    def counting(root, index, source):
        given.update({name: len(meta["chunks"]) for name, meta in index.items()})
        return real(root, index, source)

    tensors.reader = counting
    try:
        return {**load_state(path, "fsdp"), "given": given}
    finally:
        tensors.reader = real


def test_a_sharded_load_plans_over_its_own_chunks_only(ranks, sharded):
    """fsdp saved on 2 ranks and loaded on 2: each rank's reader gets, of each sharded tensor,
    the one chunk of its own rows (none where its shard is empty), never the other rank's, and
    loads bit-exact what was trained."""
    path, trained = sharded
    index = read_manifest(path)["tensors"]
    given = []
    for loaded in ranks.run(load_counting_chunks, str(path)):
        expect_same(loaded, trained)
        given.append(loaded["given"])
    names = [n for n in given[0] if len(index[n]["chunks"]) == 2]
    assert names, given
    for name in names:
        filled = sum(math.prod(c["sizes"]) > 0 for c in index[name]["chunks"])
        assert [g[name] for g in given] in ([1, 1], [1, 0], [0, 1]), (name, given)
        assert given[0][name] + given[1][name] == filled, (name, given)
