"""The wandb logger, selected by name, writes one offline run; read back from its .wandb file.

wandb runs offline here (no account, no network): WANDB_MODE=offline, and every wandb directory
in a temporary one. The run's records are read with wandb's own protobuf (``wandb.proto``) from
the ``run-ID.wandb`` transaction log, the file ``wandb sync`` uploads.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchplug_wandb", reason="torchplug-wandb is not installed")
wandb = pytest.importorskip(
    "wandb", reason="wandb is not installed (pip install wandb; the tox 'examples' env has it)"
)

from torchplug_wandb import WandbLogger  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

import torchplug as tp  # noqa: E402

#: wandb's own variables for the run's options (the tests set the ones they use).
OPTIONS = ("PROJECT", "ENTITY", "NAME", "TAGS", "RUN_GROUP", "JOB_TYPE", "NOTES", "RUN_ID")


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch) -> Iterator[None]:
    """Offline wandb, its config/cache/data directories in tmp_path, run files in tmp_path/runs."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "runs"))
    (tmp_path / "runs").mkdir()
    for name in ("CONFIG_DIR", "CACHE_DIR", "DATA_DIR", "ARTIFACT_DIR"):
        monkeypatch.setenv(f"WANDB_{name}", str(tmp_path / "wandb-home" / name.lower()))
    for name in (*OPTIONS, "RESUME"):
        monkeypatch.delenv(f"WANDB_{name}", raising=False)
    monkeypatch.delenv("TORCHPLUG_LOGGERS", raising=False)
    wandb.teardown()  # wandb reads its variables once per process, into a singleton
    yield
    wandb.teardown()


# -- reading an offline run ---------------------------------------------------------------------

BLOCK = 32 * 1024  # the .wandb file is a LevelDB-style log: 32 KiB blocks of framed records
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every ``Record`` of a run-ID.wandb file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    found, pending, pos = [], b"", 7  # ":W&B", a 2-byte magic, a 1-byte version
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


def run_files(root: Path) -> list[Path]:
    return sorted(root.rglob("run-*.wandb"))


