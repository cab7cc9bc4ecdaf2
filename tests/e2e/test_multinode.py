"""Multi-node for real on one machine: two ``torchplug launch --nnodes 2`` on loopback (c10d
rendezvous), 2 ranks each, train to the single-process result."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from support.paths import TESTS
from support.reference import assert_close_dicts, train
from torchplug.plugin import free_port

SCRIPT = textwrap.dedent(
    f"""
    import os, sys, torch
    sys.path.insert(0, {str(TESTS)!r})
    from support.reference import train
    result = train(steps=4)
    if os.environ["RANK"] == "0":
        torch.save({{k: result[k] for k in ("params", "losses", "world_size", "strategy")}},
                   sys.argv[1])
    """
)


@pytest.mark.slow
def test_two_nodes_on_loopback_train_four_ranks_to_the_single_process_result(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "result.pt"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torchplug", "launch",
                "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", f"multinode-{port}",
                str(script), str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]  # fmt: skip
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    result = torch.load(out, weights_only=True)
    assert (result["world_size"], result["strategy"]) == (4, "ddp")
    reference = train("single", steps=4)
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    assert_close_dicts(result["params"], reference["params"], atol=1e-6)
