"""``torchplug.Trainer``: a small ready loop on the Engine, for those who do not want to write one.

The Engine stays the primary API; the Trainer is ordinary Engine calls (about 300 lines of code), so
what it does can be read and copied into a hand-written loop. It adds: gradient accumulation
and clipping, an LR scheduler stepped once per optimizer step, evaluation with metrics over the
whole eval set (padding dropped, reduced over every rank), metrics to the Engine's loggers, a
progress bar on rank 0, numbered checkpoints with automatic resume, and callbacks as pluggy
hook implementations ([`torchplug.trainer.hooks`][torchplug.trainer.hooks]).

Why this module is over 500 lines: the Trainer is one class on purpose, read top to bottom as
the loop it runs (fit, the epoch, evaluation, checkpoints, throughput), and about half of it is
the argument and attribute documentation the API reference renders.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pluggy
import torch

from torchplug.contract.errors import ConfigurationError
from torchplug.contract.spec import PROJECT
from torchplug.engine.engine import Engine
from torchplug.features.throughput import ThroughputMonitor
from torchplug.trainer import hooks
from torchplug.trainer.progress import Progress, wanted

Metric = Callable[[torch.Tensor, torch.Tensor], Any]
#: Optimizer steps the Trainer's own ThroughputMonitor rates over (a moving window).
THROUGHPUT_WINDOW = 100


def _positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"Trainer: {name}={value!r} must be a whole number of 1 or more"
            + (" (or None)" if allow_none else "")
            + f". Fix: e.g. {name}=1."
        )


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of rows whose highest output is the target class (a ready ``metrics`` entry).

    Args:
        outputs: Scores of shape ``(rows, classes)``.
        targets: The class index of each row.
    """
    return (outputs.argmax(-1) == targets).float().mean().item()


