"""Precision spellings users bring from Accelerate and Fabric mean the same thing everywhere."""

from __future__ import annotations

import pytest

import torchplug as tp
from torchplug.engine.config import normalize_precision


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("no", "32"),
        ("32-true", "32"),
        (32, "32"),
        ("bf16-mixed", "bf16"),
        ("BF16", "bf16"),
        ("16-mixed", "fp16"),
        (16, "fp16"),
        ("fp16", "fp16"),
    ],
)
def test_aliases_are_canonical(spelling, canonical):
    assert normalize_precision(spelling) == canonical


@pytest.mark.parametrize("spelling", ["fp8", "8-mixed", "bf16-true"])
def test_unsupported_precisions_say_so(spelling):
    with pytest.raises(tp.ConfigurationError, match="not supported by the active backends"):
        normalize_precision(spelling)


def test_fp8_does_not_suggest_fp32():
    with pytest.raises(tp.ConfigurationError) as info:
        tp.Engine("single", precision="fp8")
    assert "fp32" not in str(info.value).split("torchplug runs")[0]


def test_an_alias_in_code_agrees_with_the_launcher(monkeypatch):
    monkeypatch.setenv("TORCHPLUG_LAUNCH_PRECISION", "bf16")
    with tp.Engine("single", precision="bf16-mixed") as engine:
        assert engine.precision == "bf16"
    monkeypatch.setenv("TORCHPLUG_LAUNCH_PRECISION", "no")
    with tp.Engine("single", precision=32) as engine:
        assert engine.precision == "32"
