"""``torchplug launch`` checks before it spawns: one line with the fix, exit code 2, no process.

Each bad input runs a launch whose script would leave a marker file; the marker's absence shows
that nothing started.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from support.commands import torchplug
from torchplug.plugin import free_port

MARKER_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    Path(sys.argv[1]).joinpath(f"started-{os.environ.get('RANK', 'x')}").write_text(
        os.environ.get("MASTER_PORT", "") + " " + os.environ.get("TORCHPLUG_LAUNCH_STRATEGY", "")
    )
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(MARKER_SCRIPT)
    return path


def refused(run, tmp_path) -> str:
    """The one-line message of a launch that must have been refused before starting anything."""
    assert run.returncode == 2, run.stdout + run.stderr
    assert not list(tmp_path.glob("started-*")), "a process started"
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr
    return lines[0]


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5"])
def test_bad_process_count(tmp_path, script, value):
    line = refused(torchplug("launch", "-n", value, str(script), str(tmp_path)), tmp_path)
    assert f"-n/--nproc-per-node '{value}' is not a number of processes" in line
    assert "Fix: e.g. -n 2." in line


def test_missing_script(tmp_path, script):
    line = refused(torchplug("launch", "-n", "2", str(tmp_path / "trian.py")), tmp_path)
    assert "Training script" in line and "trian.py' does not exist" in line
    assert "Did you mean 'train.py'? Give the path of a Python file" in line


@pytest.mark.parametrize("strategy", ["ddp", "tp"])  # a class; a function (its annotation)
def test_a_strategy_its_blocked_defaults_leave_unanswered_is_refused(tmp_path, script, strategy):
    """With ``torch_distributed`` blocked, ddp's class answers setup, wrap and no_sync only: every
    rank's Engine would refuse, so the launcher refuses first, naming the hooks and the fixes."""
    run = torchplug(
        "launch", "-n", "2", "--strategy", strategy, str(script), str(tmp_path),
        env={"TORCHPLUG_BLOCK_PLUGINS": "torch_distributed"},
    )  # fmt: skip
    line = refused(run, tmp_path)
    assert f"strategy '{strategy}' (from torchplug launch --strategy) leaves 1" in line, line
    assert "torchplug_optimizer_step" in line and "torchplug_reduce" in line, line
    assert "blocked default plugins: torch_distributed" in line, line
    assert "--plugin MODULE" in line, line
    assert "Remove torch_distributed from TORCHPLUG_BLOCK_PLUGINS" in line, line


@pytest.mark.slow
def test_a_plugin_given_with_dash_dash_plugin_answering_them_is_let_through(tmp_path):
    (tmp_path / "answers.py").write_text(
        "from torchplug.plugins import torch_distributed as defaults\n"
        "hooks = {k: v for k, v in vars(defaults).items() if k.startswith('torchplug_')}\n"
        "globals().update(hooks)\n"
    )  # the defaults' answers, under another plugin name
    (tmp_path / "train.py").write_text(
        "import sys, torch, torchplug as tp\n"
        "from pathlib import Path\n"
        "with tp.Engine() as engine:\n"
        "    total = engine.reduce(torch.tensor(float(engine.rank + 1)), 'sum').item()\n"
        "    Path(sys.argv[1], f'started-{engine.rank}').write_text(str(total))\n"
    )
    run = torchplug(
        "launch", "-n", "2", "--strategy", "ddp", "--plugin", "answers", "train.py",
        str(tmp_path), env={"TORCHPLUG_BLOCK_PLUGINS": "torch_distributed"}, cwd=tmp_path,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    made = {p.name: p.read_text() for p in tmp_path.glob("started-*")}
    assert made == {"started-0": "3.0", "started-1": "3.0"}, made


def test_missing_module(tmp_path):
    line = refused(torchplug("launch", "-n", "1", "-m", "no_such_module_here"), tmp_path)
    assert "-m no_such_module_here: no module of that name can be imported" in line


def test_precision_the_strategy_cannot_run(tmp_path, script):
    run = torchplug(
        "launch", "-n", "2", "--strategy", "fsdp", "--precision", "fp16", str(script), "."
    )
    line = refused(run, tmp_path)
    assert "strategy 'fsdp' (from torchplug launch --strategy) cannot run precision 'fp16'" in line
    assert "it supports 32, bf16" in line


def test_unknown_precision(tmp_path, script):
    line = refused(torchplug("launch", "--precision", "bf17", str(script)), tmp_path)
    assert "Unknown precision 'bf17'. Did you mean 'bf16'?" in line


def test_single_process_strategy_on_two_processes(tmp_path, script):
    line = refused(torchplug("launch", "-n", "2", "--strategy", "single", str(script)), tmp_path)
    assert "runs in one process, but 2 processes are asked for" in line


def test_bad_option_in_the_config_file(tmp_path, script):
    (tmp_path / "torchplug.toml").write_text('strategy = "ddp"\n[options]\nbucket_cap_mb = -5\n')
    run = torchplug("launch", "-n", "2", str(script), str(tmp_path), cwd=tmp_path)
    line = refused(run, tmp_path)
    assert "Option 'bucket_cap_mb' of strategy 'ddp' must be a number of MiB above 0" in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ("--strategy", "ddp", "--option", "timeout=-1"),
            "Option 'timeout' of strategy 'ddp' must be a number of seconds above 0",
        ),
        (
            ("--strategy", "ddp", "--option", "bucket_cap=5"),
            "Unknown option 'bucket_cap' for strategy 'ddp'. Did you mean 'bucket_cap_mb'?",
        ),
        (("--option", "bucket_cap=5"), "option 'bucket_cap' (from torchplug launch --option "),
        (("--option", "timeout"), "--option 'timeout' is not NAME=VALUE; expected e.g."),
    ],
)
def test_bad_launcher_option(tmp_path, script, args, expected):
    assert expected in refused(torchplug("launch", *args, str(script)), tmp_path)


