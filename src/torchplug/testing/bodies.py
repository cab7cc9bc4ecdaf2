"""What the conformance kit runs on every rank: a tiny training run and collective checks.

Module-level functions, so that `RankPool` workers can import them.

Why this module is over 500 lines: each function is one body the kit's properties run on every rank
of a `RankPool` (train, reference, load, collectives, data order, ...), and they must be module-
level functions of one importable module for the workers to find them; splitting them would split
the kit's bodies from each other with nothing to gain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplug as tp
import torchplug.plugin as tpp
from torchplug.contract import manager
from torchplug.plugins.base import REDUCE_OPS

FEATURES = 8
MAX_STEPS = 20
GLOBAL_BATCH = 16
#: fp16's first loss scale in the kit: small enough that no step overflows on its own (each rank's
#: smaller batch has larger per-sample gradients, so 2**16 overflows on different steps than one
#: process would); skipping is checked with an injected inf instead.
FP16_SCALE = 256.0


def make_model(seed: int = 0, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )


def make_dataset(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.linspace(-1, 1, FEATURES).unsqueeze(1)
    y = x @ w + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def kit_scale(strategy: str, precision: str | None) -> dict[str, Any]:
    """The Engine arguments that start fp16 at `FP16_SCALE` (none in other precisions,
    or where the strategy's own fp16 takes no ``init_scale``)."""
    if precision != "fp16" or strategy == "auto":
        return {}
    info = manager.get_registry().strategy(strategy)
    names = {o.name for o in info.precision_options}
    if not info.owns_precision or "init_scale" in names:
        return {"precision_options": {"init_scale": FP16_SCALE}}
    return {}


def register(plugins: Sequence[str]) -> None:
    """Import and register in-house plugin modules by name (in every rank, before the Engine)."""
    registry = manager.get_registry()
    for name in plugins:
        if not registry.pm.has_plugin(name):
            # from the current directory too, as `python -m` imports (torchplug check --plugin)
            manager.import_plugin_module(registry, name, strict=True)


class NaNGuard:
    """An extension that skips the optimizer step when any rank's gradients hold NaN or inf:
    the pattern docs/plugins.md documents, checked on every backend by the kit's ``nan_skip``.

    A wrapper cannot leave out the backend (it must yield), so it makes the backend's step a
    no-update step with ``engine.skipping_updates`` and returns ``False`` ("skipped"), which
    ``optimizer.step_was_skipped`` then reports. The ranks agree through ``engine.reduce``: a
    step skipped on one rank only would leave the replicas apart.
    """

    @tpp.hookimpl(wrapper=True)
    def torchplug_optimizer_step(
        self, engine: tp.Engine, optimizer: torch.optim.Optimizer, closure: Any
    ) -> Any:
        from torch.distributed.tensor import DTensor

        bad = any(
            not (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).isfinite().all()
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        )
        bad = engine.reduce(torch.tensor(float(bad)), op="max").item() > 0
        with engine.skipping_updates(optimizer, bad):
            stepped = yield
        return bool(stepped) and not bad


def full_state(engine: tp.Engine, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Gathered parameters and optimizer tensors by name (no optimizer tensors from a backend
    whose optimizer state has no portable form: DeepSpeed's)."""
    try:
        state = engine.full_state(model, optimizer)
    except tp.CheckpointError:
        return {"params": engine.full_state(model)["model"], "optimizer": {}}
    optim = {
        f"{name}.{k}": v
        for name, values in state["optimizer"]["state"].items()
        for k, v in values.items()
        if isinstance(v, torch.Tensor)
    }
    return {"params": state["model"], "optimizer": optim}


def _optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    return getattr(torch.optim, name)(params, lr=lr)


def frozen_groups(model: torch.nn.Module, lr: float) -> list[dict[str, Any]]:
    """Freeze the first layer (a frozen base, as fine-tuning scripts have) and return two param
    groups with their own learning rate and weight decay; the frozen tensors stay in the second
    group, as ``model.parameters()`` passed whole leaves them (torch skips tensors without a
    gradient, so they must never get one)."""
    for param in model[0].parameters():
        param.requires_grad_(False)
    head = dict(model[2].named_parameters())
    return [
        {"params": [head["weight"]], "lr": lr, "weight_decay": 0.1},
        {"params": [*model[0].parameters(), head["bias"]], "lr": lr / 2, "weight_decay": 0.0},
    ]


#: The two training steps users write: ``model(x)`` then `engine.backward` (``"backward"``), or
#: `engine.forward_backward` (``"forward_backward"``). The kit runs the first unless the
#: strategy refuses it (``StrategyInfo(refuses=("backward",))``: pp, whose schedule runs both).
LOOPS = ("backward", "forward_backward")


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def user_step(
    engine: tp.Engine,
    model: torch.nn.Module,
    x: torch.Tensor | tuple[Any, ...],
    y: torch.Tensor,
    loop: str = "backward",
    loss_fn: Any = mse,
    scale: float = 1.0,
) -> torch.Tensor:
    """``loss_fn(model(x), y) * scale``, forward and backward as ``loop`` writes them; the
    loss, detached (``scale``: a micro-batch's share, an injected inf or nan; a tuple ``x``:
    the model's positional inputs)."""
    inputs = x if isinstance(x, tuple) else (x,)
    if loop == "forward_backward":
        return engine.forward_backward(
            model, *inputs, target=y, loss_fn=lambda out, target: loss_fn(out, target) * scale
        )
    if loop != "backward":
        raise ValueError(f"loop {loop!r}: expected one of {LOOPS}")
    loss = loss_fn(model(*inputs), y) * scale
    engine.backward(loss)
    return loss.detach()


def _injects(engine: tp.Engine) -> bool:
    """Whether this rank's loss takes an injected inf or nan: the first data-parallel replica's,
    on every rank that computes it (tensor-parallel peers alike, the last pipeline stage)."""
    return engine.data_parallel_rank == 0


def _batches(world_size: int, global_batch: int = GLOBAL_BATCH) -> DataLoader:
    return DataLoader(make_dataset(MAX_STEPS * global_batch), batch_size=global_batch // world_size)


def reference(
    optimizer: str = "AdamW",
    steps: int = 10,
    lr: float = 3e-2,
    precision: str = "32",
    clip: float | None = None,
    accumulate: int = 1,
    scheduler: str | None = None,
    inf_at_step: int | None = None,
    nan_at_step: int | None = None,
    norm_type: float = 2.0,
    frozen: bool = False,
) -> dict[str, Any]:
    """The same run as `train` in plain PyTorch: one process, the combined batch, no
    torchplug at all (no Engine, no optimizer patch, no loader wrapper, no state gathering), so a
    bug shared by torchplug's code paths cannot hide in the comparison."""
    model = make_model()
    opt = _optimizer(optimizer, frozen_groups(model, lr) if frozen else model.parameters(), lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduler else None
    dtype, scaler = reference_amp(precision)
    losses, norms, skipped, lrs = [], [], [], []
    for step, (x, y) in enumerate(_batches(1)):
        if step >= steps:
            break
        parts = []
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                out = model(xs)
            part = torch.nn.functional.mse_loss(out.float(), ys) / accumulate
            if inf_at_step == step:
                part = part * float("inf")
            if nan_at_step == step:
                part = part * float("nan")
            (scaler.scale(part) if scaler else part).backward()
            parts.append(part.detach())
        if clip is not None:
            if scaler:
                scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type).item())
        if scaler:
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < scale)
        elif nan_at_step is not None and any(
            not p.grad.isfinite().all() for p in model.parameters() if p.grad is not None
        ):
            skipped.append(True)  # what NaNGuard does: no update
        else:
            opt.step()
            skipped.append(False)
        opt.zero_grad()
        if sched is not None:
            sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        losses.append(torch.stack(parts).sum().item())
    return {
        "losses": losses,
        "norms": norms,
        "skipped": skipped,
        "lrs": lrs,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def train(
    strategy: str,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    steps: int = 10,
    first_step: int = 0,
    save_to: str | None = None,
    load_from: str | None = None,
    lr: float = 3e-2,
    optimizer: str = "AdamW",
    precision: str | None = None,
    clip: float | None = None,
    accumulate: int = 1,
    scheduler: str | None = None,
    inf_at_step: int | None = None,
    nan_at_step: int | None = None,
    norm_type: float = 2.0,
    nan_guard: bool = False,
    probe_sync: bool = False,
    width: int = 16,
    global_batch: int = GLOBAL_BATCH,
    precision_options: dict[str, Any] | None = None,
    engine_args: dict[str, Any] | None = None,
    with_accumulate: bool = False,
    frozen: bool = False,
    checkpoint_dir: str | None = None,
    error_if_nonfinite: bool = False,
    loop: str = "backward",
) -> dict[str, Any]:
    """``steps`` steps on the global batch split over the ranks, as a user writes them.

    ``scheduler`` is ``"before"`` or ``"after"`` setup (a StepLR halving the LR each step);
    ``accumulate`` micro-batches are accumulated under ``engine.no_sync``; ``inf_at_step`` makes
    rank 0's loss infinite at that step. ``probe_sync`` records, for the first micro-batch
    under no_sync, whether this rank's gradients equal every other rank's (they must not).
    ``with_accumulate``: the micro-batches go through ``engine.accumulate`` instead (the loop a
    user writes: step and zero_grad on every micro-batch, the Engine skips them in between).
    ``frozen``: the first layer frozen and two param groups (`frozen_groups`); the result's
    ``thawed`` names the frozen parameters that setup made trainable. ``checkpoint_dir``: the
    Engine gets it with ``resume="latest"``, ``engine.resume`` runs after setup (its step must be
    ``first_step``) and ``engine.save_checkpoint`` after the last step.
    ``precision_options`` default (None): fp16 starts at `FP16_SCALE`; ``{}``: the
    precision plugin's own defaults. ``engine_args``: more Engine arguments (``compile``, ...).
    ``loop``: one of `LOOPS`, the step as the user writes it (`user_step`).
    """
    register(plugins)
    extra: dict[str, Any] = dict(engine_args or {})  # Engine arguments: compile=, ...
    if precision_options is not None:
        if precision_options:
            extra["precision_options"] = precision_options
    else:
        extra.update(kit_scale(strategy, precision))
    guard = [NaNGuard()] if nan_guard else []
    if checkpoint_dir is not None:
        extra.update(checkpoint_dir=checkpoint_dir, resume="latest")
    with tp.Engine(
        strategy, precision=precision, plugins=guard, **extra, **(options or {})
    ) as engine:
        model = make_model(width=width)
        params = frozen_groups(model, lr) if frozen else model.parameters()
        opt = _optimizer(optimizer, params, lr)
        originals = dict(model.named_parameters())
        if scheduler == "before":
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        model, opt = engine.setup(model, opt)
        if scheduler == "after":
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        if load_from is not None:
            state = {"model": model, "optimizer": opt, "step": 0}
            engine.load(load_from, state)
            assert state["step"] == first_step, (state["step"], first_step)
        if checkpoint_dir is not None:
            resumed = engine.resume({"model": model, "optimizer": opt})
            assert resumed == (first_step or None), f"resumed at {resumed}, not {first_step}"
        losses, norms, skipped, lrs, synced, scales, checksums = [], [], [], [], [], [], []
        batches = _batches(engine.data_parallel_size, global_batch)
        for at, (x, y) in enumerate(engine.setup_dataloader(batches)):
            if at < first_step:
                continue
            if at >= first_step + steps:
                break
            micro = list(zip(x.chunk(accumulate), y.chunk(accumulate), strict=True))
            parts = []
            if with_accumulate:
                for i, (xs, ys) in enumerate(micro):
                    with engine.accumulate(model, steps=len(micro)):
                        part = user_step(engine, model, xs, ys, loop)  # divided inside accumulate
                        if probe_sync and i == 0 and at == first_step:
                            synced.append(_grads_agree(engine, model))
                        opt.step()
                        opt.zero_grad()
                    parts.append(part.detach() / len(micro))
                skipped.append(bool(getattr(opt, "step_was_skipped", False)))
                lrs.append(opt.param_groups[0]["lr"])
                losses.append(engine.reduce(torch.stack(parts).sum(), "mean").item())
                continue
            for i, (xs, ys) in enumerate(micro):
                last = i == len(micro) - 1
                scale = 1.0 / len(micro)
                if _injects(engine) and at in (inf_at_step, nan_at_step):
                    scale *= float("inf") if at == inf_at_step else float("nan")
                with engine.no_sync(model, enabled=not last):
                    part = user_step(engine, model, xs, ys, loop, scale=scale)
                if probe_sync and not last and at == first_step:
                    synced.append(_grads_agree(engine, model))
                parts.append(part)
            if clip is not None:
                norm = engine.clip_grad_norm_(
                    model, clip, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
                )
                norms.append(norm.item())
            opt.step()
            skipped.append(bool(getattr(opt, "step_was_skipped", False)))
            opt.zero_grad()
            if scheduler is not None:
                sched.step()
            lrs.append(opt.param_groups[0]["lr"])
            losses.append(engine.reduce(torch.stack(parts).sum(), "mean").item())
            local = sum(
                (p.detach().double().sum() for p in _local(model)),
                torch.zeros((), dtype=torch.float64),
            )
            checksums.append(engine.reduce(local, "sum").item())
            scaler = next((p.scaler for p in engine.plugins if getattr(p, "scaler", None)), None)
            scales.append(scaler.get_scale() if scaler is not None else None)
        if save_to is not None:
            engine.save(save_to, {"model": model, "optimizer": opt, "step": first_step + steps})
        if checkpoint_dir is not None:
            engine.save_checkpoint({"model": model, "optimizer": opt}, step=first_step + steps)
        return {
            "losses": losses,
            "norms": norms,
            "skipped": skipped,
            "lrs": lrs,
            "synced": synced,
            "scales": scales,
            "checksums": checksums,
            "strategy": engine.strategy,
            "rank": engine.rank,
            "world_size": engine.world_size,
            "is_torch_optimizer": isinstance(opt, torch.optim.Optimizer),
            "thawed": [
                n for n, p in originals.items() if frozen and n.startswith("0.") and p.requires_grad
            ],  # fmt: skip
            **full_state(engine, model, opt),
        }


class Routed(torch.nn.Module):
    """`TwoExperts`' experts, called as one layer (where a pipeline cuts the model)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(width, 1) for _ in range(2)])

    def forward(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        return self.experts[expert](h)


class TwoExperts(torch.nn.Module):
    """A trunk and two experts; each forward uses one, as a mixture-of-experts block skips the
    experts no local token was routed to (Mixtral and Qwen-MoE in transformers 4.x, many in-house
    MoE layers): ranks then use different parameters in one step."""

    #: Where a pipeline cuts it (the kit's ``split_points`` name the MLP's layers).
    split_points = ("moe",)

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(FEATURES, width)
        self.moe = Routed(width)
        #: Its own tensor-parallel plan (the kit's MLP plan names other layers).
        self.tp_plan = {"trunk": "colwise", "moe.experts.*": "rowwise"}

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.moe(torch.tanh(self.trunk(x)), expert)


def _expert_share(x: torch.Tensor, y: torch.Tensor, rank: int, ranks: int) -> tuple[Any, ...]:
    """Rank ``rank``'s rows of a global batch and the expert they use (rank r: expert r % 2)."""
    share = len(x) // ranks
    rows = slice(rank * share, (rank + 1) * share)
    return x[rows], y[rows], rank % 2


def reference_amp(precision: str) -> tuple[torch.dtype | None, torch.amp.GradScaler | None]:
    """What a plain-PyTorch reference runs ``precision`` with: autocast's dtype, and for fp16 a
    GradScaler starting at the scale the kit's Engines use."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE) if precision == "fp16" else None
    return dtype, scaler


def reference_step(
    loss: torch.Tensor, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
) -> None:
    """Backward and update as plain PyTorch writes them (through ``scaler`` for fp16)."""
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()


def experts_reference(
    steps: int = 6, ranks: int = 2, lr: float = 3e-2, precision: str = "32"
) -> dict[str, Any]:
    """`train_experts` in plain PyTorch on one process: each share of the global batch through
    its rank's expert, the loss the mean of the shares' means (what averaging gradients over the
    ranks computes, an expert a rank did not use counting as a zero gradient there), in
    ``precision`` as `reference` runs it."""
    torch.manual_seed(0)
    model = TwoExperts()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    dtype, scaler = reference_amp(precision)
    losses = []
    for step, (x, y) in enumerate(_batches(1)):
        if step >= steps:
            break
        parts = []
        for rank in range(ranks):
            xs, ys, expert = _expert_share(x, y, rank, ranks)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                out = model(xs, expert)
            parts.append(torch.nn.functional.mse_loss(out.float(), ys))
        loss = torch.stack(parts).mean()
        reference_step(loss, opt, scaler)
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params}


def train_experts(
    strategy: str,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    precision: str | None = None,
    steps: int = 6,
    loop: str = "backward",
) -> dict[str, Any]:
    """Data parallel over `TwoExperts` where data-parallel rank r routes its whole share to
    expert r % 2: a parameter one rank used and another did not must still be averaged over
    every rank (as a zero where unused), or the step refused naming them."""
    register(plugins)
    options = {k: v for k, v in (options or {}).items() if k != "tp_plan"}  # the model's own
    if "split_points" in options:
        options["split_points"] = list(TwoExperts.split_points)
    with tp.Engine(
        strategy, precision=precision, **kit_scale(strategy, precision), **options
    ) as engine:
        torch.manual_seed(0)
        model = TwoExperts()
        model, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-2))
        losses = []
        for step, (x, y) in enumerate(_batches(1)):
            if step >= steps:
                break
            xs, ys, expert = _expert_share(
                x, y, engine.data_parallel_rank, engine.data_parallel_size
            )
            xs, ys = engine.place_batch((xs, ys))  # the backend's device (and sharding)
            loss = user_step(engine, model, (xs, expert), ys, loop)
            opt.step()
            opt.zero_grad()
            losses.append(engine.reduce(loss, "mean").item())
        dp = engine.data_parallel_size
        return {"losses": losses, "data_parallel_size": dp, **full_state(engine, model, opt)}


#: Where torch keeps the hooks a backend may put on a user's module or parameter.
MODULE_HOOKS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)  # fmt: skip
TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def hooks_on(model: torch.nn.Module) -> set[str]:
    """Every hook on ``model``'s modules and parameters, by where it sits."""
    found = set()
    for name, module in model.named_modules():
        for attr in MODULE_HOOKS:
            for key in getattr(module, attr, None) or {}:
                found.add(f"{name or '<model>'}.{attr}[{key}]")
    for name, param in model.named_parameters():
        for attr in TENSOR_HOOKS:
            for key in getattr(param, attr, None) or {}:
                found.add(f"{name}.{attr}[{key}]")
    return found


def train_again(
    strategy: str,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    precision: str | None = None,
    steps: int = 5,
    loop: str = "backward",
) -> dict[str, Any]:
    """`train`'s first ``steps`` steps under one Engine, ``close()``, then the next ``steps``
    under a second Engine given the *same* model and optimizer objects (a notebook, a test
    suite, a sweep in one process): together they must equal one Engine's run, and each
    ``close()`` must take away every hook the backend put on the user's model (one left behind
    runs again under the next Engine: a gradient averaged twice is halved)."""
    register(plugins)
    model = make_model()
    opt = _optimizer("AdamW", model.parameters(), 3e-2)
    before = hooks_on(model)
    losses: list[float] = []
    left: list[list[str]] = []
    for first in (0, steps):
        with tp.Engine(
            strategy, precision=precision, **kit_scale(strategy, precision), **(options or {})
        ) as engine:
            wrapped, wrapped_opt = engine.setup(model, opt)
            batches = engine.setup_dataloader(_batches(engine.data_parallel_size))
            for step, (x, y) in enumerate(batches):
                if step < first:
                    continue
                if step >= first + steps:
                    break
                loss = user_step(engine, wrapped, x, y, loop)
                wrapped_opt.step()
                wrapped_opt.zero_grad()
                losses.append(engine.reduce(loss, "mean").item())
            if first:
                state = full_state(engine, wrapped, wrapped_opt)
        left.append(sorted(hooks_on(model) - before))
    return {"losses": losses, "left": left, **state}


def barrier_waits(
    strategy: str,
    marker: str,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
) -> bool:
    """The last rank arrives late at ``engine.barrier()``, writing ``marker`` just before it;
    every rank must see the marker once its barrier returns (a barrier that does not wait lets
    rank 0 through first). A slow machine only makes the others wait longer."""
    import time
    from pathlib import Path

    register(plugins)
    with tp.Engine(strategy, **(options or {})) as engine:
        engine.barrier()  # all started
        if engine.rank == engine.world_size - 1:
            time.sleep(1.0)
            Path(marker).write_text("arrived")
        engine.barrier()
        return Path(marker).exists()


#: The learning rate `hyperparameters_saved` sets by hand before saving.
SET_LR = 0.0123


def hyperparameters_saved(
    strategy: str,
    path: str,
    load: bool,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    precision: str | None = None,
    loop: str = "backward",
) -> dict[str, Any]:
    """Save (``load=False``): two SGD steps under a StepLR scheduler, then the learning rate set
    by hand to `SET_LR`, saved with the scheduler. Load: fresh objects loaded from it.
    Either way: the optimizer's lr and momentum, and the scheduler's state."""
    register(plugins)
    with tp.Engine(strategy, precision=precision, **(options or {})) as engine:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        model, optimizer = engine.setup(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        if load:
            engine.load(path, state)
        else:
            for x, y in list(engine.setup_dataloader(_batches(engine.data_parallel_size)))[:2]:
                user_step(engine, model, x, y, loop)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
            for group in optimizer.param_groups:
                group["lr"] = SET_LR
            engine.save(path, state)
        group = optimizer.param_groups[0]
        sched = scheduler.state_dict()
        return {
            "lr": group["lr"],
            "momentum": group.get("momentum"),
            "scheduler": {k: sched[k] for k in ("last_epoch", "_step_count", "base_lrs")},
        }


def _elements(tensor: Any) -> int:
    """Elements this rank holds of ``tensor``: its shard of a DTensor, its partition of a
    DeepSpeed ZeRO-3 parameter."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.to_local().numel()
    partition = getattr(tensor, "ds_tensor", None)
    if partition is not None:
        return partition.numel()
    return tensor.numel() if isinstance(tensor, torch.Tensor) else 0


def held_elements(
    strategy: str,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    precision: str | None = None,
    loop: str = "backward",
) -> dict[str, int]:
    """Elements of parameters and of optimizer state (AdamW, after one step) this rank holds,
    beside the model's full parameter count: what ``shards_parameters`` / ``shards_optimizer``
    declare is measured against them."""
    register(plugins)
    with tp.Engine(strategy, precision=precision, **(options or {})) as engine:
        model = make_model(width=64)
        full = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = engine.setup(model, optimizer)
        x, y = next(iter(_batches(engine.data_parallel_size)))
        user_step(engine, model, x, y, loop)
        optimizer.step()
        optimizer.zero_grad()
        params = sum(_elements(p) for p in model.parameters())
        state = sum(
            _elements(v)
            for values in optimizer.state.values()
            for k, v in values.items()
            if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0
        )
        return {"params": params, "optimizer": state, "full": full}


def _local(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's own parameter data (its shard under a sharding strategy, once per replica)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    if params and isinstance(params[0], DTensor):
        return [p.to_local() for p in params]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return params if rank == 0 else []


def _grads_agree(engine: tp.Engine, model: torch.nn.Module) -> bool | None:
    """Whether this rank's local gradients equal every rank's (i.e. they were synchronized);
    ``None`` where the backend keeps gradients out of ``param.grad`` (DeepSpeed's partitioned
    buffers), so nothing can be told."""
    from torch.distributed.tensor import DTensor

    local = []
    for p in model.parameters():
        grad = p.grad
        if grad is None:
            continue
        local.append((grad.to_local() if isinstance(grad, DTensor) else grad).detach().float())
    flat = torch.cat([g.flatten() for g in local]) if local else torch.zeros(1)
    everyone = engine.gather(flat.cpu())  # every rank calls it: the collectives stay paired
    if not local:
        return None
    return bool(all(torch.equal(everyone[0], row) for row in everyone))


def load(
    strategy: str,
    path: str,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    precision: str | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into a freshly initialised (differently seeded) model and optimizer."""
    register(plugins)
    with tp.Engine(strategy, precision=precision, **(options or {})) as engine:
        model = make_model(seed=123)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
        model, optimizer = engine.setup(model, optimizer)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        try:
            engine.load(path, state)
            portable = True
        except tp.CheckpointError as exc:
            if "only the strategy that wrote it can restore" not in str(exc):
                raise
            engine.load(path, state, strict=False)  # e.g. DeepSpeed's optimizer state
            portable = False
        snapshot = full_state(engine, model, optimizer)
        if not portable:
            snapshot["optimizer"] = {}
        return {"step": state["step"], "optimizer_portable": portable, **snapshot}


#: The dtypes the ``collectives`` property reduces and gathers in: every one a user's metrics
#: and counters come in (torch.distributed's gloo and nccl take them all).
COLLECTIVE_DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "int32", "int8", "uint8")


def collective_values(rank: int, dtype: str) -> list[float]:
    """Rank ``rank``'s values for the ``collectives`` property in ``dtype``: whole numbers small
    enough for int8 on 8 ranks, a negative one for signed types, each exact in every dtype."""
    values = [rank + 1.0, 2.0 * rank + 1.0, 3.0]
    if dtype != "uint8":
        values.append(-(rank + 1.0))
    return values


def collectives(
    strategy: str, plugins: Sequence[str] = (), options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """reduce (every op) and gather of rank-dependent values, in every dtype of
    `COLLECTIVE_DTYPES` alone and mixed in one nested call; each answer as ``(values, dtype)``."""
    register(plugins)

    def seen(tensor: torch.Tensor) -> tuple[Any, str]:
        return tensor.cpu().double().tolist(), str(tensor.dtype).removeprefix("torch.")

    with tp.Engine(strategy, **(options or {})) as engine:
        out: dict[str, Any] = {}
        mixed = {}
        for dtype in COLLECTIVE_DTYPES:
            value = torch.tensor(collective_values(engine.rank, dtype), dtype=getattr(torch, dtype))
            mixed[dtype] = value
            for op in REDUCE_OPS:
                out[f"{dtype} {op}"] = seen(engine.reduce(value, op))
            out[f"{dtype} gather"] = seen(engine.gather(value))
        for op in REDUCE_OPS:  # one call, every dtype nested in it
            for dtype, tensor in engine.reduce(mixed, op).items():
                out[f"mixed {dtype} {op}"] = seen(tensor)
        for dtype, tensor in engine.gather(mixed).items():
            out[f"mixed {dtype} gather"] = seen(tensor)
        out["rank"], out["world_size"] = engine.rank, engine.world_size
        engine.barrier()
        return out


ORDER_SAMPLES = 64
ORDER_BATCH = 8  # global


def reference_order(epochs: int = 2, seed: int = 0) -> list[list[int]]:
    """The global batches of a shuffled loader, per step, from (seed, epoch) alone: what every
    world size must see (torch's DistributedSampler permutation, taken whole)."""
    steps = []
    for epoch in range(epochs):
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        perm = torch.randperm(ORDER_SAMPLES, generator=g).tolist()
        for s in range(ORDER_SAMPLES // ORDER_BATCH):
            steps.append(sorted(perm[s * ORDER_BATCH : (s + 1) * ORDER_BATCH]))
    return steps


def data_order(
    strategy: str,
    plugins: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    precision: str | None = None,
    epochs: int = 2,
    save_to: str | None = None,
    save_at: int | None = None,
    load_from: str | None = None,
) -> list[list[int]]:
    """The global batches (sample indices, per step) a shuffled loader yields over ``epochs``,
    after a ``next(iter(loader))`` probe. ``save_to``/``save_at``: save the loader's position
    after that many steps and stop; ``load_from``: resume from such a checkpoint."""
    register(plugins)
    with tp.Engine(strategy, precision=precision, **(options or {})) as engine:
        dataset = TensorDataset(torch.arange(ORDER_SAMPLES))
        loader = engine.setup_dataloader(
            DataLoader(dataset, batch_size=ORDER_BATCH // engine.data_parallel_size, shuffle=True)
        )
        next(iter(loader))  # a probe: it must not shift any later epoch
        model = make_model()
        model, opt = engine.setup(model, torch.optim.AdamW(model.parameters()))
        state = {"model": model, "optimizer": opt, "loader": loader}
        if load_from is not None:
            engine.load(load_from, state)
        first_epoch = loader.epoch
        steps: list[list[int]] = []
        done = 0
        # One row per data-parallel replica (the ranks of a model-parallel group share batches).
        replicas = engine.gather(torch.tensor([engine.data_parallel_rank], device=engine.device))
        rows = sorted(
            {int(r): i for i, r in reversed(list(enumerate(replicas.flatten())))}.values()
        )
        for _ in range(first_epoch, epochs):
            for (batch,) in loader:
                everyone = engine.gather(batch.to(engine.device))[rows].flatten().tolist()
                steps.append(sorted(int(i) for i in everyone))
                done += 1
                if save_to is not None and done == save_at:
                    engine.save(save_to, state)
                    return steps
        return steps
