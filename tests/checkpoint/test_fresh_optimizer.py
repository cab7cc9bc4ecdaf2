"""A never-stepped optimizer stays never-stepped: reading its state (``engine.full_state``),
saving it, or loading a checkpoint saved before the first step must not count a step.

torch's ``get_optimizer_state_dict`` creates the state with a zero step; AdamW then counted its
first real step as its second (another bias correction) and the weights differed from plain
PyTorch's. Each case here trains 3 steps after the read, save or load and compares parameters
and optimizer state bit for bit with plain PyTorch's 3 steps."""

from __future__ import annotations

import pytest
import torch

import torchplug as tp


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _optimizer(model: torch.nn.Module, tensor_lr: bool) -> torch.optim.Optimizer:
    lr = torch.tensor(0.01) if tensor_lr else 0.01
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, backward) -> None:
    for step in range(3):
        torch.manual_seed(100 + step)
        backward(model(torch.randn(6, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()


def _plain(tensor_lr: bool) -> dict:
    model = _model()
    optimizer = _optimizer(model, tensor_lr)
    _steps(model, optimizer, torch.Tensor.backward)
    return _snapshot(model, optimizer)


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    state = [
        {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for s in optimizer.state.values()
    ]
    params = [p.detach().clone() for p in model.parameters()]
    return {"params": params, "state": state, "lr": float(optimizer.param_groups[0]["lr"])}


def _engine_run(strategy: str, case: str, path: str, tensor_lr: bool) -> dict:
    options = {} if strategy == "single" else {"timeout": 120.0}
    with tp.Engine(strategy, **options) as engine:
        model = _model()
        model, optimizer = engine.setup(model, _optimizer(model, tensor_lr))
        if case == "full_state":
            full = engine.full_state(model, optimizer)
            assert full["optimizer"]["state"] == {}, "a never-stepped optimizer has no state"
        elif case == "save":
            engine.save(path, {"model": model, "optimizer": optimizer})
        elif case in ("load", "load_after_steps"):
            if case == "load_after_steps":  # a stepped optimizer loaded from step 0: fresh again
                _steps(model, optimizer, engine.backward)
                engine.load(path, {"optimizer": optimizer})
                model_fresh = _model()
                with torch.no_grad():
                    for p, q in zip(model.parameters(), model_fresh.parameters(), strict=True):
                        p.copy_(q)
            else:
                engine.load(path, {"model": model, "optimizer": optimizer})
            assert not optimizer.state, "loading a step-0 checkpoint leaves the optimizer fresh"
        _steps(model, optimizer, engine.backward)
        return _snapshot(model, optimizer)


def _assert_same(got: dict, want: dict) -> None:
    for a, b in zip(got["params"], want["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(got["state"]) == len(want["state"])
    for a, b in zip(got["state"], want["state"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert got["lr"] == want["lr"]


def _step0_checkpoint(strategy: str, path: str) -> None:
    options = {} if strategy == "single" else {"timeout": 120.0}
    with tp.Engine(strategy, **options) as engine:
        model = _model()
        model, optimizer = engine.setup(model, _optimizer(model, False))
        engine.save(path, {"model": model, "optimizer": optimizer})


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("case", ["full_state", "save"])
def test_reading_or_saving_before_the_first_step_counts_no_step(tmp_path, case, tensor_lr):
    got = _engine_run("single", case, str(tmp_path / "ckpt"), tensor_lr)
    _assert_same(got, _plain(tensor_lr))


@pytest.mark.parametrize("case", ["load", "load_after_steps"])
def test_a_checkpoint_saved_before_the_first_step_loads_as_a_fresh_optimizer(tmp_path, case):
    path = str(tmp_path / "ckpt")
    _step0_checkpoint("single", path)
    got = _engine_run("single", case, path, False)
    _assert_same(got, _plain(False))


def _on_ranks(strategy: str, path: str) -> list[bool]:
    """Save at step 0 (reads the state through torch's distributed API), train; then load that
    checkpoint in a second Engine and train: both equal plain PyTorch's 3 steps."""
    want = _plain(False)
    results = []
    for case in ("save", "load"):
        _assert_same(_engine_run(strategy, case, path, False), want)
        results.append(True)
    return results


def _fsdp_full(path: str, case: str) -> list:
    with tp.Engine("fsdp", timeout=120.0) as engine:
        model = _model()
        model, optimizer = engine.setup(model, _optimizer(model, False))
        if case == "save":
            engine.save(path, {"model": model, "optimizer": optimizer})
        else:
            engine.load(path, {"model": model, "optimizer": optimizer})
        _steps(model, optimizer, engine.backward)
        full = engine.full_state(model, optimizer)
        return [v for _, v in sorted(full["model"].items())] + [
            full["optimizer"]["state"][k]["step"] for k in sorted(full["optimizer"]["state"])
        ]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_step0_save_and_its_load_count_no_step_on_two_ranks(ranks, tmp_path, strategy):
    path = str(tmp_path / "ckpt")
    if strategy == "ddp":
        assert ranks.run(_on_ranks, strategy, path) == [[True, True], [True, True]]
        return
    want = _plain(False)
    model = _model()
    names = sorted(model.state_dict())  # the model has parameters only (no buffers)
    plain = dict(zip([n for n, _ in model.named_parameters()], want["params"], strict=True))
    for case in ("save", "load"):
        for result in ranks.run(_fsdp_full, path, case):
            values, steps = result[: len(names)], result[len(names) :]
            for name, value in zip(names, values, strict=True):
                torch.testing.assert_close(value, plain[name], rtol=0, atol=0)
            assert [float(s) for s in steps] == [3.0] * len(steps)
