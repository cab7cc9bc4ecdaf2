"""The conformance kit on powersgd: one test per property, on two real ranks."""

import pytest

pytest.importorskip("torchplug_powersgd")

from torchplug.testing.conformance import Conformance  # noqa: E402


class TestPowerSGD(Conformance):
    strategy = "powersgd"
