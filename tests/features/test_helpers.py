"""The helpers users expect from Accelerate and Fabric: gather_for_metrics, accumulate,
seed_everything, engine.log, on real ranks where it matters."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import random

import numpy
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp
import torchplug.plugin as tpp
from support.accumulation import accumulated_training, large_batch_reference
from torchplug.testing import RankPool


def eval_gather(batch_size: int) -> dict:
    """A 7-item eval set over the ranks: every item once, nested outputs, uneven batches."""
    with tp.Engine("ddp", timeout=60.0) as engine:
        data = TensorDataset(torch.arange(7), torch.arange(7).float() * 10)
        loader = engine.setup_dataloader(DataLoader(data, batch_size=batch_size))
        items, nested, plain = [], [], 0
        for index, value in loader:
            got = engine.gather_for_metrics(index)
            items += got.tolist()
            out = engine.gather_for_metrics((index, {"value": value[:, None], "n": len(index)}))
            nested.append((out[0].tolist(), out[1]["value"].squeeze(1).tolist(), out[1]["n"]))
            plain += engine.gather(index.new_tensor(len(index))).sum().item()
        uneven = engine.gather_for_metrics(torch.ones(engine.rank + 1, 3), padding=0)
        try:
            engine.gather_for_metrics(torch.ones(2, engine.rank + 1), padding=0)
            mismatch = None
        except tp.ConfigurationError as exc:
            mismatch = str(exc)
        return {
            "items": items,
            "nested": nested,
            "plain": plain,
            "uneven": tuple(uneven.shape),
            "mismatch": mismatch,
        }


@pytest.mark.parametrize("batch_size", [2, 4])
def test_gather_for_metrics_returns_exactly_the_eval_set(ranks, batch_size):
    results = ranks.run(eval_gather, batch_size, timeout=60)
    out = results[0]
    assert out["plain"] == 8  # what gather counts: the padded sample twice
    assert sorted(out["items"]) == list(range(7))  # gather_for_metrics: exactly 7
    assert results[1]["items"] == out["items"]
    for index, value, n in out["nested"]:
        assert [v / 10 for v in value] == index
        assert n.tolist() == [batch_size] * 2 or len(n) == 2
    assert out["uneven"] == (3, 3)  # 1 row from rank 0, 2 from rank 1
    assert "differ beyond the first dimension: [(2, 1), (2, 2)]" in out["mismatch"]


def test_accumulate_equals_one_large_batch(ranks):
    results = ranks.run(accumulated_training, 2, timeout=60)
    assert results[0] == results[1]
    skipped = results[0][-1]
    assert skipped == [True, False, True, False]
    assert results[0][:-1] == pytest.approx(large_batch_reference(), abs=1e-6)


def accumulated_over_epochs(strategy: str, epochs: int = 2, steps: int = 4) -> dict:
    """Issue 34: 5 batches per epoch per rank, ``accumulate(steps=4)``: what updates when."""
    with tp.Engine(strategy) as engine:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = engine.setup(model, optimizer)
        g = torch.Generator().manual_seed(1)
        n = 10 * engine.world_size  # 5 batches of 2 per rank
        x, y = torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)
        loader = engine.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=2))
        updates, after_epoch = [], []
        for _ in range(epochs):
            stepped = 0
            for xb, yb in loader:
                with engine.accumulate(model, steps=steps):
                    engine.backward(torch.nn.functional.mse_loss(model(xb), yb))
                    optimizer.step()
                    stepped += not optimizer.step_was_skipped
                    optimizer.zero_grad()
            updates.append(stepped)
            after_epoch.append([p.detach().clone() for p in model.parameters()])
            grads = [p.grad for p in model.parameters() if p.grad is not None]
        return {"updates": updates, "after_epoch": after_epoch, "grads_left": grads}


def accelerate_reference(world: int, epochs: int = 2, steps: int = 4) -> list[list]:
    """Accelerate's semantics in plain PyTorch (``GradientAccumulationPlugin`` defaults): each
    loss divided by ``steps``; the update on every ``steps``-th batch and on the last batch of
    the pass, where the count starts again. The global batch of ``world`` ranks' batches of 2
    is ``2 * world`` consecutive items of each round (DistributedSampler interleaves)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    n = 10 * world
    x, y = torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)
    out = []
    for _ in range(epochs):
        count = 0
        for b in range(5):
            rows = slice(b * 2 * world, (b + 1) * 2 * world)
            (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / steps).backward()
            count += 1
            if count % steps == 0 or b == 4:
                optimizer.step()
                optimizer.zero_grad()
                count = 0
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_accumulate_completes_the_group_at_the_end_of_each_loader_pass(ranks, world):
    """Issue 34 point 1: 5 batches per epoch and steps=4 update twice per epoch (4 + the last
    1), as Accelerate's default does, not once with a group spanning two epochs; no gradient
    is left unapplied at the end; the numbers equal Accelerate's semantics in plain PyTorch."""
    results = (
        [accumulated_over_epochs("single")]
        if world == 1
        else ranks.run(accumulated_over_epochs, "ddp", timeout=120)
    )
    expected = accelerate_reference(world)
    for result in results:
        assert result["updates"] == [2, 2]
        assert all(not bool(g.abs().sum()) for g in result["grads_left"])  # nothing left over
        for got, want in zip(result["after_epoch"], expected, strict=True):
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_accumulate_rejects_a_bad_count():
    with tp.Engine("single") as engine:
        model = engine.setup(torch.nn.Linear(1, 1))
        with pytest.raises(tp.ConfigurationError, match="steps=0 is not a number of micro"):
            engine.accumulate(model, 0).__enter__()


