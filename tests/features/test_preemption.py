"""A scheduler's notice (SIGTERM, SIGUSR1) as ``engine.preempted``: save, leave, resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import torchplug as tp
from support.paths import TESTS


def test_the_handler_is_installed_on_first_read_and_removed_at_close():
    before = signal.getsignal(signal.SIGTERM)
    with tp.Engine("single") as engine:
        assert signal.getsignal(signal.SIGTERM) == before  # not read yet: default behaviour
        assert engine.preempted is False
        assert signal.getsignal(signal.SIGTERM) != before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert engine.preempted is True
        assert engine.preempted is True  # stays agreed
    assert signal.getsignal(signal.SIGTERM) == before
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_a_handler_the_script_set_is_still_called():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: seen.append(number))
    try:
        with tp.Engine("single") as engine:
            assert not engine.preempted
            os.kill(os.getpid(), signal.SIGTERM)
            assert engine.preempted and seen == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)  # the script's own handler, back in place
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def _one_rank_noticed() -> list[bool]:
    """Only rank 1 is sent the notice; both ranks must be told at the same read."""
    with tp.Engine("ddp") as engine:
        answers = [engine.preempted]
        if engine.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        answers.append(engine.preempted)
        return answers


@pytest.mark.slow
def test_every_rank_agrees_when_one_rank_got_the_notice(ranks):
    assert ranks.run(_one_rank_noticed) == [[False, True], [False, True]]


LAUNCHED = textwrap.dedent(
    f"""
    import sys, torch
    sys.path.insert(0, {str(TESTS)!r})
    from support.restart_body import train
    result = train(sys.argv[1], preempt_marker=sys.argv[2])
    if int(__import__("os").environ["RANK"]) == 0:
        torch.save(result, sys.argv[3])
    """
)


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_exits_143_and_resumes_bit_exact(ranks, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    marker, out, ckpt = tmp_path / "marker", tmp_path / "result.pt", tmp_path / "ckpt"
    argv = [sys.executable, "-m", "torchplug", "launch", "-n", "2", "--shutdown-timeout", "300"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    launcher = subprocess.Popen(
        [*argv, str(script), str(ckpt), str(marker), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        while not marker.exists() and launcher.poll() is None:
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=600)
    finally:
        launcher.kill()
    assert launcher.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr
    assert "torchplug launch: stopped by SIGTERM" in stderr
    assert f"The last checkpoint saved in this run: {ckpt.resolve()}/step-7 (step 7)" in stderr
    assert torch.load(out, weights_only=True) == {"preempted": 7}

    resumed = subprocess.run(
        [*argv, str(script), str(ckpt), str(marker), str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    finished = torch.load(out, weights_only=True)
    assert finished["resumed"] == 7

    from support.restart_body import train

    uninterrupted = ranks.run(train, str(tmp_path / "clean"), timeout=120)[0]
    for name, value in uninterrupted["params"].items():
        assert torch.equal(finished["params"][name], value), name


@pytest.mark.slow
def test_a_stopped_job_without_a_checkpoint_says_so(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text(
        "import pathlib, sys, time, torchplug as tp\n"
        "with tp.Engine('ddp') as engine:\n"
        "    engine.barrier()\n"
        "    pathlib.Path(sys.argv[1] + str(engine.rank)).touch()\n"
        "    time.sleep(600)\n"
    )
    marker = tmp_path / "ready"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torchplug", "launch", "-n", "2", str(script), str(marker)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    try:
        while not all(Path(f"{marker}{r}").exists() for r in (0, 1)) and launcher.poll() is None:
            time.sleep(0.1)
        launcher.send_signal(signal.SIGUSR1)  # srun --signal=USR1@90 reaches the launcher
        _, stderr = launcher.communicate(timeout=600)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGUSR1, stderr[-3000:]
    assert "stopped by SIGUSR1" in stderr and "No checkpoint was saved in this run" in stderr
    assert "Traceback" not in stderr, stderr
