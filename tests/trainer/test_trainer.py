"""torchplug.Trainer on real ranks: the same result as the Engine loop it is made of, metrics
over the whole eval set, callbacks as hookimpls, and resume after a hard kill."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import torchplug as tp
import torchplug.plugin as tpp
from support import trainer_body
from support.paths import SUPPORT


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
        str(SUPPORT / "trainer_body.py"), str(ckpt), str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SUPPORT), "OMP_NUM_THREADS": "1"}
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
    stopped = capsys.readouterr().err  # max_steps ends the bar: 3/3, not 3 of the epoch's
    assert "3/3" in stopped and f"/{steps}" not in stopped, stopped[-600:]
    result = _fit(tmp_path, checkpoint_every=100)
    assert result["step"] == steps
    err = capsys.readouterr().err
    assert f"3/{steps}" in err and f"{steps}/{steps}" in err, err[-600:]
    assert "100%" in err
    shown = [int(n) for n in re.findall(rf"(?<!\d)(\d+)/{steps}\b", err)]
    assert min(shown) == 3, shown  # no restart from zero


def trainer_throughput(log_dir: str) -> dict:
    """3 epochs of 96 items on 2 ranks (6 steps of 8 per rank each), logged every 6 steps."""
    model, optimizer = trainer_body.model_and_optimizer()
    with tp.Trainer(
        model,
        optimizer,
        torch.nn.functional.cross_entropy,
        torch.utils.data.DataLoader(trainer_body.data(), batch_size=8, shuffle=True),
        strategy="ddp",
        max_epochs=3,
        loggers=["jsonl"],
        log_dir=log_dir,
        log_every=6,
        timeout=60.0,
    ) as trainer:
        result = trainer.fit()
        return {"result": result, "totals": trainer.throughput.totals}


def test_trainer_measures_and_logs_throughput_on_every_rank(ranks, tmp_path):
    """Issue 27 item 6: the Trainer's samples/s, counted by its ThroughputMonitor, logged
    through the loggers: every sample of every epoch counted once, the rates the monitor's
    samples over its seconds (no wall-clock budget: consistency only)."""
    r0, r1 = ranks.run(trainer_throughput, str(tmp_path), timeout=180)
    for rank in (r0, r1):
        assert rank["result"]["samples"] == 96 * 3  # the data set x epochs, over both ranks
        assert rank["totals"]["samples"] == 96 * 3 // 2 and rank["totals"]["batches"] == 18
        assert rank["totals"]["time"] > 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in records if "throughput/samples_per_s" in r}
    assert sorted(logged) == [6, 12, 18]
    last = logged[18]  # the window (100 steps) holds the whole run: total samples / seconds
    assert last["throughput/samples_per_s"] == pytest.approx(144 / r0["totals"]["time"])
    together = 144 / r0["totals"]["time"] + 144 / r1["totals"]["time"]
    assert last["throughput/global/samples_per_s"] == pytest.approx(together)
    assert last["train/samples_per_s"] == last["throughput/global/samples_per_s"]
    assert last["throughput/batches_per_s"] == pytest.approx(18 / r0["totals"]["time"])
    assert "throughput/tokens_per_s" not in last  # float features: no tokens to count
    epochs = [r for r in records if "epoch/samples_per_s" in r]
    assert len(epochs) == 3 and all(r["epoch/samples_per_s"] > 0 for r in epochs)
    assert r0["result"]["samples_per_s"] == epochs[-1]["epoch/samples_per_s"]


STALL = 3.0


class SlowToStartLogger:
    """Rank 0's logger takes STALL seconds for the hyperparameters and again for its first
    metrics (wandb starts its run there)."""

    def __init__(self) -> None:
        self.started = False

    def log_hyperparams(self, params: dict) -> None:
        time.sleep(STALL)

    def log_metrics(self, metrics: dict, step: int) -> None:
        if not self.started:
            self.started = True
            time.sleep(STALL)

    def close(self) -> None:
        pass


def trainer_with_a_slow_logger() -> dict:
    model, optimizer = trainer_body.model_and_optimizer()
    began = time.perf_counter()
    with tp.Trainer(
        model,
        optimizer,
        torch.nn.functional.cross_entropy,
        torch.utils.data.DataLoader(trainer_body.data(), batch_size=8),
        strategy="ddp",
        max_epochs=1,
        loggers=[SlowToStartLogger()],
        log_every=2,
        hparams={"lr": 0.1},
        timeout=60.0,
    ) as trainer:
        trainer.fit()
        return {"clock": trainer.throughput.totals["time"], "wall": time.perf_counter() - began}


def test_the_throughput_clock_leaves_out_the_wait_for_rank_zeros_loggers(ranks):
    """Every rank waits for rank 0's slow logger (hyperparameters, first metrics) outside its
    training clock: neither stall counts as training on any rank (without that, the other
    ranks waited in the next step's collective and their samples/s collapsed)."""
    for rank in ranks.run(trainer_with_a_slow_logger, timeout=300):
        assert rank["clock"] <= rank["wall"] - 1.8 * STALL, rank


def test_trainer_counts_tokens_flops_and_mfu_with_its_engines_monitor(
    tmp_path, capsys, monkeypatch
):
    from torchplug.trainer import progress

    monkeypatch.setattr(progress, "BARS", ())  # the text bar: its line shows what it shows
    tokens = torch.randint(0, 10, (32, 5), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(tokens, torch.randint(0, 3, (32,)))
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(20, 3)
    )
    engine = tp.Engine("single", loggers=["jsonl"], log_dir=tmp_path)
    monitor = tp.ThroughputMonitor(engine, peak_flops=1e9)
    with tp.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.functional.cross_entropy,
        torch.utils.data.DataLoader(data, batch_size=8),
        engine=engine,
        throughput=monitor,
        flops_per_batch=1000.0,
        log_every=4,
        progress=True,
    ) as trainer:
        result = trainer.fit()
    totals = monitor.totals
    assert totals["samples"] == 32 and totals["tokens"] == 32 * 5 and totals["flops"] == 4000
    assert result["samples"] == 32
    record = next(
        json.loads(line)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if "throughput/tokens_per_s" in line
    )
    assert record["throughput/tokens_per_s"] == pytest.approx(160 / totals["time"])
    assert record["throughput/flops_per_s"] == pytest.approx(4000 / totals["time"])
    assert record["throughput/mfu"] == pytest.approx(4000 / totals["time"] / 1e9)
    err = capsys.readouterr().err
    assert "samples/s" in err and "tokens/s" in err and "MFU" in err, err[-400:]
    assert "tokens_per_s" in result


