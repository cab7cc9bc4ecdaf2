"""torchplug.Trainer on real ranks: the same result as the Engine loop it is made of, metrics
over the whole eval set, callbacks as hookimpls, and resume after a hard kill."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchplug as tp
import torchplug.plugin as tpp
import trainer_body

HERE = Path(__file__).parent


def trainer_and_engine_loop() -> dict:
    os.environ["TORCHPLUG_STRATEGY"] = "ddp"
    return {"trainer": trainer_body.train(None), "engine": trainer_body.engine_loop()}


def test_trainer_reaches_the_engine_loops_final_loss(ranks):
    results = ranks.run(trainer_and_engine_loop, timeout=120)
    trainer, engine = results[0]["trainer"], results[0]["engine"]
    assert trainer["train_loss"] == pytest.approx(engine["train_loss"], abs=1e-6)
    assert trainer["params"] == pytest.approx(engine["params"], abs=1e-6)
    assert trainer["step"] == 18 and trainer["epoch"] == 3  # 96 items / (8 x 2 ranks) x 3
    assert results[1]["trainer"]["params"] == trainer["params"]
    # the eval metrics are over the 21 eval items (padded to 22 on 2 ranks), same on every rank
    assert len(trainer["evals"]) == 3
    assert results[1]["trainer"]["evals"] == trainer["evals"]
    assert 0.0 <= trainer["eval_accuracy"] <= 1.0
    assert round(trainer["eval_accuracy"] * 21) == pytest.approx(trainer["eval_accuracy"] * 21)


def test_trainer_resumes_after_a_kill_from_the_checkpoint_step(ranks, tmp_path):
    reference = ranks.run(trainer_body.train, str(tmp_path / "reference"), timeout=120)[0]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    command = [
        sys.executable, "-m", "torchplug", "launch", "-n", "2", "--strategy", "ddp",
        str(HERE / "trainer_body.py"), str(ckpt), str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([*command, "7"], env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode != 0, killed.stdout + killed.stderr
    assert "SIGKILL" in killed.stderr
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == [
        "step-3",
        "step-6",
    ]
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step 6" in again.stdout
    resumed = json.loads(out.read_text())
    assert resumed["started_at"] == 6
    assert resumed["steps_run"] == 18 - 6
    assert resumed["params"] == pytest.approx(reference["params"], abs=1e-6)
    assert resumed["train_loss"] == pytest.approx(reference["train_loss"], abs=1e-6)


def test_trainer_logs_and_stops_on_request(tmp_path):
    class StopAtFour:
        @tpp.hookimpl
        def on_step_end(self, trainer, step, loss):
            return step == 4

    model, optimizer = trainer_body.model_and_optimizer()
    with tp.Trainer(
        model,
        optimizer,
        torch.nn.functional.cross_entropy,
        torch.utils.data.DataLoader(trainer_body.data(), batch_size=8),
        strategy="single",
        grad_accum=2,
        clip_grad_norm=1.0,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        loggers=["jsonl"],
        log_dir=tmp_path,
        log_every=2,
        callbacks=[StopAtFour()],
        progress=True,  # a tqdm bar on stderr, even when it is not a terminal
    ) as trainer:
        result = trainer.fit()
        lr = trainer.optimizer.param_groups[0]["lr"]
    assert result["step"] == 4
    assert lr == pytest.approx(0.2 * 0.5**4)  # stepped once per optimizer step, not per batch
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [2, 4]
    assert "epoch/train_loss" in records[-1]


def test_trainer_errors_say_what_to_do():
    model, optimizer = trainer_body.model_and_optimizer()
    with pytest.raises(tp.ConfigurationError, match="Trainer needs train_data"):
        tp.Trainer(model, optimizer, torch.nn.functional.cross_entropy, strategy="single")
    with pytest.raises(tp.ConfigurationError, match="checkpoint_every needs checkpoint_dir"):
        tp.Trainer(model, optimizer, None, [1], strategy="single", checkpoint_every=2)
    trainer = tp.Trainer(model, optimizer, None, [torch.ones(2, 4)], strategy="single")
    with trainer, pytest.raises(tp.ConfigurationError, match="override training_step"):
        trainer.fit()


def _fit(tmp_path, **kwargs) -> dict:
    model, optimizer = trainer_body.model_and_optimizer()
    with tp.Trainer(
        model,
        optimizer,
        torch.nn.functional.cross_entropy,
        torch.utils.data.DataLoader(trainer_body.data(), batch_size=8),
        strategy="single",
        checkpoint_dir=tmp_path / "ckpt",
        progress=True,
        **kwargs,
    ) as trainer:
        return trainer.fit()


@pytest.mark.parametrize("bar", ["tqdm", "text"])
def test_a_resumed_epochs_bar_starts_where_it_stopped_and_reaches_the_end(
    tmp_path, capsys, monkeypatch, bar
):
    """Issue 27 item 3: the bar of an epoch resumed at step 3 starts at 3/N and ends at N/N
    (it ended at 25-76 % before), with tqdm and with the base install's own text bar."""
    from torchplug.trainer import progress

    if bar == "tqdm":
        pytest.importorskip("tqdm")
    else:
        monkeypatch.setattr(progress, "BARS", ())  # as without tqdm and rich installed
    steps = len(torch.utils.data.DataLoader(trainer_body.data(), batch_size=8))
    assert steps > 4
    _fit(tmp_path, max_steps=3, checkpoint_every=3)
    capsys.readouterr()
    result = _fit(tmp_path, checkpoint_every=100)
    assert result["step"] == steps
    err = capsys.readouterr().err
    assert f"3/{steps}" in err and f"{steps}/{steps}" in err, err[-600:]
    assert "100%" in err
    shown = [int(n) for n in re.findall(rf"(?<!\d)(\d+)/{steps}\b", err)]
    assert min(shown) == 3, shown  # no restart from zero
