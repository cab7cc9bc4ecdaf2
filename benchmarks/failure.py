"""What one failure costs: ``ft-ddp`` against ``ddp`` + ``--max-restarts`` + ``resume="latest"``.

The same script (contrib/torchplug-torchft/tests/scripts/train.py: 120 steps of 0.1 s) on 2
data-parallel ranks, run without a failure and with one rank SIGKILLed before step 75, round by
round. ``ddp`` saves a checkpoint every 50 steps and its launcher restarts both ranks, which
resume from step 50; ``ft-ddp`` runs 2 replica groups of 1 rank, the killed group restarts alone
and rejoins live. Time lost: the job's wall time with the failure minus without it; steps lost:
the steps a surviving rank computed twice. Target (issue 38): ft-ddp loses at most a fifth of
the time ddp does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import interleaved, record

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "contrib" / "torchplug-torchft" / "tests" / "scripts" / "train.py"
STEPS, EVERY, DIE_AT, STEP_SECONDS = 120, 50, 75, 0.1


def _job(name: str, fail: bool, tmp: Path) -> tuple[float, int]:
    """Run one job; return its wall time and the steps a surviving rank computed twice."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    script = [str(SCRIPT), "--out", str(out), "--steps", str(STEPS), "--slow", str(STEP_SECONDS)]
    if name == "ddp":
        command = [sys.executable, "-m", "torchplug", "launch", "-n", "2", "--strategy", "ddp"]
        command += ["--max-restarts", "1", *script, "--checkpoint-every", str(EVERY)]
        if fail:
            command += ["--die-at", str(DIE_AT), "--die-group", "0", "--die-rank", "1"]
    else:
        command = [sys.executable, "-m", "torchplug_torchft", "launch", "--replicas", "2"]
        command += ["--heartbeat-timeout", "1", "-n", "1", "--max-restarts", "1", *script]
        if fail:
            command += ["--die-at", str(DIE_AT), "--die-group", "1", "--die-rank", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("MASTER_PORT", None)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    survivor = out / "group0_rank0.jsonl"
    lines = survivor.read_text().splitlines()
    seen = [json.loads(line)["step"] for line in lines if '"step"' in line]
    return took, len(seen) - len(set(seen))


def run(rounds: int, smoke: bool) -> list[dict[str, Any]]:
    if importlib.util.find_spec("torchplug_torchft") is None:
        print("  skipped: torchplug-torchft is not installed (pip install it from contrib/)")
        return []
    tmp = Path(tempfile.mkdtemp(prefix="torchplug-bench-failure-"))
    lost_steps: dict[str, list[int]] = {"ddp": [], "ft-ddp": []}

    def lost(name: str) -> float:
        clean, _ = _job(name, False, tmp)
        failed, twice = _job(name, True, tmp)
        lost_steps[name].append(twice)
        return failed - clean

    try:
        results = interleaved(
            {name: (lambda n=name: lost(n)) for name in ("ddp", "ft-ddp")},
            1 if smoke else rounds,
            lambda: None,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    group = f"time lost per failure, checkpoint every {EVERY} steps (failure at {DIE_AT})"
    return [
        record(
            "failure",
            group,
            "ddp + --max-restarts + resume",
            "s",
            results["ddp"],
            results["ddp"],
            "ddp + restarts",
        ),
        record(
            "failure",
            group,
            "ft-ddp (torchft)",
            "s",
            results["ft-ddp"],
            results["ddp"],
            "ddp + restarts",
            {"max": 0.2},
        ),
        record(
            "failure",
            "steps a surviving rank computed twice, per failure",
            "ddp + --max-restarts + resume",
            "steps",
            lost_steps["ddp"],
        ),
        record(
            "failure",
            "steps a surviving rank computed twice, per failure",
            "ft-ddp (torchft)",
            "steps",
            lost_steps["ft-ddp"],
        ),  # fmt: skip
    ]
