"""DeepSpeed ZeRO 1/2/3 against the single-process reference (tox -e deepspeed)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import torchplug as tp
from support import memory_body
from support.checkpoint_attacks import no_unpickling
from support.commands import torchplug
from support.paths import ROOT
from support.ported import check_strategy
from support.reference import assert_close_dicts, make_dataset, make_model, train
from torchplug.testing import bodies
from torchplug.testing.conformance import classes, require_precision
from torchplug.util import capabilities

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed"
)


def train_ds(
    strategy: str,
    precision: str | None = None,
    steps: int = 10,
    first_step: int = 0,
    save_to: str | None = None,
    load_from: str | None = None,
    optimizer_name: str = "AdamW",
    scheduler: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The kit's training run (torchplug.testing.bodies.train) through DeepSpeed; ``scheduler`` is
    ``"before"`` or ``"after"`` setup (a StepLR halving the LR every step)."""
    result = bodies.train(
        strategy,
        options={"timeout": 120.0, **options},
        precision=precision,
        steps=steps,
        first_step=first_step,
        save_to=save_to,
        load_from=load_from,
        optimizer=optimizer_name,
        scheduler=scheduler,
        precision_options={},
    )
    result["params"] = {k: v.float() for k, v in result["params"].items()}
    return result


def extensions() -> list[str]:
    """What this process would find in torch's JIT extension directory."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.fixture(scope="module")
def reference() -> dict:
    return train("single")


@needs_deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_single_process_reference_without_compiling(ranks, reference, stage):
    for result in ranks.run(train_ds, f"deepspeed-zero{stage}", timeout=300):
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert_close_dicts(result["params"], reference["params"], atol=1e-5)
    assert ranks.run(extensions) == [[], []]  # nothing was JIT-compiled


def plain_reference(optimizer_name: str, scheduler: bool, steps: int = 10) -> dict[str, Any]:
    """The same run in plain PyTorch, no torchplug: the full batch in one process."""
    model = make_model()
    optimizer = getattr(torch.optim, optimizer_name)(model.parameters(), lr=3e-2)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    losses = []
    for step, (x, y) in enumerate(DataLoader(make_dataset(320), batch_size=16)):
        if step >= steps:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler:
            sched.step()
        losses.append(loss.item())
    return {"losses": losses, "params": dict(model.state_dict())}


@needs_deepspeed
@pytest.mark.parametrize(
    ("strategy", "optimizer_name", "scheduler"),
    [
        ("deepspeed-zero2", "SGD", "before"),
        ("deepspeed-zero2", "SGD", "after"),
        ("deepspeed-zero3-offload", "SGD", "after"),
        ("deepspeed-zero3-offload", "AdamW", "before"),
    ],
)
def test_any_torch_optimizer_and_scheduler_order_match_plain_pytorch(
    ranks, strategy, optimizer_name, scheduler
):
    expected = plain_reference(optimizer_name, scheduler=True)
    for result in ranks.run(
        train_ds, strategy, optimizer_name=optimizer_name, scheduler=scheduler, timeout=300
    ):
        assert result["losses"] == pytest.approx(expected["losses"], abs=1e-5)
        assert_close_dicts(result["params"], expected["params"], atol=1e-5)
    assert ranks.run(extensions) == [[], []]  # offload with a torch optimizer compiles nothing


class Output(dict):
    """A dict subclass with attribute access, like a Hugging Face ModelOutput."""

    def __getattr__(self, name: str) -> Any:
        return self[name]


class DictModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x: torch.Tensor) -> Output:
        return Output(prediction=self.net(x))


def output_type_under_bf16() -> str:
    with tp.Engine("deepspeed-zero2", precision="bf16") as engine:
        model = DictModel()
        model, _ = engine.setup(model, torch.optim.AdamW(model.parameters()))
        out = model(torch.randn(4, 8))
        return f"{type(out).__name__} {out.prediction.dtype}"


@needs_deepspeed
def test_bf16_keeps_the_model_output_type(ranks):
    assert ranks.run(output_type_under_bf16, timeout=300) == ["Output torch.float32"] * 2


@needs_deepspeed
def test_zero_bf16_is_deepspeed_bf16_within_tolerance(ranks, reference):
    for result in ranks.run(train_ds, "deepspeed-zero2", "bf16", timeout=300):
        assert result["losses"] == pytest.approx(reference["losses"], abs=5e-2)
        assert result["losses"] != reference["losses"]


@needs_deepspeed
@pytest.mark.parametrize(
    ("stage", "native"), [(2, False), (3, False), (2, True), (3, True)], ids=str
)
def test_save_resume_is_bit_exact(ranks, tmp_path, stage, native):
    """Through the portable checkpoint (default), and DeepSpeed's own (native_checkpoint=True)."""
    name, path = f"deepspeed-zero{stage}", str(tmp_path / "ckpt")
    whole = ranks.run(train_ds, name, timeout=300)[0]
    first = ranks.run(train_ds, name, steps=5, save_to=path, native_checkpoint=native, timeout=300)[
        0
    ]
    second = ranks.run(
        train_ds,
        name,
        steps=5,
        first_step=5,
        load_from=path,
        native_checkpoint=native,
        timeout=300,
    )[0]
    assert (Path(path) / "deepspeed").is_dir() == native
    assert first["losses"] + second["losses"] == whole["losses"]
    for key, value in whole["params"].items():
        assert torch.equal(second["params"][key], value), key


