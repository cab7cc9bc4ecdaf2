"""torchrun's per-rank error file (``TORCHELASTIC_ERROR_FILE``, what ``@record`` writes): how a
rank tells the launcher why it failed. Written by the excepthook for an uncaught exception and
by the exit check of an asynchronous save nobody waited for; `torchplug launch` reads it for its
summary (the first failing rank, its message and traceback)."""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "TORCHELASTIC_ERROR_FILE"


def write(message: str, callstack: str, when: float, *, secondary: bool = False) -> bool:
    """Write this rank's error (``when``: seconds since the epoch, for the launcher's order;
    ``secondary``: a consequence of another rank's failure); return whether it was written
    (no error file outside torchrun, or one that cannot be written)."""
    path = os.environ.get(ENV)
    if not path:
        return False
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": callstack,
                "timestamp": str(int(when)),
                "torchplug_time": repr(when),
                "torchplug_secondary": secondary,
            },
        }
    }
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data))
    except OSError:
        return False
    return True
