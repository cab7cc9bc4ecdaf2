"""HSDP: ``fsdp`` with ``dp_replicate=2`` on 4 ranks (FSDP2 over a 2-D ``("dp_replicate",
"dp_shard")`` mesh: each parameter sharded over 2 ranks, replicated over 2 groups) against the
single-process reference, and its checkpoint moved to ``single`` and plain ``fsdp`` bit-exact."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from support.reference import assert_close_dicts, train
from torchplug.testing import RankPool
from torchplug.testing.processes import default_sys_path


@pytest.fixture(scope="module")
def four() -> Iterator[RankPool]:
    pool = RankPool(4, sys_path=default_sys_path())
    yield pool
    pool.stop()


def test_hsdp_matches_the_single_process_reference_and_shards_within_groups(four):
    reference = train("single", clip=1.0)
    results = four.run(train, "fsdp", clip=1.0, min_params=1, dp_replicate=2, timeout=300)
    for result in results:
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert_close_dicts(result["params"], reference["params"], atol=1e-5)
        assert_close_dicts(result["optimizer"], reference["optimizer"], atol=1e-5)
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)


def test_hsdp_checkpoint_loads_into_single_and_fsdp_bit_exact(four, ranks, tmp_path):
    path = str(tmp_path / "hsdp")
    saved = four.run(train, "fsdp", steps=3, save_to=path, dp_replicate=2, timeout=300)[0]
    alone = train("single", steps=0, load_from=path, first_step=3)
    for key, value in saved["params"].items():
        assert torch.equal(alone["params"][key], value), key
    for loaded in ranks.run(train, "fsdp", steps=0, load_from=path, first_step=3, timeout=300):
        for key, value in saved["params"].items():
            assert torch.equal(loaded["params"][key], value), key
        assert_close_dicts(loaded["optimizer"], saved["optimizer"], atol=0)


def test_dp_replicate_that_does_not_divide_the_ranks_says_so(ranks):
    from support.reference import setup_error

    said = ranks.run(setup_error, "fsdp", dp_replicate=3)
    assert all("dp_replicate=3 does not divide the 2 ranks" in s for s in said), said
