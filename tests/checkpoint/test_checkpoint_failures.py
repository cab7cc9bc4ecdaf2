"""A checkpoint that fails on any rank, in any phase, fails on every rank within seconds, with the
failing rank and the OS error named; the previous checkpoint stays and no temporary is left."""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import torchplug as tp
from support.reference import make_model

PHASES = {
    # phase: (failing rank, what breaks, errno name expected in the message)
    "prepare": (0, "torchplug.checkpoint.files.temporary_dir", "EACCES"),
    "capture": (1, "torchplug.checkpoint.io.capture", "EIO"),
    "write": (1, "torchplug.checkpoint.tensors.write", "ENOSPC"),
    "hash": (1, "torchplug.checkpoint.io._describe", "EIO"),  # sizes, sha256s, fsync
    "commit": (0, "torchplug.checkpoint.files.swap_into_place", "EXDEV"),
}


def save_with_a_failure(path: str, phase: str) -> dict[str, Any]:
    """Save once, then save again with ``phase`` broken on one rank; report what each saw."""
    import importlib

    rank_to_fail, target, code = PHASES[phase]
    # Timeouts far above the expected time (well under a second): only a real wait for one
    # of them (a rank left behind) can fail the "ends fast" assertion below.
    with tp.Engine("fsdp", timeout=1200.0, checkpoint_timeout=1200.0) as engine:
        model = make_model()
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        engine.save(path, {"model": model, "optimizer": optimizer, "step": 1})
        module_name, attr = target.rsplit(".", 1)
        module = importlib.import_module(module_name)
        original = getattr(module, attr)

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise OSError(getattr(errno, code), f"injected {phase} failure", path)

        if engine.rank == rank_to_fail:
            setattr(module, attr, broken)
        start = time.monotonic()
        try:
            engine.save(path, {"model": model, "optimizer": optimizer, "step": 2})
            message = None
        except tp.CheckpointError as exc:
            message = str(exc)
        finally:
            setattr(module, attr, original)
        elapsed = time.monotonic() - start
        state = {"step": 0}
        engine.load(path, state)
        leftovers = [p.name for p in Path(path).parent.iterdir() if p.name != Path(path).name]
        return {"message": message, "elapsed": elapsed, "step": state["step"], "left": leftovers}


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_a_failure_in_any_phase_ends_the_save_on_every_rank(ranks, tmp_path, phase):
    rank, _, code = PHASES[phase]
    results = ranks.run(save_with_a_failure, str(tmp_path / "ckpt"), phase, timeout=600)
    for result in results:
        assert result["message"] is not None, "the save reported success"
        assert f"failed on rank {rank}" in result["message"]
        assert code in result["message"] and "ckpt" in result["message"]
        assert "previous checkpoint at that path, if any, is intact" in result["message"]
        assert result["elapsed"] < 60  # 20x below the 1200 s it would otherwise wait
        assert result["step"] == 1  # the previous checkpoint, intact
        assert result["left"] == []  # no temporary directory left behind


def save_on_rank_zero_only(path: str) -> dict[str, Any]:
    done = Path(path).parent / "rank-0-done"
    with tp.Engine("ddp", checkpoint_timeout=3) as engine:
        start = time.monotonic()
        message = None
        if engine.is_main:
            try:
                engine.save(path, {"step": 1})
            except tp.CheckpointError as exc:
                message = str(exc)
            done.touch()
        else:
            # The other ranks go on training until rank 0 is out of its save (or for far longer
            # than the 3 s it should take): a rank 0 that waited for them fails, however slow
            # the machine.
            deadline = time.monotonic() + 600
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        elapsed = time.monotonic() - start
        engine.barrier()
        left = sorted(p.name for p in Path(path).parent.iterdir() if p != done)
        engine.save(path, {"step": 2})  # called on every rank: works, the ranks are in step
        return {"message": message, "elapsed": elapsed, "left": left, "after": engine.load(path)}


def test_save_on_one_rank_only_is_refused_not_hung(ranks, tmp_path):
    main, _ = ranks.run(save_on_rank_zero_only, str(tmp_path / "ckpt"), timeout=900)
    assert "rank(s) 1 did not call engine.save" in main["message"]
    assert "not inside `if engine.is_main:`" in main["message"]
    assert main["elapsed"] < 60  # 3 s timeout; the other rank would have waited 600 s
    assert main["left"] == []
    assert main["after"] == {"step": 2}


def save_and_load_without_numpy(path: str) -> list[float]:
    """Multi-process save and load with numpy unusable (an install made as the README says)."""

    def unavailable(self: torch.Tensor) -> Any:
        raise RuntimeError("Numpy is not available")

    real = torch.Tensor.numpy
    torch.Tensor.numpy = unavailable  # type: ignore[method-assign]
    try:
        with tp.Engine("ddp") as engine:
            model = engine.setup(make_model())
            engine.save(path, {"model": model, "step": 3})
            other = engine.setup(make_model(seed=7))
            state = {"model": other, "step": 0}
            engine.load(path, state)
            assert state["step"] == 3
            return [p.sum().item() for p in other.parameters()]
    finally:
        torch.Tensor.numpy = real  # type: ignore[method-assign]


