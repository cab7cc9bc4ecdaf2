"""Every corruption of a checkpoint either fails with a CheckpointError naming a file or a key, or
loads a state bit-identical to the original: never a silently different state, never another
exception type.

Every byte of manifest.json is flipped in turn (two ways: the lowest bit, which keeps most bytes
printable, and 0x20, which swaps letter case), a sample of bytes of every tensor file is flipped,
and every file is truncated at several points, manifest.index among them. (The format has no
pickled ``.metadata`` to fuzz: the tensor index is manifest.index, its digest in manifest.json;
tests/checkpoint/test_checkpoint_index.py fuzzes it re-recorded as a forger would.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

import torchplug as tp
from support.checkpoint_attacks import Loader, load_state, same
from support.reference import train


@pytest.fixture(scope="module")
def checkpoints(ranks, tmp_path_factory) -> list[Path]:
    single = tmp_path_factory.mktemp("fuzz") / "single"
    train("single", steps=1, save_to=str(single))
    sharded = tmp_path_factory.mktemp("fuzz") / "two-ranks"
    ranks.run(train, "fsdp", steps=1, save_to=str(sharded))
    return [single, sharded]


def _outcome(load: Loader, path: Path, baseline: dict, what: str, named: str) -> str:
    try:
        loaded = load(path)
    except tp.CheckpointError as exc:
        assert named in str(exc) or "manifest.json" in str(exc), f"{what}: {exc}"
        return "refused"
    except Exception as exc:  # noqa: BLE001 - any other type is the failure being looked for
        pytest.fail(f"{what}: {type(exc).__name__}: {exc}")
    assert same(loaded, baseline), f"{what}: loaded a different state"
    return "same"


def _variants(data: bytes, every: int) -> list[tuple[str, bytes]]:
    out = []
    for i in range(0, len(data), every):
        for mask in (0x01, 0x20):
            mutated = bytearray(data)
            mutated[i] ^= mask
            out.append((f"byte {i} ^ {mask:#x}", bytes(mutated)))
    for cut in sorted({0, 1, len(data) // 3, len(data) // 2, len(data) - 1}):
        out.append((f"truncated to {cut}", data[:cut]))
    return out


def test_every_corruption_is_refused_or_harmless(checkpoints):
    counts = {"refused": 0, "same": 0}
    load = Loader()
    for root in checkpoints:
        baseline = load_state(str(root), guard=False)
        assert same(load(root), baseline)
        files = sorted(p for p in root.rglob("*") if p.is_file())
        assert len(files) >= 2
        for file in files:
            name = file.relative_to(root).as_posix()
            original = file.read_bytes()
            every = 1 if file.name == "manifest.json" else max(1, len(original) // 150)
            try:
                for label, data in _variants(original, every):
                    file.write_bytes(data)
                    counts[
                        _outcome(load, root, baseline, f"{root.name}/{name} {label}", file.name)
                    ] += 1
            finally:
                file.write_bytes(original)
    load.engine.close()
    assert counts["refused"] > 1000
