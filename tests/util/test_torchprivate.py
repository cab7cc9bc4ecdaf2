"""The private parts of torch torchplug reads, each behind one adapter in
``torchplug.util.torchprivate``: pinned to the torch versions they were checked against, and
exercised on the installed torch (issue 26 item 2: side channels)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from torchplug.plugin import free_port
from torchplug.util import torchprivate


def test_the_installed_torch_is_one_the_adapters_were_checked_against():
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert version in torchprivate.CHECKED_TORCH, (
        f"torch {version} is new to torchplug.util.torchprivate: check whether it offers a public "
        f"default-store accessor or GradScaler found-inf query, run this file, and add it to "
        f"CHECKED_TORCH"
    )


@pytest.fixture
def world_of_one():
    """A real gloo process group of one rank, destroyed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    yield
    dist.destroy_process_group()


def test_default_store_is_the_default_groups_store(world_of_one):
    store = torchprivate.default_store()
    assert isinstance(store, dist.Store)
    store.set("torchplug/probe", "1")
    assert store.get("torchplug/probe") == b"1"
    assert store.check(["torchplug/probe"])
    store.delete_key("torchplug/probe")


@pytest.mark.parametrize("bad", [False, True])
def test_found_inf_says_what_gradscaler_step_would_skip(bad):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    loss = model(torch.ones(1, 2)).sum() * (float("inf") if bad else 1.0)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    assert torchprivate.found_inf(scaler, optimizer) is bad
    before = model.weight.detach().clone()
    scaler.step(optimizer)  # torch's own decision agrees
    assert torch.equal(model.weight, before) is bad
    scaler.update()
    assert scaler.get_scale() == (2.0**3 if bad else 2.0**4)


def test_forget_device_meshes_empties_dtensors_caches(world_of_one):
    """The caches an Engine's close() empties: filled by a DTensor op, empty after."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])
    (x @ x + x).sum()
    cached = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    native = torch._C._get_DTensor_sharding_propagator_cache_stats
    assert cached.cache_info().currsize + sum(native()) > 0
    torchprivate.forget_device_meshes()
    assert cached.cache_info().currsize == 0
    (x @ x + x).sum()  # the same ops again: decided anew in C++ (no hit), as in Python
    assert native()[0] == 0 and cached.cache_info().hits == 0


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


def test_ddp_reduction_finished_tells_a_half_reduced_backward_from_a_whole_one(world_of_one):
    from torch.nn.parallel import DistributedDataParallel

    x = torch.randn(2, 4)
    model, other = DistributedDataParallel(_TwoLayers()), DistributedDataParallel(_TwoLayers())
    assert torchprivate.ddp_reduction_finished(model)  # no backward yet
    model(x).sum().backward()
    assert torchprivate.ddp_reduction_finished(model)  # every parameter reduced
    model._use_python_reducer = True  # as torch._dynamo's optimize_ddp="python_reducer" sets it
    assert not torchprivate.ddp_reduction_finished(model)  # the C++ reducer cannot tell then
    model._use_python_reducer = False
    other(model(x).detach()).sum().backward()  # a GAN's step: `model` ran, no backward reached it
    assert torchprivate.ddp_reduction_finished(model)
    assert torchprivate.ddp_reduction_finished(other)
    model(x, use_b=False).sum().backward()  # `b` took no part: DDP waits for its gradients
    assert not torchprivate.ddp_reduction_finished(model)
    with pytest.raises(
        TypeError, match="expects a torch DistributedDataParallel.*got a _TwoLayers"
    ):
        torchprivate.ddp_reduction_finished(model.module)


def test_nothing_unscaled_is_an_optimizer_without_gradients_and_forgets_it():
    """No gradient: True, and the optimizer's unscale record is dropped, so that its next step
    unscales afresh (the next round's gradients are not left scaled) and update() runs."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    scaler.scale(torch.ones(()))  # the scale is made at the first scaling
    scaler.unscale_(optimizer)  # nothing to unscale: no backward reached the model
    assert torchprivate.nothing_unscaled(scaler, optimizer) is True
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optimizer)  # not "already called since the last update()"
    assert torchprivate.nothing_unscaled(scaler, optimizer) is False
    assert torch.equal(model.weight.grad, torch.ones(1, 2))  # unscaled: d(sum)/dw = x
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**4
