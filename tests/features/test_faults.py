"""Failures end fast and say why: no teardown hang, debug mode for collectives, one traceback.

Launcher tests start real 2-rank jobs with a small collective timeout and time them from the
moment the script enters its collective; the others reuse the ``ranks`` pool.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import torchplug as tp
from support.commands import torchplug
from support.paths import ROOT
from torchplug.testing import RankError

FAILING = textwrap.dedent(
    """
    import os, sys, time, torch, torchplug as tp
    mode, timeout, stamp = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    with tp.Engine("ddp", timeout=timeout) as engine:
        engine.barrier()
        if engine.rank == 0:
            open(stamp, "w").write(repr(time.time()))
        if engine.rank == 1:
            if mode == "raise":
                raise ValueError("boom on rank 1")
            if mode == "abort":
                os.abort()  # as a crash in native code ends a rank: SIGABRT, no Python error
            time.sleep(300)  # mode == "stall"
        engine.reduce(torch.ones(3), "sum")
    """
)


def launch_failing(tmp_path: Path, mode: str, timeout: float) -> tuple[object, float]:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    stamp = tmp_path / "stamp"
    # The harness gives up after 300 s: a job that waits for its collective timeout fails the
    # test's "ends fast" assertion long before that (each test's timeout is >= 20x its bound).
    run = torchplug("launch", "-n", "2", str(script), mode, str(timeout), str(stamp), timeout=300)
    ended = time.time()
    return run, ended - float(stamp.read_text())


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_job_and_is_named_first_with_one_traceback(tmp_path):
    run, elapsed = launch_failing(tmp_path, "raise", timeout=1200.0)
    assert run.returncode == 1
    assert elapsed < 60, f"took {elapsed:.1f} s: something waited for the 1200 s timeout"
    summary = run.stderr[run.stderr.index("torchplug launch: the job failed") :]
    assert summary.startswith(f"torchplug launch: the job failed ({tmp_path / 'failing.py'}).")
    assert "Rank 1 failed first: ValueError: boom on rank 1\n" in summary
    assert "rank 1's traceback:" in summary and 'raise ValueError("boom on rank 1")' in summary
    assert run.stderr.count("Traceback (most recent call last)") == 1
    assert "\n  rank 0: " in summary  # the secondary error, in one line
    assert "FAILED" not in run.stderr  # torchrun's block is replaced by the summary


@pytest.mark.slow
def test_a_rank_that_stalls_ends_the_job_within_the_timeout_and_is_named(tmp_path):
    run, elapsed = launch_failing(tmp_path, "stall", timeout=3.0)
    assert run.returncode == 1
    # 20x the 3 s timeout; without it the job would wait for the stalled rank's 300 s sleep
    assert elapsed < 60, f"took {elapsed:.1f} s"
    assert "Rank 0 failed first: PeerGoneError: Rank 0 waited 3 s in engine.reduce()" in run.stderr
    assert "Rank(s) [1] raised nothing and were still running when it failed" in run.stderr
    assert "torchplug launch --debug" in run.stderr


@pytest.mark.slow
def test_a_rank_that_crashes_is_named_first_as_crashed_not_as_stalled(tmp_path):
    """A rank a signal of its own ended (SIGABRT here) is the cause; the agent's SIGTERM to the
    others is not a stall."""
    run, elapsed = launch_failing(tmp_path, "abort", timeout=1200.0)
    assert run.returncode == 1
    assert elapsed < 60, f"took {elapsed:.1f} s: something waited for the 1200 s timeout"
    assert "Rank 1 failed first: died of SIGABRT, a crash" in run.stderr, run.stderr[-3000:]
    assert "raised nothing and were still running" not in run.stderr


# -- teardown after an exception does not wait (pool) --------------------------------------------


def raise_inside_with(timeout: float) -> float:
    start = time.monotonic()
    try:
        with tp.Engine("ddp", timeout=timeout) as engine:
            if engine.rank == 1:
                raise ValueError("boom")
            engine.reduce(torch.ones(2), "sum")  # rank 1 never joins
    except ValueError:
        pass
    except tp.TorchplugError as exc:
        return time.monotonic() - start if "another rank went away" in str(exc) else -1.0
    return time.monotonic() - start


def test_leaving_the_engine_by_an_exception_skips_the_teardown_barrier(ranks):
    """Rank 1 leaves by an exception while rank 0 waits in a reduce: with a teardown barrier it
    would wait for the whole 1200 s timeout; without, rank 0 learns within seconds."""
    took = ranks.run(raise_inside_with, 1200.0, timeout=600)
    assert 0 <= took[0] < 60 and took[1] < 60, took


# -- debug mode (pool) ---------------------------------------------------------------------------


def mismatched(kind: str) -> None:
    os.environ["TORCHPLUG_DEBUG_COLLECTIVES"] = "1"
    with tp.Engine("ddp", timeout=5.0) as engine:
        r = engine.rank
        if kind == "shape":
            engine.reduce(torch.ones(3 + r), "sum")
        elif kind == "reduce-gather":
            engine.reduce(torch.ones(3)) if r == 0 else engine.gather(torch.ones(3))
        elif kind == "op":
            engine.reduce(torch.ones(3), "max" if r else "sum")
        elif kind == "missing":
            if r == 0:
                engine.barrier()
        else:
            engine.reduce(torch.ones(3), "sum")
            engine.gather(torch.ones(2, dtype=torch.int64))
            engine.barrier()


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (
            "shape",
            "rank(s) [0] call reduce(sum) on shape (3,) float32; "
            "rank(s) [1] call reduce(sum) on shape (4,) float32",
        ),
        (
            "reduce-gather",
            "rank(s) [0] call reduce(mean) on shape (3,) float32; "
            "rank(s) [1] call gather on shape (3,) float32",
        ),
        ("op", "rank(s) [0] call reduce(sum) on shape (3,) float32; rank(s) [1] call reduce(max)"),
    ],
)
def test_debug_mode_names_the_ranks_that_differ(ranks, kind, expected):
    with pytest.raises(RankError) as err:
        ranks.run(mismatched, kind, timeout=60)
    story = str(err.value)
    for rank in (0, 1):  # every rank raises the same diagnosis instead of hanging
        part = story.split(f"--- rank {rank} raised:")[1].split("--- rank")[0]
        assert "CollectiveError: Ranks disagree on torchplug collective #1" in part
        assert expected in part


def test_debug_mode_names_a_rank_that_never_arrives(ranks):
    with pytest.raises(RankError) as err:
        ranks.run(mismatched, "missing", timeout=60)
    assert "but rank(s) [1] did not reach collective #1 within 5 s" in str(err.value)


def test_debug_mode_lets_matching_collectives_through(ranks):
    assert ranks.run(mismatched, "same", timeout=60) == [None, None]


# -- exit without close ----------------------------------------------------------------------------


@pytest.mark.slow
def test_runs_that_never_call_close_exit_cleanly():
    """The suite's share of benchmarks/exit_without_close.py (50 runs by hand; see docs)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from exit_without_close import SCRIPT, run_once
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"no_close_{os.getpid()}.py"
    script.write_text(SCRIPT)
    try:
        outcomes = [run_once(script) for _ in range(3)]
    finally:
        script.unlink()
    assert all(clean for clean, _ in outcomes), [why for _, why in outcomes]


