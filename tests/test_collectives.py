"""reduce / gather / barrier / main_process_first / print on real ranks."""

from __future__ import annotations

import contextlib
import io
import os
import time

import pytest
import torch

import torchplug as tp
import torchplug.plugin as tpp


def collectives(marker: str) -> dict:
    with tp.Engine("ddp", timeout=60.0) as engine:
        r = engine.rank
        value = torch.tensor([r + 1.0, 2.0 * (r + 1)])
        out = {op: engine.reduce(value, op).tolist() for op in ("sum", "mean", "max", "min")}
        out["input_unchanged"] = value.tolist() == [r + 1.0, 2.0 * (r + 1)]
        out["int_mean"] = engine.reduce(torch.tensor(r + 2), "mean").item()
        out["python_number_sum"] = engine.reduce(r + 1, "sum").item()
        out["gather"] = engine.gather(value).tolist()
        out["gather_scalar"] = engine.gather(torch.tensor(float(r))).tolist()
        with engine.main_process_first():
            out["saw_main_first"] = os.path.exists(marker)  # rank 0 creates it, then the others run
            if engine.is_main:
                time.sleep(0.5)
                open(marker, "w").close()
        engine.barrier()
        out["flags"] = (engine.is_main, engine.is_local_main, engine.world_size, engine.local_rank)
        return out


def test_reduce_and_gather_on_two_ranks(ranks, tmp_path):
    results = ranks.run(collectives, str(tmp_path / "marker"), timeout=60)
    for rank, out in enumerate(results):
        assert out["sum"] == [3.0, 6.0]
        assert out["mean"] == [1.5, 3.0]
        assert out["max"] == [2.0, 4.0]
        assert out["min"] == [1.0, 2.0]
        assert out["input_unchanged"]
        assert out["int_mean"] == 2.5
        assert out["python_number_sum"] == 3
        assert out["gather"] == [[1.0, 2.0], [2.0, 4.0]]
        assert out["gather_scalar"] == [0.0, 1.0]
        assert out["flags"] == (rank == 0, rank == 0, 2, rank)
        assert out["saw_main_first"] == (rank == 1)


def test_single_process_collectives_are_identity():
    with tp.Engine("single") as engine:
        assert engine.reduce(torch.tensor([1.0, 3.0]), "mean").tolist() == [1.0, 3.0]
        assert engine.gather(torch.tensor([1.0, 3.0])).tolist() == [[1.0, 3.0]]
        engine.barrier()


def test_unknown_reduce_op_names_the_valid_ones():
    with tp.Engine("single") as engine, pytest.raises(tp.ConfigurationError, match="sum, mean"):
        engine.reduce(torch.tensor(1.0), "avg")


def printing() -> str:
    buffer = io.StringIO()
    with tp.Engine("ddp", timeout=60.0) as engine, contextlib.redirect_stdout(buffer):
        engine.print(f"hello from rank {engine.rank}")
    return buffer.getvalue()


def test_print_on_rank_zero_only(ranks):
    assert ranks.run(printing, timeout=60) == ["hello from rank 0\n", ""]


def test_print_only_on_main(capsys):
    with tp.Engine("single") as engine:
        engine.print("visible")
    assert capsys.readouterr().out == "visible\n"


class CountingReduce:
    """An extension wrapping the reduce hook: what reaches it went through the one channel."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    @tpp.hookimpl(wrapper=True)
    def torchplug_reduce(self, engine, tensor, op):
        self.calls.append((op, str(tensor.dtype)))
        return (yield)


def broadcasting() -> dict:
    counter = CountingReduce()
    with tp.Engine("ddp", timeout=60.0, plugins=[counter]) as engine:
        mine = {"rank": engine.rank, "text": "ünïcødé ✓" * (engine.rank + 1), "more": [1, None]}
        got = engine.broadcast_object(mine, src=1)
        return {"got": got, "calls": counter.calls}


def test_broadcast_object_sends_src_s_object_through_the_reduce_hook(ranks):
    """Issue 26 item 2: ``broadcast_object`` calls no torch.distributed function of its own; the
    backend's reduce hook carries it, so any backend's collectives do."""
    expected = {"rank": 1, "text": "ünïcødé ✓" * 2, "more": [1, None]}
    for out in ranks.run(broadcasting, timeout=60):
        assert out["got"] == expected
        assert out["calls"] == [("max", "torch.int64"), ("sum", "torch.uint8")], out["calls"]
