"""The module engine.setup returns has prefix-free state_dict()/load_state_dict() on every
backend, so a user's plain torch.save(model.state_dict()) is portable across strategies."""

from __future__ import annotations

import pickle

import pytest
import torch

import torchplug as tp
from torchplug.engine import wrappers


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def save_under(strategy: str, path: str) -> list[str]:
    """Train one step under ``strategy``, torch.save the returned model's state_dict on rank 0;
    also checks a torchplug checkpoint still round-trips through the same model."""
    with tp.Engine(strategy, timeout=60.0) as engine:
        model = make()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = engine.setup(model, optimizer)
        engine.backward(model(torch.ones(2, 4, device=engine.device)).sum())
        optimizer.step()
        keys = list(model.state_dict())
        if engine.is_main:
            torch.save(model.state_dict(), path)
        engine.save(f"{path}.ckpt", {"model": model, "optimizer": optimizer})
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        engine.load(f"{path}.ckpt", {"model": model, "optimizer": optimizer})
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
        engine.barrier()
    return keys


def load_under(strategy: str, path: str) -> dict[str, list[float]]:
    """Load the plain state dict into the model setup returns under ``strategy``."""
    with tp.Engine(strategy, timeout=60.0) as engine:
        model = engine.setup(make())
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved)
        full = engine.full_state(model)["model"]
        assert set(full) == set(saved)
        return {k: v.flatten().tolist() for k, v in full.items()}


def test_ddp_state_dict_has_plain_names_and_loads_anywhere(ranks, tmp_path):
    path = str(tmp_path / "ddp.pt")
    for keys in ranks.run(save_under, "ddp", path):
        assert keys == ["0.weight", "0.bias", "2.weight", "2.bias"]
    saved = torch.load(path, weights_only=True)
    plain = make()
    plain.load_state_dict(saved)  # strict: every key matches a plain module
    assert not torch.equal(plain[0].weight, make()[0].weight)  # the trained values, not init
    for loaded in ranks.run(load_under, "fsdp", path):
        for name, value in saved.items():
            assert loaded[name] == value.flatten().tolist(), name


def test_state_dict_methods_are_restored_by_close():
    engine = tp.Engine("single")
    wrapper = torch.nn.Module()
    wrapper.module = make()  # a `.module` wrapper, as DDP, FairScale and DeepSpeed return
    wrappers.portable_state_dict(engine, wrapper, wrapper.module)
    assert list(wrapper.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    with engine._context.native_state_dicts():
        assert list(wrapper.state_dict())[0] == "module.0.weight"
    engine.close()
    assert "state_dict" not in wrapper.__dict__ and "load_state_dict" not in wrapper.__dict__
    assert list(wrapper.state_dict())[0] == "module.0.weight"
    pickle.dumps(wrapper)  # nothing of the engine's is left on it


def _installed(strategy: str, package: str) -> object:
    import importlib.util

    missing = importlib.util.find_spec(package) is None
    return pytest.param(strategy, marks=pytest.mark.skipif(missing, reason=f"{package} missing"))


@pytest.mark.parametrize(
    "strategy",
    ["fsdp", _installed("fairscale-sdp", "fairscale"), _installed("deepspeed", "deepspeed")],
)
def test_every_backend_names_state_like_the_plain_model(ranks, tmp_path, strategy):
    for keys in ranks.run(save_under, strategy, str(tmp_path / "model.pt")):
        assert keys == ["0.weight", "0.bias", "2.weight", "2.bias"]
    if strategy != "fsdp":  # fsdp's state_dict() holds this rank's shards (DTensors), by design
        plain = make()
        plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
