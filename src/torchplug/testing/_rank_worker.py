"""Entry point of a RankPool worker, started by torchrun as a module."""

from torchplug.testing.processes import worker_loop

if __name__ == "__main__":
    worker_loop()
