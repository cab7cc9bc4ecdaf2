"""The tests' training run: the conformance kit's own body (torchplug.testing.bodies.train), with
the signature the tests use. One training loop serves the kit, these tests and DeepSpeed's."""

from __future__ import annotations

from typing import Any

import torch

from torchplug.testing import bodies
from torchplug.testing.bodies import full_state, make_dataset, make_model  # noqa: F401

MAX_STEPS = bodies.MAX_STEPS

#: Full (gathered) parameters and optimizer tensors by name, whatever the strategy.
snapshot = full_state


def train(
    strategy: str = "auto",
    precision: str | None = None,
    steps: int = 10,
    global_batch: int = 16,
    lr: float = 3e-2,
    inf_at_step: int | None = None,
    save_to: str | None = None,
    load_from: str | None = None,
    first_step: int = 0,
    clip: float | None = None,
    width: int = 16,
    precision_options: dict[str, Any] | None = None,
    accumulate: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """``steps`` steps of AdamW on the global batch split over the ranks (the precision plugin's
    own defaults unless ``precision_options``); other keyword arguments go to the Engine."""
    return bodies.train(
        strategy,
        options=options,
        steps=steps,
        first_step=first_step,
        save_to=save_to,
        load_from=load_from,
        lr=lr,
        precision=precision,
        clip=clip,
        accumulate=accumulate,
        inf_at_step=inf_at_step,
        width=width,
        global_batch=global_batch,
        precision_options=precision_options or {},
    )


def assert_close_dicts(actual: dict, expected: dict, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=atol, rtol=0, msg=key)


def run(ranks, strategy: str, nprocs: int, **kwargs) -> dict:
    if nprocs == 1:
        return train(strategy, **kwargs)
    results = ranks.run(train, strategy, **kwargs)
    return results[0]


def setup_error(strategy: str, **options: Any) -> str:
    """What ``Engine(strategy, **options)`` says when it refuses to start (``""``: it started)."""
    import torchplug as tp

    try:
        tp.Engine(strategy, **options).close()
    except tp.ConfigurationError as exc:
        return str(exc)
    return ""