@pytest.mark.slow
def test_a_configuration_error_on_every_rank_is_reported_once_and_short(tmp_path):
    script = tmp_path / "cfg.py"
    script.write_text('import torchplug as tp\nwith tp.Engine("ddp", timeout=-1):\n    pass\n')
    run = torchplug("launch", "-n", "2", str(script))
    assert run.returncode == 1
    ours = [x for x in run.stderr.splitlines() if x.strip() and not x.startswith("W1")]
    assert run.stderr.count("Traceback") == 1 and len(ours) <= 12, run.stderr
    first = re.search(r"Rank (\d) failed first: ConfigurationError: Option 'timeout'", run.stderr)
    assert first, run.stderr
    assert "torchplug's own frames left out" in run.stderr
    other = 1 - int(first.group(1))
    # The other rank either reached the same error or was stopped by torchrun once the first
    # one exited (a race no launcher can win): both are reported in one line, never a traceback.
    same = f"  rank {other}: the same error as rank {first.group(1)}"
    stopped = f"  rank {other}: stopped by signal SIGTERM"
    assert same in run.stderr or stopped in run.stderr, run.stderr


@pytest.mark.slow
def test_a_long_message_is_cut_at_a_word_saying_where_the_rest_is(tmp_path):
    """The summary's one line per rank never cuts a word (an outsider read
    `torchplug_model_state, torchplu`): it ends `... (cut: ...)` naming where the whole is, and
    the first rank's traceback holds the whole message."""
    script = tmp_path / "long.py"
    script.write_text(
        "import torchplug as tp\n"
        "with tp.Engine('ddp') as engine:\n"
        "    words = ' '.join(f'torchplug_hook_number_{i}' for i in range(40))\n"
        "    raise ValueError(f'rank {engine.rank} leaves {words} unanswered END')\n"
    )
    run = torchplug("launch", "-n", "2", str(script), timeout=300)
    assert run.returncode == 1, run.stderr
    headline = next(x for x in run.stderr.splitlines() if "failed first: " in x)
    message = headline.split("failed first: ", 1)[1]
    assert message.endswith("... (cut: the traceback below has it whole)"), headline
    kept = message.split(" ... (cut:")[0]
    assert len(kept) <= 300 and re.fullmatch(r".* torchplug_hook_number_\d+", kept), kept
    assert re.search(r"rank \d leaves .* torchplug_hook_number_39 unanswered END", run.stderr)
    ours = [
        x for x in run.stderr.splitlines() if "[torchplug] rank" in x or x.startswith("  rank ")
    ]
    assert len(ours) >= 2, run.stderr  # each rank's own line ([rankN]: ...) and the summary's
    for line in ours:
        assert "END" not in line and "torchplug_hook_number_39" not in line, line
        assert not re.search(r"torchplug_hook_number_?$|torchplug_hook_num\b", line), line


