"""``pp``: parity with plain PyTorch on the global batch (every schedule, 2 and 4 stages, a
GPT-style model with tied ends across stages and a Hugging Face Llama, pipelines times data
parallel), accumulation, clipping, a scheduler, evaluation, and portable checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from support import pipeline_body as body
from torchplug.testing import RankPool
from torchplug.testing.processes import default_sys_path

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble")


@pytest.fixture(scope="module")
def four() -> Iterator[RankPool]:
    pool = RankPool(4, sys_path=default_sys_path())
    yield pool
    pool.stop()


def _close(got: Any, want: Any, what: str, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _matches(results: list[dict], expected: dict, tol: float = 1e-5) -> None:
    for rank, result in enumerate(results):
        _close(result["losses"], expected["losses"], f"rank {rank} losses", tol)
        _close(result["norms"], expected["norms"], f"rank {rank} norms", tol)
        assert result["params"].keys() == expected["params"].keys()
        for name, value in expected["params"].items():
            _close(result["params"][name], value, f"rank {rank} {name}", tol)
        index, size = result["share"]
        _close(result["eval"], expected["eval"].chunk(size)[index], f"rank {rank} eval", tol)
        # gather_for_metrics: each data-parallel share once, whatever the pipeline's length
        _close(result["gathered"], expected["eval"], f"rank {rank} gathered", tol)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_ranks_every_schedule_equals_plain_pytorch(ranks, schedule):
    results = ranks.run(body.train, "pp", {"schedule": schedule}, timeout=300)
    _matches(results, body.reference())


def test_four_stages_and_eight_interleaved_equal_plain_pytorch(four):
    expected = body.reference()
    _matches(four.run(body.train, "pp", {"schedule": "1f1b"}, timeout=300), expected)
    _matches(four.run(body.train, "pp", {"schedule": "interleaved-1f1b"}, timeout=300), expected)


def test_pipelines_times_data_parallel_equal_plain_pytorch(four):
    options = {"pp_size": 2, "schedule": "1f1b", "n_microbatches": 2}
    _matches(four.run(body.train, "pp", options, timeout=300), body.reference())


def test_hugging_face_llama_in_two_and_four_stages(ranks, four):
    expected = body.reference("llama")
    _matches(
        ranks.run(body.train, "pp", {"schedule": "gpipe"}, kind="llama", timeout=300), expected
    )
    _matches(four.run(body.train, "pp", {"schedule": "1f1b"}, kind="llama", timeout=300), expected)
    fsdp = {"pp_size": 2, "dp_shard": 2, "schedule": "gpipe", "n_microbatches": 2}
    _matches(four.run(body.train, "pp", fsdp, kind="llama", timeout=300), expected)


def test_hugging_face_llama_split_by_its_own_tp_plan_in_two_stages(four):
    """pp x tp on the HF model's own plan (``_tp_plan``, found on the wrapped
    LlamaForCausalLM and prefixed): attention heads and MLPs split, the embedding by its
    features, sdpa in math ops on the CPU, export's metadata asserts dropped."""
    tp = {"pp_size": 2, "tp_size": 2, "schedule": "1f1b", "n_microbatches": 2}
    _matches(four.run(body.train, "pp", tp, kind="llama", timeout=300), body.reference("llama"))


FSDP = {"pp_size": 2, "dp_shard": 2, "n_microbatches": 2}
TP = {"pp_size": 2, "tp_size": 2, "n_microbatches": 2}


def test_stages_sharded_by_fsdp_or_split_by_tp_equal_plain_pytorch(four):
    """pp x fsdp (FSDP2 over dp_shard in each stage) and pp x tp (the model's tp_plan), with
    accumulation, clipping and a scheduler; each rank holds a fraction of its stage."""
    expected = body.reference(accumulate=2)
    total = sum(p.numel() for p in body.make().parameters())
    for options in (FSDP, TP):
        results = four.run(body.train, "pp", options, accumulate=2, timeout=300)
        _matches(results, expected)
        # a whole stage is about half of the model; sharded or split, well under that
        assert all(r["held"] < 0.35 * total for r in results), (options, total, results[0]["held"])


def test_checkpoints_move_out_of_and_into_sharded_stages_bit_exact(four, tmp_path):
    first = str(tmp_path / "pp-fsdp")
    saved = four.run(body.train, "pp", FSDP, steps=2, save_to=first, timeout=300)[0]
    loaded = body.train("single", {}, steps=0, load_from=first)
    for name, value in saved["params"].items():
        assert torch.equal(loaded["params"][name], value), name
    for name, value in saved["optimizer"]["state"].items():
        for key, tensor in value.items():
            assert torch.equal(loaded["optimizer"]["state"][name][key], tensor), (name, key)
    # going on from it under pp x tp (loaded before the stages exist) is single going on
    alone = body.train("single", {}, steps=2, load_from=first, first_step=2)
    for result in four.run(body.train, "pp", TP, steps=2, load_from=first, first_step=2):
        for name, value in alone["params"].items():
            _close(result["params"][name], value, name)
    # loaded into stages already sharded (after steps): exactly the checkpoint
    for options in (FSDP, TP):
        for result in four.run(body.train, "pp", options, steps=1, reload_from=first):
            for name, value in saved["params"].items():
                assert torch.equal(result["params"][name], value), (options, name)
            for name, value in saved["optimizer"]["state"].items():
                for key, tensor in value.items():
                    got = result["optimizer"]["state"][name][key]
                    assert torch.equal(got, tensor), (options, name, key)


