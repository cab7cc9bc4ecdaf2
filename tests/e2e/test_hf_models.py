"""Hugging Face models as users have them (tiny configs, nothing downloaded): tensor parallel
splits a Llama by its own plan and matches one process; GPT-2 (empty plan, Conv1D) is refused by
name, never run as a silent replica."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

from support import hf_models  # noqa: E402
from support.reference import assert_close_dicts  # noqa: E402
from torchplug.testing import RankPool  # noqa: E402
from torchplug.testing.processes import default_sys_path  # noqa: E402


@pytest.fixture(scope="module")
def four() -> Iterator[RankPool]:
    pool = RankPool(4, sys_path=default_sys_path())
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def reference() -> dict:
    return hf_models.reference()


def check_split_run(results: list[dict], reference: dict, tp_size: int) -> None:
    for result in results:
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert_close_dicts(result["params"], reference["params"], atol=1e-5)
        # really split: the projections, embeddings and head hold 1/tp of their weights here
        assert result["local_bytes"] < 0.6 * result["full_bytes"] if tp_size == 2 else True


def test_tp_splits_a_llama_by_its_own_plan_and_matches_one_process(ranks, reference):
    results = ranks.run(hf_models.train, "tp", {}, timeout=600)
    check_split_run(results, reference, tp_size=2)


def test_fsdp_tp_on_four_ranks_matches_one_process(four, reference):
    results = four.run(hf_models.train, "fsdp-tp", {"dp_size": 2, "tp_size": 2}, timeout=600)
    for result in results:
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert_close_dicts(result["params"], reference["params"], atol=1e-5)
        # tp splits by 2, fsdp shards what is left over the other 2
        assert result["local_bytes"] < 0.35 * result["full_bytes"]


def test_gpt2s_empty_plan_is_refused_naming_the_model(ranks):
    for message in ranks.run(hf_models.setup_error, "tp", {}, hf_models.gpt2, timeout=600):
        assert message is not None, "GPT-2 ran as a replica under tp"
        assert "empty tensor-parallel plan for GPT2LMHeadModel" in message
        assert "use 'fsdp' / 'ddp'" in message


def test_a_plan_on_gpt2s_conv1d_is_refused_naming_the_layer(ranks):
    plan = {
        "tp_plan": {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
    }
    for message in ranks.run(hf_models.setup_error, "tp", plan, hf_models.gpt2, timeout=600):
        assert message is not None
        assert "matches transformer.h.0.mlp.c_fc, a Conv1D" in message
        assert "split nn.Linear and nn.Embedding only" in message


@pytest.mark.parametrize(("strategy", "options"), [("fsdp", {}), ("tp", {})])
def test_meta_init_gives_the_models_own_initialisation_bit_exact(ranks, strategy, options):
    """Hugging Face initialises through post_init (_init_weights: normal(0, 0.02), ones for
    norms), not the layers' reset_parameters; built empty, the model must get the same numbers."""
    eager = hf_models.llama().state_dict()
    for built in ranks.run(hf_models.built_empty, strategy, options, timeout=600):
        assert built.keys() == eager.keys()
        differ = [k for k in eager if not torch.equal(built[k], eager[k])]
        assert not differ, differ


def test_meta_init_in_one_process_is_bit_exact_too():
    eager = hf_models.llama().state_dict()
    built = hf_models.built_empty("single", {})
    assert [k for k in eager if not torch.equal(built[k], eager[k])] == []


