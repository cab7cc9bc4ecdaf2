"""The checkpoint settings: the signing key and how long a rank waits for the others.

Both come from an ``Engine`` argument or an environment variable. They are parsed here once, so
that the Engine, ``torchplug launch`` (before it spawns) and ``torchplug doctor`` agree on what is
valid.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from torchplug.contract.errors import CheckpointError, ConfigurationError

KEY_ENV = "TORCHPLUG_CHECKPOINT_KEY"
TIMEOUT_ENV = "TORCHPLUG_CHECKPOINT_TIMEOUT"
#: Seconds a rank waits for the others to call engine.save/load before naming the absent ones.
DEFAULT_TIMEOUT = 300.0
MIN_KEY_BYTES = 16


def key_from(explicit: str | bytes | None, env: Mapping[str, str] | None = None) -> bytes | None:
    """The signing key: the explicit one, else ``TORCHPLUG_CHECKPOINT_KEY``, else none.

    A variable that is set but empty is an error, not "no key": a secret that expanded to nothing
    must not switch verification off quietly.
    """
    env = os.environ if env is None else env
    source = "Engine(checkpoint_key=...)"
    key: str | bytes | None = explicit
    if key is None and KEY_ENV in env:
        key, source = env[KEY_ENV], KEY_ENV
    if key is None:
        return None
    if not isinstance(key, (str, bytes, bytearray)):
        raise ConfigurationError(
            f"checkpoint_key must be a str or bytes secret, got {type(key).__name__} {key!r} "
            f"(an int would become that many zero bytes). Pass e.g. "
            f"checkpoint_key=secrets.token_hex(32), or set {KEY_ENV}."
        )
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) < MIN_KEY_BYTES:
        raise CheckpointError(
            f"The checkpoint key from {source} is {len(raw)} bytes long"
            + (" (the variable is set but empty)" if not raw else "")
            + f"; use at least {MIN_KEY_BYTES} random bytes (e.g. `python -c 'import secrets; "
            f"print(secrets.token_hex(32))'`), or unset {KEY_ENV} to load without verification."
        )
    return raw


def timeout_from(value: float | None, env: Mapping[str, str] | None = None) -> float:
    """Seconds a save or load waits for every rank to arrive (argument, else environment)."""
    env = os.environ if env is None else env
    source, shown = "checkpoint_timeout", repr(value)
    if value is None:
        if TIMEOUT_ENV not in env:
            return DEFAULT_TIMEOUT
        source, shown = TIMEOUT_ENV, repr(env[TIMEOUT_ENV])
        try:
            value = float(env[TIMEOUT_ENV])
        except ValueError:
            value = None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not 0 < value < 1e7:  # type: ignore[operator]
        raise ConfigurationError(
            f"{source}={shown} is not a usable number of seconds: expected a positive number "
            f"below 1e7 (the default is {DEFAULT_TIMEOUT:.0f}). Fix or unset it."
        )
    return float(value)  # type: ignore[arg-type]


def problems(env: Mapping[str, str] | None = None) -> list[str]:
    """What is wrong with the checkpoint settings in ``env`` (for launch and doctor)."""
    found = []
    for check in (lambda: key_from(None, env), lambda: timeout_from(None, env)):
        try:
            check()
        except (CheckpointError, ConfigurationError) as exc:
            found.append(str(exc))
    return found
