"""Issue 35 item 4: ranks that use different parameters in one step (a mixture of experts whose
rank r routes everything to expert r) train right or are refused before anything moves, on
every strategy; the kit's ``rank_dependent`` property, with the options that make it right."""

from __future__ import annotations

import pytest

from torchplug.testing.kit import Kit


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "option", "nprocs"),
    [
        ("ddp", {"find_unused_parameters": True}, 2),
        ("fsdp", {"reduce_scatter_unused_params": True}, 2),
        ("fsdp-tp", {"reduce_scatter_unused_params": True, "tp_size": 2}, 4),
    ],
)
def test_the_option_the_refusal_names_makes_the_experts_right(strategy, option, nprocs):
    refused = Kit(strategy, nprocs, options={k: v for k, v in option.items() if k == "tp_size"})
    try:
        outcome = refused.outcome("rank_dependent")
    finally:
        refused.close()
    assert outcome.passed and outcome.refused, outcome
    name = next(k for k in option if k != "tp_size")
    assert f"{name}=True" in outcome.detail  # the refusal names the option to pass
    kit = Kit(strategy, nprocs, options=option)
    try:
        outcome = kit.outcome("rank_dependent")
    finally:
        kit.close()
    assert outcome.passed and not outcome.refused, outcome  # equal to plain PyTorch
