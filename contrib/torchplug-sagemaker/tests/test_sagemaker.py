"""SageMaker's variables, as SageMaker sets them, give the right identity."""

import json

import pytest

pytest.importorskip("torchplug_sagemaker")

from torchplug.engine import connector as cluster  # noqa: E402

ENV = {
    "SM_HOSTS": json.dumps(["algo-1", "algo-2", "algo-3"]),
    "SM_CURRENT_HOST": "algo-2",
    "SM_NUM_GPUS": "4",
    "SM_NUM_CPUS": "32",
}


def test_host_identity_from_sagemaker_variables():
    info = cluster.detect(ENV)
    assert info.source == "SageMaker"
    assert (info.node_rank, info.num_nodes, info.local_world_size) == (1, 3, 4)
    assert (info.rank, info.world_size, info.master_addr, info.master_port) == (
        4,
        12,
        "algo-1",
        29500,
    )


def test_cpu_hosts_run_one_process_each():
    info = cluster.detect({**ENV, "SM_NUM_GPUS": "0", "SM_CURRENT_HOST": "algo-3"})
    assert (info.rank, info.world_size, info.node_rank) == (2, 3, 2)


def test_torchrun_processes_are_described_by_torchrun():
    info = cluster.detect({**ENV, "RANK": "5", "WORLD_SIZE": "12", "TORCHELASTIC_RUN_ID": "x"})
    assert info.source == "torchrun" and info.rank == 5