def test_seed_everything_repeats_random_torch_and_numpy():
    def draw():
        return (random.random(), torch.rand(1).item(), numpy.random.rand())

    assert tp.seed_everything(7) == 7
    first = draw()
    tp.seed_everything(7)
    assert draw() == first
    with pytest.raises(ValueError, match="seed -1 is not a whole number"):
        tp.seed_everything(-1)


def test_seed_worker_differs_per_rank_and_worker():
    from torchplug.features.seeding import worker_seed

    seeds = {worker_seed(3, rank, worker) for rank in range(4) for worker in range(4)}
    assert len(seeds) == 16


def logging_on_ranks(log_dir: str) -> int:
    with tp.Engine("ddp", timeout=60.0, loggers=["csv", "jsonl"], log_dir=log_dir) as engine:
        for step in range(3):
            engine.log({"loss": torch.tensor(1.0 / (step + 1)), "rank": engine.rank}, step=step)
        engine.log({"eval_accuracy": 0.5})
        return engine.rank


def test_log_writes_csv_and_jsonl_on_rank_zero_only(ranks, tmp_path):
    ranks.run(logging_on_ranks, str(tmp_path), timeout=60)
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,name,value,time"
    assert [r.split(",")[:3] for r in rows[1:3]] == [["0", "loss", "1.0"], ["0", "rank", "0.0"]]
    assert rows[-1].split(",")[:3] == ["3", "eval_accuracy", "0.5"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert {r.get("rank") for r in records[:3]} == {0}  # rank 1 wrote nothing
    assert not list(tmp_path.glob("rank-*"))


class ListLogger:
    """A third-party tracker: collects what it is given."""

    seen: list = []

    def __init__(self, log_dir):
        self.log_dir = log_dir

    def log_metrics(self, metrics, step):
        ListLogger.seen.append((step, dict(metrics)))

    def close(self):
        ListLogger.seen.append("closed")


@tpp.hookimpl
def torchplug_register_loggers(register):
    register(tpp.LoggerInfo("list", ListLogger, "collects metrics in a list"))


def test_a_logger_plugin_is_selected_by_name_like_a_strategy(tmp_path, monkeypatch):
    import sys

    ListLogger.seen = []
    tp.register(sys.modules[__name__], name="list-logger")
    monkeypatch.setenv("TORCHPLUG_LAUNCH_LOGGERS", "list")
    with tp.Engine("single", log_dir=tmp_path) as engine:
        assert engine.loggers.source == "torchplug launch --logger"
        engine.log({"loss": 2})
    assert ListLogger.seen == [(0, {"loss": 2.0}), "closed"]


def test_unknown_and_unusable_loggers_are_named(monkeypatch):
    with pytest.raises(tp.ConfigurationError, match=r"Unknown logger 'cvs'. Did you mean 'csv'"):
        tp.Engine("single", loggers=["cvs"])
    from torchplug.contract.manager import get_registry

    info = get_registry().loggers["tensorboard"]
    assert info.install_hint == "pip install torchplug[tensorboard]"
    monkeypatch.setenv("TORCHPLUG_LOGGERS", "nope")
    with pytest.raises(tp.ConfigurationError, match="came from environment TORCHPLUG_LOGGERS"):
        tp.Engine("single")


def test_tensorboard_logger_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    with tp.Engine("single", loggers="tensorboard", log_dir=tmp_path) as engine:
        engine.log({"loss": 1.5}, step=4)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_logger_writes_hyperparameters_to_the_hparams_tab(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    with tp.Engine("single", loggers="tensorboard", log_dir=tmp_path) as engine:
        engine.log_hyperparams({"lr": 0.5, "optim": {"name": "sgd"}, "layers": [2, 3]})
    found = {}
    for events in (tmp_path / "tensorboard").glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        try:
            contents = accumulator.PluginTagToContent("hparams").values()
        except KeyError:
            continue  # the scalars' file
        for content in contents:
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            if data.HasField("session_start_info"):
                found = {
                    k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
                    for k, v in data.session_start_info.hparams.items()
                }
    assert found == {"lr": 0.5, "optim.name": "sgd", "layers": "[2, 3]"}


@pytest.mark.slow
def test_trainer_logs_its_hparams_once_on_rank_zero(ranks, tmp_path):
    results = ranks.run(_train_with_hparams, str(tmp_path))
    assert results == [None, None]
    assert json.loads((tmp_path / "hparams.json").read_text()) == {
        "lr": 0.1, "model.width": 8, "note": "baseline"
    }  # fmt: skip
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x for x in lines if "hparams" in x] == [
        {"hparams": {"lr": 0.1, "model.width": 8, "note": "baseline"}}
    ]
    assert not list(tmp_path.glob("rank-*"))  # rank 1 wrote nothing


def _train_with_hparams(log_dir: str) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    model = torch.nn.Linear(4, 1)
    trainer = tp.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.functional.mse_loss,
        DataLoader(data, batch_size=4),
        strategy="ddp",
        loggers=["csv", "jsonl"],
        log_dir=log_dir,
        hparams={"lr": 0.1, "model": {"width": 8}, "note": "baseline"},
        progress=False,
    )
    trainer.fit()
    trainer.close()


