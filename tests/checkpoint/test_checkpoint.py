"""Checkpoints: written by rank 0 atomically, verified on load, bit-exact across world sizes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import blake3
import pytest
import torch

import torchplug as tp
from support.checkpoint_attacks import as_format3, forge
from support.reference import make_model, snapshot, train
from torchplug.checkpoint import read_manifest


def load_and_snapshot(path: str, strategy: str) -> dict:
    with tp.Engine(strategy) as engine:
        model = make_model(seed=123)  # different init: everything must come from the checkpoint
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
        model, optimizer = engine.setup(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        rest = engine.load(path, state)
        return {"step": state["step"], "rest": rest, **snapshot(engine, model, optimizer)}


def assert_bit_exact(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


@pytest.fixture(scope="module")
def saved_on_two_ranks(ranks, tmp_path_factory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("ckpt") / "run")
    results = ranks.run(train, "ddp", steps=3, save_to=path)
    return path, results[0]


def test_manifest_records_run_and_files(saved_on_two_ranks):
    path, _ = saved_on_two_ranks
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    assert manifest["format"] == "torchplug-checkpoint"
    assert manifest["format_version"] == 4
    # the tensor index is manifest.index (columns), recorded with its size and digest
    assert "tensors" not in manifest
    assert manifest["index"]["file"] == "manifest.index"
    assert (Path(path) / "manifest.index").stat().st_size == manifest["index"]["size"]
    assert manifest["strategy"]["name"] == "ddp"
    assert manifest["world_size"] == 2
    assert manifest["step"] == 3
    assert manifest["layout"] == "dcp"
    # no pickled .metadata; the replicated (DDP) tensors are shared out over both ranks' files
    assert set(manifest["files"]) == {
        "tensors/rank-0/__0_0.distcp",
        "tensors/rank-1/__0_0.distcp",
    }
    index = read_manifest(path)["tensors"]
    assert index["model/0.weight"]["shape"] == [16, 8]
    assert index["model/0.weight"]["dtype"] == "float32"
    assert manifest["entries"]["step"] == {"kind": "value", "data": 3}
    assert manifest["entries"]["model"]["kind"] == "module"
    assert manifest["entries"]["model"]["data"]["0.weight"] == {"__tensor__": "model/0.weight"}
    for name, info in manifest["files"].items():
        assert (Path(path) / name).stat().st_size == info["size"]
        # hashed while written, so it must equal a hash of what is on disk (BLAKE3, the
        # blake3 package's own)
        assert blake3.blake3((Path(path) / name).read_bytes()).hexdigest() == info["blake3"]
        assert "sha256" not in info
    assert not [p for p in Path(path).parent.iterdir() if p.name.startswith(".")]


def test_two_rank_checkpoint_loads_bit_exact_in_one_process(saved_on_two_ranks):
    path, trained = saved_on_two_ranks
    loaded = load_and_snapshot(path, "single")
    assert loaded["step"] == 3
    assert_bit_exact(loaded["params"], trained["params"])
    assert_bit_exact(loaded["optimizer"], trained["optimizer"])


def test_two_rank_checkpoint_loads_bit_exact_in_two_ranks(ranks, saved_on_two_ranks):
    path, trained = saved_on_two_ranks
    for loaded in ranks.run(load_and_snapshot, path, "ddp"):
        assert loaded["step"] == 3
        assert_bit_exact(loaded["params"], trained["params"])
        assert_bit_exact(loaded["optimizer"], trained["optimizer"])


@pytest.fixture
def saved(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    train("single", steps=2, save_to=str(path))
    return path


SHARD = "tensors/rank-0/__0_0.distcp"


def test_truncated_file_is_rejected_naming_it(saved):
    data = (saved / SHARD).read_bytes()
    (saved / SHARD).write_bytes(data[: len(data) // 2])
    with pytest.raises(tp.CheckpointError, match=r"__0_0\.distcp.*truncated"):
        load_and_snapshot(str(saved), "single")


def test_a_file_changed_through_a_shared_mapping_after_hashing_never_reaches_a_signed_load(
    tmp_path, monkeypatch
):
    """Issue 36 item 1: a same-user process writing through a ``MAP_SHARED`` mapping whose page
    is dirty already changes the file without moving its mtime or ctime, so a check of the
    file's identity cannot see it. The load uses the bytes it hashed (read once, into memory):
    changed right after the hashing, the file's new bytes never reach the model."""
    import mmap

    from torchplug.checkpoint import verify

    monkeypatch.setenv("TORCHPLUG_CHECKPOINT_KEY", "a key of at least sixteen bytes")
    saved = tmp_path / "ckpt"
    train("single", steps=2, save_to=str(saved))
    expected = load_and_snapshot(str(saved), "single")
    real = verify.check_files
    with (saved / SHARD).open("r+b") as handle, mmap.mmap(handle.fileno(), 0) as mapped:
        page = (len(mapped) // 2) & ~(mmap.PAGESIZE - 1)  # a page of tensor data
        mapped[page] = original = mapped[page]  # dirty before the load: later writes move no time

        def check_then_change(root, files, names):
            found = real(root, files, names)
            for i in range(page, min(page + mmap.PAGESIZE, len(mapped))):
                mapped[i] ^= 0xFF
            return found

        verify.check_files = check_then_change
        try:
            loaded = load_and_snapshot(str(saved), "single")
        finally:
            verify.check_files = real
        assert (saved / SHARD).read_bytes()[page] == original ^ 0xFF  # the file did change
    assert loaded["step"] == expected["step"]
    assert_bit_exact(loaded["params"], expected["params"])
    assert_bit_exact(loaded["optimizer"], expected["optimizer"])


def test_altered_file_is_rejected_naming_it(saved):
    data = bytearray((saved / SHARD).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (saved / SHARD).write_bytes(bytes(data))
    with pytest.raises(tp.CheckpointError, match=r"__0_0\.distcp.*blake3 check"):
        load_and_snapshot(str(saved), "single")


def _as_format_2(path: Path) -> None:
    """Rewrite a checkpoint's manifest as format 2 wrote it: sha256 per file, version 2."""
    from torchplug.checkpoint import manifest as mf

    as_format3(path)  # format 2 held the tensor index in manifest.json, as format 3 does
    body = json.loads((path / "manifest.json").read_text())
    for name, info in body["files"].items():
        del info["blake3"]
        info["sha256"] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    body["format_version"] = 2
    body["digest"] = hashlib.sha256(mf.canonical(body)).hexdigest()
    (path / "manifest.json").write_text(json.dumps(body))


def test_a_format_2_checkpoint_with_sha256_digests_loads_and_is_verified(saved):
    """Checkpoints written before BLAKE3 (sha256 per file) still load bit for bit, and their
    files are still checked: a flipped byte fails the sha256 check."""
    expected = load_and_snapshot(str(saved), "single")
    _as_format_2(saved)
    loaded = load_and_snapshot(str(saved), "single")
    assert_bit_exact(loaded["params"], expected["params"])
    assert_bit_exact(loaded["optimizer"], expected["optimizer"])
    data = bytearray((saved / SHARD).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (saved / SHARD).write_bytes(bytes(data))
    with pytest.raises(tp.CheckpointError, match=r"__0_0\.distcp.*sha256 check"):
        load_and_snapshot(str(saved), "single")


def test_missing_file_and_missing_checkpoint_are_named(saved, tmp_path):
    (saved / SHARD).unlink()
    with pytest.raises(tp.CheckpointError, match=r"__0_0\.distcp is missing"):
        load_and_snapshot(str(saved), "single")
    with pytest.raises(tp.CheckpointError, match="No torchplug checkpoint"):
        load_and_snapshot(str(tmp_path / "nowhere"), "single")


def test_state_key_absent_from_checkpoint_is_an_error(saved):
    with tp.Engine("single") as engine, pytest.raises(tp.CheckpointError, match="'scheduler'"):
        engine.load(
            saved,
            {
                "scheduler": torch.optim.lr_scheduler.LambdaLR(
                    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), lambda s: 1.0
                )
            },
        )


def test_architecture_mismatch_names_the_differences(saved):
    with tp.Engine("single") as engine:
        other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
        with pytest.raises(tp.CheckpointError, match=r"in the checkpoint only\): \['2\.bias'"):
            engine.load(saved, {"model": other, "optimizer": None, "step": 0})


def test_overwrite_replaces_atomically_and_keeps_values(tmp_path):
    path = tmp_path / "ckpt"
    first, second = torch.arange(3.0), torch.arange(4.0)
    with tp.Engine("single") as engine:
        engine.save(path, {"step": 1, "note": {"a": [1, 2]}, "rng": first})
        engine.save(path, {"step": 2, "note": {"a": [3]}, "rng": second}, metadata={"run": "b"})
        state = {"step": 0}
        rest = engine.load(path, state)
    assert state == {"step": 2}
    assert rest["note"] == {"a": [3]}
    assert torch.equal(rest["rng"], second)
    assert json.loads((path / "manifest.json").read_text())["metadata"] == {"run": "b"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_unsaveable_object_gets_a_clear_error(tmp_path):
    with tp.Engine("single") as engine, pytest.raises(tp.CheckpointError, match="state_dict"):
        engine.save(tmp_path / "ckpt", {"thing": object()})
    assert not (tmp_path / "ckpt").exists()


def test_save_leaves_torch_save_crc_setting_as_it_was(tmp_path):
    """The per-record crc32 is off only inside a save (the sha256 covers those files)."""
    before = torch.serialization.get_crc32_options()
    try:
        for setting in (True, False):
            torch.serialization.set_crc32_options(setting)
            with tp.Engine("single") as engine:
                engine.save(tmp_path / f"ckpt-{setting}", {"w": torch.ones(3)})
            assert torch.serialization.get_crc32_options() is setting
    finally:
        torch.serialization.set_crc32_options(before)


def test_tensors_read_raw_equal_what_was_saved_in_every_layout(tmp_path):
    """Chunks are read straight from their stored bytes ("raw" in the index): a transposed view,
    a slice of a larger storage, bf16, an empty tensor, and a target of another dtype all come
    back equal; a checkpoint without "raw" (written before it existed) reads through DCP."""
    base = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    saved = {
        "transposed": base.t(),
        "slice": base[1:3, 2:6],
        "bf16": torch.randn(7, 3).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
        "int": torch.arange(-5, 5, dtype=torch.int64),
    }
    with tp.Engine("single") as engine:
        engine.save(tmp_path / "ckpt", dict(saved))
        index = read_manifest(tmp_path / "ckpt")["tensors"]
        assert all("raw" in c for t in index.values() for c in t["chunks"])
        loaded = engine.load(tmp_path / "ckpt", {k: None for k in saved})
        for key, value in saved.items():
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key

        # the same checkpoint without "raw" (format 3, as written before "raw" existed): the
        # DCP path gives the same tensors
        as_format3(tmp_path / "ckpt")

        def drop_raw(body: dict) -> None:
            for meta in body["tensors"].values():
                for chunk in meta["chunks"]:
                    del chunk["raw"]

        forge(tmp_path / "ckpt", drop_raw)
        again = engine.load(tmp_path / "ckpt", {k: None for k in saved})
        for key, value in saved.items():
            assert torch.equal(again[key], value), key


def test_a_module_loads_raw_into_another_dtype_and_layout(tmp_path):
    """A target that cannot take the bytes in place (bf16 parameters, a checkpoint of fp32)
    is filled through a temporary and cast, as DCP does."""
    torch.manual_seed(0)
    source = torch.nn.Linear(6, 4)
    with tp.Engine("single") as engine:
        engine.save(tmp_path / "ckpt", {"model": source})
        target = torch.nn.Linear(6, 4).to(torch.bfloat16)
        engine.load(tmp_path / "ckpt", {"model": target})
    assert torch.equal(target.weight, source.weight.to(torch.bfloat16))
    assert torch.equal(target.bias, source.bias.to(torch.bfloat16))


def save_twice(path: str) -> dict:
    with tp.Engine("ddp") as engine:
        model = engine.setup(make_model())
        engine.save(path, {"model": model, "step": 1})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        engine.save(path, {"model": model, "step": 2})
        state = {"step": 0}
        engine.load(path, state)
        weight = model.state_dict()["0.weight"].clone()
        engine.load(path, {"model": model})
        return {
            "step": state["step"],
            "same": torch.equal(model.state_dict()["0.weight"], weight),
            "left": sorted(p.name for p in Path(path).parent.iterdir()),
        }


def test_a_replaced_checkpoint_is_removed_by_every_rank(ranks, tmp_path):
    """Each rank removes its own files of the checkpoint it replaces; nothing is left over."""
    for result in ranks.run(save_twice, str(tmp_path / "run")):
        assert result == {"step": 2, "same": True, "left": ["run"]}


def encode_a_sharded_tensor() -> str:
    """What the checkpoint says of FSDP1's ShardedTensor state, on real ranks."""
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    from torchplug.checkpoint import manifest

    with tp.Engine("ddp", timeout=120.0) as engine:
        spec = ChunkShardingSpec(
            dim=0, placements=[f"rank:{r}/cpu" for r in range(engine.world_size)]
        )
        sharded = empty(spec, 4, 3)
        try:
            manifest.encode({"weight": sharded}, "model", {})
        except tp.CheckpointError as exc:
            return str(exc)
    return "accepted"


def test_fsdp1_sharded_tensor_state_is_refused_naming_what_to_return(ranks):
    """Issue 26 item 8: a raw RuntimeError from deep inside DCP became a CheckpointError saying
    what a state hook must return instead."""
    for message in ranks.run(encode_a_sharded_tensor, timeout=120):
        assert "ShardedTensor" in message and "DTensor" in message, message
        assert "_use_dtensor=True" in message


def test_without_blake3_a_save_records_sha256_and_a_blake3_checkpoint_says_what_to_install(
    saved, tmp_path, monkeypatch
):
    """blake3 is a dependency; where it cannot be imported a save falls back to sha256 (and
    loads), and a checkpoint hashed with BLAKE3 is refused with the package to install."""
    from torchplug.checkpoint import files

    monkeypatch.setattr(files, "_blake3", lambda: None)
    with pytest.raises(tp.CheckpointError, match=r"pip install blake3"):
        load_and_snapshot(str(saved), "single")
    path = tmp_path / "sha"
    train("single", steps=1, save_to=str(path))
    manifest = json.loads((path / "manifest.json").read_text())
    assert all("sha256" in info and "blake3" not in info for info in manifest["files"].values())
    assert load_and_snapshot(str(path), "single")["step"] == 1