def load_portably(path: str, strategy: str) -> dict[str, Any]:
    with no_unpickling():  # the portable checkpoint holds no pickle, DeepSpeed's included
        return bodies.load(strategy, path)


@needs_deepspeed
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_zero3_checkpoint_loads_into_ddp_and_single_with_its_optimizer_state(
    ranks, tmp_path, precision
):
    path = str(tmp_path / "ckpt")
    saved = ranks.run(train_ds, "deepspeed-zero3", precision, steps=3, save_to=path, timeout=300)
    saved = saved[0]
    assert saved["optimizer"], "DeepSpeed's optimizer state by parameter name"
    for loaded in [*ranks.run(load_portably, path, "ddp"), load_portably(path, "single")]:
        assert loaded["optimizer_portable"] and loaded["step"] == 3
        # the fp32 master weights; under bf16 they round to the weights DeepSpeed trained with
        for key, value in saved["params"].items():
            assert torch.equal(loaded["params"][key], value), key
        assert loaded["optimizer"].keys() == saved["optimizer"].keys()
        for key, value in saved["optimizer"].items():
            assert torch.equal(loaded["optimizer"][key], value), key


@needs_deepspeed
def test_config_conflicts_name_both_values_and_sources():
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("deepspeed-zero3", config={"zero_optimization": {"stage": 2}})
    message = str(info.value)
    assert "ZeRO stage: 3 from the strategy name, but 2 in the config dict" in message
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("deepspeed", precision="bf16", config={"bf16": {"enabled": False}})
    assert "bf16.enabled: True from precision (code argument), but False" in str(info.value)


@needs_deepspeed
def test_the_precision_probe_agrees_with_deepspeeds_accelerator(monkeypatch):
    """torchplug answers "can DeepSpeed run fp16/bf16 here?" without importing deepspeed; the
    answer must be DeepSpeed's own on this machine, whatever its CPU."""
    monkeypatch.delenv(capabilities.ASSUME_NO_KERNELS_ENV, raising=False)
    from deepspeed.accelerator import get_accelerator

    from torchplug.plugins.deepspeed import precision_check

    supported = get_accelerator().supported_dtypes()
    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        assert (precision_check(precision) is None) == (dtype in supported), (
            precision,
            supported,
        )