def test_hyperparameters_logged_twice_are_kept_by_every_logger(tmp_path):
    with tp.Engine("single", loggers=["csv", "jsonl"], log_dir=tmp_path) as engine:
        engine.log_hyperparams({"lr": 0.1, "bs": 8})
        engine.log_hyperparams({"lr": 0.2, "seed": 3})
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"lr": 0.2, "bs": 8, "seed": 3}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"hparams": {"lr": 0.1, "bs": 8}}, {"hparams": {"lr": 0.2, "seed": 3}}]


def test_log_hyperparams_wants_a_dict(tmp_path):
    with (
        tp.Engine("single", loggers=["jsonl"], log_dir=tmp_path) as engine,
        pytest.raises(tp.ConfigurationError, match="expects a dict of names to values"),
    ):
        engine.log_hyperparams(["lr", 0.1])


def test_metric_values_must_be_numbers(tmp_path):
    with (
        tp.Engine("single", loggers=["jsonl"], log_dir=tmp_path) as engine,
        pytest.raises(TypeError, match="tensor of shape \\(2,\\); expected one number"),
    ):
        engine.log({"loss": torch.ones(2)})


def test_launch_refuses_an_unknown_logger_before_starting(tmp_path):
    from support.commands import torchplug

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    run = torchplug("launch", "-n", "2", "--logger", "tensorbord", str(script))
    assert run.returncode == 2, run.stderr
    assert "--logger tensorbord: Unknown logger 'tensorbord'. Did you mean 'tensorboard'" in (
        run.stderr
    )


def test_plugins_command_lists_the_loggers():
    from support.commands import torchplug

    run = torchplug("plugins")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("logger "))
    rows = {line.split()[0]: line for line in lines[header + 2 :] if line.strip()}
    assert "usable" in rows["csv"] and "torchplug" in rows["csv"]
    assert {"csv", "jsonl", "tensorboard"} <= set(rows)


def tensor_parallel_gather() -> list:
    # one data-parallel replica over 2 ranks
    with tp.Engine("tp", timeout=60.0, tp_plan={"up": "colwise"}) as engine:
        data = TensorDataset(torch.arange(7))
        loader = engine.setup_dataloader(DataLoader(data, batch_size=4))
        items = []
        for (index,) in loader:
            items += engine.gather_for_metrics(index).tolist()
        return items


def test_gather_for_metrics_counts_a_tensor_parallel_replica_once(ranks):
    results = ranks.run(tensor_parallel_gather, timeout=60)
    assert results[0] == results[1] == list(range(7))


def split_and_pad(n: int) -> dict:
    """What each rank gets of ``n`` items (list, tensor, dict; padded and not), a rank-sized
    tensor padded across processes, and the stop triggers."""
    with tp.Engine("ddp") as engine:
        items = list(range(n))
        out = {}
        with engine.split_between_processes(items) as mine:
            out["list"] = mine
        with engine.split_between_processes(items, apply_padding=True) as mine:
            out["padded"] = mine
        with engine.split_between_processes(torch.arange(n), apply_padding=True) as mine:
            out["tensor"] = mine.tolist()
        with engine.split_between_processes({"a": items, "b": tuple(items)}) as mine:
            out["dict"] = mine
        mine = torch.full((engine.rank + 1, 2), float(engine.rank))
        out["pad_last"] = engine.pad_across_processes(mine, dim=0, pad_index=-1).tolist()
        out["pad_first"] = engine.pad_across_processes(mine, 0, -1, pad_first=True).tolist()
        out["any"] = engine.any(engine.rank == 1)
        out["all"] = engine.all(engine.rank == 1)
        out["all_true"] = engine.all(True)
        return out


@pytest.mark.parametrize("n", [5, 4, 1])
def test_split_between_processes_gives_contiguous_parts_and_pads_them_alike(ranks, n):
    results = ranks.run(split_and_pad, n, timeout=120)
    parts = [r["list"] for r in results]
    assert parts[0] + parts[1] == list(range(n))  # every item once, in order
    assert len(parts[0]) - len(parts[1]) in (0, 1)  # the first part the longer
    longest = len(parts[0])
    for r in results:
        assert len(r["padded"]) == len(r["tensor"]) == longest
        assert r["padded"] == r["tensor"]
        assert r["dict"] == {"a": r["list"], "b": tuple(r["list"])}
    if n == 5:
        assert [r["padded"] for r in results] == [[0, 1, 2], [3, 4, 4]]
    if n == 1:
        assert [r["padded"] for r in results] == [[0], [0]]  # an empty part repeats the last