def test_master_port_that_is_no_port(tmp_path, script):
    run = torchplug("launch", str(script), env={"MASTER_PORT": "notaport"})
    assert "MASTER_PORT='notaport' is not a TCP port" in refused(run, tmp_path)


def test_no_arguments_says_what_to_write():
    run = torchplug("launch")
    assert run.returncode == 2
    assert "no training script given. Usage: torchplug launch [-n N]" in run.stderr
    assert "required" not in run.stderr


def test_help_shows_torchplug_flags_first_with_the_strategies():
    run = torchplug("launch", "--help")
    assert run.returncode == 0
    text = run.stdout
    own = text.index("torchplug options (put them before the script)")
    assert own < text.index("torchrun options (passed through)")
    assert own < text.index("--nnodes")
    usable = " ".join(text.split()).split("usable here: ")[1]
    assert all(name in usable for name in ("ddp", "fsdp", "single"))  # plus installed extras


@pytest.mark.slow
def test_master_port_is_honoured_and_flags_after_the_script_warn(tmp_path, script):
    from torchplug.plugin import free_port

    port = free_port()
    run = torchplug(
        "launch", "--master-port", str(port), str(script), str(tmp_path), "--strategy", "single"
    )
    assert run.returncode == 0, run.stderr
    port_seen, strategy_seen = (tmp_path / "started-0").read_text().split(" ")
    assert port_seen == str(port)
    assert strategy_seen == ""  # the flag went to the script, and torchplug said so:
    assert "warning: '--strategy single' comes after the script" in run.stderr
    assert "so it goes to the script, not to torchplug launch" in run.stderr
    assert f"torchplug launch ... --strategy single {script}" in run.stderr

    other = free_port()
    run = torchplug("launch", str(script), str(tmp_path), env={"MASTER_PORT": str(other)})
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "started-0").read_text().split(" ")[0] == str(other)


INHOUSE = textwrap.dedent(
    """
    import torchplug.plugin as tpp

    @tpp.hookimpl
    def torchplug_register_strategies(register):
        register(tpp.StrategyInfo(name="my-inhouse", factory=tpp.DDPStrategy, description="ours",
                                  extends=tpp.DistributedStrategy))
    """
)


