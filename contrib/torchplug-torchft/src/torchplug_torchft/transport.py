"""The live state's transport: torchft's HTTP transport, read without unpickling code.

torchft's ``HTTPTransport`` loads what a peer serves with ``torch.load(weights_only=False)``, which
runs whatever a pickle names. The state ``ft-ddp`` sends is tensors and plain values only, so the
receiving side here loads with ``weights_only=True``: a payload naming anything else is refused.
"""

from __future__ import annotations

import urllib.request
import warnings
from datetime import timedelta
from typing import Any

import torch
from torchft.checkpointing._serialization import _streaming_load
from torchft.checkpointing.http_transport import HTTPTransport


class TensorsOnlyHTTPTransport(HTTPTransport):
    """`HTTPTransport` whose receiving side unpickles tensors and plain values only."""

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> Any:
        with (
            urllib.request.urlopen(address, timeout=timeout.total_seconds()) as stream,
            warnings.catch_warnings(),
        ):
            # torch makes each received tensor over the bytes it came in (read-only: it warns);
            # each is copied into memory of its own before anything can write to it
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            return _owned(_streaming_load(stream, weights_only=True))


def _owned(value: Any) -> Any:
    """``value`` with every tensor in it (nested in dicts, lists, tuples) copied."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _owned(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_owned(item) for item in value)
    return value