@needs_deepspeed
def test_fp16_on_a_cpu_without_fp16_kernels_is_refused_before_initializing(monkeypatch):
    """What an AMD EPYC without AVX512-FP16 answers, forced here through torch's own probe."""
    monkeypatch.delenv(capabilities.ASSUME_NO_KERNELS_ENV, raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    from torchplug.contract import manager

    info = manager.get_registry().strategy("deepspeed-zero2")
    why = manager.get_registry().precision_unavailable(info, "fp16")
    assert why is not None and "_is_mkldnn_fp16_supported() is False" in why
    with pytest.raises(tp.ConfigurationError) as error:
        tp.Engine("deepspeed-zero2", precision="fp16")
    message = str(error.value)
    assert "cannot run precision 'fp16'" in message and "not available on this machine" in message
    assert "DeepSpeed's CPU accelerator needs for fp16" in message
    # bf16 and the AMP plugin's fp16 (torch's reference kernels) stay available
    assert manager.get_registry().precision_unavailable(info, "bf16") is None
    ddp = manager.get_registry().strategy("ddp")
    assert manager.get_registry().precision_unavailable(ddp, "fp16") is None


NO_FP16 = {capabilities.ASSUME_NO_KERNELS_ENV: "fp16"}


@needs_deepspeed
def test_launch_refuses_fp16_deepspeed_without_fp16_kernels_before_spawning(tmp_path):
    script = tmp_path / "x.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    run = torchplug(
        "launch", "-n", "2", "--strategy", "deepspeed-zero2", "--precision", "fp16",
        str(script), env=NO_FP16,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert not marker.exists()  # refused before spawning
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert "fp16 not available on this machine" in lines[0]
    assert "this CPU has no fp16 kernels (TORCHPLUG_ASSUME_NO_KERNELS=fp16 says so)" in lines[0]


@needs_deepspeed
def test_plugins_lists_fp16_as_unavailable_and_check_skips_it():
    listing = torchplug("plugins", "--verbose", env=NO_FP16).stdout
    section = listing.split("\ndeepspeed-zero2: ", 1)[1].split("\n\n", 1)[0]
    assert "precisions: 32, bf16, fp16 (not available on this machine: " in section, section
    run = torchplug("check", "deepspeed-zero2", "-n", "2", "--precision", "fp16", env=NO_FP16)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SKIP  parity (fp16 not available on this machine: " in run.stdout
    assert "FAIL" not in run.stdout and "PASS" not in run.stdout
    from torchplug.testing.kit import PROPERTIES

    assert f"0 passed, 0 failed, {len(PROPERTIES)} skipped" in run.stdout


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed installed")
def test_missing_deepspeed_names_the_install_command():
    with pytest.raises(tp.ConfigurationError, match=r"pip install torchplug\[deepspeed\]"):
        tp.Engine("deepspeed-zero2")


@needs_deepspeed
def test_convert_accepts_a_native_deepspeed_checkpoint(ranks, tmp_path):
    import subprocess
    import sys

    from safetensors.torch import load_file

    path = tmp_path / "ckpt"
    saved = ranks.run(
        train_ds,
        "deepspeed-zero2",
        steps=2,
        save_to=str(path),
        native_checkpoint=True,
        timeout=300,
    )[0]
    for source in (path, path / "deepspeed"):  # the torchplug checkpoint, and DeepSpeed's own
        out = tmp_path / f"out-{source.name}"
        trust = ["--from", "deepspeed", "--trust-pickles"] if source.name == "deepspeed" else []
        run = subprocess.run(
            [sys.executable, "-m", "torchplug", "convert", str(source), str(out), *trust],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        converted = load_file(str(out / "model.safetensors"))
        for key, value in saved["params"].items():
            assert torch.equal(converted[key], value), key


def resume_message(path: str) -> str | None:
    try:
        train_ds("deepspeed-zero1", steps=1, first_step=1, load_from=path, native_checkpoint=True)
    except tp.CheckpointError as exc:
        return str(exc)
    return None


@needs_deepspeed
def test_native_files_the_manifest_does_not_list_are_refused(ranks, tmp_path):
    path = tmp_path / "ckpt"
    ranks.run(
        train_ds,
        "deepspeed-zero1",
        steps=1,
        save_to=str(path),
        native_checkpoint=True,
        timeout=300,
    )
    planted = path / "deepspeed" / "torchplug" / "zero_pp_rank_9_mp_rank_00_optim_states.pt"
    planted.write_bytes(b"not listed")
    for message in ranks.run(resume_message, str(path), timeout=300):
        assert message is not None and "does not list" in message, message
        assert "zero_pp_rank_9" in message


@needs_deepspeed
@pytest.mark.parametrize(
    ("strategy", "precision"),
    [
        ("deepspeed-zero1", None),
        ("deepspeed-zero2", "bf16"),
        ("deepspeed-zero2", "fp16"),
        ("deepspeed-zero3", None),
        ("deepspeed-zero3-offload", None),
    ],
)
def test_ported_scripts_run_unchanged_like_ddp(ranks, tmp_path, strategy, precision):
    require_precision(strategy, precision)
    check_strategy(ranks, strategy, precision, tmp_path)


# The conformance kit on every DeepSpeed strategy in every precision it supports.
for _name in ("deepspeed", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"):
    for _cls_name, _cls in classes(_name).items():
        globals()[_cls_name] = needs_deepspeed(_cls)
for _cls_name, _cls in classes("deepspeed-zero3-offload").items():
    globals()[_cls_name] = needs_deepspeed(_cls)


# -- the portable checkpoint, both ways ------------------------------------------------------------

#: A covering subset of the pairs among {ddp@2, fsdp@2, single@1, zero1@2, zero2@2, zero3@2,
#: zero3@1}: every DeepSpeed stage and world size is a source and a target at least once, against
#: every other kind of strategy, across stages and across world sizes.
PAIRS = [
    ("ddp@2", "deepspeed-zero2@2"),
    ("single@1", "deepspeed-zero3@2"),
    ("deepspeed-zero2@2", "deepspeed-zero3@2"),
    ("deepspeed-zero2@2", "ddp@2"),
    ("deepspeed-zero3@2", "single@1"),
    ("deepspeed-zero1@2", "fsdp@2"),
    ("fsdp@2", "deepspeed-zero1@2"),
    ("deepspeed-zero3@1", "deepspeed-zero1@2"),
    ("deepspeed-zero3@2", "deepspeed-zero3@1"),
]


@pytest.fixture(scope="module")
def one_rank() -> Any:
    from torchplug.testing import RankPool

    pool = RankPool(1)
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def runs(ranks: Any, one_rank: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Cached runs by node (``strategy@nprocs``): 10 uninterrupted steps, and 5 steps saved."""
    cache: dict[tuple[str, str], Any] = {}
    root = tmp_path_factory.mktemp("portable")

    def run(node: str, what: str, **kwargs: Any) -> Any:
        strategy, nprocs = node.split("@")
        pool = ranks if nprocs == "2" else one_rank
        options = {"timeout": 120.0} if strategy != "single" else {}
        if what == "resume":
            return pool.run(
                bodies.train,
                strategy,
                options=options,
                steps=5,
                first_step=5,
                **kwargs,
                timeout=300,
            )[0]
        if (node, what) not in cache:
            if what == "whole":
                cache[node, what] = pool.run(bodies.train, strategy, options=options, timeout=300)[
                    0
                ]
            else:
                path = str(root / node)
                pool.run(
                    bodies.train, strategy, options=options, steps=5, save_to=path, timeout=300
                )
                cache[node, what] = path
        return cache[node, what]

    return run


@needs_deepspeed
@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{s}->{t}" for s, t in PAIRS])
def test_portable_checkpoint_resumes_across_stages_world_sizes_and_strategies(runs, source, target):
    whole = runs(target, "whole")
    resumed = runs(target, "resume", load_from=runs(source, "saved"))
    assert resumed["losses"] == pytest.approx(whole["losses"][5:], abs=1e-6)
    assert resumed["params"].keys() == whole["params"].keys()
    assert_close_dicts(resumed["params"], whole["params"], atol=1e-6)
    assert resumed["optimizer"].keys() == whole["optimizer"].keys() != set()
    assert_close_dicts(resumed["optimizer"], whole["optimizer"], atol=1e-6)


def plain_deepspeed(path: str, stage: int, steps: int = 5) -> dict[str, Any]:
    """A training run written with DeepSpeed alone (no torchplug): the kit's model and data, each
    rank a slice of every global batch, then ``engine.save_checkpoint(path)``."""
    import deepspeed

    from torchplug.plugins.deepspeed import _reset_deepspeed_state

    _reset_deepspeed_state()  # this pool's earlier DeepSpeed runs leave module-level groups
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT compile on CPU
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = bodies.make_model()
    config = {
        "train_micro_batch_size_per_gpu": bodies.GLOBAL_BATCH // world,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    dataset = bodies.make_dataset(bodies.MAX_STEPS * bodies.GLOBAL_BATCH)
    for step, (x, y) in enumerate(DataLoader(dataset, bodies.GLOBAL_BATCH)):
        if step == steps:
            break
        loss = torch.nn.functional.mse_loss(ds_engine(x.chunk(world)[rank]), y.chunk(world)[rank])
        ds_engine.backward(loss)
        ds_engine.step()
    ds_engine.save_checkpoint(path)
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    held = {}
    for name, param in model.named_parameters():
        held[f"{name}"] = safe_get_full_fp32_param(param).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            held[f"{name}.{key}"] = safe_get_full_optimizer_state(param, key).detach().clone()
    torch.distributed.destroy_process_group()
    _reset_deepspeed_state()
    return held


@needs_deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_a_plain_deepspeed_checkpoint_converts_and_resumes_under_fsdp(ranks, tmp_path, stage):
    import subprocess
    import sys

    native, portable = tmp_path / "native", tmp_path / "portable"
    held = ranks.run(plain_deepspeed, str(native), stage, timeout=300)[0]
    run = subprocess.run(
        [sys.executable, "-m", "torchplug", "convert", str(native), str(portable)]
        + ["--to", "checkpoint", "--from", "deepspeed", "--trust-pickles"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == str(portable) and "WARNING" not in run.stderr, run.stderr
    # What DeepSpeed held is what the portable checkpoint holds, bit for bit.
    loaded = load_portably(str(portable), "single")
    assert loaded["step"] == 5
    for key, value in held.items():
        got = (
            loaded["optimizer"][key]
            if key.endswith("exp_avg_sq") or key.endswith("exp_avg")
            else loaded["params"][key]
        )
        assert torch.equal(got, value), key
    # ... and fsdp continues from it as if it had run the first 5 steps itself.
    options = {"timeout": 120.0}
    whole = ranks.run(bodies.train, "fsdp", options=options, timeout=300)[0]
    resumed = ranks.run(
        bodies.train,
        "fsdp",
        options=options,
        steps=5,
        first_step=5,
        load_from=str(portable),
        timeout=300,
    )[0]
    assert resumed["losses"] == pytest.approx(whole["losses"][5:], abs=1e-6)
    assert_close_dicts(resumed["params"], whole["params"], atol=1e-6)
    assert_close_dicts(resumed["optimizer"], whole["optimizer"], atol=1e-6)


def grouped(
    strategy: str,
    steps: int,
    first_step: int = 0,
    save_to: str | None = None,
    load_from: str | None = None,
) -> dict[str, Any]:
    """Two parameter groups (no weight decay on biases, another LR), SGD with momentum, and a
    scheduler saved beside them: what fine-tuning scripts do."""
    options = {"timeout": 120.0} if strategy != "single" else {}
    with tp.Engine(strategy, **options) as engine:
        model = bodies.make_model()
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        optimizer = torch.optim.SGD(
            [{"params": weights, "weight_decay": 1e-2}, {"params": biases, "lr": 1e-2}],
            lr=3e-2,
            momentum=0.9,
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
        model, optimizer = engine.setup(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
        if load_from:
            engine.load(load_from, state)
        data = bodies.make_dataset(bodies.MAX_STEPS * bodies.GLOBAL_BATCH)
        loader = DataLoader(data, batch_size=bodies.GLOBAL_BATCH // engine.world_size)
        for step, (x, y) in enumerate(engine.setup_dataloader(loader)):
            if step < first_step:
                continue
            if step == first_step + steps:
                break
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            state["step"] = step + 1
        if save_to:
            engine.save(save_to, state)
        full = bodies.full_state(engine, model, optimizer)
        return {**full, "lrs": [g["lr"] for g in optimizer.param_groups]}


@needs_deepspeed
@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("ddp", "deepspeed-zero2"),
        ("deepspeed-zero3", "ddp"),
        ("deepspeed-zero1", "deepspeed-zero3"),
    ],
)
def test_parameter_groups_momentum_and_scheduler_move_between_strategies(
    ranks, tmp_path, source, target
):
    path = str(tmp_path / "ckpt")
    whole = ranks.run(grouped, target, 8, timeout=300)[0]
    ranks.run(grouped, source, 4, save_to=path, timeout=300)
    resumed = ranks.run(grouped, target, 4, first_step=4, load_from=path, timeout=300)[0]
    assert resumed["lrs"] == whole["lrs"] == [3e-2 / 16, 1e-2 / 16]
    assert_close_dicts(resumed["params"], whole["params"], atol=1e-6)
    assert any(k.endswith("momentum_buffer") for k in whole["optimizer"])
    assert_close_dicts(resumed["optimizer"], whole["optimizer"], atol=1e-6)


for _cls_name, _cls in classes("deepspeed-zero3-offload").items():
    globals()[_cls_name] = needs_deepspeed(_cls)


@needs_deepspeed
@pytest.mark.parametrize("strategy", ["deepspeed-zero2", "deepspeed-zero3"])
def test_accumulate_on_deepspeed_equals_one_large_batch(ranks, strategy):
    from support.accumulation import accumulated_training, large_batch_reference

    results = ranks.run(accumulated_training, 2, strategy, timeout=180)
    assert results[0][-1] == [True, False, True, False]
    assert results[0][:-1] == pytest.approx(large_batch_reference(), abs=1e-5)


@needs_deepspeed
@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("inhouse_plugin.py", [], "steps skipped by the guard: 1; weights finite: True"),
        ("char_lm.py", ["--steps", "10", "--trainer"], "sample: 'Beautiful is "),
    ],
)
def test_examples_run_unchanged_under_deepspeed(tmp_path, script, args, expected):
    import subprocess
    import sys

    examples = ROOT / "examples"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPLUG_")}
    command = [
        sys.executable, "-m", "torchplug", "launch", "-n", "2", "--strategy", "deepspeed-zero2",
        str(examples / script), *args,
    ]  # fmt: skip
    run = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert expected in run.stdout


def trainer_clipping_on_deepspeed(config: dict[str, Any] | None = None) -> str:
    from support.trainer_body import data, model_and_optimizer

    model, optimizer = model_and_optimizer()
    trainer = tp.Trainer(
        model,
        optimizer,
        torch.nn.functional.cross_entropy,
        DataLoader(data(), batch_size=8),
        strategy="deepspeed-zero2",
        clip_grad_norm=1.0,
        timeout=60.0,
        **({"config": config} if config else {}),
    )
    with trainer:
        try:
            trainer.fit()
        except tp.ConfigurationError as exc:
            return str(exc)
    return "no error"


@needs_deepspeed
def test_trainer_clips_on_deepspeed_and_a_conflicting_config_is_named(ranks):
    assert ranks.run(trainer_clipping_on_deepspeed, timeout=300) == ["no error", "no error"]
    message = ranks.run(trainer_clipping_on_deepspeed, {"gradient_clipping": 0.5}, timeout=300)[0]
    assert "Conflicting gradient clipping: engine.clip_grad_norm_(max_norm=1.0)" in message
    assert '"gradient_clipping": 0.5 in the config dict passed as config=' in message


@needs_deepspeed
@pytest.mark.parametrize("stage", ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_clip_grad_norm_with_a_scheduler_matches_plain_pytorch(ranks, stage, when):
    """SGD + an LR scheduler made before or after setup + clip_grad_norm_ (what every LLM script
    does): the norms equal the reference's on every rank, and so do losses and parameters."""
    results = ranks.run(
        bodies.train, stage, optimizer="SGD", lr=0.1, clip=0.05, scheduler=when, timeout=300
    )
    reference = bodies.reference(optimizer="SGD", lr=0.1, clip=0.05, scheduler=when)
    assert max(reference["norms"]) > 0.05  # the clip really bites
    for result in results:
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5, abs=1e-7)
        assert result["norms"] == results[0]["norms"]  # the same global norm on every rank
        assert result["lrs"] == pytest.approx(reference["lrs"], abs=1e-12)
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert_close_dicts(result["params"], reference["params"], atol=1e-5)


def built_partitioned() -> list[Any]:
    with tp.Engine("deepspeed-zero3", timeout=120.0) as engine:
        with engine.init_module(empty=True):  # ZeRO-3: zero.Init partitions while building
            model = bodies.make_model()
        local = [(hasattr(p, "ds_id"), p.numel(), p.ds_numel) for p in model.parameters()]
        model, _ = engine.setup(model, torch.optim.AdamW(model.parameters()))
        return local


@needs_deepspeed
def test_zero3_builds_the_model_partitioned_under_init_module(ranks):
    for local in ranks.run(built_partitioned, timeout=300):
        assert all(has_id and numel == 0 and full > 0 for has_id, numel, full in local), local


def load_pretrained_into_zero3(path: str) -> str:
    with tp.Engine("deepspeed-zero3") as engine:
        with engine.init_module(empty=True):
            model = bodies.make_model()
        model, _ = engine.setup(model, torch.optim.AdamW(model.parameters()))
        try:
            engine.load_pretrained(model, path)
        except tp.CheckpointError as exc:
            return str(exc)
        return "loaded"


@needs_deepspeed
def test_load_pretrained_refuses_zero3_partitions_before_reading(ranks, tmp_path):
    """The DeepSpeed plugin answers torchplug_load_pretrained itself for ZeRO-3's partitioned
    parameters (no DeepSpeed knowledge in the checkpoint package): refused, saying what works."""
    from safetensors.torch import save_file

    save_file({"nothing": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    for message in ranks.run(load_pretrained_into_zero3, str(tmp_path), timeout=300):
        assert "ZeRO-partitioned parameter" in message and "init_module()" in message


@needs_deepspeed
def test_fp16_resume_carries_deepspeeds_loss_scale(ranks, tmp_path):
    require_precision("deepspeed-zero2", "fp16")
    args = {
        "precision": "fp16",
        "precision_options": {"init_scale": 256.0, "growth_interval": 1},
        "optimizer": "SGD",
        "lr": 0.1,
    }
    whole = ranks.run(bodies.train, "deepspeed-zero2", steps=8, **args, timeout=600)[0]
    path = str(tmp_path / "half")
    ranks.run(bodies.train, "deepspeed-zero2", steps=4, save_to=path, **args, timeout=600)
    resumed = ranks.run(
        bodies.train, "deepspeed-zero2", steps=4, first_step=4, load_from=path, **args,
        timeout=600,
    )  # fmt: skip
    for result in resumed:
        assert result["skipped"] == whole["skipped"][4:]
        assert result["losses"] == pytest.approx(whole["losses"][4:], abs=1e-6)
        for name, value in whole["params"].items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-6, rtol=0)


@needs_deepspeed
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"])
@pytest.mark.parametrize("make", ["gpt2", "llama"])
def test_hugging_face_models_train_in_low_precision_like_autocast(ranks, stage, precision, make):
    pytest.importorskip("transformers")
    from support import hf_models

    hf_models.check_low_precision(ranks, stage, precision, make)


@needs_deepspeed
@pytest.mark.parametrize("stage", ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"])
def test_hugging_face_models_train_like_one_process(ranks, stage):
    """A tiny GPT-2 (tied embeddings, Conv1D) and Llama under every ZeRO stage."""
    pytest.importorskip("transformers")
    from support import hf_models

    for make in (hf_models.gpt2, hf_models.llama):
        reference = hf_models.reference(make)
        for result in ranks.run(hf_models.train, stage, {}, make, timeout=600):
            assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
            assert_close_dicts(result["params"], reference["params"], atol=1e-5)


@needs_deepspeed
@pytest.mark.parametrize("source", ["ddp", "fsdp"])
def test_batchnorm_checkpoints_load_rank_zeros_statistics_into_zero3(ranks, tmp_path, source):
    """A ResNet-shaped model whose ranks hold different BatchNorm statistics, saved under ddp or
    fsdp, loads into ZeRO-3 with exactly rank 0's statistics on every rank, and its eval logits
    equal rank 0's model."""
    from support.real_models import load_into, train_bn_and_save

    path = str(tmp_path / "ckpt")
    saved = ranks.run(train_bn_and_save, source, path, timeout=600)
    rank0 = saved[0]
    assert any(not torch.equal(v, saved[1]["buffers"][k]) for k, v in rank0["buffers"].items())
    for loaded in ranks.run(load_into, "deepspeed-zero3", path, timeout=600):
        for name, value in rank0["buffers"].items():
            assert torch.equal(loaded["buffers"][name], value), name
        torch.testing.assert_close(loaded["logits"], rank0["logits"], rtol=0, atol=1e-5)


def _live_tensor_bytes() -> int:
    """Bytes of every storage a live CPU tensor holds, each storage counted once."""
    import gc

    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
            except RuntimeError:
                continue
            if storage.nbytes():
                found[storage.data_ptr()] = storage.nbytes()
    return sum(found.values())


def zero3_save_holds(path: str) -> dict[str, int]:
    """Train ZeRO-3 one AdamW step, then save; what the save held when it began writing (new
    tensor bytes since before the save), what it wrote, the rank's fair share of the full state
    and its largest tensor."""
    from torchplug.checkpoint import tensors as store

    engine = tp.Engine("deepspeed-zero3", timeout=120.0)
    with engine.init_module(empty=True):
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine.backward(model(torch.randn(4, 256)).square().mean())
    optimizer.step()
    optimizer.zero_grad()
    full = [p.ds_numel * 4 for p in model.parameters()] * 3  # fp32 weights, exp_avg, exp_avg_sq
    seen: dict[str, int] = {}
    real = store.write

    def spy(root: Any, tensors: dict[str, torch.Tensor], rank: int) -> Any:
        seen["held"] = _live_tensor_bytes() - before
        seen["written"] = sum(t.numel() * t.element_size() for t in tensors.values())
        return real(root, tensors, rank)

    store.write = spy  # this rank's process only
    try:
        before = _live_tensor_bytes()
        engine.save(path, {"model": model, "optimizer": optimizer})
    finally:
        store.write = real
    engine.close()
    return {**seen, "share": sum(full) // engine.world_size, "largest": max(full)}


@needs_deepspeed
def test_zero3_save_holds_its_share_of_the_state_not_the_whole_model(ranks, tmp_path):
    """Issue 25 item 8: each full tensor is gathered once the save knows which rank writes it,
    and kept only there; before, every rank held the whole model and optimizer state."""
    results = ranks.run(zero3_save_holds, str(tmp_path / "ckpt"), timeout=300)
    for held in results:
        assert held["held"] <= held["share"] + held["largest"] + 64 * 1024, held
        assert held["written"] >= held["share"] - held["largest"], held
    assert sum(h["written"] for h in results) >= 2 * results[0]["share"] - 64 * 1024
    empty = {"model": None, "optimizer": None}
    state = tp.Engine("single").load(tmp_path / "ckpt", empty, strict=False)
    assert len(state["model"]) == 24 and len(state["optimizer"]["state"]) == 24


@needs_deepspeed
@pytest.mark.parametrize(
    "strategy, precision",
    [("deepspeed-zero3", "32"), ("deepspeed-zero3", "bf16"), ("deepspeed-zero1", "32")]
    + [("deepspeed-zero2", "bf16")],
)
def test_estimate_memory_is_within_5_percent_of_the_live_bytes(ranks, strategy, precision):
    """Issue 27 item 8: `torchplug estimate-memory` against the live tensors of a real step
    (parameter partitions, persistent small parameters, gradient partitions, fp32 masters)."""
    from support.memory_estimates import assert_within, estimate_for

    measured = ranks.run(memory_body.measure, strategy, precision, timeout=300)
    estimate = estimate_for(strategy, precision)
    assert_within(estimate, measured)
    assert estimate["masters"] > 0 and estimate["grads"] > 0


def set_up_schedule_free(strategy: str) -> str:
    import schedulefree

    model = torch.nn.Linear(4, 2)
    with tp.Engine(strategy) as engine:
        try:
            engine.setup(model, schedulefree.AdamWScheduleFree(model.parameters(), lr=0.1))
        except tp.ConfigurationError as error:
            return str(error)
    return "set up"


@needs_deepspeed
def test_a_schedule_free_optimizer_is_refused_naming_why(ranks):
    """Its train()/eval() switch would change DeepSpeed's flat partitions, not the weights the
    model computes with: evaluations would silently use the training weights (issue 34)."""
    pytest.importorskip("schedulefree")
    for said in ranks.run(set_up_schedule_free, "deepspeed-zero2"):
        assert "schedule-free optimizer (AdamWScheduleFree)" in said, said
        assert "Use it with ddp, fsdp or tp" in said


@needs_deepspeed
@pytest.mark.parametrize(
    ("source", "target"), [("ddp", "deepspeed-zero2"), ("deepspeed-zero2", "ddp")]
)
def test_a_checkpoint_saved_before_the_first_step_resumes_as_a_fresh_optimizer(
    ranks, tmp_path, source, target
):
    """A step-0 save of either strategy loads into the other as a never-stepped optimizer: 5
    steps after the load equal 5 steps of a run that loaded nothing (losses, parameters,
    optimizer state)."""
    path = str(tmp_path / "step0")
    options = {"timeout": 120.0}
    ranks.run(bodies.train, source, options=options, steps=0, save_to=path, timeout=300)
    fresh = ranks.run(bodies.train, target, options=options, steps=5, timeout=300)[0]
    resumed = ranks.run(
        bodies.train, target, options=options, steps=5, load_from=path, timeout=300
    )[0]
    assert resumed["losses"] == pytest.approx(fresh["losses"], abs=1e-6)
    assert_close_dicts(resumed["params"], fresh["params"], atol=1e-6)
    assert resumed["optimizer"].keys() == fresh["optimizer"].keys() != set()
    assert_close_dicts(resumed["optimizer"], fresh["optimizer"], atol=1e-6)
