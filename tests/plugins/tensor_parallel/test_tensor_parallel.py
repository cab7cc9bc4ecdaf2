"""``tp`` (2 ranks) and ``fsdp-tp`` (4 ranks, dp=2 × tp=2) against the single-process reference,
through the conformance kit, plus the checkpoint round trip fsdp-tp@4 -> single -> fsdp@2."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import torchplug as tp
from torchplug.testing import RankPool, bodies
from torchplug.testing.conformance import classes
from torchplug.testing.processes import default_sys_path

#: The kit's model is Linear -> Tanh -> Linear: the classic Megatron MLP split.
PLAN = {"0": "colwise", "2": "rowwise"}
TWO_D = {"tp_plan": PLAN, "dp_size": 2, "tp_size": 2}

globals().update(classes("tp", ("32",), options={"tp_plan": PLAN}))
globals().update(classes("fsdp-tp", ("32", "bf16"), options=TWO_D, nprocs=4))


@pytest.fixture(scope="module")
def four() -> Iterator[RankPool]:
    pool = RankPool(4, sys_path=default_sys_path())
    yield pool
    pool.stop()


def test_fsdp_tp_checkpoint_moves_to_single_and_fsdp_bit_exact(four, ranks, tmp_path):
    path, again = str(tmp_path / "2d"), str(tmp_path / "single")
    saved = four.run(bodies.train, "fsdp-tp", options=TWO_D, steps=3, save_to=path, timeout=300)
    saved = saved[0]
    in_single = bodies.load("single", path)
    for key, value in saved["params"].items():
        assert torch.equal(in_single["params"][key], value), key
    assert in_single["optimizer"].keys() == saved["optimizer"].keys() != set()
    for key, value in saved["optimizer"].items():
        assert torch.equal(in_single["optimizer"][key], value), key
    # single saves it again; fsdp on 2 ranks loads that
    with tp.Engine("single") as engine:
        model = bodies.make_model(seed=5)
        optimizer = torch.optim.AdamW(model.parameters())
        model, optimizer = engine.setup(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        engine.load(path, state)
        engine.save(again, state)
    for loaded in ranks.run(bodies.load, "fsdp", again, timeout=300):
        for key, value in saved["params"].items():
            assert torch.equal(loaded["params"][key], value), key
        for key, value in saved["optimizer"].items():
            assert torch.equal(loaded["optimizer"][key], value), key
    # and back into fsdp-tp on 4 ranks
    for loaded in four.run(bodies.load, "fsdp-tp", again, options=TWO_D, timeout=300):
        for key, value in saved["params"].items():
            assert torch.equal(loaded["params"][key], value), key


def batches_seen(strategy: str, options: dict[str, Any]) -> list[float]:
    with tp.Engine(strategy, timeout=60.0, **options) as engine:
        data = bodies.make_dataset(64)
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        return [x.sum().item() for x, _ in engine.setup_dataloader(loader)]


def test_ranks_of_one_tensor_parallel_group_see_the_same_batches(four):
    seen = four.run(batches_seen, "fsdp-tp", TWO_D, timeout=300)
    assert seen[0] == seen[1] and seen[2] == seen[3]  # tp groups {0, 1} and {2, 3}
    assert seen[0] != seen[2] and len(seen[0]) == 64 // 4 // 2


@pytest.mark.parametrize(
    ("strategy", "options", "message"),
    [
        ("tp", {"tp_plan": {"0": "diagonal"}}, "expected one of colwise, rowwise, sequence"),
    ],
)
def test_wrong_plans_and_sizes_are_refused_with_the_fix(strategy, options, message):
    with pytest.raises(tp.ConfigurationError, match=message):
        tp.Engine(strategy, **options)


def test_no_plan_names_both_ways_to_give_one():
    with tp.Engine("tp") as engine:
        model = bodies.make_model()
        with pytest.raises(
            tp.ConfigurationError, match="needs a tensor-parallel plan.*tp_plan attr"
        ):
            engine.setup(model)


def test_the_models_own_plan_is_used(ranks):
    reference = bodies.reference(steps=3)
    result = ranks.run(train_with_model_plan)[0]
    assert result == pytest.approx(reference["losses"], abs=1e-6)


def train_with_model_plan() -> list[float]:
    with tp.Engine("tp", timeout=60.0) as engine:
        model = bodies.make_model()
        model.tp_plan = PLAN
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
        model, optimizer = engine.setup(model, optimizer)
        assert type(model[0].weight).__name__ == "DTensor"
        losses = []
        loader = torch.utils.data.DataLoader(
            bodies.make_dataset(bodies.MAX_STEPS * bodies.GLOBAL_BATCH), bodies.GLOBAL_BATCH
        )
        for step, (x, y) in enumerate(engine.setup_dataloader(loader)):
            if step == 3:
                break
            loss = torch.nn.functional.mse_loss(model(x), y)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses


def test_a_plan_that_matches_nothing_names_the_submodules():
    with tp.Engine("tp", tp_plan={"layers.*.q": "colwise"}) as engine:
        model = bodies.make_model()
        with pytest.raises(tp.ConfigurationError, match=r"match no submodule.*\['0', '1', '2'\]"):
            engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    typo = {**PLAN, "fc": "colwise"}
    with tp.Engine("tp", tp_plan=typo) as engine:  # one typo among good entries is an error too
        model = bodies.make_model()
        with pytest.raises(tp.ConfigurationError, match=r"entries \['fc'\] match no submodule"):
            engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def refusal(strategy: str, options: dict[str, Any]) -> str:
    try:
        tp.Engine(strategy, timeout=60.0, **options).close()
    except tp.ConfigurationError as exc:
        return str(exc)
    return "accepted"


def test_sizes_that_do_not_multiply_to_the_world_size_are_refused(ranks):
    for message in ranks.run(refusal, "fsdp-tp", {"tp_plan": PLAN, "dp_size": 3}):
        assert "dp_size × tp_size = the world size (2)" in message
        assert "dp_size=2, tp_size=1" in message or "dp_size=1, tp_size=2" in message


def mesh_facts(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """One job's 2-D mesh, and whether two models set up in it split over the same one."""
    with tp.Engine(strategy, timeout=60.0, **options) as engine:
        mesh = engine.mesh
        first = engine.setup(bodies.make_model())
        second = engine.setup(bodies.make_model(seed=5))
        meshes = [m[0].weight.device_mesh for m in (first, second)]
        return {
            "shape": tuple(mesh.shape),
            "names": mesh.mesh_dim_names,
            "tp_ranks": mesh["tp"].mesh.tolist(),
            "dp_ranks": mesh["dp"].mesh.tolist() if "dp" in mesh.mesh_dim_names else None,
            "shared": meshes[0] is meshes[1],
            # tp's DTensors are on the job's "tp" slice, fsdp-tp's on a mesh spanning both dims
            # (FSDP2 over "dp" makes that object itself): equal to the job's, not the same
            "on_job_mesh": meshes[0] == (mesh["tp"] if strategy == "tp" else mesh),
        }


