"""One settings order: code > launch flag > TORCHPLUG_* env > config file > default."""

from __future__ import annotations

import pytest

import torchplug as tp
from test_cluster import doctor
from torchplug.core import config


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_defaults(project):
    settings = config.resolve()
    assert (settings.strategy.value, settings.strategy.source) == ("auto", "default")
    assert (settings.precision.value, settings.precision.source) == ("32", "default")


def test_each_source_overrides_the_ones_below(project, monkeypatch):
    (project / "pyproject.toml").write_text(
        '[tool.torchplug]\nstrategy = "ddp"\nprecision = "bf16"\n'
        "[tool.torchplug.options]\nfind_unused_parameters = true\n"
    )
    settings = config.resolve()
    assert settings.strategy == config.Setting("ddp", f"config file {project / 'pyproject.toml'}")
    assert settings.options["find_unused_parameters"].value is True

    (project / "torchplug.toml").write_text('strategy = "single"\n')  # preferred over pyproject
    assert config.resolve().strategy.value == "single"
    assert config.resolve().precision.source == "default"  # the whole file is torchplug.toml's

    monkeypatch.setenv("TORCHPLUG_STRATEGY", "ddp")
    assert config.resolve().strategy == config.Setting("ddp", "environment TORCHPLUG_STRATEGY")

    monkeypatch.setenv("TORCHPLUG_LAUNCH_STRATEGY", "single")
    assert config.resolve().strategy == config.Setting("single", "torchplug launch --strategy")

    settings = config.resolve("single", "fp16", {"device": "cpu"})
    assert settings.strategy == config.Setting("single", "code argument")
    assert settings.precision == config.Setting("fp16", "code argument")
    assert settings.options["device"] == config.Setting("cpu", "code argument")


def test_auto_in_code_defers_to_the_launcher(project, monkeypatch):
    monkeypatch.setenv("TORCHPLUG_LAUNCH_STRATEGY", "single")
    with tp.Engine("auto") as engine:
        assert engine.strategy == "single"
        assert engine.settings.strategy.source == "torchplug launch --strategy"


def test_config_file_precision_reaches_the_engine(project):
    (project / "torchplug.toml").write_text('precision = "bf16-mixed"\n')
    with tp.Engine("single") as engine:
        assert engine.precision == "bf16"


def test_bad_config_key_is_named_with_a_suggestion(project):
    (project / "torchplug.toml").write_text('stratgy = "ddp"\n')
    with pytest.raises(
        tp.ConfigurationError, match="Unknown key 'stratgy'.*Did you mean 'strategy'"
    ):
        config.resolve()


def test_explicit_config_path_must_exist(project, monkeypatch):
    monkeypatch.setenv("TORCHPLUG_CONFIG", str(project / "missing.toml"))
    with pytest.raises(tp.ConfigurationError, match="names no file"):
        config.resolve()


def test_doctor_prints_every_setting_with_its_source(project):
    (project / "torchplug.toml").write_text('precision = "bf16"\n')
    output = doctor({"TORCHPLUG_STRATEGY": "ddp"}, project)
    lines = output.splitlines()
    strategy = next(x for x in lines if x.strip().startswith("strategy"))
    precision = next(x for x in lines if x.strip().startswith("precision "))
    assert "ddp" in strategy and "environment TORCHPLUG_STRATEGY" in strategy
    assert "bf16" in precision and "torchplug.toml" in precision
    assert "torch " in output and "world_size   1" in output