@pytest.mark.slow
def test_plugin_module_from_the_current_directory_reaches_every_rank(tmp_path):
    (tmp_path / "my_plugin.py").write_text(INHOUSE)
    (tmp_path / "train.py").write_text(
        "import sys, torchplug as tp\n"
        "with tp.Engine() as engine:\n"
        "    line = f'strategy {engine.rank} {engine.strategy} {engine.options[\"timeout\"]}\\n'\n"
        "    sys.stdout.write(line)  # one write per line: the ranks share the pipe\n"
        "    sys.stdout.flush()\n"
    )
    run = torchplug(
        "launch",
        "-n",
        "2",
        "--plugin",
        "my_plugin",
        "--strategy",
        "my-inhouse",
        "--option",
        "timeout=42",
        "train.py",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert sorted(re.findall(r"strategy \d my-inhouse [0-9.]+", run.stdout)) == [
        "strategy 0 my-inhouse 42.0",
        "strategy 1 my-inhouse 42.0",
    ]


def test_unknown_plugin_module_is_refused(tmp_path, script):
    run = torchplug("launch", "--plugin", "not_a_module_x", str(script), cwd=tmp_path)
    line = refused(run, tmp_path)
    assert "Plugin module 'not_a_module_x' could not be loaded: ModuleNotFoundError" in line


def test_strategy_of_an_unknown_plugin_is_refused(tmp_path, script):
    line = refused(torchplug("launch", "--strategy", "my-inhouse", str(script)), tmp_path)
    assert "Unknown strategy 'my-inhouse'" in line


def test_bad_checkpoint_settings_are_refused_before_spawning(tmp_path):
    from support.commands import torchplug as run_torchplug

    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    run = run_torchplug(
        "launch", "-n", "2", str(script), env={"TORCHPLUG_CHECKPOINT_TIMEOUT": "abc"}
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "TORCHPLUG_CHECKPOINT_TIMEOUT='abc' is not a usable number" in run.stderr
    assert not marker.exists()


ECHO_ARGS = textwrap.dedent(
    """
    import argparse, json, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int)
    parser.add_argument("--log")
    parser.add_argument("--node")
    parser.add_argument("--logger", action="append")
    parser.add_argument("rest", nargs="*")
    print("ARGS " + json.dumps(vars(parser.parse_args())))
    """
)


@pytest.mark.slow
def test_the_scripts_own_arguments_are_never_parsed_by_the_launcher(tmp_path):
    """Words after the script are the script's: no prefix matching ('--n' is not '--nnodes'),
    torchrun's own flag names included, and no warning for a flag the script defines."""
    script = tmp_path / "tiny.py"
    script.write_text(ECHO_ARGS)
    run = torchplug(
        "launch", "-n", "1", str(script), "--n", "5", "--log", "x", "--node", "a",
        "--logger", "csv", "--", "--nnodes", "3",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    seen = [line for line in run.stdout.splitlines() if line.startswith("ARGS ")]
    assert seen == [
        'ARGS {"n": 5, "log": "x", "node": "a", "logger": ["csv"], "rest": ["--nnodes", "3"]}'
    ], run.stdout
    assert "warning" not in run.stderr, run.stderr  # the script defines --logger itself


def test_flags_without_a_script_are_one_line_with_the_usage(tmp_path):
    run = torchplug("launch", "-n", "2", "--strategy", "ddp")
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines == [
        "torchplug launch: no training script given after the flags -n 2 --strategy ddp. Usage: "
        "torchplug launch [-n N] [--strategy NAME] [--precision P] [torchrun flags] SCRIPT "
        "[args] (torchplug launch --help lists every flag)."
    ]


#: 20 rounds of 5 Engines one after another in one process (issue 35: 20 times in a row), each
#: from per-rank seeds; after one step every rank's output on one input must agree.
ENGINES_IN_A_ROW = textwrap.dedent(
    """
    import sys, torch, torchplug as tp
    for i in range(100):
        with tp.Engine() as engine:  # the strategy the launcher was given
            torch.manual_seed(100 * engine.rank + i)  # each rank its own initialisation
            model = torch.nn.Sequential(
                torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
            )
            model.tp_plan = {"0": "colwise", "2": "rowwise"}
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model, opt = engine.setup(model, opt)
            engine.backward(model(torch.randn(6, 4)).square().mean())
            opt.step()
            out = model(torch.ones(1, 4)).detach().reshape(-1)
            seen = engine.gather(out)
            same = all(torch.equal(seen[0], other) for other in seen)
            sys.stdout.write(f"engine {i} rank {engine.rank} replicas {same}\\n")
            sys.stdout.flush()
    """
)

#: A strategy a user's own module registers, passed with ``--plugin`` (no package installed).
IN_HOUSE = textwrap.dedent(
    """
    import torchplug.plugin as tpp
    from torchplug.plugins.ddp import DDPStrategy

    class InHouse(DDPStrategy):
        pass

    @tpp.hookimpl
    def torchplug_register_strategies(register):
        register(tpp.StrategyInfo(name="in-house", factory=InHouse, description="ours"))
    """
)


def _every_engine_replicated(stdout: str) -> None:
    lines = sorted(re.findall(r"engine \d+ rank \d replicas \w+", stdout))
    assert lines == sorted(
        f"engine {i} rank {r} replicas True" for i in range(100) for r in range(2)
    ), stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp", "fsdp-tp", "in-house"])
def test_engines_made_one_after_another_in_a_launched_process_each_get_their_group(
    tmp_path, strategy
):
    """Under torchrun the process groups of one process share the agent's store: each Engine's
    group must rendezvous under its own prefix, or the second one waits forever for addresses
    the first one's ranks left there (5 Engines on 2 ranks hung every run; issue 35: every
    built-in distributed strategy and an in-house one, 5 Engines in a row 20 times)."""
    (tmp_path / "engines.py").write_text(ENGINES_IN_A_ROW)
    (tmp_path / "in_house.py").write_text(IN_HOUSE)
    plugin = ["--plugin", "in_house"] if strategy == "in-house" else []
    run = torchplug(
        "launch", "-n", "2", "--strategy", strategy, *plugin, "engines.py",
        cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    _every_engine_replicated(run.stdout)


@pytest.mark.slow
def test_engines_one_after_another_without_torchruns_store_each_get_their_group(tmp_path):
    """As srun and mpirun start ranks: no agent, MASTER_ADDR/MASTER_PORT only, so every Engine
    rendezvouses through rank 0's ``tcp://`` store, which torch shares by port inside a process
    (the second Engine hung in init_process_group before groups got a prefix there too)."""
    (tmp_path / "engines.py").write_text(ENGINES_IN_A_ROW)
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "engines.py")],
            env={
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": "2",
                "TORCHPLUG_STRATEGY": "ddp",
                "PYTHONWARNINGS": "ignore",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    outputs = []
    try:
        for rank in ranks:
            out, err = rank.communicate(timeout=900)
            assert rank.returncode == 0, out[-3000:] + err[-3000:]
            outputs.append(out)
    finally:
        for rank in ranks:
            rank.kill()
    _every_engine_replicated("".join(outputs))


OWN_LAUNCHER = textwrap.dedent(
    """
    import json, os
    import torchplug.plugin as tpp

    def launch(argv):
        with open("seen.json", "w") as f:
            json.dump({"argv": argv, "env": os.environ.get("TORCHPLUG_OWN_LAUNCHER")}, f)
        return 7 if "--groups" in argv else None  # None: torchrun, as for any strategy

    @tpp.hookimpl
    def torchplug_register_strategies(register):
        register(tpp.StrategyInfo(name="own-launch", factory=tpp.DDPStrategy, description="ours",
                                  extends=tpp.DistributedStrategy, launcher="own_launch:launch"))
    """
)


def test_a_strategy_with_a_launcher_of_its_own_is_handed_the_command_line(tmp_path, script):
    """``StrategyInfo(launcher="module:function")``: ``torchplug launch --strategy NAME`` calls
    it with every word, flags torchplug does not know included; ``None`` back means torchrun."""
    import json

    (tmp_path / "own_launch.py").write_text(OWN_LAUNCHER)
    env = {"TORCHPLUG_PLUGIN_MODULES": "own_launch"}
    words = ["--strategy", "own-launch", "--groups", "3", "-n", "1", str(script), str(tmp_path)]
    run = torchplug("launch", *words, cwd=tmp_path, env=env)
    assert run.returncode == 7, run.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"argv": words, "env": "own_launch:launch"}
    assert not list(tmp_path.glob("started-*")), "torchrun started too"

    words = ["--strategy", "own-launch", "-n", "1", str(script), str(tmp_path)]
    run = torchplug("launch", *words, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "started-0").read_text().split(" ")[1] == "own-launch"
