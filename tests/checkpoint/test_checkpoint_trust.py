"""A checkpoint cannot be turned against its user: no code runs on load, the manifest is validated
and digested (and signed when a key is set), paths stay inside the checkpoint, and nothing loads
silently different or partial."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import torchplug as tp
from support.checkpoint_attacks import as_format3, forge, load_state, no_unpickling, same
from support.reference import make_model, train

KEY = "k" * 32
SHARD = "tensors/rank-0/__0_0.distcp"


@pytest.fixture(scope="module")
def single_ckpt(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("single") / "ckpt"
    trained = train("single", steps=2, save_to=str(path))
    return path, trained


@pytest.fixture(scope="module")
def ddp_ckpt(ranks, tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("ddp") / "ckpt"
    return path, ranks.run(train, "ddp", steps=3, save_to=str(path))[0]


@pytest.fixture(scope="module")
def fsdp_ckpt(ranks, tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("fsdp") / "ckpt"
    return path, ranks.run(train, "fsdp", steps=3, save_to=str(path))[0]


@pytest.fixture(params=["format 4", "format 3"])
def copy(single_ckpt, tmp_path, request) -> Path:
    """A fresh copy of the single-process checkpoint to tamper with: as saved (format 4, the
    tensor index in manifest.index), and as an older torchplug saved it (format 3, the index as
    JSON in manifest.json), which still loads."""
    import shutil

    target = tmp_path / "ckpt"
    shutil.copytree(single_ckpt[0], target)
    if request.param == "format 3":
        as_format3(target)
    return target


@pytest.fixture
def copy3(single_ckpt, tmp_path) -> Path:
    """A format 3 copy: for the forgeries of the JSON tensor index (format 4's are in
    tests/checkpoint/test_checkpoint_index.py)."""
    import shutil

    target = tmp_path / "ckpt"
    shutil.copytree(single_ckpt[0], target)
    as_format3(target)
    return target


def expect_same(loaded: dict, trained: dict) -> None:
    assert same(loaded["params"], trained["params"])
    assert same(loaded["optimizer"], trained["optimizer"])


# -- no code on load ---------------------------------------------------------------------------


def test_no_checkpoint_kind_is_unpickled_on_load(ranks, single_ckpt, ddp_ckpt, fsdp_ckpt):
    for path, trained in (single_ckpt, ddp_ckpt, fsdp_ckpt):
        expect_same(load_state(str(path), "single"), trained)  # guarded: pickles raise
    for path, trained in (ddp_ckpt, fsdp_ckpt):
        for strategy in ("ddp", "fsdp"):
            for loaded in ranks.run(load_state, str(path), strategy):
                expect_same(loaded, trained)


def test_the_guard_itself_catches_unpickling():
    with no_unpickling(), pytest.raises(AssertionError, match="unpickled"):
        pickle.loads(pickle.dumps(1))


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_planted_metadata_pickles_are_never_read(single_ckpt, copy, tmp_path):
    marker = tmp_path / "pwned"
    for name in ("tensors/.metadata", "tensors/rank-0/.metadata"):
        (copy / name).write_bytes(pickle.dumps(Evil(marker)))
    expect_same(load_state(str(copy)), single_ckpt[1])
    assert not marker.exists()


def test_chunk_pointing_to_an_unlisted_file_is_refused(copy3):
    import shutil

    shutil.copy(copy3 / SHARD, copy3 / "tensors" / "extra.bin")

    def change(body):
        body["tensors"]["model/0.weight"]["chunks"][0]["file"] = "tensors/extra.bin"

    forge(copy3, change)
    with pytest.raises(tp.CheckpointError, match=r"model/0\.weight.*a file listed in 'files'"):
        load_state(str(copy3))


# -- validated manifest ------------------------------------------------------------------------


def _set(*keys, value):
    def change(body):
        node = body
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return change


FORGERIES = {
    "dtype naming torch.load": (
        _set("entries", "step", "data", value={"__dtype__": "load"}),
        "a dtype among",
    ),
    "dtype naming os": (_set("entries", "step", "data", value={"__dtype__": "os"}), "a dtype"),
    "tag with extra keys": (
        _set("entries", "step", "data", value={"__tensor__": "model/0.weight", "x": 1}),
        "exactly one of",
    ),
    "tensor not indexed": (
        _set("entries", "step", "data", value={"__tensor__": "nowhere"}),
        "a tensor listed in 'tensors'",
    ),
    "format_version 0": (_set("format_version", value=0), "format_version"),
    "format_version -7": (_set("format_version", value=-7), "format_version"),
    "format_version as text": (_set("format_version", value="2"), "format_version"),
    "world_size 0": (_set("world_size", value=0), "world_size"),
    "unknown dtype of a tensor": (
        _set("tensors", "model/0.weight", "dtype", value="object"),
        r"tensors\['model/0.weight'\].dtype",
    ),
    "chunk outside the tensor": (
        _set("tensors", "model/0.weight", "chunks", 0, "offsets", value=[1, 0]),
        "inside the tensor's shape",
    ),
    "chunk not covering the tensor": (
        _set("tensors", "model/0.weight", "chunks", 0, "sizes", value=[1, 8]),
        "cover the tensor exactly once",
    ),
    "byte range past the file": (
        _set("tensors", "model/0.weight", "chunks", 0, "length", value=10**9),
        "a byte range inside its file",
    ),
    "raw data before its chunk": (
        _set("tensors", "model/0.weight", "chunks", 0, "raw", value=-1),
        r"chunks\[0\].raw",
    ),
    "raw data past its chunk": (
        _set("tensors", "model/0.weight", "chunks", 0, "raw", value=10**9),
        r"chunks\[0\].raw",
    ),
    "raw data as text": (
        _set("tensors", "model/0.weight", "chunks", 0, "raw", value="0"),
        r"chunks\[0\].raw",
    ),
    "files renamed": (lambda body: body.update(filez=body.pop("files")), "'files' must be"),
    "module kind altered": (_set("entries", "model", "kind", value="modulf"), "kind 'modulf'"),
    "step of another type": (_set("step", value="3"), "'step'"),
}


#: The forgeries of format 3's JSON tensor index (format 4's:
#: tests/checkpoint/test_checkpoint_index.py).
JSON_INDEX = {
    "unknown dtype of a tensor", "chunk outside the tensor", "chunk not covering the tensor",
    "byte range past the file", "raw data before its chunk", "raw data past its chunk",
    "raw data as text",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(set(FORGERIES) - JSON_INDEX))
def test_forged_manifest_is_refused_naming_the_key(copy, name):
    change, message = FORGERIES[name]
    forge(copy, change)
    with pytest.raises(tp.CheckpointError, match=message):
        load_state(str(copy))


@pytest.mark.parametrize("name", sorted(JSON_INDEX))
def test_a_forged_json_tensor_index_is_refused_naming_the_key(copy3, name):
    change, message = FORGERIES[name]
    forge(copy3, change)
    with pytest.raises(tp.CheckpointError, match=message):
        load_state(str(copy3))


def test_edit_without_new_digest_is_refused(copy):
    text = (copy / "manifest.json").read_text()
    (copy / "manifest.json").write_text(text.replace('"data": 2', '"data": 3'))
    with pytest.raises(tp.CheckpointError, match="digest check"):
        load_state(str(copy))


def test_duplicate_keys_are_refused(copy):
    text = (copy / "manifest.json").read_text()
    (copy / "manifest.json").write_text(text.replace('{\n "created"', '{\n "step": 0,\n "created"'))
    with pytest.raises(tp.CheckpointError, match="repeats the key 'step'"):
        load_state(str(copy))


# -- paths stay inside -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/hostname", "tensors/../../x", "a//b"])
def test_file_entries_outside_the_directory_are_refused(copy, tmp_path, name):
    def change(body):
        body["files"][name] = {"size": 1, "sha256": "0" * 64}

    forge(copy, change)
    with pytest.raises(tp.CheckpointError, match="refusing to read it"):
        load_state(str(copy))


def test_symlink_leading_out_of_the_checkpoint_is_refused(copy, tmp_path):
    outside = tmp_path / "pristine.distcp"
    (copy / SHARD).rename(outside)
    os.symlink(outside, copy / SHARD)
    with pytest.raises(tp.CheckpointError, match="outside the checkpoint directory"):
        load_state(str(copy))


# -- signatures --------------------------------------------------------------------------------


def test_signed_checkpoints(tmp_path, monkeypatch):
    path = tmp_path / "signed"
    train("single", steps=1, save_to=str(path), checkpoint_key=KEY)
    assert json.loads((path / "manifest.json").read_text())["signature"]["alg"] == "hmac-sha256"
    assert load_state(str(path), checkpoint_key=KEY)["step"] == 1
    assert load_state(str(path))["step"] == 1  # no key configured: nothing to check
    with pytest.raises(tp.CheckpointError, match="does not match the configured key"):
        load_state(str(path), checkpoint_key="x" * 32)
    monkeypatch.setenv("TORCHPLUG_CHECKPOINT_KEY", KEY)
    assert load_state(str(path))["step"] == 1
    forge(path, _set("entries", "step", "data", value=7))  # the digest agrees; the HMAC cannot
    with pytest.raises(tp.CheckpointError, match="does not match the configured key"):
        load_state(str(path))
    unsigned = tmp_path / "unsigned"
    monkeypatch.delenv("TORCHPLUG_CHECKPOINT_KEY")
    train("single", steps=1, save_to=str(unsigned))
    with pytest.raises(tp.CheckpointError, match="is not signed"):
        load_state(str(unsigned), checkpoint_key=KEY)
    with pytest.raises(tp.CheckpointError, match="at least 16"):
        tp.Engine("single", checkpoint_key="short")


# -- no silent partial loads -------------------------------------------------------------------


def test_module_entry_into_a_plain_dict_is_an_error(single_ckpt):
    path, trained = single_ckpt
    with tp.Engine("single") as engine:
        model = make_model(seed=5)
        with pytest.raises(tp.CheckpointError, match="holds the state of an nn.Module"):
            engine.load(path, {"model": model.state_dict()})
        with pytest.raises(tp.CheckpointError, match="has no entries"):
            engine.load(path, model.state_dict())
        with pytest.raises(tp.CheckpointError, match="holds a value, not the state of a"):
            engine.load(path, {"step": model})
        state = {"model": {}}
        rest = engine.load(path, state, strict=False)
        assert torch.equal(state["model"]["0.weight"], trained["params"]["0.weight"])
        assert rest["step"] == 2


def test_load_without_state_returns_values_and_summary(single_ckpt):
    path, _ = single_ckpt
    with tp.Engine("single") as engine:
        summary = engine.load(path)
    assert summary["step"] == 2
    assert summary["model"]["kind"] == "module"
    assert summary["model"]["tensors"]["0.weight"] == {"shape": [16, 8], "dtype": "float32"}
    assert summary["optimizer"]["kind"] == "optimizer"


def test_missing_and_unexpected_keys_are_listed_and_strict_false_loads_the_rest(single_ckpt):
    path, trained = single_ckpt
    bigger = torch.nn.Sequential(*make_model(seed=9), torch.nn.Linear(1, 2))
    with tp.Engine("single") as engine:
        with pytest.raises(tp.CheckpointError, match=r"missing \(in your object only\): \['3\."):
            engine.load(path, {"model": bigger})
        extra = bigger[3].weight.detach().clone()
        engine.load(path, {"model": bigger}, strict=False)
    assert torch.equal(bigger[0].weight, trained["params"]["0.weight"])
    assert torch.equal(bigger[3].weight, extra)


def test_shape_mismatch_is_a_checkpoint_error_with_the_cause_first(single_ckpt):
    with tp.Engine("single") as engine:
        wide = make_model(width=32)
        try:
            engine.load(single_ckpt[0], {"model": wide})
        except Exception as exc:  # noqa: BLE001 - the point: `except Exception` catches it
            assert isinstance(exc, tp.CheckpointError)
            assert "ize mismatch" in str(exc), exc
        else:
            pytest.fail("loading into another width succeeded")


# -- where a save goes -------------------------------------------------------------------------


def test_save_onto_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    target, link = tmp_path / "step_1", tmp_path / "latest"
    with tp.Engine("single") as engine:
        engine.save(target, {"step": 1})
        link.symlink_to(target.name)
        engine.save(link, {"step": 2})
        assert link.is_symlink()
        assert engine.load(target, {"step": 0}) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]


def test_save_onto_a_file_or_foreign_directory_is_refused_untouched(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("keep me")
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "x.csv").write_text("1,2")
    with tp.Engine("single") as engine:
        with pytest.raises(tp.CheckpointError, match="it is a file"):
            engine.save(file, {"step": 1})
        with pytest.raises(tp.CheckpointError, match="not a torchplug checkpoint"):
            engine.save(foreign, {"step": 1})
    assert file.read_text() == "keep me"
    assert (foreign / "x.csv").read_text() == "1,2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


def test_glob_characters_in_a_name_touch_no_other_checkpoint(tmp_path):
    in_progress = tmp_path / ".run1.tmp-0123456789ab"
    in_progress.mkdir()
    with tp.Engine("single") as engine:
        engine.save(tmp_path / "run[12]", {"step": 1})
    assert in_progress.is_dir()
    assert (tmp_path / "run[12]" / "manifest.json").is_file()


def test_disk_full_names_the_errno(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "x.distcp"))

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with tp.Engine("single") as engine:
        engine.save(tmp_path / "ckpt", {"step": 1})
        with pytest.raises(tp.CheckpointError, match="ENOSPC: No space left on device"):
            engine.save(tmp_path / "ckpt", {"step": 2, "t": torch.ones(3)})
        assert engine.load(tmp_path / "ckpt", {"step": 0}) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# -- found by an outside review ------------------------------------------------------------------


def test_an_empty_key_variable_is_an_error_not_no_key(monkeypatch, single_ckpt):
    monkeypatch.setenv("TORCHPLUG_CHECKPOINT_KEY", "")
    with pytest.raises(tp.CheckpointError, match="set but empty"):
        tp.Engine("single")


def test_a_forged_shape_cannot_make_a_load_allocate_more_than_the_files_hold(copy3):
    def change(body):
        meta = body["tensors"]["model/0.weight"]
        meta["shape"] = [10**11]
        meta["chunks"][0].update(offsets=[0], sizes=[10**11])

    forge(copy3, change)
    with pytest.raises(tp.CheckpointError, match="large enough for its 100000000000 elements"):
        load_state(str(copy3))


def test_an_unsaveable_value_is_named_by_its_key(tmp_path):
    with tp.Engine("single") as engine:
        with pytest.raises(tp.CheckpointError, match="Cannot save set at s:"):
            engine.save(tmp_path / "a", {"s": {1, 2}})
        with pytest.raises(tp.CheckpointError, match="Cannot save set at d/inner/1:"):
            engine.save(tmp_path / "b", {"d": {"inner": [0, {3}]}})


def test_convert_without_numpy_says_what_to_install(single_ckpt, tmp_path, monkeypatch):
    import sys

    from torchplug.cli.conversion import convert

    monkeypatch.setitem(sys.modules, "numpy", None)
    with pytest.raises(
        tp.CheckpointError, match=r"needs the 'numpy' package.*torchplug\[convert\]"
    ):
        convert(single_ckpt[0], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_entry_only_its_writer_restores_is_an_error_naming_it_unless_not_strict(tmp_path):
    """A backend may write entries of its own kind (through checkpoint.save's entries_of); no
    other strategy guesses at them."""
    from torchplug import checkpoint

    path = str(tmp_path / "ckpt")
    with tp.Engine("single") as engine:
        model = engine.setup(make_model())
        state = {"model": model, "opt": None, "step": 4}

        def entries_of(_: Path) -> tuple[dict, dict]:
            tensors: dict = {}
            model_state = engine.full_state(model)["model"]
            found = {
                "model": {
                    "kind": "module",
                    "data": checkpoint.encode(model_state, "model", tensors),
                },
                "opt": {"kind": "mybackend-optimizer", "data": "native/"},
                "step": {"kind": "value", "data": checkpoint.encode(4, "step", tensors)},
            }
            return found, tensors

        checkpoint.save(engine, path, state, {}, entries_of=entries_of)
    with tp.Engine("single") as engine:
        model = engine.setup(make_model(seed=3))
        optimizer = torch.optim.AdamW(model.parameters())
        state = {"model": model, "opt": optimizer, "step": 0}
        with pytest.raises(tp.CheckpointError) as info:
            engine.load(path, state)
        message = str(info.value)
        assert "entry 'opt' is of kind 'mybackend-optimizer'" in message
        assert "strict=False" in message and "written by 'single'" in message
        engine.load(path, state, strict=False)
        assert state["step"] == 4 and not optimizer.state