def test_fsdp_tp_builds_one_2d_mesh_per_job(four):
    results = four.run(mesh_facts, "fsdp-tp", TWO_D, timeout=300)
    for rank, facts in enumerate(results):
        assert facts["shape"] == (2, 2) and facts["names"] == ("dp", "tp")
        assert facts["tp_ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1]  # consecutive ranks
        assert facts["dp_ranks"] == [rank % 2, rank % 2 + 2]
        assert facts["shared"] and facts["on_job_mesh"]


def test_tp_builds_one_2d_mesh_of_one_replica(ranks):
    for facts in ranks.run(mesh_facts, "tp", {"tp_plan": PLAN}):
        assert facts["shape"] == (1, 2) and facts["names"] == ("dp", "tp")
        assert facts["tp_ranks"] == [0, 1]
        assert facts["shared"], facts
        assert facts["on_job_mesh"], facts


def test_single_process_fallback_builds_a_one_by_one_mesh():
    with pytest.warns(UserWarning, match="single process here"):
        engine = tp.Engine("fsdp-tp", **TWO_D)
    with engine:
        assert tuple(engine.mesh.shape) == (1, 1) and engine.mesh.mesh_dim_names == ("dp", "tp")
        model = engine.setup(bodies.make_model())
        assert model[0].weight.device_mesh == engine.mesh


def test_tensor_parallel_is_not_an_fsdp_subclass():
    """tp shares FSDP's sharding helpers (plugins/sharding.py), not its class: it would otherwise
    inherit fsdp's hooks and options it does not take."""
    from torchplug.plugins.base import DistributedStrategy
    from torchplug.plugins.fsdp import FSDPStrategy
    from torchplug.plugins.tensor_parallel import TensorParallelStrategy

    assert not issubclass(TensorParallelStrategy, FSDPStrategy)
    assert issubclass(TensorParallelStrategy, DistributedStrategy)


#: HSDP x tp (issue 39 item 7): 2 data-parallel replicas of FSDP2 over 1 shard each, 2 tp ranks.
HSDP_TP = {**TWO_D, "dp_replicate": 2}
CHECKED = ["parity", "clipping", "accumulation", "checkpoint", "portability", "sharding"]


def test_hsdp_times_tp_equals_plain_pytorch_on_four_ranks(four):
    from torchplug.testing.kit import check

    outcomes = check("fsdp-tp", 4, options=HSDP_TP, pool=four, only=CHECKED)
    assert all(o.passed for o in outcomes), [str(o) for o in outcomes]
    facts = four.run(mesh_facts, "fsdp-tp", HSDP_TP, timeout=300)
    for rank, fact in enumerate(facts):
        names, shape = fact["names"], fact["shape"]
        assert names == ("dp_replicate", "dp_shard", "tp") and shape == (2, 1, 2), fact
        assert fact["tp_ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1], fact
        assert fact["shared"], fact


def one_mesh_then_another(orders: list[str]) -> list[list[float]]:
    """Engines one after another in this process, each on the mesh its options give."""
    return [
        bodies.train("fsdp-tp", options=HSDP_TP if o == "hsdp" else TWO_D, steps=3)["losses"]
        for o in orders
    ]


def test_engines_on_other_meshes_one_after_another_in_one_process(four):
    """DTensor caches sharding decisions by mesh, and a mesh equals another of the same shape
    and dim names whatever its process groups: without `close()` dropping them, the second
    Engine's collectives ran on groups the first one's numbering named (a hang, or "Could not
    resolve the process group registered under the name N")."""
    reference = bodies.reference(steps=3)["losses"]
    for losses in four.run(one_mesh_then_another, ["2d", "hsdp", "2d", "hsdp"], timeout=600):
        for run in losses:
            assert run == pytest.approx(reference, abs=1e-5), (run, reference)


def test_a_dp_replicate_that_does_not_divide_dp_size_says_so(four):
    for message in four.run(refusal, "fsdp-tp", {**TWO_D, "dp_replicate": 3}):
        assert "dp_replicate=3 does not divide the 2 data-parallel ranks" in message, message


@pytest.mark.slow
def test_hsdp_times_tp_on_eight_ranks_equals_plain_pytorch():
    """2 replicas x 2 FSDP shards x 2 tensor-parallel ranks on one 3-D mesh."""
    from torchplug.testing.kit import check

    pool = RankPool(8, sys_path=default_sys_path())
    try:
        options = {"tp_plan": PLAN, "dp_size": 4, "tp_size": 2, "dp_replicate": 2}
        outcomes = check("fsdp-tp", 8, options=options, pool=pool, only=CHECKED)
        assert all(o.passed for o in outcomes), [str(o) for o in outcomes]
    finally:
        pool.stop()
