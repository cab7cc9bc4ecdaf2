"""The Trainer: a small ready loop on the Engine (`loop`), its callback hooks
(`hooks`) and its progress display (`progress`)."""

from torchplug.trainer.loop import Trainer, accuracy

__all__ = ["Trainer", "accuracy"]