@pytest.fixture(scope="module")
def gpt2_reference() -> dict:
    return hf_models.reference(hf_models.gpt2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gpt2_with_tied_embeddings_trains_like_one_process(ranks, gpt2_reference, strategy):
    for result in ranks.run(hf_models.train, strategy, {}, hf_models.gpt2, timeout=600):
        assert result["losses"] == pytest.approx(gpt2_reference["losses"], abs=1e-5)
        assert_close_dicts(result["params"], gpt2_reference["params"], atol=1e-5)


@pytest.mark.parametrize(
    ("strategy", "precision"),
    [("single", "bf16"), ("single", "fp16"), ("ddp", "bf16"), ("ddp", "fp16"), ("fsdp", "bf16")],
)
@pytest.mark.parametrize("make", ["gpt2", "llama"])
def test_hugging_face_models_train_in_low_precision_like_autocast(ranks, strategy, precision, make):
    """(DeepSpeed's and FairScale's precisions: in their own test files, same check.)"""
    hf_models.check_low_precision(ranks, strategy, precision, make)


def test_gpt2_checkpoint_moves_from_fsdp_to_single_continues_and_converts(ranks, tmp_path):
    """fsdp@2 trains 2 steps and saves; single loads it and trains 2 more, equal to 4 steps in
    one process; ``torchplug convert`` of that checkpoint loads into from_pretrained with the
    tie kept and the same weights."""
    import subprocess
    import sys

    from transformers import GPT2LMHeadModel

    whole = hf_models.reference(hf_models.gpt2, steps=4)
    first, again = str(tmp_path / "fsdp"), str(tmp_path / "single")
    ranks.run(hf_models.train, "fsdp", {}, hf_models.gpt2, 2, first, timeout=600)
    second = hf_models.train("single", {}, hf_models.gpt2, 2, again, first, 2)
    assert second["losses"] == pytest.approx(whole["losses"][2:], abs=1e-5)
    assert_close_dicts(second["params"], whole["params"], atol=1e-5)
    out = tmp_path / "hf"
    run = subprocess.run(
        [sys.executable, "-m", "torchplug", "convert", again, str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    hf_models.gpt2().config.save_pretrained(out)
    loaded = GPT2LMHeadModel.from_pretrained(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    state = loaded.state_dict()
    for name, value in second["params"].items():
        assert torch.equal(state[name], value), name


def test_a_sharded_export_loads_with_from_pretrained(tmp_path):
    """``convert --max-shard-size``: shards and an index as save_pretrained writes them; a
    transformers model loads them, tie kept, every tensor equal."""
    import json
    import subprocess
    import sys

    from transformers import GPT2LMHeadModel

    ckpt = str(tmp_path / "ckpt")
    trained = hf_models.train("single", {}, hf_models.gpt2, 1, ckpt)
    out = tmp_path / "hf"
    run = subprocess.run(
        [sys.executable, "-m", "torchplug", "convert", ckpt, str(out), "--max-shard-size", "20KB"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    from safetensors import safe_open

    for shard in shards:  # none above the limit unless one tensor alone is
        with safe_open(str(out / shard), "pt") as f:
            tensors = [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118 - safe_open's API
        sizes = [t.numel() * t.element_size() for t in tensors]
        assert sum(sizes) <= 20_000 or len(sizes) == 1, (shard, sizes)
    hf_models.gpt2().config.save_pretrained(out)
    loaded = GPT2LMHeadModel.from_pretrained(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    state = loaded.state_dict()
    for name, value in trained["params"].items():
        assert torch.equal(state[name], value), name
    again = subprocess.run(
        [sys.executable, "-m", "torchplug", "convert", ckpt, str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert again.returncode == 2 and "from an earlier export in the other layout" in again.stderr


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory) -> tuple[str, dict]:
    """A llama saved by transformers' own save_pretrained in shards, and its weights."""
    model = hf_models.llama(seed=7)
    out = tmp_path_factory.mktemp("llama-sharded")
    model.save_pretrained(out, max_shard_size="20KB", safe_serialization=True)
    assert (out / "model.safetensors.index.json").is_file()
    return str(out), {k: v.clone() for k, v in model.state_dict().items()}


def test_load_pretrained_in_one_process_is_bit_exact(sharded_llama):
    path, expected = sharded_llama
    result = hf_models.load_pretrained_under("single", {}, path)
    assert result["missing"] == []
    assert [k for k in expected if not torch.equal(result["state"][k], expected[k])] == []


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_load_pretrained_into_an_empty_built_model_under_each_strategy(
    ranks, sharded_llama, strategy
):
    path, expected = sharded_llama
    total = sum(v.numel() for v in expected.values())
    for result in ranks.run(hf_models.load_pretrained_under, strategy, {}, path, timeout=600):
        assert [k for k in expected if not torch.equal(result["state"][k], expected[k])] == []
        if strategy == "fsdp":  # each rank read its shards, not the model
            assert result["read"] <= 0.6 * total, (result["read"], total)
        if strategy == "ddp":
            assert result["read"] == total


def test_load_pretrained_names_what_is_missing(tmp_path):
    from safetensors.torch import save_file

    import torchplug as tp

    save_file({"model.embed_tokens.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with tp.Engine("single") as engine:
        model = engine.setup(hf_models.llama())
        with pytest.raises(tp.CheckpointError, match="has no weights for"):
            engine.load_pretrained(model, tmp_path)
        with pytest.raises(tp.CheckpointError, match="with shape \\(1,\\); the model's is"):
            engine.load_pretrained(model, tmp_path, strict=False)


def test_load_pretrained_without_safetensors_names_the_install(tmp_path, monkeypatch):
    import sys

    import torchplug as tp

    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    with tp.Engine("single") as engine:
        model = engine.setup(torch.nn.Linear(2, 2))
        with pytest.raises(tp.CheckpointError, match=r"pip install torchplug\[convert\]"):
            engine.load_pretrained(model, tmp_path)


def _two_shards(root, second: dict) -> None:
    """A save_pretrained-style index over two shards; ``second`` is the second shard's content."""
    import json

    from safetensors.torch import save_file

    save_file({"0.weight": torch.full((3, 2), 7.0), "0.bias": torch.full((3,), 7.0)},
              str(root / "a.safetensors"))  # fmt: skip
    save_file(second, str(root / "b.safetensors"))
    weight_map = {"0.weight": "a.safetensors", "0.bias": "a.safetensors",
                  "1.weight": "b.safetensors", "1.bias": "b.safetensors"}  # fmt: skip
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize(
    "problem, message",
    [
        ("shape", r"b\.safetensors holds '1\.weight' with shape \(5, 3\)"),
        ("absent", r"names b\.safetensors for '1\.bias', but that shard has no tensor"),
        ("header", r"b\.safetensors is not a readable safetensors file"),
        ("huge", r"b\.safetensors is not a readable safetensors file"),
        ("list", r"'weight_map' is a list"),
        ("nul", r"which is not a file name inside"),
    ],
)
def test_load_pretrained_is_all_or_nothing_and_names_every_bad_input(tmp_path, problem, message):
    """Issue 36 item 4: a bad second shard (a shape that does not fit, a tensor the index names
    but the shard lacks, a malformed or hostile header), a weight_map that is a list, a NUL in a
    name: one CheckpointError naming the file and the problem, and the model unchanged (the
    first shard, which is fine, was not copied either)."""
    import json
    import struct

    import torchplug as tp

    good = {"1.weight": torch.ones(1, 3), "1.bias": torch.ones(1)}
    if problem == "shape":
        _two_shards(tmp_path, {"1.weight": torch.ones(5, 3), "1.bias": torch.ones(1)})
    elif problem == "absent":
        _two_shards(tmp_path, {"1.weight": torch.ones(1, 3)})
    elif problem in ("header", "huge"):
        _two_shards(tmp_path, good)
        raw = b"not a header at all" if problem == "header" else struct.pack("<Q", 2**63) + b"{}"
        (tmp_path / "b.safetensors").write_bytes(raw)
    else:
        _two_shards(tmp_path, good)
        index = tmp_path / "model.safetensors.index.json"
        body = json.loads(index.read_text())
        if problem == "list":
            body["weight_map"] = list(body["weight_map"].items())
        else:
            body["weight_map"]["1.bias"] = "b.safetensors\u0000"
        index.write_text(json.dumps(body))
    with tp.Engine("single") as engine:
        model = engine.setup(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(tp.CheckpointError, match=message):
            engine.load_pretrained(model, tmp_path)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # nothing half-loaded