@pytest.mark.slow
def test_a_message_of_several_lines_is_marked_cut_on_every_rank_line(tmp_path):
    """Only a message's first line fits a summary line; one with more lines says so and where
    the rest is (an outsider's second line, the detail, vanished without a word)."""
    script = tmp_path / "lines.py"
    script.write_text(
        "import torchplug as tp\n"
        "with tp.Engine('ddp') as engine:\n"
        "    raise RuntimeError(f'rank {engine.rank} short first line\\nthe detail is HERE')\n"
    )
    run = torchplug("launch", "-n", "2", str(script), timeout=300)
    assert run.returncode == 1, run.stderr
    first = re.search(
        r"Rank (\d) failed first: RuntimeError: rank \d short first line (.*)", run.stderr
    )
    assert first and first.group(2) == "... (cut: the traceback below has it whole)", run.stderr
    assert "the detail is HERE" in run.stderr  # in that traceback
    other = 1 - int(first.group(1))
    line = next(x for x in run.stderr.splitlines() if x.startswith(f"  rank {other}: "))
    assert f"rank {other} short first line ... (cut: whole in " in line or "SIGTERM" in line, line
    own = [x for x in run.stderr.splitlines() if "[torchplug] rank" in x]
    assert own, run.stderr
    for line in own:
        assert "short first line ... (cut: whole in the file below)" in line, line
        assert "(the error and its traceback: " in line, line


@pytest.mark.slow
def test_launch_debug_turns_the_check_on_in_every_rank(tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(
        "import torch, torchplug as tp\n"
        "with tp.Engine('ddp', timeout=10.0) as engine:\n"
        "    engine.reduce(torch.ones(3)) if engine.rank == 0 else engine.gather(torch.ones(3))\n"
    )
    run = torchplug("launch", "-n", "2", "--debug", str(script), timeout=120)
    assert run.returncode == 1
    assert "CollectiveError: Ranks disagree on torchplug collective #1" in run.stderr
    assert "rank(s) [1] call gather on shape (3,) float32" in run.stderr


SLEEPER = textwrap.dedent(
    """
    import sys, time, torchplug as tp
    with tp.Engine("ddp") as engine:
        engine.barrier()
        print(f"ready {engine.rank}", flush=True)
        time.sleep(600)
    """
)


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_the_workers_and_says_so_without_a_traceback(tmp_path):
    import signal
    import subprocess

    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchplug", "launch", "-n", "2", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    seen = ""
    while seen.count("ready ") < 2:  # both workers are in the loop
        # counted in the text, not per line: torchrun runs workers unbuffered (python -u), so
        # two ranks' prints can interleave as "ready 0ready 1\n\n"
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        seen += line
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "torchplug launch: stopped by SIGTERM" in err
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
