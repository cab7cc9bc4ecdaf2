"""The peers themselves against their torchplug ports (issue 34 item 6).

Twelve example scripts of Accelerate and Lightning Fabric, each adapted only to run offline
(``scripts/``: the upstream file each follows is named in its docstring), run on 2 CPU processes
under the peer (torchrun, as Accelerate and Fabric document for multi-CPU runs) and their ports
under ``torchplug launch -n 2`` with ``ddp`` and ``fsdp``. Every step's loss (the mean over
ranks) and every final metric must agree within 1e-5: the guides promise the same training, and
the steps show where it stops being so. Each pair is a class, so ``--dist loadscope`` spreads the
pairs over the workers and each peer runs once per pair.

Also here: every row of docs/migration-accelerate.md and docs/migration-fabric.md whose peer call
one of the peer scripts makes has its torchplug call in that script's port.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate", reason="the peers env installs accelerate (tox -e peers)")
pytest.importorskip("lightning_fabric", reason="the peers env installs lightning-fabric")
pytest.importorskip("transformers", reason="the tiny BERT is built by transformers")
pytest.importorskip("sklearn", reason="Fabric's k-fold example splits with scikit-learn")

from support.paths import ROOT  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
GUIDES = {"accelerate": ROOT / "docs" / "migration-accelerate.md",
          "fabric": ROOT / "docs" / "migration-fabric.md"}  # fmt: skip
TOLERANCE = 1e-5
#: A hang guard for one launch (each takes seconds); never a budget.
TIMEOUT = 900

pytestmark = pytest.mark.slow


#: What a peer's process prints when it aborts in native code while exiting (seen once in CI:
#: Accelerate's local_sgd example, after its record was written and every epoch printed; the
#: peer scripts, as upstream's, leave the process group for the interpreter's exit to tear down).
EXIT_CRASH = "terminate called without an active exception"


def launch(command: list[str], tmp: Path, record: Path | None = None) -> None:
    """Run one 2-process launch in ``tmp``; fail with its output if it fails. ``record``: a
    peer's run, which may abort while exiting (`EXIT_CRASH`) once it has written its record
    whole; torchplug's runs must exit cleanly."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MASTER_PORT", None)  # each launcher picks a free port of its own
    run = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    said = f"{command}\n{run.stdout[-6000:]}\n{run.stderr[-6000:]}"
    if run.returncode != 0 and record is not None and EXIT_CRASH in run.stdout + run.stderr:
        assert record.is_file(), said
        json.loads(record.read_text())  # whole, or this fails with the record's error
        print(f"peer aborted while exiting, after its record was written:\n{said}")
        return
    assert run.returncode == 0, said


def run_peer(script: str, args: list[str], tmp: Path) -> dict[str, Any]:
    out = tmp / "record.json"
    out.unlink(missing_ok=True)  # the record must be this run's
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launch(
        [*torchrun, "--nproc-per-node", "2", str(SCRIPTS / script), "--out", str(out), *args],
        tmp,
        record=out,
    )
    return json.loads(out.read_text())


def run_port(script: str, strategy: str, args: list[str], tmp: Path) -> dict[str, Any]:
    out = tmp / "record.json"
    torchplug = [sys.executable, "-m", "torchplug", "launch", "-n", "2", "--strategy", strategy]
    launch([*torchplug, str(SCRIPTS / script), "--out", str(out), *args], tmp)
    return json.loads(out.read_text())


def differences(peer: Any, port: Any, where: str = "") -> tuple[float, list[str]]:
    """The largest difference between two records' numbers, and what does not match: numbers
    further apart than `TOLERANCE`, other values unequal, lists of other lengths, other keys."""
    if isinstance(peer, dict) and isinstance(port, dict):
        if peer.keys() != port.keys():
            return math.inf, [f"{where}: keys {sorted(peer)} vs {sorted(port)}"]
        found = [differences(peer[k], port[k], f"{where}.{k}") for k in peer]
    elif isinstance(peer, list) and isinstance(port, list):
        if len(peer) != len(port):
            return math.inf, [f"{where}: {len(peer)} values vs {len(port)}"]
        found = [
            differences(a, b, f"{where}[{i}]")
            for i, (a, b) in enumerate(zip(peer, port, strict=True))
        ]
    elif isinstance(peer, int | float) and isinstance(port, int | float):
        gap = abs(peer - port)
        return gap, [f"{where}: {peer!r} vs {port!r}"] if gap > TOLERANCE else []
    else:
        return (0.0, []) if peer == port else (math.inf, [f"{where}: {peer!r} vs {port!r}"])
    return max((gap for gap, _ in found), default=0.0), [m for _, ms in found for m in ms]


