"""The contrib packages, installed into a temporary target and used by name."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from support.commands import doctor, identity
from support.installing import installed as install_into_temporary_target
from support.paths import ROOT
from torchplug.cli.launch import apply_cluster, launch_parser
from torchplug.plugin import ClusterInfo
from torchplug.testing.kit import check
from torchplug.testing.processes import RankPool, default_sys_path

CONTRIB = ROOT / "contrib"
PACKAGES = {
    "torchplug_powersgd": "torchplug-powersgd",
    "torchplug_sagemaker": "torchplug-sagemaker",
    "torchplug_wandb": "torchplug-wandb",
}


@pytest.fixture(scope="module", autouse=True)
def installed() -> Iterator[None]:
    """The contrib packages, installed into a temporary target for this module (nothing is
    installed into the running environment, nothing is built inside contrib/), unless the
    environment (tox) already has them."""
    missing = [d for m, d in PACKAGES.items() if importlib.util.find_spec(m) is None]
    if not missing:
        yield
        return
    with install_into_temporary_target(*(CONTRIB / d for d in missing)):
        yield


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    """Two ranks that see the temporary install (the session's ranks started before it)."""
    with RankPool(2, sys_path=default_sys_path()) as ranks:
        yield ranks


def torchplug(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchplug", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_powersgd_is_listed_with_its_package_and_version():
    run = torchplug("plugins")
    line = next(x for x in run.stdout.splitlines() if x.startswith("powersgd"))
    assert "torchplug-powersgd 0.1.0" in line and line.endswith("usable")


def test_powersgd_inherits_ddps_options_through_extends():
    run = torchplug("plugins", "--verbose")
    section = run.stdout.split("\npowersgd: ", 1)[1].split("\n\n", 1)[0]
    assert "extends: ddp" in section
    for option in ("find_unused_parameters", "bucket_cap_mb", "timeout", "rank", "warm_up"):
        assert f"option {option}:" in section, section
    assert "torchplug_wrap: torchplug_powersgd:PowerSGD" in section


@pytest.mark.slow
def test_powersgd_passes_the_conformance_kit_on_two_ranks(pool):
    outcomes = check("powersgd", pool=pool)
    failed = [str(o) for o in outcomes if not (o.passed or o.skipped)]
    assert not failed, failed
    assert "lossy: checked for convergence" in outcomes[0].detail


def test_wandb_logger_is_listed_with_its_package_and_what_it_needs():
    """Listed from its entry point without importing wandb; usable only where wandb is (its
    own tests, in contrib/torchplug-wandb/tests, run it offline where it is)."""
    run = torchplug("plugins")
    line = next(x for x in run.stdout.splitlines() if x.startswith("wandb "))
    assert "torchplug-wandb 0.1.0" in line
    if importlib.util.find_spec("wandb") is None:
        assert line.endswith("unusable: package 'wandb' not installed — pip install wandb"), line
    else:
        assert line.endswith("usable"), line


def test_sagemaker_identity_in_doctor(tmp_path):
    env = {
        "SM_HOSTS": json.dumps(["algo-1", "algo-2"]),
        "SM_CURRENT_HOST": "algo-2",
        "SM_NUM_GPUS": "0",
        "SM_NUM_CPUS": "8",
    }
    lines = identity(doctor(env, tmp_path))
    assert lines["detected"] == "SageMaker"
    assert (lines["rank"], lines["world_size"], lines["node_rank"]) == ("1", "2", "1")
    assert lines["master_addr"] == "algo-1"


def test_launch_takes_multi_node_flags_from_the_cluster_environment():
    parser = launch_parser()
    info = ClusterInfo(
        rank=4,
        world_size=8,
        node_rank=1,
        num_nodes=2,
        local_world_size=4,
        master_addr="algo-1",
        master_port=29500,
        source="SageMaker",
    )
    args = parser.parse_args(["train.py"])
    filled = sorted(apply_cluster(args, parser, info))
    assert filled == ["master_addr", "master_port", "nnodes", "node_rank"]
    assert (args.nnodes, args.node_rank, args.master_addr) == ("2", 1, "algo-1")
    args = parser.parse_args(["--nnodes", "3", "train.py"])  # the user's own flags win
    apply_cluster(args, parser, info)
    assert args.nnodes == "3"


def test_rank_pool_puts_the_callers_directories_on_its_ranks_path(tmp_path, monkeypatch):
    """Issue 26 item 8: a function from the caller's own module (here one in a directory only the
    caller's sys.path holds) runs on the ranks without passing sys_path."""
    (tmp_path / "my_rank_function.py").write_text(
        "import os\n\n"
        "def where():\n"
        "    return int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_rank_function

    with RankPool(2) as ranks:
        assert ranks.run(my_rank_function.where, timeout=120) == [(0, 2), (1, 2)]