def test_save_and_load_need_no_numpy(ranks, tmp_path):
    first, second = ranks.run(save_and_load_without_numpy, str(tmp_path / "ckpt"))
    assert first == second == [p.sum().item() for p in make_model().parameters()]


def count_hashing(path: str, strategy: str, key: str | None = None) -> list[str]:
    """The files this rank hashed while loading (up front, or as read for use); with a key,
    also those it mapped from another rank's sealed memory file (``"mapped:<name>"``), with
    every loaded parameter checked against the saved model."""
    from torchplug.checkpoint import sealed, verify

    hashed: list[str] = []
    real, real_read, real_map = verify.hash_pinned, verify.VerifiedBytes._read_and_check, None
    real_map = sealed.map_peer

    def counting(file: Path, algorithm: str) -> tuple:
        hashed.append(Path(file).name)
        return real(file, algorithm)

    def reading(self, name: str, share: bool = False) -> memoryview:
        hashed.append(Path(name).name)
        return real_read(self, name, share)

    def mapping(pid: int, fd: int, size: int) -> memoryview | None:
        view = real_map(pid, fd, size)
        assert view is not None, "a peer's sealed file on this host could not be mapped"
        return view

    verify.hash_pinned = counting
    verify.VerifiedBytes._read_and_check = reading
    sealed.map_peer = mapping
    try:
        with tp.Engine(strategy, checkpoint_key=key) as engine:
            model = engine.setup(make_model(seed=4))
            engine.load(path, {"model": model})
            loaded = engine.full_state(model)["model"]
    finally:
        verify.hash_pinned = real
        verify.VerifiedBytes._read_and_check = real_read
        sealed.map_peer = real_map
    saved = make_model().state_dict()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved), "loaded != saved"
    return sorted(hashed)


def train_fsdp_and_save(path: str, key: str | None = None) -> None:
    with tp.Engine("fsdp", checkpoint_key=key) as engine:
        model = engine.setup(make_model())
        engine.save(path, {"model": model})


def test_each_file_is_hashed_by_one_rank(ranks, tmp_path):
    """Without a key (the threat is corruption) the files are hashed up front, split over the
    ranks, and read in place."""
    path = str(tmp_path / "ckpt")
    ranks.run(train_fsdp_and_save, path)
    files = [p for p in Path(path).rglob("tensors/**/*") if p.is_file()]
    assert len(files) == 2  # one shard file per rank (beside manifest.json and manifest.index)
    assert [len(h) for h in ranks.run(count_hashing, path, "ddp")] == [1, 1]


def test_signed_each_file_is_hashed_once_per_host_and_mapped_by_the_others(ranks, tmp_path):
    """With a key the bytes used are the bytes hashed, from memory: ddp ranks both need both
    shard files (whole tensors), so each file is read and hashed by one rank into a sealed
    memory file the other maps (each byte hashed once per host, the model loaded bit for bit);
    fsdp ranks need only their own file, which each reads alone. No rank hashes a file twice."""
    path, key = str(tmp_path / "ckpt"), "a key of at least sixteen bytes"
    ranks.run(train_fsdp_and_save, path, key)
    files = sorted(p.name for p in Path(path).rglob("tensors/**/*") if p.is_file())
    assert len(files) == 2
    assert ranks.run(count_hashing, path, "ddp", key) == [[files[0]], [files[1]]]
    mine = ranks.run(count_hashing, path, "fsdp", key)
    assert [len(m) for m in mine] == [1, 1] and sorted(mine[0] + mine[1]) == files


def save_under_a_file(path: str) -> dict[str, Any]:
    with tp.Engine("ddp", timeout=1800.0, checkpoint_timeout=1800.0) as engine:
        start = time.monotonic()
        try:
            engine.save(path, {"step": 1})
        except tp.CheckpointError as exc:
            return {"message": str(exc), "elapsed": time.monotonic() - start}
    return {"message": None}


def test_a_real_os_error_on_rank_zero_reaches_every_rank(ranks, tmp_path):
    (tmp_path / "a-file").write_text("")
    for result in ranks.run(save_under_a_file, str(tmp_path / "a-file" / "ckpt"), timeout=600):
        assert "failed on rank 0" in result["message"]
        assert "EEXIST" in result["message"] or "ENOTDIR" in result["message"]
        assert result["elapsed"] < 60  # 30x below the 1800 s timeouts it would wait for


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs: a real full disk (needs root and mount rights; skipped, saying so,
    where the machine gives neither)."""
    import subprocess

    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
        capture_output=True, text=True,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()[:200]}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_disk_is_named_enospc_not_a_torch_internal_error(small_disk):
    with tp.Engine("single") as engine:
        engine.save(small_disk / "ckpt", {"step": 1})
        model = engine.setup(torch.nn.Linear(512, 512))  # 1 MB: four times the disk
        with pytest.raises(tp.CheckpointError) as error:
            engine.save(small_disk / "ckpt", {"step": 2, "model": model})
        message = str(error.value)
        assert "ENOSPC: No space left on device" in message, message
        assert "MB free of 0.3 MB" in message and "save again" in message
        assert engine.load(small_disk / "ckpt", {"step": 0}) == {"step": 1}  # the last one kept
    assert sorted(p.name for p in small_disk.iterdir()) == ["ckpt"]  # nothing left behind