def test_pad_across_processes_and_the_stop_triggers_agree_on_every_rank(ranks):
    zero, one = ranks.run(split_and_pad, 3, timeout=120)
    assert zero["pad_last"] == [[0.0, 0.0], [-1.0, -1.0]]
    assert zero["pad_first"] == [[-1.0, -1.0], [0.0, 0.0]]
    assert one["pad_last"] == one["pad_first"] == [[1.0, 1.0], [1.0, 1.0]]
    assert zero["any"] is one["any"] is True
    assert zero["all"] is one["all"] is False
    assert zero["all_true"] is one["all_true"] is True


def test_split_between_processes_in_one_process_and_its_errors():
    with tp.Engine("single") as engine:
        with engine.split_between_processes([1, 2, 3]) as mine:
            assert mine == [1, 2, 3]
        with (
            pytest.raises(tp.ConfigurationError, match="expected a list, tuple, tensor"),
            engine.split_between_processes(iter([1])),
        ):
            pass
        with (
            pytest.raises(tp.ConfigurationError, match="of different lengths"),
            engine.split_between_processes({"a": [1], "b": [1, 2]}),
        ):
            pass
        with pytest.raises(tp.ConfigurationError, match="expected a dim in"):
            engine.pad_across_processes(torch.ones(2), dim=3)
        assert engine.any(False) is False and engine.all(True) is True


def train_at_the_largest_batch_that_fits(factor: float = 0.5) -> dict:
    """On each rank: a model whose activations for more than 16 samples cannot be allocated (a
    real allocation failure: 2**47 bytes per extra sample, past any address space, so refused
    whatever the overcommit policy), trained one DDP step at the batch size
    find_executable_batch_size settles on."""
    engine = tp.Engine("ddp", timeout=120.0)
    model = engine.setup(torch.nn.Linear(4, 1))

    @tp.find_executable_batch_size(starting_batch_size=128, factor=factor)
    def step(batch_size: int, scale: float) -> float:
        if batch_size > 16:
            torch.empty((batch_size - 16) << 47, dtype=torch.uint8)  # past any address space
        x = torch.full((batch_size, 4), scale)
        loss = model(x).square().mean()
        engine.backward(loss)
        return float(model.module.weight.grad.sum())

    grad = step(1.0)
    engine.close()
    return {"tried": step.tried, "grad": grad}


def test_find_executable_batch_size_halves_on_real_out_of_memory_errors(ranks):
    results = ranks.run(train_at_the_largest_batch_that_fits, timeout=120)
    for result in results:
        assert result["tried"] == [128, 64, 32, 16]
    assert results[0]["grad"] == results[1]["grad"]  # one step together, gradients averaged


def test_find_executable_batch_size_backs_off_as_accelerate_does_by_default():
    """Issue 34 point 5: Accelerate's current back-off, 0.9 per retry (64, 57, 51, 45, 40)."""

    @tp.find_executable_batch_size(starting_batch_size=64)
    def step(batch_size: int) -> int:
        if batch_size > 40:
            torch.empty((batch_size - 40) << 47, dtype=torch.uint8)  # past any address space
        return batch_size

    assert step() == 40 and step.tried == [64, 57, 51, 45, 40]
    with pytest.raises(tp.ConfigurationError, match="factor=1.5"):
        tp.find_executable_batch_size(starting_batch_size=8, factor=1.5)


def test_find_executable_batch_size_raises_other_errors_at_once_and_names_the_end():
    calls = []

    @tp.find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size: int) -> None:
        calls.append(batch_size)
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        broken()
    assert calls == [8]

    @tp.find_executable_batch_size(starting_batch_size=4, factor=0.5)
    def never_fits(batch_size: int) -> None:
        torch.empty(1 << 50, dtype=torch.uint8)

    with pytest.raises(RuntimeError, match="from 4 down to 1") as info:
        never_fits()
    assert never_fits.tried == [4, 2, 1]
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(tp.ConfigurationError, match="first parameter is 'batch_size'"):
        tp.find_executable_batch_size(lambda n: n)
    with pytest.raises(tp.ConfigurationError, match="without batch_size"):
        never_fits(batch_size=3)


