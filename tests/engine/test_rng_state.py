"""``tp.RNGState``: every generator Accelerate's ``save_state`` keeps (torch, Python's ``random``,
numpy's global one; CUDA where present), per rank, through ``engine.save``/``load`` (issue 34)."""

from __future__ import annotations

import random

import numpy as np
import torch

import torchplug as tp


def _draws() -> tuple:
    return random.random(), np.random.rand(3).tolist(), np.random.normal(), torch.rand(3).tolist()


def _saved_then_loaded(path: str) -> tuple[tuple, tuple]:
    with tp.Engine() as engine:
        random.seed(1 + engine.rank)
        np.random.seed(2 + engine.rank)
        torch.manual_seed(3 + engine.rank)
        np.random.normal()  # numpy's legacy normal caches a second value: its state holds it
        engine.save(path, {"rng": tp.RNGState(engine)})
        expected = _draws()
        random.seed(99)
        np.random.seed(99)
        torch.manual_seed(99)
        engine.load(path, {"rng": tp.RNGState(engine)})
        return expected, _draws()


def test_save_and_load_bring_back_every_generator_in_one_process(tmp_path):
    expected, got = _saved_then_loaded(str(tmp_path / "ckpt"))
    assert got == expected


def test_each_rank_gets_its_own_generators_back(ranks, tmp_path):
    results = ranks.run(_saved_then_loaded, str(tmp_path / "ckpt"))
    for expected, got in results:
        assert got == expected
    assert results[0][0] != results[1][0]  # the ranks' streams differ: each took its own row


def test_a_checkpoint_saved_before_numpy_was_kept_still_loads(tmp_path):
    """Checkpoints written by earlier versions have no numpy entry: the rest is restored."""
    with tp.Engine("single") as engine:
        torch.manual_seed(5)
        state = tp.RNGState(engine).state_dict()
        del state["numpy"], state["numpy_gauss"]
        expected = torch.rand(2)
        torch.manual_seed(6)
        tp.RNGState(engine).load_state_dict(state)
        assert torch.equal(torch.rand(2), expected)
