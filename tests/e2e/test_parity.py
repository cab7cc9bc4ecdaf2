"""Strategies against the single-process reference: losses, parameters, optimizer state."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import torchplug as tp
from support.reference import assert_close_dicts, train

TOLERANCE = {None: 1e-6, "bf16": 3e-2, "fp16": 5e-3}
# A first loss scale under which this model's fp16 gradients do not overflow, so no step is
# skipped and the fp16 run is comparable step by step with fp32.
NO_OVERFLOW = {"bf16": None, "fp16": {"init_scale": 1024.0}}


@pytest.fixture(scope="module")
def reference() -> dict:
    return train("single")


def test_ddp_matches_single_process_reference(ranks, reference):
    results = ranks.run(train, "ddp")
    assert [r["world_size"] for r in results] == [2, 2]
    for result in results:
        assert result["strategy"] == "ddp"
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-6)
        assert_close_dicts(result["params"], reference["params"], atol=1e-6)
        assert_close_dicts(result["optimizer"], reference["optimizer"], atol=1e-6)
    assert reference["losses"][-1] < reference["losses"][0]


def test_gradient_accumulation_with_no_sync_matches_reference(ranks, reference):
    for result in ranks.run(train, "ddp", accumulate=2):
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-6)
        assert_close_dicts(result["params"], reference["params"], atol=1e-6)
    single = train("single", accumulate=4)
    assert single["losses"] == pytest.approx(reference["losses"], abs=1e-6)


def test_auto_picks_ddp_under_a_launcher(ranks):
    results = ranks.run(train, "auto", steps=2)
    assert [r["strategy"] for r in results] == ["ddp", "ddp"]


def test_auto_picks_single_in_one_process():
    assert train("auto", steps=2)["strategy"] == "single"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_amp_single_within_tolerance_of_fp32(precision, reference):
    result = train("single", precision, precision_options=NO_OVERFLOW[precision])
    assert not any(result["skipped"])
    assert result["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE[precision])
    assert result["losses"] != reference["losses"]  # autocast really ran in lower precision
    assert_close_dicts(result["params"], reference["params"], atol=10 * TOLERANCE[precision])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_amp_ddp_within_tolerance_of_fp32(ranks, precision, reference):
    for result in ranks.run(train, "ddp", precision, precision_options=NO_OVERFLOW[precision]):
        assert result["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE[precision])
        assert result["losses"] != reference["losses"]


def check_inf_step(result: dict, clean: dict, at: int) -> None:
    assert result["skipped"] == [i == at for i in range(len(result["skipped"]))]
    assert result["scales"][at] == result["scales"][at - 1] / 2
    # the skipped step left the parameters exactly as they were; the steps before it were clean
    assert result["checksums"][at] == result["checksums"][at - 1]
    assert result["checksums"][:at] == clean["checksums"][:at]
    assert result["checksums"][at + 1] != result["checksums"][at]  # training went on


def test_fp16_inf_gradient_skips_step_and_halves_scale_single():
    opts = {"init_scale": 1024.0}
    clean = train("single", "fp16", steps=6, precision_options=opts)
    check_inf_step(
        train("single", "fp16", steps=6, inf_at_step=3, precision_options=opts), clean, at=3
    )


def test_fp16_inf_gradient_skips_step_and_halves_scale_ddp(ranks):
    opts = {"init_scale": 1024.0}
    clean = ranks.run(train, "ddp", "fp16", steps=6, precision_options=opts)
    dirty = ranks.run(train, "ddp", "fp16", steps=6, inf_at_step=3, precision_options=opts)
    for result, reference in zip(dirty, clean, strict=True):
        check_inf_step(result, reference, at=3)


def frozen_phase(strategy: str) -> dict:
    """fp16 with a phase where every parameter is frozen and ``optimizer.step()`` still runs
    (no backward reaches the model): the Engine's steps, and plain AMP's loop, which must leave
    those steps out (``GradScaler.step`` refuses an optimizer without gradients)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    plain = copy.deepcopy(model)
    x = torch.randn(16, 4)
    frozen_at = (0, 3, 4)  # a step before any backward, and two after
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
    for step in range(6):
        if step in frozen_at:
            continue
        with torch.autocast("cpu", dtype=torch.float16):
            loss = plain(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(plain_opt)
        scaler.update()
        plain_opt.zero_grad()
    with tp.Engine(strategy, precision="fp16", precision_options={"init_scale": 1024.0}) as engine:
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        wrapped, opt = engine.setup(model, opt)
        scales = []
        for step in range(6):
            for p in model.parameters():
                p.requires_grad_(step not in frozen_at)
            if step not in frozen_at:
                engine.backward(wrapped(torch.as_tensor(x)).pow(2).mean())
            opt.step()
            opt.zero_grad()
            amp = next(p for p in engine.plugins if getattr(p, "scaler", None))
            scales.append(amp.scaler.get_scale())
    return {
        "equal": all(
            torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True)
        ),
        "scales": scales,
        "plain_scale": scaler.get_scale(),
    }


