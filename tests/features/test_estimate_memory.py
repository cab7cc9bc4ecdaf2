"""``torchplug estimate-memory``: its numbers against the live tensors of a real step on 2 ranks
(ddp, fsdp here; deepspeed-zero3 in test_deepspeed.py), its table and JSON, and a transformers
config."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from support import memory_body
from support.commands import torchplug
from support.memory_estimates import assert_within, estimate_for
from support.paths import SUPPORT
from torchplug.cli.estimate import estimates, load_model
from torchplug.features import memory


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_estimate_is_within_5_percent_of_the_live_bytes_of_a_step(ranks, strategy):
    measured = ranks.run(memory_body.measure, strategy, timeout=180)
    estimate = estimate_for(strategy)
    assert_within(estimate, measured)
    assert estimate["grads"] > 0 and estimate["optimizer"] > 0
    if strategy == "fsdp":  # dim-0 padding: rank 0 and rank 1 store the same padded shards
        assert measured[0]["params"] == measured[1]["params"] == estimate["params"]
        assert measured[1]["optimizer"] < measured[0]["optimizer"]  # state is the unpadded rows


#: An uneven split (321 rows, 37 embedding rows on 2 ranks) of a Linear and an Embedding.
TP_PLAN = {"fc2": "colwise_rep", "emb": "embedding_rowwise"}


def test_tp_estimate_follows_the_plan_within_5_percent_of_the_live_bytes(ranks):
    measured = ranks.run(memory_body.measure, "tp", tp_plan=TP_PLAN, timeout=180)
    estimate = estimate_for("tp", tp_plan=TP_PLAN)
    assert_within(estimate, measured)
    assert estimate["params"] == max(m["params"] for m in measured)  # exact
    assert estimate["params"] < estimate_for("ddp")["params"]


def test_tp_without_a_plan_says_how_to_give_one():
    with torch.device("meta"):
        model = memory_body.build()
    rows, skipped = estimates(model, 2, "32", "adamw", ["tp", "fsdp-tp"])
    assert not rows
    assert "no tensor-parallel plan" in skipped[0]["reason"]
    assert "2-D sharding" in skipped[1]["reason"]
    model.tp_plan = TP_PLAN  # the model's own plan, as the strategy takes it
    rows, _ = estimates(model, 2, "32", "adamw", ["tp"])
    assert rows[0]["params"] == estimate_for("tp", tp_plan=TP_PLAN)["params"]


def test_rules_are_exact_where_the_rule_is_exact():
    specs = memory.param_specs(memory_body.build())
    numel = sum(p.numel for p in specs)
    query = memory.MemoryQuery(specs, 2, "32", "adamw")
    from torchplug.plugins.ddp import ddp_memory
    from torchplug.plugins.deepspeed.memory import zero
    from torchplug.plugins.fsdp import fsdp2_memory

    ddp = ddp_memory(query)
    assert ddp.params == ddp.grads == 4 * numel
    assert ddp.optimizer == 2 * 4 * numel + 4 * len(specs)  # exp_avg, exp_avg_sq, step
    padded = (
        4 * (19 * 24)  # emb 37 rows -> 19 per rank
        + 4 * (167 * 24 + 167)  # fc1 333 rows -> 167
        + 4 * (167 + 167)  # LayerNorm weight and bias
        + 4 * (161 * 333 + 161)  # fc2 321 rows -> 161
        + 4 * (3 * 321 + 3)  # out 5 rows -> 3
    )
    assert fsdp2_memory(query).params == padded
    sgd = memory.replicated(memory.MemoryQuery(specs, 2, "32", "sgd"))
    assert sgd.optimizer == 0
    momentum = memory.replicated(memory.MemoryQuery(specs, 2, "32", "sgd-momentum"))
    assert momentum.optimizer == 4 * numel
    zero3 = zero(3)(memory.MemoryQuery(specs, 4, "bf16", "adamw"))
    parts = sum(math.ceil(p.numel / 4) for p in specs)
    assert zero3.grads == 2 * parts and zero3.masters == 4 * parts
    assert zero3.optimizer == 2 * 4 * parts + 4


def test_a_broken_rule_costs_its_row_and_aliases_one_row():
    import dataclasses

    from torchplug.contract.manager import get_registry

    registry = get_registry()

    def broken(query):
        raise KeyError("oops")

    registry.strategies["ddp"] = dataclasses.replace(registry.strategies["ddp"], memory=broken)
    with torch.device("meta"):
        model = memory_body.build()
    rows, skipped = estimates(model, 2, "32", "adamw", ["ddp", "fsdp", "fully-sharded"])
    assert [r["strategy"] for r in rows] == ["fsdp"]
    assert skipped == [{"strategy": "ddp", "reason": "its memory rule failed: KeyError: 'oops'"}]


def test_a_strategy_without_a_rule_gets_one_from_its_flags():
    from torchplug.contract.types import StrategyInfo

    info = StrategyInfo(name="x", factory=object, description="", shards_optimizer=True)
    specs = memory.param_specs(memory_body.build())
    estimate = memory.rule_for(info)(memory.MemoryQuery(specs, 2))
    full = memory.replicated(memory.MemoryQuery(specs, 2))
    assert estimate.params == full.params and estimate.optimizer < full.optimizer
    assert "derived from the strategy's flags" in estimate.notes[0]


def test_cli_prints_a_table_and_json_for_a_factory():
    run = torchplug("estimate-memory", "memory_body:build", "-n", "2", cwd=SUPPORT)
    assert run.returncode == 0, run.stderr
    header = next(line for line in run.stdout.splitlines() if line.startswith("strategy"))
    assert header.split() == ["strategy", "params", "grads", "optimizer", "state", "fp32"] + [
        "masters",
        "total",
    ]
    assert re.search(r"^ddp +463\.68 KiB +463\.68 KiB", run.stdout, re.M), run.stdout
    assert re.search(r"^fsdp +", run.stdout, re.M)
    assert "not estimated:" in run.stdout and "tp: no tensor-parallel plan" in run.stdout
    run = torchplug(
        "estimate-memory", "memory_body:build", "-n", "2", "--strategy", "ddp",
        "--strategy", "fsdp", "--optimizer", "sgd", "--json", cwd=SUPPORT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["parameters"] == 118_703 and out["world_size"] == 2
    assert [r["strategy"] for r in out["strategies"]] == ["ddp", "fsdp"]
    ddp = out["strategies"][0]
    assert ddp["params"] == ddp["grads"] == 4 * 118_703 and ddp["optimizer"] == 0
    assert ddp["total"] == 2 * 4 * 118_703


def test_cli_errors_name_the_fix(tmp_path, monkeypatch, capsys):
    from torchplug.cli import main

    monkeypatch.chdir(tmp_path)
    cases = [
        (["no_such_module:build"], "cannot import 'no_such_module'"),
        (["support.memory_body:nothing_here"], "has no 'nothing_here'"),
        (["no-such-model-type"], "no transformers model type"),
        (["support.memory_body:build", "--strategy", "dpp"], "ddp"),
        (["support.memory_body:build", "-n", "0"], "expected 1 or more ranks"),
        (["support.memory_body:build", "--option", "stage=3"], "needs exactly one --strategy"),
        (
            ["support.memory_body:build", "--strategy", "ddp", "--option", "nope=1"],
            "Unknown option",
        ),
        (["support.memory_body:build", "--precision", "fp8"], "not supported"),
    ]
    for args, message in cases:
        assert main(["estimate-memory", *args]) == 2, args
        assert message in capsys.readouterr().err, args


def test_a_transformers_config_is_estimated_exactly_for_ddp(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=101, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    model, what = load_model(str(tmp_path / "config.json"))
    assert "GPT2LMHeadModel" in what and next(model.parameters()).is_meta
    real = transformers.GPT2LMHeadModel(config)  # the same model, allocated, to count exactly
    exact = sum(p.numel() * p.element_size() for p in real.parameters())  # lm_head tied: once
    rows, _ = estimates(model, 2, "32", "adamw", ["ddp"])
    assert rows[0]["params"] == rows[0]["grads"] == exact
    assert rows[0]["optimizer"] == 2 * exact + 4 * len(list(real.parameters()))
    run = torchplug("estimate-memory", str(tmp_path), "--strategy", "ddp", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["strategies"][0]["params"] == exact
