"""tox's inline plugin for this project: frees each test environment's disk once it has run, and
hands pip's package sources to uv where tox-uv makes the environments.

Why: ``tox`` builds eight environments that cannot share packages (the xla one alone is
7.7 GB: torch 2.9's CUDA build and torch_xla), 15.5 GB in all, and CI runs on a machine with
little more free. ``.ci/run`` sets ``TORCHPLUG_TOX_PRUNE=1``, and each environment is
then deleted as soon as it has run, so the peak is the largest one, not their sum. Without
the variable (a developer's ``tox``) nothing is deleted and environments are reused.

With tox-uv installed beside tox (``.ci/run`` does; the README says so), uv makes and fills the
environments: xla's 7 GB in about a minute instead of four. uv reads neither pip's configuration
files nor its ``PIP_*`` variables, so a machine whose packages come from a mirror or a wheel
folder (this one's torch build lies in one) would get different packages; the sources pip is
configured with are handed to uv (``UV_*``, never overriding one already set).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tox.plugin import impl
from tox.tox_env.api import ToxEnv
from tox.tox_env.runner import RunToxEnv

PRUNE_VARIABLE = "TORCHPLUG_TOX_PRUNE"
#: pip's setting -> uv's variable and the separator of its list
UV_SOURCES = {
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "find-links": ("UV_FIND_LINKS", ","),
}


def pip_sources() -> dict[str, str]:
    """pip's effective index, extra indexes and link folders (its environment variables over
    its ``install`` section over its ``global`` one), as ``UV_*`` variables."""
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, tuple[int, str]] = {}
    rank = {"global": 0, "install": 1, ":env:": 2}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if name in UV_SOURCES and section in rank and rank[section] >= found.get(name, (-1,))[0]:
            found[name] = (rank[section], value.strip().strip("'\""))
    return {
        UV_SOURCES[name][0]: UV_SOURCES[name][1].join(value.split())
        for name, (_, value) in found.items()
        if value.split()
    }


@impl
def tox_add_core_config(core_conf: Any, state: Any) -> None:  # noqa: ARG001 (tox's signature)
    """Hand pip's package sources to uv (see the module's docstring), before any environment
    is made; ``uv pip`` then resolves among the same packages as pip does."""
    for variable, value in pip_sources().items():
        os.environ.setdefault(variable, value)
    os.environ.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")  # pip's: best of all sources


def _gigabytes(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file removed meanwhile
                total += os.lstat(os.path.join(root, name)).st_size
    return total / 1e9


@impl
def tox_env_teardown(tox_env: ToxEnv) -> None:
    """Delete a run environment's folder after its commands, when ``TORCHPLUG_TOX_PRUNE=1``.

    Only run environments inside tox's work folder are deleted; the packaging environment
    (``.pkg``), which every run environment uses, is kept.
    """
    if os.environ.get(PRUNE_VARIABLE) != "1" or not isinstance(tox_env, RunToxEnv):
        return
    env_dir = Path(tox_env.conf["env_dir"]).resolve()
    work_dir = Path(tox_env.core["work_dir"]).resolve()
    if work_dir not in env_dir.parents or not env_dir.is_dir():
        return
    size = _gigabytes(env_dir)
    shutil.rmtree(env_dir, ignore_errors=True)
    free = shutil.disk_usage(work_dir).free / 1e9
    print(
        f"{tox_env.conf.name}: {PRUNE_VARIABLE}=1, deleted {env_dir} ({size:.1f} GB); "
        f"{free:.1f} GB free",
        flush=True,
    )
