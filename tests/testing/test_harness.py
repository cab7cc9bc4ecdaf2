"""The harness itself: a failing, dying or hanging rank fails the call; nothing hangs."""

from __future__ import annotations

import os
import socket
import time

import pytest

from torchplug.testing import RankError


def identity() -> tuple[int, int, str]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_PORT"]


def port_is_taken() -> bool:
    import torch.distributed as dist

    port, rank = int(os.environ["MASTER_PORT"]), int(os.environ["RANK"])
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            taken = False
        except OSError:
            taken = True
    # rank 0 leaves (and lets its store go) only once every rank has looked
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, multi_tenant=True)
    store.set(f"looked-{rank}", "1")
    store.wait(["looked-0", "looked-1"])
    return taken


def rank_sum() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env://: rank 0's store shares the server it holds
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    return int(total)


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


def test_the_port_is_bound_before_the_ranks_hear_of_it(ranks):
    """A port that was only free when the pool looked could be taken before rank 0 binds it,
    and the other ranks would meet whatever took it; so rank 0's store holds it first, and the
    call's own process group uses that store."""
    assert ranks.run(port_is_taken) == [True, True]
    assert ranks.run(rank_sum) == [3, 3]


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