class _Counting(torch.utils.data.IterableDataset):
    """Sample ids 0..n-1 in order, as a stream (an order torchplug does not own)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n, dtype=torch.float32).unsqueeze(1))


def split_batches_on_ranks() -> dict:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    ids = torch.arange(32, dtype=torch.float32).unsqueeze(1)
    engine = tp.Engine("ddp", timeout=120.0)
    torch.manual_seed(0)
    model = engine.setup(torch.nn.Linear(1, 1))
    loader = engine.setup_dataloader(
        DataLoader(TensorDataset(ids), batch_size=8, shuffle=True), split_batches=True
    )
    mine = [b[0].flatten().tolist() for b in loader]
    x = next(iter(loader))[0]
    engine.backward(model(x).square().mean())
    grad = model.module.weight.grad.clone()
    # the one-process order for this seed, in global batches of 8
    order = list(DistributedSampler(TensorDataset(ids), 1, 0, shuffle=True, seed=engine.seed))
    streamed = engine.setup_dataloader(DataLoader(_Counting(16), batch_size=8), split_batches=True)
    stream = [b.flatten().tolist() for b in streamed]
    engine.close()
    return {"mine": mine, "order": order, "grad": grad, "first": x, "stream": stream}


def test_split_batches_makes_batch_size_the_global_batch(ranks):
    """Issue 27 item 5: with split_batches=True the ranks' parts of step i are the one-process
    batch i of batch_size samples (any sampler), and one DDP step equals the step on it."""
    r0, r1 = ranks.run(split_batches_on_ranks, timeout=120)
    assert len(r0["mine"]) == len(r1["mine"]) == 4  # 32 samples in global batches of 8
    for i in range(4):
        assert len(r0["mine"][i]) == len(r1["mine"][i]) == 4
        together = sorted(r0["mine"][i] + r1["mine"][i])
        assert together == sorted(float(j) for j in r0["order"][8 * i : 8 * i + 8])
    assert r0["stream"] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert r1["stream"] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    torch.manual_seed(0)
    reference = torch.nn.Linear(1, 1)
    full = torch.cat([r0["first"], r1["first"]])
    reference(full).square().mean().backward()
    torch.testing.assert_close(r0["grad"], reference.weight.grad)
    torch.testing.assert_close(r1["grad"], reference.weight.grad)


def split_an_uneven_global_batch() -> str:
    from torch.utils.data import DataLoader, TensorDataset

    with tp.Engine("ddp", timeout=120.0) as engine:
        try:
            engine.setup_dataloader(
                DataLoader(TensorDataset(torch.zeros(9, 1)), batch_size=5), split_batches=True
            )
        except tp.ConfigurationError as exc:
            return str(exc)
    return "accepted"


def test_split_batches_refuses_a_global_batch_the_ranks_cannot_share(ranks):
    for message in ranks.run(split_an_uneven_global_batch, timeout=120):
        assert "batch_size=5 is the global batch" in message and "multiple of 2" in message


class _Recorder:
    """A callback for your own loop: plain methods named after your events."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def on_validation_end(self, metrics: dict) -> str:
        self.seen.append(("validation", metrics["loss"]))
        return "recorded"


class _StepCounter:
    """A Trainer callback (``@hookimpl`` functions), reused in a loop of your own."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    @tpp.hookimpl
    def on_step_end(self, trainer, step, loss):
        self.steps.append(step)


def own_loop_with_callbacks() -> dict:
    recorder, counter = _Recorder(), _StepCounter()
    with tp.Engine("ddp", timeout=120.0, callbacks=[recorder, counter]) as engine:
        torch.manual_seed(0)
        model = engine.setup(torch.nn.Linear(2, 1))
        for step in range(3):
            loss = model(torch.full((4, 2), float(engine.rank + step))).square().mean()
            engine.backward(loss)
            engine.call("on_step_end", trainer=None, step=step, loss=float(loss))
        mean = float(engine.reduce(loss.detach(), "mean"))
        answers = engine.call("on_validation_end", metrics={"loss": mean})
        nothing = engine.call("on_nobody_listens")
    return {"seen": recorder.seen, "steps": counter.steps, "answers": answers, "none": nothing}


def test_engine_call_runs_callbacks_of_your_own_loop_on_every_rank(ranks):
    """Issue 27 item 5: Engine(callbacks=...) + engine.call(name, ...), Fabric's pattern; the
    Trainer's callback objects work too."""
    r0, r1 = ranks.run(own_loop_with_callbacks, timeout=120)
    for result in (r0, r1):
        assert result["steps"] == [0, 1, 2]
        assert result["answers"] == ["recorded"]  # only the callback that has the method
        assert result["none"] == []
    assert r0["seen"] == r1["seen"] and len(r0["seen"]) == 1  # reduced: the same everywhere


def test_engine_call_names_a_callback_attribute_that_is_not_a_method():
    class Broken:
        on_epoch_end = 3

    with (
        tp.Engine("single", callbacks=[Broken()]) as engine,
        pytest.raises(tp.ConfigurationError, match="not callable"),
    ):
        engine.call("on_epoch_end")
    with pytest.raises(tp.ConfigurationError, match="callbacks must be a list"):
        tp.Engine("single", callbacks="mine")


