"""Restarts resume by themselves: numbered checkpoints, rotation, RNG and loader position."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp
from support.commands import torchplug
from support.paths import TESTS

LAUNCHED = textwrap.dedent(
    f"""
    import sys, torch
    sys.path.insert(0, {str(TESTS)!r})
    from support.restart_body import train
    result = train(sys.argv[1], kill_after=7)
    if int(__import__("os").environ["RANK"]) == 0:
        torch.save(result, sys.argv[2])
    """
)


@pytest.mark.slow
def test_sigkilled_rank_restarts_and_ends_bit_equal_to_an_uninterrupted_run(ranks, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    out = tmp_path / "result.pt"
    run = torchplug(
        "launch",
        "-n",
        "2",
        "--max-restarts",
        "1",
        str(script),
        str(tmp_path / "ckpt"),
        str(out),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    restarted = torch.load(out, weights_only=True)
    assert restarted["attempt"] == 1 and restarted["resumed"] == 6  # killed after step 7

    from support.restart_body import train

    uninterrupted = ranks.run(train, str(tmp_path / "clean"), timeout=120)[0]
    assert uninterrupted["resumed"] is None
    assert restarted["params"].keys() == uninterrupted["params"].keys()
    for name, value in uninterrupted["params"].items():
        assert torch.equal(restarted["params"][name], value), name
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-"))
    assert kept == ["step-12", "step-15"]  # keep_last=2


def batches(loader, n=None):
    out = []
    for x, _ in loader:
        out.append(x.clone())
        if n is not None and len(out) == n:
            break
    return out


def make_loader(engine, generator=None):
    data = TensorDataset(torch.arange(40.0).reshape(20, 2), torch.zeros(20))
    loader = DataLoader(data, batch_size=3, shuffle=True, generator=generator)
    return engine.setup_dataloader(loader)


@pytest.mark.parametrize("own_generator", [False, True])
def test_loader_resumes_mid_epoch_with_the_same_order_and_rng(tmp_path, own_generator):
    def make(engine):
        g = torch.Generator().manual_seed(5) if own_generator else None
        return make_loader(engine, g)

    with tp.Engine("single", checkpoint_dir=tmp_path, resume="latest") as engine:
        torch.manual_seed(0)
        random.seed(0)
        loader = make(engine)
        first = batches(loader)  # epoch 0
        expected = batches(loader)  # epoch 1, all of it
        after = torch.rand(3)  # the RNG after epoch 1 started and ran

        torch.manual_seed(0)
        random.seed(0)
        loader = make(engine)
        assert all(torch.equal(a, b) for a, b in zip(batches(loader), first, strict=True))
        seen = batches(loader, 3)  # epoch 1, 3 of its 7 batches, then a checkpoint
        state = {"loader": loader, "step": 10}
        engine.save_checkpoint(state)
        torch.rand(100)  # lose the RNG state
        random.random()

        fresh = {"loader": make(engine), "step": 0}
        assert engine.resume(fresh) == 10 and fresh["step"] == 10
        rest = batches(fresh["loader"])
        assert len(seen) + len(rest) == len(expected)
        for got, want in zip(seen + rest, expected, strict=True):
            assert torch.equal(got, want)
        assert torch.equal(torch.rand(3), after)


def test_rng_states_are_restored(tmp_path):
    with tp.Engine("single", checkpoint_dir=tmp_path, resume="latest") as engine:
        torch.manual_seed(3)
        random.seed(3)
        engine.save_checkpoint({"step": 1})
        want = (torch.rand(4), random.random(), random.gauss(0, 1))
        engine.resume({"step": 0})
        assert torch.equal(torch.rand(4), want[0])
        assert (random.random(), random.gauss(0, 1)) == want[1:]
    manifest = (tmp_path / "step-1" / "manifest.json").read_text()
    assert "pickle" not in manifest


def test_rotation_keeps_the_newest_complete_checkpoint(tmp_path):
    (tmp_path / "step-99").mkdir()  # a newer number, but incomplete: no manifest
    with tp.Engine("single", checkpoint_dir=tmp_path, resume="latest", keep_last=1) as engine:
        for step in (1, 2, 3):
            engine.save_checkpoint({"step": step, "value": step * 10})
        names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
        assert names == ["step-3", "step-99"]
        state = {"step": 0, "value": 0}
        assert engine.resume(state) == 3 and state["value"] == 30


def test_a_crash_while_rotation_removes_a_checkpoint_leaves_no_false_complete_one(
    tmp_path, monkeypatch
):
    """Killed while deleting step-1's files: what is left is not a step-N with a manifest (it
    was renamed out of the namespace first), so resume never picks a checkpoint missing files;
    the next rotation removes the leftover."""
    import shutil

    from torchplug.engine import resume

    real = shutil.rmtree

    def killed_midway(path, ignore_errors=False):
        data = sorted(p for p in Path(path).rglob("*") if p.is_file() and p.name != "manifest.json")
        data[0].unlink()  # one data file gone, the manifest still there: then the crash
        raise KeyboardInterrupt

    with tp.Engine("single", checkpoint_dir=tmp_path, resume="latest", keep_last=1) as engine:
        engine.save_checkpoint({"step": 1, "value": 10})
        monkeypatch.setattr(resume.shutil, "rmtree", killed_midway)
        with pytest.raises(KeyboardInterrupt):
            engine.save_checkpoint({"step": 2, "value": 20})
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("step-")] == ["step-2"]
        assert [step for step, _ in resume.complete(tmp_path)] == [2]
        monkeypatch.setattr(resume.shutil, "rmtree", real)
        engine.save_checkpoint({"step": 3, "value": 30})
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]  # leftover removed


def test_a_renamed_checkpoint_is_not_resumed_as_the_step_its_name_says(tmp_path):
    with tp.Engine("single", checkpoint_dir=tmp_path, resume="latest") as engine:
        engine.save_checkpoint({"step": 5})
        (tmp_path / "step-5").rename(tmp_path / "step-999")
        with pytest.raises(tp.CheckpointError) as info:
            engine.resume({"step": 0})
        assert "its name says step 999, but its metadata says step 5" in str(info.value)


def test_a_user_key_named_like_the_rng_entry_is_refused(tmp_path):
    with (
        tp.Engine("single", checkpoint_dir=tmp_path) as engine,
        pytest.raises(tp.CheckpointError, match="under the key 'rng', which your state uses too"),
    ):
        engine.save_checkpoint({"step": 1, "rng": [1, 2, 3]})


def test_resume_with_nothing_saved_yet_is_a_fresh_start(tmp_path):
    with tp.Engine("single", checkpoint_dir=tmp_path / "none", resume="latest") as engine:
        state = {"step": 0}
        assert engine.resume(state) is None and state == {"step": 0}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"resume": "newest", "checkpoint_dir": "c"}, "resume='newest' is not a resume mode"),
        ({"resume": "latest"}, "resume='latest' and keep_last need checkpoint_dir"),
        ({"keep_last": 0, "checkpoint_dir": "c"}, "keep_last=0 is not a number of checkpoints"),
    ],
)
def test_bad_resume_arguments(kwargs, expected):
    with pytest.raises(tp.ConfigurationError, match=expected.replace("(", r"\(")):
        tp.Engine("single", **kwargs)


def test_save_checkpoint_needs_a_step(tmp_path):
    with (
        tp.Engine("single", checkpoint_dir=tmp_path) as engine,
        pytest.raises(tp.CheckpointError, match="save_checkpoint needs the training step"),
    ):
        engine.save_checkpoint({"model": torch.nn.Linear(1, 1)})


def resume_without_numpy(directory: str) -> int | None:
    """engine.resume on 2 ranks with numpy unusable (an install made as the README says)."""

    def unavailable(self: torch.Tensor) -> None:
        raise RuntimeError("Numpy is not available")

    real = torch.Tensor.numpy
    torch.Tensor.numpy = unavailable  # type: ignore[method-assign]
    try:
        with tp.Engine("ddp", checkpoint_dir=directory, resume="latest") as engine:
            model = engine.setup(torch.nn.Linear(2, 1))
            engine.save_checkpoint({"model": model}, step=3)
            return engine.resume({"model": model})
    finally:
        torch.Tensor.numpy = real  # type: ignore[method-assign]


def test_resume_needs_no_numpy(ranks, tmp_path):
    assert ranks.run(resume_without_numpy, str(tmp_path / "ckpts")) == [3, 3]
