"""The harness itself: a failing, dying or hanging rank fails the call; nothing hangs."""

from __future__ import annotations

import os
import time

import pytest

from torchplug.testing import RankError


def identity() -> tuple[int, int, str]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_PORT"]


def raise_on_rank_one() -> int:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one is broken")
    return 0


def die_on_rank_one() -> int:
    if os.environ["RANK"] == "1":
        os._exit(7)
    time.sleep(30)
    return 0


def hang_on_rank_one() -> int:
    if os.environ["RANK"] == "1":
        time.sleep(600)
    return 0


def test_every_rank_runs_the_call_with_a_fresh_port(ranks):
    first = ranks.run(identity)
    second = ranks.run(identity)
    assert [r[:2] for r in first] == [(0, 2), (1, 2)]
    assert first[0][2] == first[1][2] != second[0][2]


def test_an_exception_on_one_rank_fails_the_call_with_its_traceback(ranks):
    expected = r"(?s)rank 1 raised.*ValueError: rank one is broken"
    with pytest.raises(RankError, match=expected) as info:
        ranks.run(raise_on_rank_one, timeout=600)
    # decided by the answers, not by running into the timeout (no wall-clock assertion here)
    assert "did not finish" not in str(info.value) and "rank 0 raised" not in str(info.value)
    assert [r[:2] for r in ranks.run(identity)] == [(0, 2), (1, 2)]  # the pool still works


def test_a_dying_rank_fails_the_call_and_the_pool_restarts(ranks):
    with pytest.raises(RankError, match="rank 1"):
        ranks.run(die_on_rank_one, timeout=60)
    assert [r[:2] for r in ranks.run(identity)] == [(0, 2), (1, 2)]


def test_a_hanging_rank_times_out_with_a_stack_dump_and_the_pool_restarts(ranks, monkeypatch):
    monkeypatch.setattr(ranks, "timeout_floor", 0.0)  # the timeout itself is under test
    with pytest.raises(RankError) as info:
        ranks.run(hang_on_rank_one, timeout=5)
    message = str(info.value)
    assert "rank 1 did not finish within 5 s" in message
    assert "hang_on_rank_one" in message  # faulthandler's dump of where it hung
    assert [r[:2] for r in ranks.run(identity)] == [(0, 2), (1, 2)]
