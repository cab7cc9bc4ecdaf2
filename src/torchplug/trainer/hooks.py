"""The Trainer's events, as pluggy hooks: a callback is a plugin like everything else.

A callback is any object (or module) with some of these functions, marked with
``@torchplug.plugin.hookimpl``, passed as ``Trainer(callbacks=[...])``. Every callback is called
for every event (none is ``firstresult``); what a hook returns is ignored, except that
``on_step_end`` may return ``True`` to stop training after that step. They are a separate
specification from [`torchplug.contract.spec`][torchplug.contract.spec]: these events exist only in
the Trainer's loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchplug.contract.spec import hookspec

if TYPE_CHECKING:
    from pathlib import Path

#: `torchplug.trainer.loop.Trainer`, which imports this module: named through an alias, not an
#: import.
Trainer = Any


@hookspec
def on_train_start(trainer: Trainer) -> None:
    """Before the first step (after a resume: ``trainer.step`` is the checkpoint's step).

    Args:
        trainer: The Trainer (``trainer.engine``, ``trainer.model``, ``trainer.step``, ...).
    """


@hookspec
def on_epoch_start(trainer: Trainer, epoch: int) -> None:
    """Before each pass over the training data.

    Args:
        trainer: The Trainer (``trainer.engine``, ``trainer.model``, ``trainer.step``, ...).
        epoch: The epoch about to run, from 0.
    """


@hookspec
def on_step_end(trainer: Trainer, step: int, loss: float) -> bool | None:
    """After each optimizer step; ``loss`` is this rank's loss of the step (micro-batches
    averaged). Return ``True`` to stop training after this step.

    Args:
        trainer: The Trainer (``trainer.engine``, ``trainer.model``, ``trainer.step``, ...).
        step: The optimizer steps done so far.
        loss: This rank's loss of the step (micro-batches averaged).
    """


@hookspec
def on_eval_end(trainer: Trainer, metrics: dict[str, float]) -> None:
    """After each evaluation, with the metrics reduced over all ranks (the same on every rank).

    Args:
        trainer: The Trainer (``trainer.engine``, ``trainer.model``, ``trainer.step``, ...).
        metrics: ``eval_loss`` and the ``eval_*`` metrics, reduced over all ranks.
    """


@hookspec
def on_checkpoint(trainer: Trainer, path: Path) -> None:
    """After a checkpoint was written (on every rank).

    Args:
        trainer: The Trainer (``trainer.engine``, ``trainer.model``, ``trainer.step``, ...).
        path: The checkpoint directory written.
    """


@hookspec
def on_epoch_end(trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
    """After each pass over the training data (and its evaluation, if any).

    Args:
        trainer: The Trainer (``trainer.engine``, ``trainer.model``, ``trainer.step``, ...).
        epoch: The epoch that ended, from 0.
        metrics: ``train_loss`` and the evaluation's ``eval_*`` values of the epoch.
    """


@hookspec
def on_train_end(trainer: Trainer, metrics: dict[str, Any]) -> None:
    """After the last step, with what [`Trainer.fit`][torchplug.Trainer.fit] returns.

    Args:
        trainer: The Trainer (``trainer.engine``, ``trainer.model``, ``trainer.step``, ...).
        metrics: What [`Trainer.fit`][torchplug.Trainer.fit] returns.
    """