def test_measure_flops_counts_a_linear_layers_forward_and_backward():
    """Linear(i, o) on a batch of B is 2*B*i*o FLOPs forward; backward computes the weight's
    gradient (2*B*i*o) and, for every layer but the first, its input's (2*B*i*o more)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 16, bias=False)
    )
    x = torch.randn(8, 64)
    first, second = 2 * 8 * 64 * 32, 2 * 8 * 32 * 16
    expected = (first + second) + (first + 2 * second)
    assert tp.measure_flops(model, lambda: model(x).sum()) == expected
    assert all(p.grad is None for p in model.parameters())


def throughput_on_ranks() -> dict:
    with tp.Engine("ddp", timeout=120.0) as engine:
        monitor = tp.ThroughputMonitor(engine, window=3, peak_flops=1e9)
        samples = 4 * (engine.rank + 1)  # rank 1 processes twice as many samples per batch
        for step in range(5):  # one batch per second, as the loop reports it
            monitor.update(
                time=float(step + 1),
                batches=step + 1,
                samples=(step + 1) * samples,
                tokens=(step + 1) * samples * 10,
                flops=1e8,
            )
        return monitor.compute()


def test_throughput_monitor_rates_over_its_window_on_every_rank_and_together(ranks):
    """Issue 27 item 6: per-rank rates over the last `window` updates, summed over ranks; MFU
    against the peak given."""
    r0, r1 = ranks.run(throughput_on_ranks, timeout=120)
    assert r0["batches_per_s"] == 1.0 and r0["samples_per_s"] == 4.0
    assert r1["samples_per_s"] == 8.0 and r1["tokens_per_s"] == 80.0
    for result in (r0, r1):
        assert result["global/samples_per_s"] == 12.0
        assert result["global/tokens_per_s"] == 120.0
        assert result["flops_per_s"] == pytest.approx(1e8)
        assert result["mfu"] == pytest.approx(0.1)
        assert result["global/mfu"] == pytest.approx(0.1)


def test_throughput_monitor_refuses_what_it_cannot_use():
    with tp.Engine("single") as engine:
        with pytest.raises(tp.ConfigurationError, match="window"):
            tp.ThroughputMonitor(engine, window=1)
        monitor = tp.ThroughputMonitor(engine)
        assert monitor.compute() == {}  # nothing to rate yet
        monitor.update(time=1.0, batches=1, samples=1)
        with pytest.raises(tp.ConfigurationError, match="time must grow"):
            monitor.update(time=1.0, batches=2, samples=2)


def profile_a_few_steps(directory: str) -> list[str]:
    with tp.Engine(
        "ddp", timeout=120.0, profile={"wait": 1, "warmup": 1, "active": 2, "dir": directory}
    ) as engine:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = engine.setup(model, optimizer)
        for _ in range(6):
            engine.backward(model(torch.randn(4, 16)).sum())
            optimizer.step()
            optimizer.zero_grad()
    mine = f"rank-{engine.rank}."
    return sorted(p.name for p in pathlib.Path(directory).iterdir() if p.name.startswith(mine))


@pytest.mark.slow
def test_profile_writes_one_trace_per_rank_over_the_chosen_steps(tmp_path):
    """Issue 27 item 7: torch.profiler over optimizer steps 3-4 (after 1 waiting, 1 warm-up),
    one Chrome trace per rank (what TensorBoard's profiler and Perfetto read), then off.

    On ranks of its own, not the shared pool: a process that ran torch's profiler later
    crashed (SIGSEGV) in a tensor-parallel Llama step of another test sharing its ranks."""
    with RankPool(2) as own:
        traces = own.run(profile_a_few_steps, str(tmp_path), timeout=180)
    for rank, names in enumerate(traces):
        assert names[0].startswith(f"rank-{rank}.")
        assert len(names) == 1 and names[0].endswith(".pt.trace.json"), names
        events = json.loads((tmp_path / names[0]).read_text())["traceEvents"]
        seen = {e.get("name", "") for e in events}
        assert {"ProfilerStep#2", "ProfilerStep#3"} <= seen, sorted(seen)[:20]
        assert "ProfilerStep#4" not in seen and "ProfilerStep#0" not in seen
        assert any(n.startswith("aten::") and "mm" in n for n in seen)  # the Linear layers


def profile_a_block(directory: str) -> dict:
    with tp.Engine("ddp", timeout=120.0) as engine:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = engine.setup(model, optimizer)
        with engine.profile(dir=directory, record_shapes=True) as prof:
            engine.backward(model(torch.randn(4, 16)).sum())
            optimizer.step()
        table = prof.key_averages().table(row_limit=50)
        # Accelerate's schedule_option: a dict of torch.profiler.schedule's keywords
        with engine.profile(schedule={"wait": 1, "warmup": 0, "active": 1}) as scheduled:
            for _ in range(2):
                model(torch.randn(4, 16)).sum()
                scheduled.step()
        ops = {event.key for event in scheduled.key_averages()}
        return {
            "type": type(prof).__module__ + "." + type(prof).__qualname__,
            "table": table,
            "files": sorted(p.name for p in pathlib.Path(directory).iterdir()),
            "scheduled": any("mm" in op for op in ops),
        }


@pytest.mark.slow
def test_engine_profile_yields_torchs_profiler_as_accelerates_does(tmp_path):
    """Issue 34 item 5: ``with engine.profile() as prof`` is torch's profiler over the block
    (``key_averages()``), each rank's Chrome trace written as Accelerate names it when a directory
    is given (after the block: both ranks' files are there once either leaves), a schedule dict
    taken as Accelerate's ``schedule_option``. On ranks of its own, as the test above."""
    with RankPool(2) as own:
        results = own.run(profile_a_block, str(tmp_path), timeout=180)
    for result in results:
        assert result["type"] == "torch.profiler.profiler.profile"
        assert "aten::addmm" in result["table"] or "aten::mm" in result["table"], result["table"]
        assert result["files"] == ["profile_0.json", "profile_1.json"]
        assert result["scheduled"]
    for rank in range(2):
        events = json.loads((tmp_path / f"profile_{rank}.json").read_text())["traceEvents"]
        assert any("mm" in e.get("name", "") for e in events)
    engine = tp.Engine("single")
    with engine, pytest.raises(tp.ConfigurationError, match="keywords"), engine.profile(bad=1):
        pass


def test_profile_settings_are_checked_and_the_trainer_passes_them(tmp_path):
    with pytest.raises(tp.ConfigurationError, match="unknown key"):
        tp.Engine("single", profile={"steps": 3})
    with pytest.raises(tp.ConfigurationError, match="active"):
        tp.Engine("single", profile={"active": 0})
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(48, 4), torch.randint(0, 2, (48,)))
    with tp.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.functional.cross_entropy,
        torch.utils.data.DataLoader(data, batch_size=4),
        strategy="single",
        log_dir=tmp_path,
        profile=True,
        progress=False,
    ) as trainer:
        trainer.fit()
    assert len(list((tmp_path / "profile").glob("rank-0.*.pt.trace.json"))) == 1


