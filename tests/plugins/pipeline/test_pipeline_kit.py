"""The conformance kit under ``pp`` (issue 39 item 5): the kit's MLP and its real-model shape
(`KitNet`: BatchNorm, a convolution, a random buffer, an embedding tied to the head across the
two stages) both cut before their layer ``2``; the kit steps by ``engine.forward_backward``, as
pp declares (``refuses=("backward", ...)``). Its declared deviation (BatchNorm per micro-batch)
is checked to vanish in one micro-batch."""

from __future__ import annotations

import pytest

from torchplug.testing.conformance import classes
from torchplug.testing.kit import check

KIT = {"split_points": ["2"]}

globals().update(classes("pp", ("32", "bf16"), options=KIT))


def test_real_model_equals_plain_pytorch_exactly_in_one_micro_batch(ranks):
    """The deviation pp declares for ``real_model`` is BatchNorm's per micro-batch statistics
    alone: in one micro-batch the tied embedding across stages, the buffers, the statistics
    and the checkpoint into 'single' all equal plain PyTorch."""
    options = {**KIT, "schedule": "gpipe", "n_microbatches": 1}
    (outcome,) = check("pp", options=options, pool=ranks, only=["real_model"])
    assert outcome.passed and not outcome.deviated, outcome


def test_a_schedule_that_needs_more_micro_batches_says_so(ranks):
    options = {**KIT, "schedule": "1f1b", "n_microbatches": 1}
    (outcome,) = check("pp", options=options, pool=ranks, only=["parity"])
    assert not outcome.passed
    assert "ConfigurationError" in outcome.detail and "schedule='gpipe'" in outcome.detail, outcome


@pytest.mark.parametrize("strategy", ["ddp", "pp"])
def test_ranks_with_models_of_other_shapes_are_refused_on_every_rank(ranks, strategy):
    """Engine.setup gives every rank rank 0's model by broadcasts, which gloo aborts in native
    code when the sizes differ: the ranks agree on the shapes first and all refuse instead."""
    errors = ranks.run(_mismatched, strategy, timeout=300)
    assert all("differ in their tensors' shapes" in e for e in errors), errors


def _mismatched(strategy: str) -> str:
    import torch

    import torchplug as tp

    with tp.Engine(strategy, **KIT if strategy == "pp" else {}) as engine:
        width = 16 + engine.rank  # rank 1 built another configuration
        model = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
        )
        try:
            engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        except tp.ConfigurationError as exc:
            return str(exc)
    return "set up"
