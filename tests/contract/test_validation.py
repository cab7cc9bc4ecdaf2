"""Every option and environment value is checked, with what was wrong, what is expected, the fix.

Each case here is a row of docs/errors.md; the message fragments asserted are the ones it quotes.
"""

from __future__ import annotations

import pytest

import torchplug as tp
from support.commands import doctor_run
from support.paths import ROOT
from torchplug.engine import config
from torchplug.engine import connector as cluster


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, "must be a number of seconds above 0 and at most 3.1536e+07, got 0.0"),
        (-1, "got -1.0"),
        (float("nan"), "got nan"),
        (1e300, "got 1e+300"),
    ],
)
def test_bad_timeout_is_refused_before_any_process_group(value, expected):
    with pytest.raises(tp.ConfigurationError, match="Option 'timeout' of strategy 'ddp'") as err:
        tp.Engine("ddp", timeout=value)
    assert expected in str(err.value)
    assert "Pass a valid value, e.g. timeout=1800.0" in str(err.value)


def test_cuda_device_on_a_cpu_machine_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(tp.ConfigurationError) as err:
        tp.Engine("single", device="cuda:0")
    assert "Option 'device' of strategy 'single' asks for 'cuda:0'" in str(err.value)
    assert "this machine has no CUDA device; expected 'cpu'" in str(err.value)


def test_garbage_device_name():
    with pytest.raises(tp.ConfigurationError, match="is not a device name: 'gpu0'"):
        tp.Engine("single", device="gpu0")


def test_unknown_process_group_backend():
    with pytest.raises(tp.ConfigurationError) as err:
        tp.Engine("ddp", process_group_backend="bogus")
    message = str(err.value)
    assert "names an unknown torch.distributed backend 'bogus'" in message
    assert "expected one of gloo, nccl" in message


def test_negative_bucket_cap():
    with pytest.raises(tp.ConfigurationError) as err:
        tp.Engine("ddp", bucket_cap_mb=-5)
    assert "Option 'bucket_cap_mb' of strategy 'ddp' must be a number of MiB above 0" in str(
        err.value
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "notaport"},
            "MASTER_PORT='notaport' is not a TCP port; expected a whole number from 1 to 65535",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"},
            "MASTER_PORT='70000' is not a TCP port",
        ),
        ({"RANK": "5", "WORLD_SIZE": "2"}, "Rank 5 (from environment (RANK/WORLD_SIZE)) is "),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "World size 0 (from environment (RANK/WORLD_SIZE))"),
        ({"RANK": "0", "WORLD_SIZE": "-3"}, "World size -3"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "Environment variable RANK='x' is not an integer"),
    ],
)
def test_bad_launcher_variables(env, expected):
    with pytest.raises(tp.ConfigurationError) as err:
        cluster.detect(env)
    assert expected in str(err.value)


def test_rank_outside_the_world_names_the_range():
    with pytest.raises(tp.ConfigurationError, match="expected 0 to 1"):
        cluster.detect({"RANK": "5", "WORLD_SIZE": "2"})


def test_bad_environment_reaches_the_engine_not_a_hang(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(tp.ConfigurationError, match="outside the world of 2 processes"):
        tp.Engine("ddp")


def test_tool_torchplug_as_a_string_in_pyproject(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[tool]\ntorchplug = "ddp"\n')
    with pytest.raises(tp.ConfigurationError) as err:
        config.resolve()
    message = str(err.value)
    assert "are str 'ddp'; expected a table" in message
    assert '[tool.torchplug]\nstrategy = "ddp"' in message
    assert "Unknown key" not in message


def test_strategy_of_the_wrong_type_in_the_config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "torchplug.toml").write_text("strategy = 3.5\n")
    with pytest.raises(tp.ConfigurationError, match="'strategy' in .* is float 3.5; expected a"):
        config.resolve()


def test_precision_conflict_suggests_a_value_that_exists(monkeypatch):
    monkeypatch.setenv("TORCHPLUG_LAUNCH_PRECISION", "bf16")
    with pytest.raises(tp.ConfigurationError) as err:
        tp.Engine("single", precision="fp16")
    message = str(err.value)
    assert "pass precision=None (or nothing) in the code" in message
    assert "'auto'" not in message


def test_same_precision_spelled_twice_is_no_conflict(monkeypatch):
    monkeypatch.setenv("TORCHPLUG_LAUNCH_PRECISION", "bf16")
    with tp.Engine("single", precision="bf16-mixed") as engine:
        assert engine.precision == "bf16"


def test_unknown_strategy_from_the_environment_names_its_source(monkeypatch):
    monkeypatch.setenv("TORCHPLUG_STRATEGY", "garbage")
    with pytest.raises(tp.ConfigurationError) as err:
        tp.Engine()
    assert "Unknown strategy 'garbage'" in str(err.value)
    assert "(The name came from environment TORCHPLUG_STRATEGY.)" in str(err.value)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TORCHPLUG_STRATEGY": "garbage"}, "strategy 'garbage' (from environment "),
        ({"TORCHPLUG_PRECISION": "bf17"}, "Unknown precision 'bf17'. Did you mean 'bf16'?"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "Rank 3 (from environment (RANK/WORLD_SIZE))"),
        ({"TORCHPLUG_CHECKPOINT_TIMEOUT": "abc"}, "TORCHPLUG_CHECKPOINT_TIMEOUT='abc' is not"),
        ({"TORCHPLUG_CHECKPOINT_KEY": "short"}, "TORCHPLUG_CHECKPOINT_KEY is 5 bytes long"),
    ],
)
def test_doctor_exits_nonzero_on_an_invalid_setting(tmp_path, env, expected):
    run = doctor_run(env, tmp_path)
    assert run.returncode == 1, run.stdout
    invalid = run.stdout.split("\ninvalid\n", 1)[1]
    assert expected in invalid
    assert "invalid setting(s)" in run.stdout