@pytest.mark.slow
def test_three_d_and_hsdp_on_eight_ranks_equal_plain_pytorch(tmp_path):
    """pp x fsdp x tp (2 x 2 x 2; the GPT and the HF Llama) and pp x HSDP (2 stages, 2
    replicas x 2 shards, interleaved), against plain PyTorch; the 3-D run's checkpoint loads
    into single bit-exact."""
    pool = RankPool(8, sys_path=default_sys_path())
    try:
        expected = body.reference()
        where = str(tmp_path / "3d")
        three_d = {**FSDP, "tp_size": 2}
        results = pool.run(body.train, "pp", three_d, save_to=where, timeout=600)
        _matches(results, expected)
        loaded = body.train("single", {}, steps=0, load_from=where)
        for name, value in results[0]["params"].items():
            assert torch.equal(loaded["params"][name], value), name
        hsdp = {**FSDP, "schedule": "interleaved-1f1b"}
        _matches(pool.run(body.train, "pp", hsdp, timeout=600), expected)
        llama = pool.run(body.train, "pp", three_d, kind="llama", timeout=600)
        _matches(llama, body.reference("llama"))
    finally:
        pool.stop()


def test_accumulation_and_explicit_split_points(ranks):
    options = {"schedule": "1f1b", "split_points": "layers.3", "n_microbatches": 4}
    results = ranks.run(body.train, "pp", options, accumulate=2, timeout=300)
    _matches(results, body.reference(accumulate=2))


def test_same_loop_under_ddp_and_fsdp(ranks):
    """The loop written with forward_backward runs unchanged on the other strategies."""
    expected = body.reference()
    for strategy in ("ddp", "fsdp"):
        _matches(ranks.run(body.train, strategy, {}, timeout=300), expected)


def test_bf16_follows_autocast(ranks):
    from torchplug.util.capabilities import cpu_kernels_missing

    missing = cpu_kernels_missing("bf16")
    if missing:
        pytest.skip(missing)
    results = ranks.run(body.train, "pp", {}, precision="bf16", timeout=300)
    _matches(results, body.reference(precision="bf16"), tol=5e-2)


def test_checkpoint_moves_between_stage_counts_and_strategies_bit_exact(ranks, four, tmp_path):
    first, again = str(tmp_path / "pp2"), str(tmp_path / "single")
    saved = ranks.run(body.train, "pp", {}, steps=2, save_to=first, timeout=300)[0]
    # single loads it and trains on: the same as pp going on from it, and as never stopping
    alone = body.train("single", {}, steps=2, load_from=first, first_step=2, save_to=again)
    for name, value in saved["params"].items():
        assert torch.equal(body.train("single", {}, steps=0, load_from=first)["params"][name],
                           value), name  # fmt: skip
    on_four = four.run(body.train, "pp", {}, steps=2, load_from=first, first_step=2, timeout=300)
    for name, value in alone["params"].items():
        _close(on_four[0]["params"][name], value, name)
    whole = body.reference()
    for name, value in whole["params"].items():
        _close(alone["params"][name], value, name)
    # single's checkpoint loads bit-exact into 4 stages and into fsdp
    for pool, strategy in ((four, "pp"), (ranks, "fsdp")):
        for loaded in pool.run(body.train, strategy, {}, steps=0, load_from=again, timeout=300):
            for name, value in alone["params"].items():
                assert torch.equal(loaded["params"][name], value), (strategy, name)
            for name, value in alone["optimizer"]["state"].items():
                for key, tensor in value.items():
                    assert torch.equal(loaded["optimizer"]["state"][name][key], tensor), name


def test_training_forward_and_uneven_batches_say_what_to_do(ranks):
    said = ranks.run(body.training_forward_error, {})
    assert all("engine.forward_backward(model" in s for s in said), said
    said = ranks.run(body.uneven_batch_error, {})
    assert all("A batch of 5 does not split into n_microbatches=2" in s for s in said), said


@pytest.mark.parametrize("options", [{}, {"schedule": "interleaved-1f1b"}])
def test_estimate_memory_is_the_fullest_stage(ranks, options):
    from torchplug.cli.estimate import estimates

    with torch.device("meta"):
        model = body.GPT()
    (whole,), _ = estimates(model, 2, "32", "adamw", ["ddp"], {})
    (estimate,), skipped = estimates(model, 2, "32", "adamw", ["pp"], options)
    assert not skipped, skipped
    measured = ranks.run(body.measured_bytes, options, timeout=300)
    for field in ("params", "grads", "optimizer"):
        fullest = max(m[field] for m in measured)
        assert estimate[field] == pytest.approx(fullest, rel=0.05), (field, estimate, measured)
    # each rank holds about half of the model: what pipelining is for
    assert estimate["params"] < 0.6 * whole["params"]


def test_keyword_inputs_reach_the_stage_that_reads_them(ranks):
    """A tensor keyword input the last stage reads and a plain-number one, changed each step
    (an outsider's model failed on both)."""
    expected = body.keyword_inputs("plain", {})
    for schedule in ("gpipe", "interleaved-1f1b"):
        for result in ranks.run(body.keyword_inputs, "pp", {"schedule": schedule}, timeout=300):
            _close(result["losses"], expected["losses"], f"{schedule} losses")
            _close(result["eval"], expected["eval"], f"{schedule} eval")