def test_accumulate_over_micro_batches_of_a_batch_completes_at_the_last_one():
    """A loop that splits each loader batch into micro-batches (two ``accumulate`` blocks per
    batch) completes the pass's last group at the last micro-batch of the last batch, not at
    its first: 3 batches of 2 micro-batches, steps=4 -> updates after micro-batches 4 and 6."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 3, generator=g), torch.randn(12, 1, generator=g)
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i in range(6):
        rows = slice(2 * i, 2 * i + 2)
        (torch.nn.functional.mse_loss(reference(x[rows]), y[rows]) / 4).backward()
        if i in (3, 5):
            ref_opt.step()
            ref_opt.zero_grad()
    with tp.Engine("single") as engine:
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = engine.setup_dataloader(DataLoader(TensorDataset(x, y), batch_size=4))
        stepped = []
        for xb, yb in loader:
            for xs, ys in zip(xb.chunk(2), yb.chunk(2), strict=True):
                with engine.accumulate(model, steps=4):
                    engine.backward(torch.nn.functional.mse_loss(model(xs), ys))
                    optimizer.step()
                    stepped.append(not optimizer.step_was_skipped)
                    optimizer.zero_grad()
    assert stepped == [False, False, False, True, False, True]
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def gathers_after_a_padded_pass() -> list[int]:
    """A pass over a loader whose last batch is padded on rank 1, then gathers of tensors that
    come from no prepared loader (upstream cross_validation's test loader)."""
    from torch.utils.data import DataLoader, TensorDataset

    with tp.Engine("ddp", timeout=120.0) as engine:
        loader = engine.setup_dataloader(DataLoader(TensorDataset(torch.arange(7)), batch_size=2))
        for (index,) in loader:
            engine.gather_for_metrics(index)
        rows = [engine.gather_for_metrics(torch.full((3,), engine.rank)) for _ in range(2)]
        return [len(r) for r in rows]


def test_a_finished_pass_leaves_no_padding_for_later_gathers(ranks):
    """Issue 34: the last padded batch's padding applied only to gathers during its pass, as
    Accelerate trims only while a prepared loader is iterating; afterwards nothing is cut."""
    assert ranks.run(gathers_after_a_padded_pass) == [[6, 6], [6, 6]]


def folds_in_turn() -> bool:
    """k-fold as upstream writes it: each fold's model set up, trained, evaluated under no_grad
    and tested; the next fold's model then trains (the earlier one is not used again)."""
    results = []
    with tp.Engine("ddp", timeout=120.0) as engine:
        for fold in range(2):
            torch.manual_seed(fold)
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
            model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for _ in range(2):
                engine.backward(model(torch.randn(3, 4)).sum())
                optimizer.step()
                optimizer.zero_grad()
            with torch.no_grad():
                model(torch.randn(3, 4))  # evaluation: no backward follows
                model(torch.randn(3, 4))
            results.append(True)
    return all(results)


def test_a_model_evaluated_under_no_grad_is_not_checked_at_the_next_models_backward(ranks):
    """Issue 34 (upstream cross_validation): DDP's unused-parameter check looks at models whose
    forward can lead to this backward; fold 0's evaluation under no_grad is not one."""
    assert ranks.run(folds_in_turn) == [True, True]


def two_models_one_with_a_gradient_no_optimizer_clears() -> list[float]:
    """Two models, each with its own loss. The first has a parameter left out of its optimizer
    (trainable, so its gradient stays after ``zero_grad``); the second model's backward then
    sees the first with some gradients missing, though the first took no part in that loss."""
    with tp.Engine("ddp", timeout=120.0) as engine:
        torch.manual_seed(0)
        first = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        second = torch.nn.Linear(4, 1)
        first, opt_first = engine.setup(first, torch.optim.SGD(first[1].parameters(), lr=0.1))
        second, opt_second = engine.setup(second, torch.optim.SGD(second.parameters(), lr=0.1))
        losses = []
        for _ in range(2):
            engine.backward(first(torch.ones(2, 4)).sum())
            opt_first.step()
            opt_first.zero_grad()  # first[0]'s gradients stay: it is in no optimizer
            loss = second(torch.ones(2, 4)).sum()
            engine.backward(loss)
            opt_second.step()
            opt_second.zero_grad()
            losses.append(loss.item())
        return losses


def test_a_model_with_some_gradients_left_is_not_checked_at_another_models_backward(ranks):
    """The unused-parameter check asks the loss's graph which models took part: the first
    model's leftover gradients are not this loss's, and the second model trains."""
    results = ranks.run(two_models_one_with_a_gradient_no_optimizer_clears)
    torch.manual_seed(0)
    torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))  # the same seed order
    reference = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for _ in range(2):
        loss = reference(torch.ones(2, 4)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert results == [pytest.approx(want), pytest.approx(want)]


def distillation_with_a_frozen_teacher(strategy: str) -> list[list[float]]:
    """A student trained towards a frozen teacher: both set up, the teacher with no optimizer
    and no trainable parameter (DDP itself refuses such a module)."""
    with tp.Engine(strategy, timeout=120.0) as engine:
        torch.manual_seed(0)
        teacher = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)).eval()
        teacher.requires_grad_(False)
        student = torch.nn.Linear(4, 8)
        opt = torch.optim.SGD(student.parameters(), lr=0.1)
        teacher = engine.setup(teacher)
        student, opt = engine.setup(student, opt)
        torch.manual_seed(1 + engine.rank)
        for _ in range(3):
            x = torch.randn(6, 4)
            with torch.no_grad():
                target = teacher(x)
            engine.backward((student(x) - target).pow(2).mean())
            opt.step()
            opt.zero_grad()
        return [v.flatten().tolist() for v in engine.full_state(student)["model"].values()]