class Run:
    """What one offline run holds: its identity, config (hyperparameters) and history."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.history: list[dict[str, Any]] = []
        self.config: dict[str, Any] = {}
        self.run: Any = None
        self.exited = False
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.run = record.run
                self._config(record.run.config)
            elif kind == "config":
                self._config(record.config)
            elif kind == "history":
                row = {_key(item): json.loads(item.value_json) for item in record.history.item}
                self.history.append({k: v for k, v in row.items() if not k.startswith("_")})
            elif kind == "exit":
                self.exited = True

    def _config(self, config: Any) -> None:
        for item in config.update:
            self.config[_key(item)] = json.loads(item.value_json)
        for item in config.remove:
            self.config.pop(_key(item), None)

    @property
    def hyperparams(self) -> dict[str, Any]:
        return {k: v for k, v in self.config.items() if k != "_wandb"}

    def metric(self, name: str) -> list[tuple[int, Any]]:
        """``(torchplug step, value)`` for every row that has ``name``."""
        return [(row["global_step"], row[name]) for row in self.history if name in row]


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def only_run(root: Path) -> Run:
    # wandb's service writes the run file in the background and may not have flushed it when
    # finish() returns (CI under load read a file holding only its header): shutting the
    # service down closes its files.
    wandb.teardown()
    (path,) = run_files(root)  # exactly one run
    return Run(path)


# -- one process ----------------------------------------------------------------------------------


def test_metrics_at_each_step_and_the_run_is_finished(tmp_path):
    with tp.Engine("single", loggers=["wandb"], log_dir=tmp_path / "logs") as engine:
        for step in range(3):
            engine.log({"loss": 1.0 / (step + 1), "lr": 0.1}, step=step)
        engine.log({"eval/acc": 0.75}, step=1)  # out of order: kept, charted at step 1
    run = only_run(tmp_path / "runs")
    assert run.metric("loss") == [(0, 1.0), (1, 0.5), (2, 1 / 3)]
    assert run.metric("lr") == [(0, 0.1), (1, 0.1), (2, 0.1)]
    assert run.metric("eval/acc") == [(1, 0.75)]
    assert run.run.project == "torchplug"
    assert run.exited  # engine close finished the run
    assert wandb.run is None


def test_hyperparameters_are_the_run_config(tmp_path):
    with tp.Engine("single", loggers=["wandb"], log_dir=tmp_path / "logs") as engine:
        engine.log_hyperparams({"lr": 3e-4, "optim": {"name": "adamw", "betas": (0.9, 0.95)}})
        engine.log_hyperparams({"lr": 1e-3, "seed": 7, "dtype": object()})  # a later call updates
    config = only_run(tmp_path / "runs").hyperparams
    assert config.pop("dtype").startswith("<object object at")  # not JSON: its text
    assert config == {"lr": 1e-3, "optim.name": "adamw", "optim.betas": [0.9, 0.95], "seed": 7}


def test_options_come_from_wandbs_variables_and_the_files_default_to_the_log_dir(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("WANDB_DIR")
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    monkeypatch.setenv("WANDB_NAME", "first-try")
    monkeypatch.setenv("WANDB_TAGS", "baseline,cpu")
    monkeypatch.setenv("WANDB_RUN_GROUP", "sweep-1")
    monkeypatch.setenv("WANDB_JOB_TYPE", "train")
    monkeypatch.setenv("WANDB_NOTES", "a note")
    with tp.Engine("single", loggers=["wandb"], log_dir=tmp_path / "logs") as engine:
        engine.log({"loss": 2.0}, step=5)
    assert not run_files(tmp_path / "runs")
    run = only_run(tmp_path / "logs" / "wandb")  # LOG_DIR/wandb without WANDB_DIR
    assert (run.run.project, run.run.display_name) == ("proj", "first-try")
    assert list(run.run.tags) == ["baseline", "cpu"]
    assert (run.run.run_group, run.run.job_type, run.run.notes) == ("sweep-1", "train", "a note")
    assert run.metric("loss") == [(5, 2.0)]


def test_a_logger_object_takes_wandb_init_keywords(tmp_path):
    logger = WandbLogger(project="demo", name="object", tags=["x"], group="g", mode="offline")
    assert logger._run is None  # nothing started until it logs
    with tp.Engine("single", loggers=[logger]) as engine:
        engine.log_hyperparams({"bs": 8})
        engine.log({"loss": 0.25}, step=1)
    run = only_run(tmp_path / "runs")
    assert (run.run.project, run.run.display_name, run.run.run_group) == ("demo", "object", "g")
    assert list(run.run.tags) == ["x"]
    assert run.hyperparams == {"bs": 8} and run.metric("loss") == [(1, 0.25)]
    assert run.exited


def test_a_run_the_script_started_is_used_and_left_open(tmp_path):
    mine = wandb.init(project="mine", config={"own": 1})
    with tp.Engine("single", loggers=["wandb"], log_dir=tmp_path / "logs") as engine:
        engine.log_hyperparams({"lr": 0.5})
        engine.log({"loss": 1.5}, step=3)
    assert wandb.run is mine  # not finished by the Engine
    mine.log({"after": 1.0})
    mine.finish()
    run = only_run(tmp_path / "runs")
    assert run.run.project == "mine"
    assert run.hyperparams == {"own": 1, "lr": 0.5}
    assert run.metric("loss") == [(3, 1.5)]


# -- two ranks ------------------------------------------------------------------------------------

SCRIPT = """
    import torch
    import torchplug as tp
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    model = torch.nn.Linear(4, 1)
    trainer = tp.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.functional.mse_loss,
        DataLoader(data, batch_size=2),
        max_epochs=2,
        log_every=1,
        hparams={"lr": 0.1, "model": {"width": 4}, "note": "two ranks"},
        progress=False,
    )
    trainer.fit()
    engine = trainer.engine
    ranks = engine.reduce(torch.tensor(float(engine.rank + 1)), "sum")
    engine.log({"check/rank_sum": ranks, "check/world": engine.world_size}, step=100)
    engine.log({"check/rank_sum": ranks * 2}, step=101)
    trainer.close()
"""


@pytest.mark.slow
def test_a_two_rank_launch_writes_one_run_with_the_trainers_metrics(tmp_path):
    """``torchplug launch -n 2 --logger wandb --logger jsonl``: one run (rank 0's) whose history
    is exactly what the jsonl logger saw, step by step, and whose config is the hparams."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    logs = tmp_path / "logs"
    launched = subprocess.run(
        [
            *(sys.executable, "-m", "torchplug", "launch", "-n", "2", "--strategy", "ddp"),
            *("--logger", "wandb", "--logger", "jsonl", str(script)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "TORCHPLUG_LOG_DIR": str(logs)},
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    run = only_run(tmp_path / "runs")  # one run: rank 1 made none
    assert not list(logs.glob("rank-*"))
    assert run.exited
    assert run.hyperparams == {"lr": 0.1, "model.width": 4, "note": "two ranks"}

    # Every value the jsonl logger wrote (rank 0, the same calls) is in the run at its step.
    seen = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    calls = [row for row in seen if "hparams" not in row]
    for call in calls:
        call["global_step"] = call.pop("step")
        del call["time"]
    assert run.history == calls
    # 16 samples over 2 ranks in batches of 2: 4 steps an epoch, 2 epochs, logged every step.
    assert [step for step, _ in run.metric("train/loss")] == list(range(1, 9))
    assert run.metric("train/lr") == [(step, 0.1) for step in range(1, 9)]
    assert [step for step, _ in run.metric("epoch/train_loss")] == [4, 8]
    assert run.metric("check/rank_sum") == [(100, 3.0), (101, 6.0)]  # reduced over both ranks
    assert run.metric("check/world") == [(100, 2)]
