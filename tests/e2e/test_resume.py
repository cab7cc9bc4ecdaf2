"""Cross-strategy resume: 5 steps with A, save, load with B, 5 more == 10 uninterrupted steps."""

from __future__ import annotations

import pytest

from support.reference import assert_close_dicts, run, train

PAIRS = [
    (("fsdp", 2), ("ddp", 2)),
    (("fsdp", 2), ("single", 1)),
    (("fsdp", 2), ("fsdp", 1)),
    (("single", 1), ("fsdp", 2)),
    (("ddp", 2), ("fsdp", 2)),
    (("ddp", 2), ("single", 1)),
]


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    return train("single", steps=10)


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=lambda p: f"{p[0]}@{p[1]}")
def test_resume_in_another_strategy_equals_uninterrupted(
    ranks, tmp_path, uninterrupted, first, second
):
    path = str(tmp_path / "ckpt")
    before = run(ranks, *first, steps=5, save_to=path)
    after = run(ranks, *second, steps=5, first_step=5, load_from=path)
    losses = before["losses"] + after["losses"]
    assert losses == pytest.approx(uninterrupted["losses"], abs=1e-6)
    assert_close_dicts(after["params"], uninterrupted["params"], atol=1e-6)
    assert_close_dicts(after["optimizer"], uninterrupted["optimizer"], atol=1e-6)