def test_doctor_checks_file_options_against_the_strategy(tmp_path):
    (tmp_path / "torchplug.toml").write_text('strategy = "ddp"\n[options]\ntimeout = -1\n')
    run = doctor_run({}, tmp_path)
    assert run.returncode == 1
    assert "Option 'timeout' of strategy 'ddp' must be a number of seconds above 0" in run.stdout


def test_every_row_of_docs_errors_is_backed_by_a_test():
    import re

    root = ROOT
    doc = (root / "docs" / "errors.md").read_text()
    cited = set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", doc))
    assert len(cited) >= 30
    missing = [
        f"{path}::{name}"
        for path, name in sorted(cited)
        if not re.search(rf"^def {name}\(", (root / path).read_text(), re.MULTILINE)
    ]
    assert not missing
    rows = [line for line in doc.splitlines() if line.startswith("| ") and "---" not in line]
    unbacked = [r for r in rows if not r.startswith("| input") and not r.startswith("| fault")]
    assert all("`tests/" in r for r in unbacked), [r for r in unbacked if "`tests/" not in r]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seed": "abc"}, "seed must be a whole number from 0 to 2\\*\\*64 - 1, got str"),
        ({"seed": 1.5}, "seed must be a whole number"),
        ({"seed": None}, "seed must be a whole number"),
        ({"seed": 2**70}, "seed must be a whole number"),
        ({"seed": True}, "seed must be a whole number"),
        ({"checkpoint_key": 64}, "checkpoint_key must be a str or bytes secret, got int"),
        ({"checkpoint_key": 3.5}, "checkpoint_key must be a str or bytes secret, got float"),
        ({"checkpoint_key": ["x"]}, "checkpoint_key must be a str or bytes secret, got list"),
        ({"checkpoint_dir": 5}, "checkpoint_dir must be a directory path"),
        ({"checkpoint_dir": True}, "checkpoint_dir must be a directory path"),
        ({"checkpoint_dir": ""}, "checkpoint_dir is an empty path"),
        ({"log_dir": 5}, "log_dir must be a non-empty directory path"),
        ({"activation_checkpointing": 5}, "activation_checkpointing takes module classes"),
        ({"plugins": [5]}, "plugins takes plugin objects, module names or hook functions, got int"),
    ],
)
def test_engine_arguments_are_checked_where_they_enter(kwargs, message):
    with pytest.raises(tp.ConfigurationError, match=message):
        tp.Engine("single", **kwargs)


def test_config_files_that_are_no_toml_or_no_table_are_named(tmp_path, monkeypatch):
    from torchplug.engine import config

    (tmp_path / "torchplug.toml").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(tp.ConfigurationError, match="is not text"):
        config.find_config(tmp_path, {})
    (tmp_path / "torchplug.toml").unlink()
    (tmp_path / "torchplug.toml").mkdir()
    with pytest.raises(tp.ConfigurationError, match=r"is not a file \(a directory\)"):
        config.find_config(tmp_path, {})
    (tmp_path / "torchplug.toml").rmdir()
    (tmp_path / "pyproject.toml").write_text("tool = 5\n")
    with pytest.raises(tp.ConfigurationError, match="sets tool = 5"):
        config.find_config(tmp_path, {})


def test_a_misspelled_strategy_table_is_an_error_in_the_engine_too(tmp_path, monkeypatch):
    (tmp_path / "torchplug.toml").write_text("[strategies.dpp]\nbucket_cap_mb = 5\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tp.ConfigurationError, match=r"\[strategies\.dpp\].*Did you mean 'ddp'"):
        tp.Engine("single")


@pytest.mark.slow
def test_a_negative_max_restarts_is_refused_before_starting(tmp_path):
    from support.commands import torchplug

    script = tmp_path / "x.py"
    script.write_text("print('ran')\n")
    run = torchplug("launch", "--max-restarts", "-1", str(script))
    assert run.returncode == 2 and "ran" not in run.stdout
    assert "--max-restarts -1 is negative" in run.stderr
