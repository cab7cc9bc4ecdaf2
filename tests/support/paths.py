"""The checkout's folders, for tests that read its files or point a subprocess at them (the same
wherever the test module lives under tests/)."""

from __future__ import annotations

from pathlib import Path

#: tests/support: the shared helpers, and the scripts the tests launch (trainer_body.py, ...)
SUPPORT = Path(__file__).resolve().parent
#: tests: on sys.path (pyproject.toml), so ``support`` imports from here
TESTS = SUPPORT.parent
#: the checkout: src/, docs/, examples/, benchmarks/, contrib/
ROOT = TESTS.parent
