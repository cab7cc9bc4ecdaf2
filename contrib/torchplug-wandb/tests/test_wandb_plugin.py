"""The plugin without wandb: announcing it imports nothing, and a missing wandb says what to
install. These run whether or not wandb is installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torchplug_wandb", reason="torchplug-wandb is not installed")

from torchplug_wandb import WandbLogger  # noqa: E402

import torchplug as tp  # noqa: E402
from torchplug.contract.errors import ConfigurationError  # noqa: E402


def test_announcing_and_listing_the_logger_does_not_import_wandb():
    code = (
        "import sys\n"
        "import torchplug_wandb\n"
        "assert 'torch' not in sys.modules and 'wandb' not in sys.modules\n"
        "from torchplug.cli.plugins import plugins\n"
        "plugins(verbose=True)\n"
        "import importlib.util, torchplug\n"
        "if importlib.util.find_spec('wandb'):  # selected, checked, unused: no run, no import\n"
        "    torchplug.Engine('single', loggers=['wandb']).close()\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] == 'wandb']\n"
        "assert not heavy, heavy\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("wandb "))
    assert "torchplug-wandb 0.1.0" in line


def test_a_missing_wandb_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigurationError, match="pip install wandb"):
        tp.Engine("single", loggers=["wandb"], log_dir=tmp_path)
    with pytest.raises(ImportError, match="pip install wandb"):
        WandbLogger(tmp_path).log_metrics({"loss": 1.0}, step=0)
