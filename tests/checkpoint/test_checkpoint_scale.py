"""Checkpoints at scale and under concurrent change: the signature before any validation work,
validation linear-ish in the chunk count, and the bytes loaded are the bytes verified."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

import torchplug as tp
from support.checkpoint_attacks import _random_tensor
from torchplug.checkpoint import manifest as mf

KEY = b"k" * 32


def _manifest(ranks: int, tensors: int, rows: int = 64, cols: int = 8) -> dict:
    """A legitimate fsdp-shaped body: every tensor split by rows over ``ranks`` files."""
    files = {f"tensors/__{r}_0.distcp": {"size": 10**9, "sha256": "0" * 64} for r in range(ranks)}
    index = {}
    per = max(rows // ranks, 1)
    for t in range(tensors):
        chunks = []
        for r in range(ranks):
            start = min(r * per, rows)
            size = rows - start if r == ranks - 1 else min(per, rows - start)
            chunks.append({
                "offsets": [start, 0], "sizes": [size, cols], "file": f"tensors/__{r}_0.distcp",
                "offset": t * 4096, "length": 4096,
            })  # fmt: skip
        index[f"model.layer{t}.weight"] = {
            "dtype": "float32",
            "shape": [rows, cols],
            "chunks": chunks,
        }
    body = mf.build({"strategy": {"name": "fsdp", "options": {}}, "world_size": ranks, "step": 1},
                    {"model": {"kind": "module", "data": {}}}, index, files)  # fmt: skip
    return body


def _counting(monkeypatch, name: str) -> list[int]:
    """Count the boxes ``manifest.<name>`` is handed (work, not wall time)."""
    calls = [0]
    real = getattr(mf, name)

    def counting(shape, boxes, *rest):
        calls[0] += len(boxes)
        return real(shape, boxes, *rest)

    monkeypatch.setattr(mf, name, counting)
    return calls


@pytest.mark.parametrize("ranks", [256, 1024])
def test_a_legitimate_manifest_of_many_ranks_validates_in_work_linear_in_its_chunks(
    ranks, monkeypatch
):
    rows = ranks * 2
    body = _manifest(ranks, tensors=40, rows=rows)
    raw = json.dumps(body).encode()
    per_tensor = _counting(monkeypatch, "_disjoint_columns")
    pairwise = _counting(monkeypatch, "_disjoint")
    batched = [0]
    real = mf._validate_group

    def counting(dims, group, sizes):
        batched[0] += sum(len(chunks) for *_, chunks in group)
        return real(dims, group, sizes)

    monkeypatch.setattr(mf, "_validate_group", counting)
    parsed = mf.parse(raw, "m.json")
    assert len(parsed["tensors"]) == 40
    assert batched[0] == 40 * ranks  # each chunk looked at once, all tensors together
    assert per_tensor == pairwise == [0]  # no tensor by tensor work, no pairwise comparison


def test_the_columnwise_chunk_checks_agree_with_the_chunk_by_chunk_ones(monkeypatch):
    """The fast column-wise path and the loop that explains failures accept exactly the same
    tensors, on 3000 random layouts, spoiled and not."""
    rng = random.Random(0)
    outcomes = {True: 0, False: 0}
    for _ in range(3000):
        meta, files = _random_tensor(rng)
        results = []
        for fast in (True, False):
            with monkeypatch.context() as m:
                if not fast:
                    m.setattr(mf, "_columns", lambda *a: None)
                try:
                    mf._validate_tensor("t", meta, files)
                    results.append(None)
                except (tp.CheckpointError, mf._Invalid) as exc:
                    results.append(str(exc))
        assert results[0] == results[1], (meta, results)
        outcomes[results[0] is None] += 1
    assert min(outcomes.values()) > 300, outcomes  # both kinds well represented


def test_the_batched_checks_accept_only_what_the_tensor_by_tensor_checks_accept():
    """All tensors of a manifest checked at once: on 2000 random manifests of 1-4 random tensors
    (spoiled and not), every tensor the batch accepts passes the tensor-by-tensor checks, and a
    manifest whose tensors all pass (one raw-position style per dimensionality, as one writer
    writes them) is accepted whole."""
    rng = random.Random(1)
    accepted_whole = 0
    for _ in range(2000):
        tensors, files = {}, None
        for t in range(rng.randint(1, 4)):
            tensors[f"t{t}"], files = _random_tensor(rng)
        sizes = {name: info["size"] for name, info in files.items()}
        accepted = mf._validate_batch(tensors, sizes)
        valid = set()
        for name, meta in tensors.items():
            try:
                mf._validate_tensor(name, meta, files, sizes)
                valid.add(name)
            except (tp.CheckpointError, mf._Invalid):
                pass
        assert accepted <= valid, (tensors, accepted, valid)
        styles = {}
        for meta in tensors.values():
            raws = {"raw" in c for c in meta["chunks"] if isinstance(c, dict)}
            styles.setdefault(len(meta["shape"]), set()).update(raws)
        if valid == set(tensors) and all(len(v) == 1 for v in styles.values()):
            assert accepted == valid, tensors
            accepted_whole += 1
    assert accepted_whole > 100, accepted_whole


def test_overlapping_and_gapped_layouts_are_refused_in_every_shape():
    def refused(shape, boxes):
        return not mf._disjoint(shape, [(list(o), list(s)) for o, s in boxes])

    assert not refused([4, 4], [((0, 0), (2, 4)), ((2, 0), (2, 4))])
    assert not refused(
        [4, 4], [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))]
    )
    assert not refused([6, 4], [((0, 0), (3, 4)), ((3, 0), (3, 1)), ((3, 1), (3, 3))])  # not a grid
    assert refused([4, 4], [((0, 0), (3, 4)), ((2, 0), (2, 4))])  # rows 2 overlap
    assert refused([4, 4], [((0, 0), (2, 3)), ((1, 1), (2, 3))])
    assert refused([6, 4], [((0, 0), (3, 4)), ((2, 0), (4, 1)), ((3, 1), (3, 3))])  # not a grid
    assert refused([2, 2, 2], [((0, 0, 0), (2, 2, 1)), ((0, 1, 0), (1, 1, 2))])
    assert not refused([8], [((4,), (4,)), ((0,), (4,))])
    assert refused([8], [((0,), (5,)), ((4,), (3,))])


def test_a_forged_unsigned_manifest_is_refused_before_any_validation_work(monkeypatch, tmp_path):
    """1 MB of chunks, no signature, a key configured: refused for the signature, no chunk
    looked at."""
    body = _manifest(ranks=12000, tensors=1, rows=12000)
    raw = json.dumps(body).encode()
    assert len(raw) > 1_000_000
    root = tmp_path / "forged"
    root.mkdir()
    (root / "manifest.json").write_bytes(raw)
    calls = _counting(monkeypatch, "_disjoint")
    monkeypatch.setattr(mf, "_validate_tensor", lambda *a: calls.__setitem__(0, calls[0] + 1))
    from torchplug.checkpoint.io import read_manifest

    with pytest.raises(tp.CheckpointError, match="is not signed"):
        read_manifest(root, KEY)
    assert calls == [0]
    # signed with another key: also refused before validation
    value = hmac.new(b"x", mf.canonical(body), hashlib.sha256).hexdigest()
    body["signature"] = {"alg": "hmac-sha256", "value": value}
    (root / "manifest.json").write_text(json.dumps(body))
    with pytest.raises(tp.CheckpointError, match="does not match the configured key"):
        read_manifest(root, KEY)
    assert calls == [0]


def _save(path: Path, value: float) -> None:
    with tp.Engine("single", checkpoint_key=KEY) as engine:
        model = torch.nn.Linear(64, 64)
        with torch.no_grad():
            model.weight.fill_(value)
            model.bias.fill_(value)
        engine.save(path, {"model": engine.setup(model)})


def test_files_swapped_during_loads_never_give_unverified_bytes(tmp_path):
    genuine, other = tmp_path / "genuine", tmp_path / "other"
    _save(genuine, 1.0)
    _save(other, 2.0)  # the same layout, other bytes: what an attacker swaps in
    data = [p.relative_to(genuine) for p in genuine.rglob("*.distcp")]
    assert data and all((other / p).exists() for p in data)
    keep = tmp_path / "keep"
    keep.mkdir()
    for i, rel in enumerate(data):
        os.link(genuine / rel, keep / f"genuine-{i}")
        os.link(other / rel, keep / f"forged-{i}")
    stop = threading.Event()
    swaps = [0]

    def swapper() -> None:
        while not stop.is_set():
            for which in ("forged", "genuine"):
                for i, rel in enumerate(data):
                    tmp = keep / f"tmp-{i}"
                    os.link(keep / f"{which}-{i}", tmp)
                    os.replace(tmp, genuine / rel)
                swaps[0] += 1
                time.sleep(random.random() * 0.004)  # a few ms: about a load's verify/read gap

    thread = threading.Thread(target=swapper, daemon=True)
    outcomes = {"genuine": 0, "refused": 0, "unverified": 0}
    with tp.Engine("single", checkpoint_key=KEY) as engine:
        model = engine.setup(torch.nn.Linear(64, 64))
        thread.start()
        try:
            for _ in range(200):
                with torch.no_grad():
                    model.weight.zero_()
                try:
                    engine.load(genuine, {"model": model})
                except tp.CheckpointError:
                    outcomes["refused"] += 1
                    continue
                seen = set(model.weight.flatten().tolist())
                outcomes["genuine" if seen == {1.0} else "unverified"] += 1
        finally:
            stop.set()
            thread.join()
    assert swaps[0] > 50, swaps  # the files really changed under the loads
    assert outcomes["unverified"] == 0, outcomes
    assert outcomes["refused"] > 0, outcomes
