"""tox's inline plugin for this project: frees each test environment's disk once it has run.

Why: ``tox`` builds eight environments that cannot share packages (the xla one alone is
7.7 GB: torch 2.9's CUDA build and torch_xla), 15.5 GB in all, and CI runs on a machine with
little more free. ``.ci/run`` sets ``TORCHPLUG_TOX_PRUNE=1``, and each environment is
then deleted as soon as it has run, so the peak is the largest one, not their sum. Without
the variable (a developer's ``tox``) nothing is deleted and environments are reused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from tox.plugin import impl
from tox.tox_env.api import ToxEnv
from tox.tox_env.runner import RunToxEnv

PRUNE_VARIABLE = "TORCHPLUG_TOX_PRUNE"


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
