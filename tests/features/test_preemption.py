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


def _in_a_fresh_process(body: str) -> None:
    """Signal handlers are the process's: each case runs alone in a new interpreter (a pytest
    worker may hold Engines an earlier test never closed), its asserts inside ``body``."""
    prelude = (
        "import gc, os, signal, time, torchplug as tp\n"
        "from torchplug.features import preemption\n"
        "preemption.GRACE = 0.5  # the watcher's delay, short: the cases wait past it\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body) + "\nprint('done')\n"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.split()[-1:] == ["done"], (
        f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )


@pytest.mark.slow
def test_the_handler_is_installed_when_the_engine_is_made_and_removed_at_close():
    """Issue 36 item 8: armed at creation (a notice during setup is held), not at first read."""
    _in_a_fresh_process(
        """
        with tp.Engine("single") as engine:
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
            assert engine.preempted is False
            os.kill(os.getpid(), signal.SIGUSR1)
            assert engine.preempted is True
            assert engine.preempted is True  # stays agreed
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        """
    )


@pytest.mark.slow
def test_a_handler_the_script_set_is_still_called():
    _in_a_fresh_process(
        """
        seen = []
        signal.signal(signal.SIGTERM, lambda number, frame: seen.append(number))
        with tp.Engine("single") as engine:
            assert not engine.preempted
            os.kill(os.getpid(), signal.SIGTERM)
            assert engine.preempted and seen == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)  # the script's own handler, back in place
        assert seen == [signal.SIGTERM, signal.SIGTERM]
        time.sleep(2)  # past the watcher's delay: a handled SIGTERM never ends the process
        """
    )


@pytest.mark.slow
def test_an_engine_never_closed_does_not_turn_a_later_handled_notice_into_a_kill():
    """The CI crash of an xdist worker: an Engine an earlier test never closed (and never
    asked) was still armed when a later test sent SIGTERM under its own handler; the watcher
    then ended the whole process `GRACE` seconds later. A notice that a handler took, or that a
    live Engine read, is not the forgotten Engine's to act on."""
    _in_a_fresh_process(
        """
        forgotten = tp.Engine("single")  # never closed, never asked
        seen = []
        signal.signal(signal.SIGTERM, lambda number, frame: seen.append(number))
        with tp.Engine("single") as engine:
            os.kill(os.getpid(), signal.SIGTERM)
            assert engine.preempted and seen == [signal.SIGTERM]
        time.sleep(2)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with tp.Engine("single") as engine:
            os.kill(os.getpid(), signal.SIGTERM)  # no handler: but this Engine reads it
            assert engine.preempted
            time.sleep(2)
        assert forgotten.preempted  # it was told too, and asks only now
        """
    )


@pytest.mark.slow
def test_engines_closed_out_of_order_or_dropped_put_the_scripts_handler_back():
    _in_a_fresh_process(
        """
        seen = []
        mine = lambda number, frame: seen.append(number)
        signal.signal(signal.SIGTERM, mine)
        first, second = tp.Engine("single"), tp.Engine("single")
        first.close()  # the older one first
        assert signal.getsignal(signal.SIGTERM) != mine  # the second is still armed
        second.close()
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        dropped = tp.Engine("single")
        assert signal.getsignal(signal.SIGTERM) is not mine
        del dropped
        gc.collect()  # an Engine collected unclosed: nobody can read its flag any more
        assert signal.getsignal(signal.SIGTERM) is mine
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]  # once: no stale handler in between
        """
    )


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


#: A user's loop on one process: the notice is sent at ``NOTICE_AT`` ("setup": right after the
#: Engine is made, before its model is set up; a step number otherwise); ``read`` says whether
#: the loop reads ``engine.preempted`` after each step. It prints each step it finishes.
LOOP = textwrap.dedent(
    """
    import os, signal, sys, torch, torchplug as tp
    sig, notice_at, read = getattr(signal, sys.argv[1]), sys.argv[2], sys.argv[3] == "read"
    engine = tp.Engine("single")
    if notice_at == "setup":
        os.kill(os.getpid(), sig)
    model = torch.nn.Linear(4, 2)
    model, opt = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(20):
        if notice_at == str(step):
            os.kill(os.getpid(), sig)
        engine.backward(model(torch.randn(3, 4)).sum())
        opt.step()
        opt.zero_grad()
        print("step", step, flush=True)
        if read and engine.preempted:
            print("preempted", step, flush=True)
            break
    engine.close()
    """
)


def _loop(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("notice", ["SIGTERM", "SIGUSR1"])
def test_a_notice_during_setup_is_held_for_the_first_read(tmp_path, notice):
    """A scheduler's signal that arrives while the Engine sets up (SLURM's USR1 13 s after the
    start, a preemption during a long model build) is the loop's first answer, not a kill."""
    done = _loop(tmp_path, notice, "setup", "read")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["step", "0", "preempted", "0"]


@pytest.mark.slow
def test_a_sigterm_nobody_reads_still_ends_the_process_by_the_second_step(tmp_path):
    """A script that never reads ``engine.preempted`` (or torchrun stopping a failed job's
    workers) keeps SIGTERM's default effect: the process ends by the signal, two optimizer
    steps after it at most."""
    done = _loop(tmp_path, "SIGTERM", "3", "ignore")
    assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]
    assert done.stdout.split() == ["step", "0", "step", "1", "step", "2", "step", "3"]


@pytest.mark.slow
def test_a_sigterm_reaches_a_rank_blocked_in_c_that_never_read_the_flag(tmp_path):
    """The main thread waits inside a C++ call (a store read, as a rank stuck in a collective
    does) where no Python handler can run: the notice still takes its default effect, after
    `GRACE` seconds, long before the 3,600 s the call would wait."""
    script = tmp_path / "blocked.py"
    ready = tmp_path / "ready"
    script.write_text(
        "import datetime, pathlib, sys, torchplug as tp\n"
        "from torch.distributed import TCPStore\n"
        "engine = tp.Engine('single')\n"
        "store = TCPStore('127.0.0.1', 0, 1, True, timeout=datetime.timedelta(seconds=3600))\n"
        "pathlib.Path(sys.argv[1]).touch()\n"
        "store.get('never set')\n"
    )
    process = subprocess.Popen([sys.executable, str(script), str(ready)], stderr=subprocess.PIPE)
    try:
        while not ready.exists() and process.poll() is None:
            time.sleep(0.1)
        time.sleep(0.5)  # inside store.get
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=600)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGTERM, process.stderr.read()[-3000:]
