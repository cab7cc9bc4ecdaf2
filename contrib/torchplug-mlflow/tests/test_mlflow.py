"""The mlflow logger, selected by name, writes a run with the metrics to ./mlruns."""

from __future__ import annotations

import pytest

pytest.importorskip("torchplug_mlflow")
mlflow = pytest.importorskip("mlflow")

import torchplug as tp  # noqa: E402


def test_metrics_reach_a_local_mlflow_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with tp.Engine("single", loggers=["mlflow"]) as engine:
        for step in range(3):
            engine.log({"loss": 1.0 / (step + 1)}, step=step)
    assert (tmp_path / "mlruns").is_dir()
    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("torchplug")
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 0.5), (2, 1 / 3)]


def test_hyperparameters_are_the_runs_params(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with tp.Engine("single", loggers=["mlflow"]) as engine:
        engine.log_hyperparams({"lr": 3e-4, "optim": {"name": "adamw", "betas": (0.9, 0.95)}})
    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("torchplug").experiment_id])
    assert run.data.params == {
        "lr": "0.0003", "optim.name": "adamw", "optim.betas": "(0.9, 0.95)"
    }  # fmt: skip
