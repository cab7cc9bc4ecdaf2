"""The torchplug command in a subprocess: ``torchplug(*args)`` and ``torchplug doctor``."""

from __future__ import annotations

import os
import subprocess
import sys


def torchplug(*args: str, timeout: float = 180, env: dict | None = None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "torchplug", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        **kw,
    )


def doctor_run(env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    """``torchplug doctor`` with ``env`` as the whole environment (plus PATH)."""
    return subprocess.run(
        [sys.executable, "-m", "torchplug", "doctor"],
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            # a source checkout run with PYTHONPATH=src tests that checkout, not an installed copy
            **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ},
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def doctor(env: dict[str, str], cwd) -> str:
    """``torchplug doctor``'s output; the settings must be valid."""
    run = doctor_run(env, cwd)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def identity(output: str) -> dict[str, str]:
    """The last word of each line of doctor's output, by its first word."""
    return {line.split()[0]: line.split()[-1] for line in output.splitlines() if line.strip()}
