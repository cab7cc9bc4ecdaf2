"""torchplug convert: a checkpoint from any strategy -> model.safetensors for a plain nn.Module."""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import torchplug as tp
from support.reference import make_model, train


def convert(*args: str, umask: int = -1) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchplug", "convert", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        umask=umask,
    )


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_converted_sharded_checkpoint_gives_the_trained_models_outputs(ranks, tmp_path, strategy):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    trained = ranks.run(train, strategy, steps=3, save_to=str(ckpt))[0]
    run = convert(str(ckpt), str(out), "--optimizer", "--progress")
    assert run.returncode == 0, run.stderr
    assert "converting [" in run.stderr  # the progress bar
    fresh = make_model(seed=99)
    fresh.load_state_dict(load_file(str(out / "model.safetensors")))
    reference = make_model(seed=99)
    reference.load_state_dict(trained["params"])
    x = torch.randn(5, 8)
    assert torch.equal(fresh(x), reference(x))
    optimizer = load_file(str(out / "optimizer.safetensors"))
    assert torch.equal(
        optimizer["state.0.weight.exp_avg"], trained["optimizer"]["0.weight.exp_avg"]
    )


@pytest.mark.slow
def test_convert_errors_name_the_problem(tmp_path):
    run = convert(str(tmp_path / "missing"), str(tmp_path / "out"))
    assert run.returncode == 2 and "No torchplug checkpoint" in run.stderr
    with tp.Engine("single") as engine:
        engine.save(tmp_path / "two", {"a": make_model(), "b": make_model(1), "step": 1})
    run = convert(str(tmp_path / "two"), str(tmp_path / "out"))
    assert run.returncode == 2 and "--entry" in run.stderr
    run = convert(str(tmp_path / "two"), str(tmp_path / "out"), "--entry", "b")
    assert run.returncode == 0, run.stderr
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(loaded["0.weight"], make_model(1)[0].weight)


class Touch:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_a_torch_save_file_is_named_as_not_a_checkpoint_and_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    torch.save({"weight": torch.ones(2), "trap": Touch(str(marker))}, tmp_path / "model.pt")
    run = convert(str(tmp_path / "model.pt"), str(tmp_path / "out"))
    assert run.returncode == 2
    assert "is not a torchplug checkpoint: it is a torch.save file" in run.stderr
    assert "never unpickles" in run.stderr and "engine.save(path, {'model': model})" in run.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_checkpoint_of_a_state_dict_says_it_holds_no_model(tmp_path):
    with tp.Engine("single") as engine:
        engine.save(tmp_path / "ckpt", {"model": make_model().state_dict()})
    run = convert(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert run.returncode == 2 and "holds no model" in run.stderr
    assert "'model' (" in run.stderr and "not its state_dict()" in run.stderr


@pytest.mark.slow
def test_converted_files_honour_the_umask(tmp_path):
    with tp.Engine("single") as engine:
        engine.save(tmp_path / "ckpt", {"model": make_model()})
    for mask, mode in ((0o022, 0o644), (0o077, 0o600)):
        out = tmp_path / f"out{mask:o}"
        run = convert(str(tmp_path / "ckpt"), str(out), umask=mask)
        assert run.returncode == 0, run.stderr
        assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == mode


def _planted_pickle(directory, marker) -> None:
    """A directory laid out like DeepSpeed's native checkpoint whose files run code when
    unpickled (they would create ``marker``)."""
    import pickle

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    step = directory / "global_step1"
    step.mkdir(parents=True)
    (directory / "latest").write_text("global_step1")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (step / name).write_bytes(pickle.dumps(Payload()))


def test_a_directory_without_a_manifest_is_never_unpickled_without_the_opt_in(tmp_path):
    source, marker = tmp_path / "native", tmp_path / "ran"
    _planted_pickle(source, marker)
    run = convert(str(source), str(tmp_path / "out"))
    assert run.returncode == 2 and not marker.exists()
    assert "has no manifest.json" in run.stderr and "unpickles its files" in run.stderr
    assert "--from deepspeed --trust-pickles" in run.stderr


def test_with_a_key_set_a_directory_without_a_manifest_is_refused_even_when_trusted(tmp_path):
    source, marker = tmp_path / "native", tmp_path / "ran"
    _planted_pickle(source, marker)
    env = {**os.environ, "TORCHPLUG_CHECKPOINT_KEY": "k" * 32}
    run = subprocess.run(
        [sys.executable, "-m", "torchplug", "convert", str(source), str(tmp_path / "out")]
        + ["--from", "deepspeed", "--trust-pickles"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 2 and not marker.exists()
    assert "a checkpoint key is set" in run.stderr and "only signed" in run.stderr


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GB", 2 * 10**9), ("500MiB", 500 * 2**20), ("1.5 kb", 1500), ("4096", 4096), (77, 77)],
)
def test_shard_sizes_read_as_hugging_face_counts_them(text, size):
    from torchplug.cli.conversion import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["2 apples", "", "-1GB", "0", "GB"])
def test_a_bad_shard_size_says_what_is_expected(text):
    from torchplug.cli.conversion import parse_size

    with pytest.raises(tp.CheckpointError, match="expected a number of bytes or a number with a"):
        parse_size(text)
