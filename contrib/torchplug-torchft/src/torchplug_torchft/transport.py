"""The live state's transport: torchft's HTTP transport, read without unpickling code.

torchft's ``HTTPTransport`` loads what a peer serves with ``torch.load(weights_only=False)``, which
runs whatever a pickle names. The state ``ft-ddp`` sends is tensors and plain values only, so the
receiving side here loads with ``weights_only=True``: a payload naming anything else is refused.
"""

from __future__ import annotations

import urllib.request
from datetime import timedelta
from typing import Any

from torchft.checkpointing._serialization import _streaming_load
from torchft.checkpointing.http_transport import HTTPTransport


class TensorsOnlyHTTPTransport(HTTPTransport):
    """`HTTPTransport` whose receiving side unpickles tensors and plain values only."""

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> Any:
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as stream:
            return _streaming_load(stream, weights_only=True)