def test_fp16_steps_with_no_gradient_update_nothing_as_in_fp32_single():
    """They used to end in GradScaler's "No inf checks were recorded prior to update"."""
    result = frozen_phase("single")
    assert result["equal"], result
    assert result["scales"][-1] == result["plain_scale"] and len(set(result["scales"])) == 1


def test_fp16_steps_with_no_gradient_update_nothing_as_in_fp32_ddp(ranks):
    for result in ranks.run(frozen_phase, "ddp"):
        assert result["equal"], result
        assert result["scales"][-1] == result["plain_scale"]


def clip_and_skip(strategy: str) -> dict:
    """fp16, clipping every step and stepping only when the norm is finite (a common guard), an
    inf loss at step 2: the Engine against plain AMP's recipe (``unscale_``, clip, ``step`` when
    finite, ``update()`` every iteration)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    plain = copy.deepcopy(model)
    x = torch.randn(16, 4)

    def loss_of(net: nn.Module, step: int) -> torch.Tensor:
        return net(x).float().pow(2).mean() * (float("inf") if step == 2 else 1.0)

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
    plain_norms, plain_scales = [], []
    for step in range(5):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(plain, step)
        scaler.scale(loss).backward()
        scaler.unscale_(plain_opt)
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_norms.append(norm.item())
        if torch.isfinite(norm):
            scaler.step(plain_opt)
        scaler.update()
        plain_scales.append(scaler.get_scale())
        plain_opt.zero_grad()
    norms, scales = [], []
    with tp.Engine(strategy, precision="fp16", precision_options={"init_scale": 1024.0}) as engine:
        wrapped, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
        amp = next(p for p in engine.plugins if getattr(p, "scaler", None))
        for step in range(5):
            engine.backward(loss_of(wrapped, step))
            norm = engine.clip_grad_norm_(wrapped, 1.0)
            norms.append(norm.item())
            if torch.isfinite(norm):
                opt.step()
            opt.zero_grad()
            scales.append(amp.scaler.get_scale())
    return {
        "equal": all(
            torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True)
        ),
        "norms": (norms, plain_norms),
        "scales": (scales, plain_scales),
    }


def check_clip_and_skip(result: dict) -> None:
    norms, plain_norms = result["norms"]
    assert norms[:2] + norms[3:] == plain_norms[:2] + plain_norms[3:], result
    assert not math.isfinite(norms[2]) and not math.isfinite(plain_norms[2])
    assert result["equal"], result
    # the skipped step's inf halved the scale at the next backward, as update() did
    scales, plain_scales = result["scales"]
    assert scales[3:] == plain_scales[3:] == [512.0, 512.0], result


def test_fp16_clip_then_skip_the_step_matches_plain_amp_single():
    """The norm after a skipped step was read from gradients left scaled (x1024), and the next
    update was lost, before the round ended at the next backward."""
    check_clip_and_skip(clip_and_skip("single"))


def test_fp16_clip_then_skip_the_step_matches_plain_amp_ddp(ranks):
    for result in ranks.run(clip_and_skip, "ddp"):
        check_clip_and_skip(result)
