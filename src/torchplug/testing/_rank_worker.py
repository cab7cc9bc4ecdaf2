"""Entry point of a RankPool worker, started by torchrun: ``python -m torchplug.testing._rank_worker``."""

from torchplug.testing.processes import worker_loop

if __name__ == "__main__":
    worker_loop()
