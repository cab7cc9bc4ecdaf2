"""FairScale strategies against the single-process reference (tox -e fairscale)."""

from __future__ import annotations

import pytest
import torch

import torchplug as tp
from support import memory_body
from support.memory_estimates import assert_within, estimate_for
from support.ported import check_strategy
from support.reference import assert_close_dicts, make_dataset, make_model, run, train
from torchplug.testing.conformance import classes

pytest.importorskip("fairscale")


@pytest.fixture(scope="module")
def reference() -> dict:
    return train("single")


@pytest.mark.parametrize("strategy", ["fairscale-oss", "fairscale-sdp"])
def test_fairscale_matches_single_process_reference(ranks, reference, strategy):
    # train() calls optimizer.zero_grad() with its default arguments (set_to_none=True)
    for result in ranks.run(train, strategy):
        assert result["strategy"] == strategy
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert_close_dicts(result["params"], reference["params"], atol=1e-5)
        assert_close_dicts(result["optimizer"], reference["optimizer"], atol=1e-5)


def raw_sharded_ddp_losses() -> list[float]:
    """FairScale used directly, as its docs show, with torch>=2 zero_grad(): the known trap."""
    import torch.distributed as dist
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    with tp.Engine("ddp", timeout=60.0) as engine:  # only for the process group
        model = make_model()
        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=3e-2)
        model = ShardedDataParallel(model, optimizer)
        data = make_dataset(20 * 16)
        losses = []
        for step in range(10):
            x, y = data[step * 16 : (step + 1) * 16]
            x, y = (
                x[engine.rank * 8 : (engine.rank + 1) * 8],
                y[engine.rank * 8 : (engine.rank + 1) * 8],
            )
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(engine.reduce(loss.detach(), "mean").item())
        dist.barrier()
        return losses


def test_the_zero_grad_trap_is_real_without_the_plugin(ranks, reference):
    losses = ranks.run(raw_sharded_ddp_losses)[0]
    assert losses[:2] == pytest.approx(reference["losses"][:2], abs=1e-5)  # first steps agree
    assert max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True)) > 1e-3


def test_fairscale_fsdp_is_unusable_on_cpu_with_the_reason():
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("fairscale-fsdp")
    assert "supports_cpu=False (it needs a CUDA GPU)" in str(info.value)
    assert "Choose a usable strategy" in str(info.value)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (("fairscale-oss", 2), ("single", 1)),
        (("ddp", 2), ("fairscale-oss", 2)),
        (("fairscale-oss", 2), ("fsdp", 2)),
        (("fsdp", 2), ("fairscale-sdp", 2)),
    ],
    ids=lambda p: f"{p[0]}@{p[1]}",
)
def test_resume_across_fairscale_and_others(ranks, tmp_path, first, second):
    uninterrupted = train("single", steps=10)
    path = str(tmp_path / "ckpt")
    before = run(ranks, *first, steps=5, save_to=path)
    after = run(ranks, *second, steps=5, first_step=5, load_from=path)
    assert before["losses"] + after["losses"] == pytest.approx(uninterrupted["losses"], abs=1e-6)
    assert_close_dicts(after["params"], uninterrupted["params"], atol=1e-6)


globals().update(classes("fairscale-oss"))
globals().update(classes("fairscale-sdp"))


@pytest.mark.parametrize("strategy", ["fairscale-oss", "fairscale-sdp"])
@pytest.mark.parametrize("precision", [None, "bf16", "fp16"])
def test_ported_scripts_run_unchanged_like_ddp(ranks, tmp_path, strategy, precision):
    check_strategy(ranks, strategy, precision, tmp_path)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", ["fairscale-oss", "fairscale-sdp"])
@pytest.mark.parametrize("make", ["gpt2", "llama"])
def test_hugging_face_models_train_in_low_precision_like_autocast(ranks, strategy, precision, make):
    pytest.importorskip("transformers")
    from support import hf_models

    hf_models.check_low_precision(ranks, strategy, precision, make)


@pytest.mark.parametrize(
    "strategy, options",
    [("fairscale-oss", {}), ("fairscale-sdp", {}), ("fairscale-sdp", {"reduce_buffer_size": 0})],
)
def test_estimate_memory_is_within_5_percent_of_the_live_bytes(ranks, strategy, options):
    """Issue 27 item 8: OSS's owner-by-owner optimizer state (the fullest owner), and
    ShardedDDP's gradients (whole with reduce buckets; the owned share without)."""
    measured = ranks.run(memory_body.measure, strategy, **options, timeout=300)
    assert_within(estimate_for(strategy, **options), measured)
