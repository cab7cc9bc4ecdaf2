"""Install packages for a test without touching the running environment or the checkout.

Each package is copied to a temporary directory (so setuptools' ``build/`` and ``*.egg-info``
land there, not in ``contrib/``) and pip-installed with ``--target`` into a temporary folder that
is put on ``sys.path`` and ``PYTHONPATH`` for the test; everything is removed afterwards.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def installed(*sources: Path) -> Iterator[Path]:
    """pip-install ``sources`` (package directories) into a temporary target; yield it."""
    scratch = Path(tempfile.mkdtemp(prefix="torchplug-install-"))
    target = scratch / "site"
    copies = []
    for source in sources:
        copy = scratch / "src" / source.name
        shutil.copytree(
            source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
        )
        copies.append(str(copy))
    saved_path, saved_env = list(sys.path), os.environ.get("PYTHONPATH")
    try:
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install"),
                *("--no-deps", "--no-build-isolation", "--no-compile", "--target", str(target)),
                *copies,
            ],
            check=True,
            capture_output=True,
            timeout=300,
            cwd=scratch,
        )
        sys.path.insert(0, str(target))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), saved_env]))
        importlib.invalidate_caches()
        yield target
    finally:
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_env
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", "") or "").startswith(str(scratch)):
                del sys.modules[name]
        importlib.invalidate_caches()
        shutil.rmtree(scratch, ignore_errors=True)
