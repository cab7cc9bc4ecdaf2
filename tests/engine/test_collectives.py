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


def gathering_like_the_peers() -> dict:
    """Issue 34 point 3: what Accelerate's ``gather`` and Fabric's ``all_gather`` /
    ``all_reduce`` take: nested tuples, lists and dicts of tensors and numbers."""
    with tp.Engine("ddp") as engine:
        r = engine.rank
        logits = torch.full((3, 2), float(r))
        labels = torch.tensor([r, r + 10, r + 20])
        pair = engine.gather((logits, labels), concat=True)  # accelerator.gather((a, b))
        stacked = engine.gather({"x": labels, "n": r})  # fabric.all_gather(dict)
        reduced = engine.reduce({"loss": torch.tensor(float(r + 1)), "n": [r, 2 * r]}, "sum")
        kept = torch.tensor([1.0 + r])
        engine.reduce(kept, "sum")
        objects = engine.gather_object([f"rank{r}"])  # accelerate gather_object
        values = engine.gather_object({"r": r})
        return {
            "pair": [t.tolist() for t in pair],
            "pair_shapes": [tuple(t.shape) for t in pair],
            "stacked": {k: v.tolist() for k, v in stacked.items()},
            "reduced": {"loss": reduced["loss"].item(), "n": [t.item() for t in reduced["n"]]},
            "kept": kept.item(),
            "rank": r,
            "scalar": engine.gather(torch.tensor(float(r)), concat=True).tolist(),
            "objects": objects,
            "values": values,
        }


def test_gather_and_reduce_take_what_the_peers_take(ranks):
    for result in ranks.run(gathering_like_the_peers, timeout=120):
        assert result["pair_shapes"] == [(6, 2), (6,)]  # concatenated, as Accelerate's
        assert result["pair"][1] == [0, 10, 20, 1, 11, 21]
        assert result["pair"][0] == [[0.0, 0.0]] * 3 + [[1.0, 1.0]] * 3
        assert result["stacked"] == {"x": [[0, 10, 20], [1, 11, 21]], "n": [0, 1]}
        assert result["reduced"] == {"loss": 3.0, "n": [1, 2]}
        assert result["kept"] == 1.0 + result["rank"]  # the input is not changed in place
        assert result["scalar"] == [0.0, 1.0]
        assert result["objects"] == ["rank0", "rank1"]  # lists joined
        assert result["values"] == [{"r": 0}, {"r": 1}]


def test_gather_names_what_it_takes_when_given_something_else():
    with tp.Engine("single") as engine, pytest.raises(TypeError, match="gather_object"):
        engine.gather(("a", "b"))