@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        "fsdp",
        pytest.param(
            "fairscale-sdp",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("fairscale") is None, reason="fairscale not installed"
            ),
        ),
    ],
)
def test_a_frozen_model_is_set_up_beside_a_trained_one_as_plain_ddp_trains_it(ranks, strategy):
    """``engine.setup(teacher)`` with no trainable parameter (torch's DDP raises "not needed"
    for it): the student ends where plain PyTorch on the two ranks' batches ends."""
    results = ranks.run(distillation_with_a_frozen_teacher, strategy)
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)).eval()
    student = torch.nn.Linear(4, 8)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    data = []
    for rank in range(2):
        torch.manual_seed(1 + rank)
        data.append([torch.randn(6, 4) for _ in range(3)])
    for step in range(3):
        # DDP averages the ranks' gradients: the mean of the two ranks' losses
        loss = sum(
            (student(x) - teacher(x).detach()).pow(2).mean() for x in (d[step] for d in data)
        )
        (loss / 2).backward()
        opt.step()
        opt.zero_grad()
    want = [p.detach().flatten().tolist() for p in student.parameters()]
    for got in results:
        for g, w in zip(got, want, strict=True):
            assert g == pytest.approx(w, abs=1e-6)


def unfreeze_after_setup() -> str:
    """A model set up frozen (left unwrapped under ddp) is unfrozen and trained."""
    with tp.Engine("ddp", timeout=120.0) as engine:
        torch.manual_seed(0)
        model = engine.setup(torch.nn.Linear(4, 2).requires_grad_(False))
        model.requires_grad_(True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            engine.backward(model(torch.full((2, 4), float(engine.rank))).sum())
        except tp.ConfigurationError as error:
            return str(error)
        optimizer.step()
        return "not refused"


def test_a_model_set_up_frozen_then_unfrozen_is_refused_before_the_ranks_drift(ranks):
    """Left unwrapped because it had nothing to train, it would train unsynchronised: each
    rank's copy on its own gradients."""
    for message in ranks.run(unfreeze_after_setup):
        assert "set up with no trainable parameter now has gradients" in message, message
        assert "weight" in message and "engine.setup(model, optimizer)" in message, message


def local_sgd_block() -> dict:
    """Two ranks step on their own data inside a block (3 steps, averaging every 2)."""
    with tp.Engine("ddp", timeout=120.0) as engine:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        seen = []
        with tp.LocalSGD(engine, model, local_sgd_steps=2) as local_sgd:
            for step in range(3):
                torch.manual_seed(10 * engine.rank + step)
                engine.backward(model(torch.randn(4, 3)).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
                seen.append(engine.gather(next(model.parameters()).detach().clone()))
        end = engine.gather(next(model.parameters()).detach().clone())
        return {"seen": [s.tolist() for s in seen], "end": end.tolist()}


def test_local_sgd_keeps_gradients_local_and_averages_every_k_steps_and_at_the_end(ranks):
    """``tp.LocalSGD``: after step 1 the ranks differ (no gradient exchanged), after step 2
    they are equal (averaged), after step 3 they differ again, and the block's end averages."""
    result = ranks.run(local_sgd_block)[0]
    first, second, third = (torch.tensor(s) for s in result["seen"])
    assert not torch.equal(first[0], first[1])
    assert torch.equal(second[0], second[1])
    assert not torch.equal(third[0], third[1])
    end = torch.tensor(result["end"])
    assert torch.equal(end[0], end[1])
    torch.testing.assert_close(end[0], third.mean(0))


def test_local_sgd_needs_a_positive_step_count():
    with tp.Engine("single") as engine:
        model = engine.setup(torch.nn.Linear(2, 2))
        with pytest.raises(tp.ConfigurationError, match="local_sgd_steps=0"):
            tp.LocalSGD(engine, model, local_sgd_steps=0)
