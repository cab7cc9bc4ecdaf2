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
from checkpoint_attacks import no_unpickling
from reference import make_dataset, make_model, train
from test_parity import assert_close_dicts
from test_ported import check_strategy
from torchplug.testing import bodies
from torchplug.testing.conformance import classes

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
@pytest.mark.parametrize("stage", [2, 3])
def test_save_resume_is_bit_exact(ranks, tmp_path, stage):
    name, path = f"deepspeed-zero{stage}", str(tmp_path / "ckpt")
    whole = ranks.run(train_ds, name, timeout=300)[0]
    first = ranks.run(train_ds, name, steps=5, save_to=path, timeout=300)[0]
    second = ranks.run(train_ds, name, steps=5, first_step=5, load_from=path, timeout=300)[0]
    assert first["losses"] + second["losses"] == whole["losses"]
    for key, value in whole["params"].items():
        assert torch.equal(second["params"][key], value), key


def load_model(path: str, strategy: str) -> dict[str, torch.Tensor]:
    with no_unpickling(), tp.Engine(strategy) as engine:  # the portable part holds no pickle
        model = engine.setup(make_model(seed=7))
        state = {"model": model, "step": 0}
        engine.load(path, state)
        return engine.full_state(model)["model"]


@needs_deepspeed
def test_zero3_checkpoint_loads_into_ddp_and_single(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = ranks.run(train_ds, "deepspeed-zero3", steps=3, save_to=path, timeout=300)[0]
    for loaded in [*ranks.run(load_model, path, "ddp"), load_model(path, "single")]:
        for key, value in saved["params"].items():
            assert torch.equal(loaded[key], value), key
    # DeepSpeed's optimizer state cannot go into another strategy: an error, not an empty optimizer
    with tp.Engine("single") as engine:
        model = make_model(seed=7)
        model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters()))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        with pytest.raises(tp.CheckpointError, match="entry 'optimizer' is of kind 'deepspeed-"):
            engine.load(path, state)
        engine.load(path, state, strict=False)  # the explicit escape: the model and the step
        assert state["step"] == 3
        assert torch.equal(
            engine.full_state(model)["model"]["0.weight"], saved["params"]["0.weight"]
        )


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
def test_fp16_on_a_device_without_it_is_refused_before_initializing():
    from deepspeed.accelerator import get_accelerator

    if torch.float16 in get_accelerator().supported_dtypes():
        pytest.skip("this device supports fp16 in DeepSpeed")
    with pytest.raises(tp.ConfigurationError, match="does not support fp16.*precision='bf16'"):
        tp.Engine("deepspeed-zero2", precision="fp16")


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
    saved = ranks.run(train_ds, "deepspeed-zero2", steps=2, save_to=str(path), timeout=300)[0]
    for source in (path, path / "deepspeed"):  # the torchplug checkpoint, and DeepSpeed's own
        out = tmp_path / f"out-{source.name}"
        run = subprocess.run(
            [sys.executable, "-m", "torchplug", "convert", str(source), str(out)],
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
        train_ds("deepspeed-zero1", steps=1, first_step=1, load_from=path)
    except tp.CheckpointError as exc:
        return str(exc)
    return None


@needs_deepspeed
def test_native_files_the_manifest_does_not_list_are_refused(ranks, tmp_path):
    path = tmp_path / "ckpt"
    ranks.run(train_ds, "deepspeed-zero1", steps=1, save_to=str(path), timeout=300)
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
    check_strategy(ranks, strategy, precision, tmp_path)


# The conformance kit on every DeepSpeed strategy in every precision it supports.
for _name in ("deepspeed", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"):
    for _cls_name, _cls in classes(_name).items():
        globals()[_cls_name] = needs_deepspeed(_cls)
for _cls_name, _cls in classes("deepspeed-zero3-offload").items():
    globals()[_cls_name] = needs_deepspeed(_cls)


@needs_deepspeed
@pytest.mark.parametrize("strategy", ["deepspeed-zero2", "deepspeed-zero3"])
def test_accumulate_on_deepspeed_equals_one_large_batch(ranks, strategy):
    from test_helpers import accumulated_training, large_batch_reference

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

    examples = Path(__file__).resolve().parent.parent / "examples"
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


def trainer_clipping_on_deepspeed() -> str:
    from trainer_body import data, model_and_optimizer

    model, optimizer = model_and_optimizer()
    trainer = tp.Trainer(
        model,
        optimizer,
        torch.nn.functional.cross_entropy,
        DataLoader(data(), batch_size=8),
        strategy="deepspeed-zero2",
        clip_grad_norm=1.0,
        timeout=60.0,
    )
    with trainer:
        try:
            trainer.fit()
        except tp.ConfigurationError as exc:
            return str(exc)
    return "no error"


@needs_deepspeed
def test_trainer_clipping_on_deepspeed_says_where_to_clip(ranks):
    message = ranks.run(trainer_clipping_on_deepspeed, timeout=180)[0]
    assert message.startswith(
        "Trainer(clip_grad_norm=1.0) cannot clip on strategy 'deepspeed-zero2'"
    )
    assert '"gradient_clipping": MAX_NORM in the DeepSpeed config' in message
    assert "pass clip_grad_norm=None" in message