def test_trainer_throughput_off_and_wrong_arguments():
    model, optimizer = trainer_body.model_and_optimizer()
    data = torch.utils.data.DataLoader(trainer_body.data(), batch_size=8)
    loss = torch.nn.functional.cross_entropy
    with tp.Trainer(model, optimizer, loss, data, strategy="single", throughput=False) as trainer:
        result = trainer.fit()
    assert trainer.throughput is None and "samples" not in result
    assert "samples_per_s" not in result
    other = tp.Engine("single")
    with pytest.raises(tp.ConfigurationError, match="made on another Engine"):
        tp.Trainer(model, optimizer, loss, data, strategy="single",
                   throughput=tp.ThroughputMonitor(other))  # fmt: skip
    with pytest.raises(tp.ConfigurationError, match="flops_per_batch"):
        tp.Trainer(model, optimizer, loss, data, strategy="single", flops_per_batch=-1.0)
    other.close()


def test_trainer_accumulation_completes_the_last_group_of_each_epoch():
    """Issue 34 point 1 through the Trainer: 5 batches per epoch and grad_accum=4 are 2
    optimizer steps per epoch (4 batches, then the last 1), the scheduler stepping with them,
    and the parameters those of plain PyTorch doing the same (loss / 4 on every batch)."""
    model, optimizer = trainer_body.model_and_optimizer()
    data = trainer_body.data(n=40)
    with tp.Trainer(
        model,
        optimizer,
        torch.nn.functional.cross_entropy,
        torch.utils.data.DataLoader(data, batch_size=8),
        strategy="single",
        grad_accum=4,
        max_epochs=2,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    ) as trainer:
        result = trainer.fit()
        trained = [p.detach().clone() for p in trainer.model.parameters()]
    assert result["step"] == 4
    reference, ref_opt = trainer_body.model_and_optimizer()
    x, y = data.tensors
    lrs = [0.2, 0.1, 0.05, 0.025]
    step = 0
    for _ in range(2):
        for b in range(5):
            loss = torch.nn.functional.cross_entropy(
                reference(x[b * 8 : b * 8 + 8]), y[b * 8 : b * 8 + 8]
            )
            (loss / 4).backward()
            if b in (3, 4):
                for group in ref_opt.param_groups:
                    group["lr"] = lrs[step]
                ref_opt.step()
                ref_opt.zero_grad()
                step += 1
    for got, want in zip(trained, reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
