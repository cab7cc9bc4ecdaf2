"""The Trainer: a small ready loop on the Engine (:mod:`.loop`), its callback hooks
(:mod:`.hooks`) and its progress display (:mod:`.progress`)."""

from torchplug.trainer.loop import Trainer, accuracy

__all__ = ["Trainer", "accuracy"]
