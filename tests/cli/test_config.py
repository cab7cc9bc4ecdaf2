"""One settings order: code > launch flag > TORCHPLUG_* env > config file > default."""

from __future__ import annotations

import pytest

import torchplug as tp
from support.commands import doctor
from torchplug.engine import config


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


SIDE_BY_SIDE = """\
[options]                  # shared: applies where the chosen strategy knows the name
find_unused_parameters = true
timeout = 120

[strategies.deepspeed]     # deepspeed only
config = "ds_config.json"
stage = 2
"""


def test_a_deepspeed_table_and_a_ddp_run_side_by_side(project):
    (project / "torchplug.toml").write_text(SIDE_BY_SIDE)
    with tp.Engine("ddp") as engine:
        assert engine.options["find_unused_parameters"] is True
        assert engine.options["timeout"] == 120.0
        assert "config" not in engine.options and "stage" not in engine.options
        assert engine.settings.options["timeout"].source.endswith("torchplug.toml [options]")
    # a shared option the chosen strategy does not know is left out, not an error
    with tp.Engine("single") as engine:
        assert "find_unused_parameters" not in engine.options
        assert "find_unused_parameters" in engine.settings.ignored


def test_the_strategy_table_overrides_the_shared_options(project, monkeypatch):
    (project / "pyproject.toml").write_text(
        "[tool.torchplug.options]\ntimeout = 120\n"
        "[tool.torchplug.strategies.distributed-data-parallel]\ntimeout = 60\n"  # an alias
    )
    with tp.Engine("ddp") as engine:
        assert engine.options["timeout"] == 60.0
        source = engine.settings.options["timeout"].source
        assert source.endswith("[tool.torchplug.strategies.distributed-data-parallel]")
    with tp.Engine("ddp", timeout=30) as engine:  # the code's argument is higher still
        assert engine.options["timeout"] == 30.0


def test_unknown_names_in_a_strategy_table_or_shared_options_are_errors(project):
    (project / "torchplug.toml").write_text("[strategies.ddp]\nfind_unused = true\n")
    with pytest.raises(tp.ConfigurationError, match="Unknown option 'find_unused'.*ddp"):
        tp.Engine("ddp")
    (project / "torchplug.toml").write_text("[options]\nfind_unused = true\n")
    with pytest.raises(tp.ConfigurationError, match="'find_unused'.*no installed strategy"):
        tp.Engine("single")
    (project / "torchplug.toml").write_text("[strategies]\nddp = 3\n")
    with pytest.raises(tp.ConfigurationError, match="one table of options per strategy"):
        config.resolve()


def test_doctor_shows_the_shared_and_the_strategy_tables_with_their_source(project):
    (project / "torchplug.toml").write_text('strategy = "ddp"\n' + SIDE_BY_SIDE)
    lines = doctor({}, project).splitlines()
    row = {line.split()[0]: line for line in lines if line.startswith("  ") and line.split()}
    assert "[options]" in row["options.find_unused_parameters"]
    assert "True" in row["options.find_unused_parameters"]
    assert "ds_config.json" in row["strategies.deepspeed.config"]
    assert "[strategies.deepspeed]" in row["strategies.deepspeed.stage"]
    # values and sources start in the same column on every settings row
    settings = [line for line in lines if line.split()[0] in row and "config file" in line]
    assert len({line.index("config file") for line in settings}) == 1


def test_doctor_shows_processes_loggers_and_log_dir_and_calls_a_typo_invalid(project):
    """Everything torchplug.toml and the environment set is shown with its source; a shared
    option no installed strategy knows is called invalid in its row, as it is below it."""
    (project / "torchplug.toml").write_text(
        'strategy = "ddp"\nprocesses = 2\nnodes = 1\nloggers = ["csv"]\n'
        "[options]\ntimeout = 60\nbucket_cap_mb = 5\nbogus = 1\n"
    )
    from support.commands import doctor_run

    run = doctor_run({"TORCHPLUG_LOG_DIR": str(project / "runs")}, project)
    assert run.returncode == 1, run.stdout + run.stderr  # 'bogus'
    output = run.stdout
    row = {line.split()[0]: line for line in output.splitlines() if line.startswith("  ")}
    assert row["processes"].split()[1] == "2" and "(read by torchplug launch)" in row["processes"]
    assert row["nodes"].split()[1] == "1"
    assert row["loggers"].split()[1] == "csv" and "torchplug.toml" in row["loggers"]
    assert str(project / "runs") in row["log_dir"] and "TORCHPLUG_LOG_DIR" in row["log_dir"]
    assert "(an option of no installed strategy: invalid, below)" in row["options.bogus"]
    assert "unused" not in row["options.bogus"]
    assert "option 'bogus'" in output.split("\ninvalid\n")[1]
    output = doctor_run(
        {"TORCHPLUG_STRATEGY": "fsdp", "TORCHPLUG_LOGGERS": "jsonl"}, project
    ).stdout
    row = {line.split()[0]: line for line in output.splitlines() if line.startswith("  ")}
    assert "(not an option of this strategy: unused)" in row["options.bucket_cap_mb"]
    assert row["loggers"].split()[1] == "jsonl" and "TORCHPLUG_LOGGERS" in row["loggers"]
    assert row["log_dir"].split()[1] == "logs" and "default" in row["log_dir"]


def test_doctor_reports_a_typo_in_a_strategy_table_once_blaming_that_table(project):
    (project / "torchplug.toml").write_text(
        'strategy = "ddp"\n[options]\ntimeout = 60\n[strategies.ddp]\nstatic_graf = true\n'
    )
    from support.commands import doctor_run

    run = doctor_run({}, project)
    assert run.returncode == 1, run.stdout + run.stderr
    invalid = run.stdout.split("\ninvalid\n")[1].splitlines()[:-1]
    assert len(invalid) == 1, invalid
    assert invalid[0].startswith("  [strategies.ddp] (in ") and "'static_graf'" in invalid[0]
    assert "[options]" not in invalid[0]
    assert "1 invalid setting(s)" in run.stdout
    row = next(x for x in run.stdout.splitlines() if x.startswith("  options.static_graf"))
    assert "(not an option of ddp: invalid, below)" in row, row


def test_doctor_flags_a_table_for_no_installed_strategy(project):
    from support.commands import doctor_run

    (project / "torchplug.toml").write_text("[strategies.deepsped]\nstage = 2\n")
    run = doctor_run({}, project)
    assert run.returncode == 1
    assert "[strategies.deepsped]" in run.stdout and "Did you mean 'deepspeed'" in run.stdout