class Trainer:
    """Train ``model`` with ``optimizer`` on ``train_data`` (a DataLoader of ``(inputs,
    targets)`` batches), on any strategy; ``fit()`` runs it.

    ``loss_fn(model(inputs), targets)`` is the loss; for other batch layouts subclass and
    override [`training_step`][torchplug.Trainer.training_step] (and
    [`eval_outputs`][torchplug.Trainer.eval_outputs]). Running the same command again after a crash
    carries on from the last checkpoint (with ``checkpoint_dir``). ``with Trainer(...) as trainer:``
    closes its Engine at the end.

    Args:
        model: The plain model (the Trainer sets it up with its Engine).
        optimizer: An optimizer made on ``model``'s parameters.
        loss_fn: ``loss_fn(outputs, targets)``, the loss of a batch; ``None`` only when a
            subclass overrides [`training_step`][torchplug.Trainer.training_step] and
            [`eval_outputs`][torchplug.Trainer.eval_outputs].
        train_data: The training batches: a DataLoader of ``(inputs, targets)`` (each rank gets
            its share). Required.
        eval_data: Evaluation batches, run after each epoch (metrics over all ranks).
        strategy: As [`Engine`][torchplug.Engine]'s ``strategy``.
        precision: As [`Engine`][torchplug.Engine]'s ``precision``.
        max_epochs: Passes over ``train_data``.
        max_steps: Stop after this many optimizer steps (``None``: after ``max_epochs``).
        grad_accum: Micro-batches per optimizer step
            ([`Engine.accumulate`][torchplug.Engine.accumulate]).
        clip_grad_norm: Clip gradients to this total norm before each optimizer step.
        scheduler: An LR scheduler made on ``optimizer`` (or a function ``optimizer ->
            scheduler``), stepped once per optimizer step that was not skipped.
        checkpoint_dir: Where numbered checkpoints go: one every ``checkpoint_every`` steps and
            one at the end.
        checkpoint_every: Steps between checkpoints (needs ``checkpoint_dir``).
        resume: ``"latest"``: continue from the newest complete checkpoint in
            ``checkpoint_dir``; ``None``: start afresh.
        keep_last: Keep only this many checkpoints (``None``: all).
        loggers: As [`Engine`][torchplug.Engine]'s ``loggers``: ``train/loss``, ``train/lr``,
            ``train/samples_per_s`` every ``log_every`` steps, and ``epoch/*`` (``train_loss``,
            ``eval_*``) after each epoch.
        log_dir: As [`Engine`][torchplug.Engine]'s ``log_dir``.
        log_every: Steps between logged training metrics (the loss is averaged over them).
        metrics: Names to functions ``fn(outputs, targets)`` run on the whole gathered eval set
            ([`accuracy`][torchplug.accuracy] is one).
        callbacks: Objects with ``@torchplug.plugin.hookimpl`` functions named as in
            [`torchplug.trainer.hooks`][torchplug.trainer.hooks].
        progress: Show a progress bar on rank 0 (tqdm, else rich); ``None``: when stderr is a
            terminal.
        hparams: Logged once with every logger when ``fit()`` starts
            ([`Engine.log_hyperparams`][torchplug.Engine.log_hyperparams]).
        throughput: Measure samples/s (tokens/s where
            [`batch_tokens`][torchplug.Trainer.batch_tokens] can tell; FLOP/s and MFU with
            ``flops_per_batch``) with a [`ThroughputMonitor`][torchplug.ThroughputMonitor]:
            shown in the progress bar and the epoch line, logged under ``throughput/...``.
            ``True`` (default): a monitor of its own; a monitor you made on the same Engine
            (e.g. with ``peak_flops``); or ``False``.
        flops_per_batch: The FLOPs of one batch's forward and backward on a rank (e.g. from
            [`measure_flops`][torchplug.measure_flops]), for FLOP/s and MFU.
        engine: An Engine you made, used instead of one made from the arguments above.
        **engine_options: Further keyword arguments of the [`Engine`][torchplug.Engine] it makes.

    Raises:
        ConfigurationError: An argument is invalid or missing (the message says the fix).

    Attributes:
        engine: The Engine it trains with.
        model: The model as [`Engine.setup`][torchplug.Engine.setup] returned it.
        optimizer: The optimizer as [`Engine.setup`][torchplug.Engine.setup] returned it.
        scheduler: The LR scheduler, or ``None``.
        train_loader: The training loader as
            [`Engine.setup_dataloader`][torchplug.Engine.setup_dataloader] returned it.
        eval_loader: The evaluation loader, or ``None``.
        step: Optimizer steps done so far (the checkpoint's step after a resume).
        epoch: The current epoch, from 0.
        loss_fn: The ``loss_fn`` argument.
        max_epochs: The ``max_epochs`` argument.
        max_steps: The ``max_steps`` argument.
        grad_accum: The ``grad_accum`` argument.
        clip_grad_norm: The ``clip_grad_norm`` argument.
        checkpoint_every: The ``checkpoint_every`` argument.
        log_every: The ``log_every`` argument.
        metrics: The ``metrics`` argument, as a dict.
        hparams: The ``hparams`` argument, as a dict.
        callbacks: The pluggy plugin manager holding the callbacks.
        hook: The callbacks' hooks, called by name:
            ``trainer.hook.on_train_start(trainer=trainer)``.
        progress: The progress bar (a no-op when off).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        train_data: Iterable[Any] | None = None,
        eval_data: Iterable[Any] | None = None,
        *,
        strategy: str = "auto",
        precision: str | int | None = None,
        max_epochs: int = 1,
        max_steps: int | None = None,
        grad_accum: int = 1,
        clip_grad_norm: float | None = None,
        scheduler: Any = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        resume: str | None = "latest",
        keep_last: int | None = None,
        loggers: Iterable[str | object] | str | None = None,
        log_dir: str | Path | None = None,
        log_every: int = 10,
        metrics: Mapping[str, Metric] | None = None,
        callbacks: Iterable[object] = (),
        progress: bool | None = None,
        hparams: Mapping[str, Any] | None = None,
        throughput: bool | ThroughputMonitor = True,
        flops_per_batch: float | None = None,
        engine: Engine | None = None,
        **engine_options: Any,
    ) -> None:
        if train_data is None:
            raise ConfigurationError(
                "Trainer needs train_data: a DataLoader of (inputs, targets) batches, e.g. "
                "Trainer(model, optimizer, loss_fn, DataLoader(dataset, batch_size=32))."
            )
        _positive("max_epochs", max_epochs)
        _positive("max_steps", max_steps, allow_none=True)
        _positive("grad_accum", grad_accum)
        _positive("checkpoint_every", checkpoint_every, allow_none=True)
        _positive("log_every", log_every)
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ConfigurationError(
                "Trainer: checkpoint_every needs checkpoint_dir, the directory to write to. "
                "Fix: Trainer(..., checkpoint_dir='checkpoints', checkpoint_every=100)."
            )
        if engine is None:
            engine = Engine(
                strategy,
                precision,
                checkpoint_dir=checkpoint_dir,
                resume=resume if checkpoint_dir is not None else None,
                keep_last=keep_last,
                loggers=loggers,
                log_dir=log_dir,
                **engine_options,
            )
        self.engine = engine
        self.loss_fn = loss_fn
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.grad_accum = grad_accum
        self.clip_grad_norm = clip_grad_norm
        self.checkpoint_every = checkpoint_every
        self.log_every = log_every
        self.metrics = dict(metrics or {})
        self.model, self.optimizer = engine.setup(model, optimizer)
        self.scheduler = scheduler(self.optimizer) if callable(scheduler) else scheduler
        self.train_loader = engine.setup_dataloader(train_data)
        self.eval_loader = engine.setup_dataloader(eval_data) if eval_data is not None else None
        self.step = 0
        self.epoch = 0
        self.progress = Progress(wanted(progress, engine.is_main))
        self.callbacks = pluggy.PluginManager(PROJECT)
        self.callbacks.add_hookspecs(hooks)
        for callback in callbacks:
            self.callbacks.register(callback)
        self.hook = self.callbacks.hook
        self.hparams = dict(hparams or {})
        self.throughput = self._monitor(throughput, flops_per_batch)
        self.flops_per_batch = flops_per_batch
        # this run's totals on this rank (batches, samples, tokens) and training seconds, with
        # evaluation and checkpoints left out
        self._seen = {"batches": 0, "samples": 0, "tokens": 0}
        self._started: float | None = None
        self._paused = 0.0
        self._warn_accelerate_schedule()

    def _monitor(
        self, throughput: bool | ThroughputMonitor, flops_per_batch: float | None
    ) -> ThroughputMonitor | None:
        if flops_per_batch is not None and (
            isinstance(flops_per_batch, bool)
            or not isinstance(flops_per_batch, (int, float))
            or not flops_per_batch > 0
        ):
            raise ConfigurationError(
                f"Trainer(flops_per_batch={flops_per_batch!r}): expected the FLOPs of one "
                f"batch's forward and backward on a rank, a positive number (e.g. "
                f"tp.measure_flops(model, lambda: loss_fn(model(x), y)))."
            )
        if isinstance(throughput, ThroughputMonitor):
            if throughput.engine is not self.engine:
                raise ConfigurationError(
                    "Trainer(throughput=monitor): the monitor was made on another Engine. Make "
                    "the Engine first and pass it to both: engine = tp.Engine(...); "
                    "tp.Trainer(..., engine=engine, throughput=tp.ThroughputMonitor(engine, "
                    "peak_flops=...))."
                )
            return throughput
        if throughput is True:
            return ThroughputMonitor(self.engine, window=THROUGHPUT_WINDOW)
        if throughput is False or throughput is None:
            return None
        raise ConfigurationError(
            f"Trainer(throughput={throughput!r}): expected True (the default), False, or a "
            f"tp.ThroughputMonitor made on the Trainer's Engine."
        )

    # -- overridable steps ------------------------------------------------------------------------

    def _split(self, batch: Any) -> tuple[Any, Any]:
        if isinstance(batch, (list, tuple)) and len(batch) == 2 and self.loss_fn is not None:
            return batch[0], batch[1]
        raise ConfigurationError(
            f"Trainer's default step expects (inputs, targets) batches and a loss_fn; got a "
            f"{type(batch).__name__} batch and loss_fn={self.loss_fn!r}. Pass loss_fn=..., or "
            f"subclass Trainer and override training_step(batch) and eval_outputs(batch)."
        )

    def training_step(self, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch (override for other batch layouts).

        Args:
            batch: One micro-batch from ``train_data``, on the device.
        """
        inputs, targets = self._split(batch)
        assert self.loss_fn is not None
        return self.loss_fn(self.model(inputs), targets)

    def _forward_backward(self, batch: Any) -> torch.Tensor:
        """The default step through ``engine.forward_backward`` (what a pipeline needs: its
        schedule runs forward and backward together); an overridden `training_step` returns a
        loss, run backward here."""
        engine = self.engine
        if type(self).training_step is Trainer.training_step:
            inputs, targets = self._split(batch)
            model = self.model
            return engine.forward_backward(model, inputs, target=targets, loss_fn=self.loss_fn)
        with engine.autocast():  # the forward and loss; backward runs outside
            loss = self.training_step(batch)
        engine.backward(loss)
        return loss

    def batch_tokens(self, batch: Any) -> int | None:
        """Tokens in one batch, for tokens/s; ``None`` when it cannot tell. Counts a mapping's
        ``attention_mask`` (else ``input_ids``), or integer inputs of 2 or more dimensions
        (token ids, batch x sequence); override for other layouts.

        Args:
            batch: One training batch, as the loader gives it.
        """
        if isinstance(batch, Mapping):
            mask, ids = batch.get("attention_mask"), batch.get("input_ids")
            if isinstance(mask, torch.Tensor):
                return int(mask.sum().item())
            return int(ids.numel()) if isinstance(ids, torch.Tensor) else None
        inputs = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
        if (
            isinstance(inputs, torch.Tensor)
            and inputs.dim() >= 2
            and not inputs.is_floating_point()
            and not inputs.is_complex()
            and inputs.dtype != torch.bool
        ):
            return int(inputs.numel())
        return None

    def eval_outputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(outputs, targets)`` of one eval batch (override for other batch layouts).

        Args:
            batch: One batch from ``eval_data``, on the device.
        """
        inputs, targets = self._split(batch)
        return self.model(inputs), targets

    # -- the loop ---------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "model": self.model,
            "optimizer": self.optimizer,
            "loader": self.train_loader,
            "step": self.step,
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler
        return state

    def fit(self) -> dict[str, Any]:
        """Train until ``max_epochs`` (or ``max_steps``); return the final metrics:
        ``step``, ``epoch``, ``train_loss`` (the last epoch's mean over steps and ranks) and
        the last evaluation's ``eval_*`` values."""
        engine = self.engine
        state = self._state()
        resumed = engine.resume(state) if engine.checkpoints.directory is not None else None
        self.step = int(state["step"])
        if resumed is not None:
            engine.print(f"resumed from step {resumed}")
        if self.hparams:
            with self._logging():
                engine.log_hyperparams(self.hparams)
        self.hook.on_train_start(trainer=self)
        self._start_clock()
        result: dict[str, Any] = {}
        stop = self._done()
        last_saved = self.step if resumed is not None else None
        while not stop and self.train_loader.epoch < self.max_epochs:
            self.epoch = self.train_loader.epoch
            self.hook.on_epoch_start(trainer=self, epoch=self.epoch)
            seen, began = dict(self._seen), self._elapsed()
            losses, stop, last_saved = self._train_epoch(state, last_saved)
            epoch_metrics: dict[str, float] = {}
            if losses:
                mean = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
                epoch_metrics["train_loss"] = engine.reduce(mean, "mean").item()
            if self.throughput is not None:
                epoch_metrics.update(self._epoch_rates(seen, self._elapsed() - began))
            if self.eval_loader is not None:
                epoch_metrics.update(self.evaluate())
            if epoch_metrics:
                with self._logging():
                    engine.log({f"epoch/{k}": v for k, v in epoch_metrics.items()}, step=self.step)
                engine.print(
                    f"epoch {self.epoch + 1}  step {self.step}  "
                    + "  ".join(
                        f"{k} {v:,.1f}" if k.endswith("_per_s") else f"{k} {v:.4f}"
                        for k, v in epoch_metrics.items()
                    )
                )
            self.hook.on_epoch_end(trainer=self, epoch=self.epoch, metrics=epoch_metrics)
            result.update(epoch_metrics)
        if engine.checkpoints.directory is not None and last_saved != self.step:
            self._checkpoint(state)
        result.update({"step": self.step, "epoch": self.train_loader.epoch})
        if self.throughput is not None:  # this run's samples over every rank
            total = torch.tensor(float(self._seen["samples"]), dtype=torch.float64)
            result["samples"] = int(engine.reduce(total, "sum").item())
        self.hook.on_train_end(trainer=self, metrics=result)
        return result

    def _done(self) -> bool:
        return self.max_steps is not None and self.step >= self.max_steps

    def _train_epoch(
        self, state: dict[str, Any], last_saved: int | None
    ) -> tuple[list[float], bool, int | None]:
        engine, model, optimizer = self.engine, self.model, self.optimizer
        self._optimizer_mode("train")
        total = (  # the last batch of the epoch completes a short group (engine.accumulate)
            -(-len(self.train_loader) // self.grad_accum)
            if hasattr(self.train_loader, "__len__")
            else None
        )
        # a resumed epoch: the loader skips the batches the checkpoint's run consumed
        initial = getattr(self.train_loader, "resumes_at", 0) // self.grad_accum
        if total is not None and self.max_steps is not None:  # max_steps ends it earlier
            total = min(total, initial + max(self.max_steps - self.step, 0))
        self.progress.start(self.epoch, total, initial)
        model.train()
        losses: list[float] = []
        micro: list[torch.Tensor] = []
        window: list[float] = []
        stop = False
        try:
            for batch in self.train_loader:
                sync = (len(micro) + 1) % self.grad_accum == 0 or bool(
                    getattr(self.train_loader, "end_of_pass", False)
                )
                with engine.accumulate(model, self.grad_accum):
                    loss = self._forward_backward(batch)
                    if sync and self.clip_grad_norm is not None:
                        self._clip()
                    optimizer.step()
                    optimizer.zero_grad()
                micro.append(loss.detach().float())
                self._count(batch)
                if not sync:
                    continue
                self.step += 1
                state["step"] = self.step
                if self.scheduler is not None and not optimizer.step_was_skipped:
                    self.scheduler.step()
                step_loss = torch.stack(micro).mean().item()
                self._record_step(len(micro))
                micro = []
                losses.append(step_loss)
                window.append(step_loss)
                self.progress.update(step_loss, self._bar_rates())
                if self.step % self.log_every == 0:
                    mean = torch.tensor(sum(window) / len(window), dtype=torch.float64)
                    metrics = {
                        "train/loss": engine.reduce(mean, "mean").item(),
                        "train/lr": float(optimizer.param_groups[0]["lr"]),
                    }
                    rates = self.throughput.compute() if self.throughput is not None else {}
                    if rates:  # a collective: every rank logs at the same steps
                        metrics["train/samples_per_s"] = rates["global/samples_per_s"]
                        metrics.update({f"throughput/{k}": v for k, v in rates.items()})
                    with self._logging():
                        engine.log(metrics, step=self.step)
                    window = []
                if self.checkpoint_every and self.step % self.checkpoint_every == 0:
                    self._checkpoint(state)
                    last_saved = self.step
                stop = self._done() or self._stop_requested(step_loss)
                if stop:
                    break
        finally:
            self.progress.end()
        return losses, stop, last_saved

    def _clip(self) -> None:
        try:
            self.engine.clip_grad_norm_(
                self.model, float(self.clip_grad_norm or 0), optimizer=self.optimizer
            )
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"Trainer(clip_grad_norm={self.clip_grad_norm}) cannot clip on strategy "
                f"'{self.engine.strategy}': {exc} With the Trainer: pass clip_grad_norm=None and "
                f"configure clipping in the strategy instead."
            ) from None

    def _stop_requested(self, loss: float) -> bool:
        answers = self.hook.on_step_end(trainer=self, step=self.step, loss=loss)
        if not self.hook.on_step_end.get_hookimpls():
            return False
        # Every rank must stop at the same step, whichever rank's callback asked.
        flag = torch.tensor(1.0 if any(a is True for a in answers) else 0.0)
        return bool(self.engine.reduce(flag, "max").item() > 0)

    def _checkpoint(self, state: dict[str, Any]) -> None:
        with self._pause():
            path = self.engine.save_checkpoint(state)
        self.hook.on_checkpoint(trainer=self, path=path)

    # -- throughput -------------------------------------------------------------------------------

    def _start_clock(self) -> None:
        """The training clock starts with the first fit() (a monitor's first point at 0)."""
        if self._started is None:
            self._started = time.perf_counter()
            if self.throughput is not None and not self.throughput.totals:
                self.throughput.update(time=0.0, batches=0, samples=0)

    def _elapsed(self) -> float:
        """Training seconds since the first fit(), evaluation and checkpoints left out."""
        if self._started is None:
            return 0.0
        return time.perf_counter() - self._started - self._paused

    @contextlib.contextmanager
    def _pause(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - began

    @contextlib.contextmanager
    def _logging(self) -> Iterator[None]:
        """Logging is not training time: rank 0 writes (a logger's first call may start a
        service run, as wandb's does, for seconds) while the other ranks wait for it here,
        together, instead of in the next step's collective, where their clocks would count it."""
        with self._pause():
            yield
            if self.throughput is not None and self.engine.world_size > 1:
                self.engine.barrier()

    def _count(self, batch: Any) -> None:
        self._seen["batches"] += 1
        self._seen["samples"] += _batch_size(batch)
        if self.throughput is not None:
            self._seen["tokens"] += self.batch_tokens(batch) or 0

    def _record_step(self, batches: int) -> None:
        """One optimizer step done: this rank's totals to the monitor."""
        if self.throughput is None:
            return
        last = self.throughput.totals.get("time", 0.0)
        self.throughput.update(
            time=max(self._elapsed(), last + 1e-9),  # strictly growing, as the monitor needs
            batches=self._seen["batches"],
            samples=self._seen["samples"],
            tokens=self._seen["tokens"] or None,
            flops=self.flops_per_batch * batches if self.flops_per_batch else None,
        )

    def _bar_rates(self) -> dict[str, float]:
        """This rank's rates times the ranks (no collective: the bar is rank 0's alone)."""
        if self.throughput is None:
            return {}
        local = self.throughput.compute(all_ranks=False)
        world = self.engine.world_size
        shown = {k: local[k] * world for k in ("samples_per_s", "tokens_per_s") if k in local}
        if "mfu" in local:
            shown["mfu"] = local["mfu"]
        return shown

    def _epoch_rates(self, seen: Mapping[str, int], seconds: float) -> dict[str, float]:
        """Samples/s (and tokens/s) of the epoch over every rank: what they processed since
        ``seen``, over the slowest rank's training seconds."""
        counts = torch.tensor(
            [
                float(self._seen["samples"] - seen["samples"]),
                float(self._seen["tokens"] - seen["tokens"]),
            ],
            dtype=torch.float64,
        )
        counts = self.engine.reduce(counts, "sum")
        slowest = self.engine.reduce(torch.tensor(seconds, dtype=torch.float64), "max").item()
        if not slowest > 0 or not counts[0].item():
            return {}
        rates = {"samples_per_s": counts[0].item() / slowest}
        if counts[1].item():
            rates["tokens_per_s"] = counts[1].item() / slowest
        return rates

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss (and ``metrics``) over the whole eval set, the same on every rank."""
        if self.eval_loader is None:
            raise ConfigurationError("Trainer.evaluate() needs eval_data=... in the Trainer.")
        with self._pause():  # not training time: left out of the throughput
            return self._evaluate()

    def _optimizer_mode(self, mode: str) -> None:
        """A schedule-free optimizer (``schedulefree.AdamWScheduleFree``) keeps different weights
        for training and for evaluation, switched by its ``train()``/``eval()``: called as
        Accelerate's optimizer wrapper and Hugging Face's Trainer call them (eval for each
        evaluation, train when training goes on). Other optimizers have neither method."""
        switch = getattr(self.optimizer, mode, None)
        if callable(switch):
            switch()

    def _evaluate(self) -> dict[str, float]:
        engine = self.engine
        self._optimizer_mode("eval")
        self.model.eval()
        outputs: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        try:
            for batch in self.eval_loader:
                with engine.autocast():
                    out, target = self.eval_outputs(batch)
                out, target = engine.gather_for_metrics((out.float(), target))
                outputs.append(out)
                targets.append(target)
        finally:
            self.model.train()
        everything, truth = torch.cat(outputs), torch.cat(targets)
        metrics: dict[str, float] = {}
        if self.loss_fn is not None:
            metrics["eval_loss"] = float(self.loss_fn(everything, truth))
        for name, fn in self.metrics.items():
            metrics[f"eval_{name}"] = float(fn(everything, truth))
        self.hook.on_eval_end(trainer=self, metrics=metrics)
        return metrics

    def close(self) -> None:
        """Close the Engine (process group, loggers)."""
        self.engine.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.engine.__exit__(kind, *exc)

    # -- a scheduler set up for Accelerate's convention -----------------------------------------

    def _warn_accelerate_schedule(self) -> None:
        """Accelerate steps a prepared scheduler once per process per step, so Accelerate
        scripts size schedules by ``steps * num_processes``; here a scheduler steps once per
        step. A OneCycleLR sized that way would run 1/world_size of its schedule: say so."""
        total = getattr(self.scheduler, "total_steps", None)
        world = self.engine.world_size
        if not isinstance(total, int) or world == 1 or not hasattr(self.train_loader, "__len__"):
            return
        planned = self.max_steps or self.max_epochs * (len(self.train_loader) // self.grad_accum)
        if planned and total == planned * world:
            warnings.warn(
                f"The scheduler is sized for {total} steps = {planned} steps x {world} "
                f"processes, Accelerate's convention (it steps schedulers once per process). "
                f"torchplug steps it once per optimizer step, so only 1/{world} of the schedule "
                f"would run. Size it for {planned} steps.",
                stacklevel=3,
            )


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, Mapping) and batch:
        return _batch_size(next(iter(batch.values())))
    return 0


__all__ = ["Trainer", "accuracy"]