def assert_same(peer: dict, port: dict) -> float:
    gap, mismatches = differences(peer, port)
    print(f"largest difference: {gap:.3g}")
    assert not mismatches, "\n".join(mismatches[:20])
    return gap


class Pair:
    """One peer script and its port; ``runs`` are the argument lists of the launches each side
    makes, in order (``{tmp}`` is the side's own folder, shared by its launches)."""

    peer: str
    port: str
    runs: tuple[tuple[str, ...], ...] = ((),)

    @staticmethod
    def _args(run: tuple[str, ...], tmp: Path) -> list[str]:
        return [arg.format(tmp=tmp) for arg in run]

    @pytest.fixture(scope="class")
    @classmethod
    def peer_records(cls, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
        tmp = tmp_path_factory.mktemp(Path(cls.peer).stem)
        records = []
        for i, run in enumerate(cls.runs):
            (tmp / str(i)).mkdir()
            records.append(run_peer(cls.peer, cls._args(run, tmp), tmp / str(i)))
        return records

    @pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
    def test_port_matches_peer(self, strategy: str, peer_records: list[dict], tmp_path: Path):
        for i, (run, peer) in enumerate(zip(self.runs, peer_records, strict=True)):
            (tmp_path / str(i)).mkdir()
            port = run_port(self.port, strategy, self._args(run, tmp_path), tmp_path / str(i))
            assert_same(peer, port)


class TestGradientAccumulation(Pair):
    peer, port = "accelerate_gradient_accumulation.py", "torchplug_gradient_accumulation.py"


class TestCheckpointing(Pair):
    """An uninterrupted run saving each epoch, then a run resumed from the first epoch's save."""

    peer, port = "accelerate_checkpointing.py", "torchplug_checkpointing.py"
    runs = (
        ("--output_dir", "{tmp}/full"),
        ("--output_dir", "{tmp}/resumed", "--resume_from_checkpoint", "{tmp}/full/epoch_0"),
    )


class TestTracking(Pair):
    peer, port = "accelerate_tracking.py", "torchplug_tracking.py"
    runs = (("--project_dir", "{tmp}"),)


class TestEarlyStopping(Pair):
    peer, port = "accelerate_early_stopping.py", "torchplug_early_stopping.py"


class TestMultiProcessMetrics(Pair):
    peer, port = "accelerate_multi_process_metrics.py", "torchplug_multi_process_metrics.py"


class TestMemory(Pair):
    peer, port = "accelerate_memory.py", "torchplug_memory.py"


class TestLocalSGD(Pair):
    """Accelerate's ``LocalSGD`` block is ``tp.LocalSGD`` (the guide's row), on ``ddp`` only:
    both average full replicas (Accelerate's refuses FSDP, torchplug's a sharded model)."""

    peer, port = "accelerate_local_sgd.py", "torchplug_local_sgd.py"

    @pytest.mark.parametrize("strategy", ["ddp"])
    def test_port_matches_peer(self, strategy: str, peer_records: list[dict], tmp_path: Path):
        super().test_port_matches_peer(strategy, peer_records, tmp_path)


class TestScheduleFree(Pair):
    peer, port = "accelerate_schedule_free.py", "torchplug_schedule_free.py"


class TestAutomaticGradientAccumulation(Pair):
    peer = "accelerate_automatic_gradient_accumulation.py"
    port = "torchplug_automatic_gradient_accumulation.py"


class TestCrossValidation(Pair):
    peer, port = "accelerate_cross_validation.py", "torchplug_cross_validation.py"


class TestImageClassifier(Pair):
    peer, port = "fabric_image_classifier.py", "torchplug_image_classifier.py"


class TestKFold(Pair):
    peer, port = "fabric_kfold_cv.py", "torchplug_kfold_cv.py"


# -- the migration guides ---------------------------------------------------------------------

CODE = re.compile(r"`([^`]+)`")
PEER_RECEIVERS = ("accelerator.", "fabric.")
PEER_MODULES = ("accelerate.", "lightning.", "lightning_fabric.")


def call_key(span: str) -> str:
    """What a code span calls or names, without its arguments: ``accelerator.backward(loss)``
    -> ``accelerator.backward(``."""
    return span.split("(", 1)[0] + "(" if "(" in span else span


def rows(guide: Path) -> list[tuple[list[str], list[str]]]:
    """The guide's mapping rows: the code spans of the peer cell and of the torchplug cell."""
    found = []
    for line in guide.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= {"-", " "}:
            continue
        peer, port = CODE.findall(cells[0]), CODE.findall(" | ".join(cells[1:]))
        if peer and port:
            found.append((peer, port))
    return found


def used(key: str, source: str) -> bool:
    """Whether ``source`` makes the call ``key`` names (a module path also by its last name, as
    ``from accelerate.utils import set_seed`` then ``set_seed(...)``)."""
    if key in source:
        return True
    if key.startswith(PEER_MODULES) and "." in key:
        return re.search(rf"(?<![\w.]){re.escape(key.rsplit('.', 1)[-1])}", source) is not None
    return False


def pairs(peer: str) -> list[tuple[Path, Path]]:
    found = []
    for script in sorted(SCRIPTS.glob(f"{peer}_*.py")):
        port = SCRIPTS / script.name.replace(f"{peer}_", "torchplug_", 1)
        found.append((script, port))
    return found


@pytest.mark.parametrize("peer", sorted(GUIDES))
def test_every_row_a_peer_script_uses_is_ported_as_the_guide_says(peer: str):
    guide, exercised, missing = GUIDES[peer], 0, []
    for script, port in pairs(peer):
        source, ported = script.read_text(), port.read_text()
        for peer_spans, port_spans in rows(guide):
            calls = [call_key(s) for s in peer_spans if call_key(s).startswith(
                (*PEER_RECEIVERS, *PEER_MODULES, "Accelerator(", "Fabric(")
            )]  # fmt: skip
            if not any(used(call, source) for call in calls):
                continue
            exercised += 1
            if not any(call_key(s) in ported for s in port_spans):
                missing.append(f"{script.name}: {peer_spans} -> {port_spans}")
    assert missing == []
    assert exercised >= 10, exercised  # the tables were read


def test_the_row_parser_reads_a_guide_table(tmp_path: Path):
    guide = tmp_path / "guide.md"
    guide.write_text(
        "| Accelerate | torchplug |\n| --- | --- |\n"
        "| `accelerator.backward(loss)` | `engine.backward(loss)` |\n"
        "| prose only | `x` |\n"
    )
    assert rows(guide) == [(["accelerator.backward(loss)"], ["engine.backward(loss)"])]
    assert used("accelerate.utils.set_seed(", "set_seed(42)")
    assert not used("accelerate.utils.set_seed(", "tp.reset_seed(42)")


# -- the sharding rules against the peers' own samplers -----------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_by_batch_deals_as_accelerates_batch_sampler_shard(world: int, drop_last: bool):
    """``shard_by="batch"`` against Accelerate's own ``BatchSamplerShard`` (even_batches): the
    same batches on every rank, for dataset sizes around every multiple of the round."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    from torchplug.features.samplers import BatchShards

    for size in range(1, 40):
        for batch in (1, 3, 4):
            batches = BatchSampler(SequentialSampler(range(size)), batch, drop_last)
            for rank in range(world):
                theirs = list(BatchSamplerShard(batches, world, rank, even_batches=True))
                ours = BatchShards(batches, world, rank)
                assert list(ours) == theirs, (size, batch, rank)
                assert len(ours) == len(theirs), (size, batch, rank)
