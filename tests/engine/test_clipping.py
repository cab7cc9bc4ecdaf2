"""``engine.clip_grad_norm_`` against torch's own, ``error_if_nonfinite`` included (issue 35)."""

from __future__ import annotations

import pytest
import torch

import torchplug as tp


def _model_with_grads(inf: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    loss = model(torch.randn(5, 4)).sum() * (float("inf") if inf else 1.0)
    loss.backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_the_norm_and_the_clipped_gradients_are_torchs(norm_type):
    reference = _model_with_grads(inf=False)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type)
    with tp.Engine("single") as engine:
        model = engine.setup(_model_with_grads(inf=False))
        norm = engine.clip_grad_norm_(model, 0.1, norm_type, error_if_nonfinite=True)
        assert torch.equal(norm, expected)
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(mine.grad, theirs.grad)


def test_a_non_finite_norm_raises_with_error_if_nonfinite_as_torch_does():
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(_model_with_grads(inf=True).parameters(), 1.0,
                                       error_if_nonfinite=True)  # fmt: skip
    with tp.Engine("single") as engine:
        model = engine.setup(_model_with_grads(inf=True))
        with pytest.raises(RuntimeError, match="is non-finite"):
            engine.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
        norm = engine.clip_grad_norm_(model, 1.0)  # the default: no error, torch's default too
        assert not torch.isfinite(norm)
