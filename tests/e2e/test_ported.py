"""Training scripts written by others (tests/support/ported_scripts.py) run unchanged under every
strategy and match their ``ddp`` result within the precision's tolerance; the Accelerate-style
script also resumes from a mid-run checkpoint to the uninterrupted result."""

from __future__ import annotations

import pytest

from support.ported import check_strategy


@pytest.mark.parametrize("precision", [None, "bf16", "fp16"])
def test_ddp_scripts_resume_to_the_uninterrupted_result(ranks, tmp_path, precision):
    check_strategy(ranks, "ddp", precision, tmp_path)


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_fsdp_runs_the_ported_scripts_like_ddp(ranks, tmp_path, precision):
    check_strategy(ranks, "fsdp", precision, tmp_path)
