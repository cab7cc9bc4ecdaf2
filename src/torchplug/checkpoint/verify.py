"""Verification and signing.

Threat model, in short (docs/checkpoints.md has it in full): the manifest digest and the per-file
sha256 catch *corruption* (truncation, flipped bits, a partial copy); they do not stop someone who
can write the checkpoint from rewriting a file and the manifest together. A signature (HMAC-SHA256
over the manifest, which holds every file's sha256) does: without the key no one can produce a
checkpoint that loads where a key is configured. Neither hides a checkpoint's contents, and a
signature proves only that someone holding the key wrote it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchplug.checkpoint.files import Pin, confined, expected_digest, hash_pinned
from torchplug.checkpoint.manifest import canonical
from torchplug.checkpoint.settings import KEY_ENV
from torchplug.contract.errors import CheckpointError


def sign(body: dict[str, Any], key: bytes | None) -> None:
    """Add ``signature`` to a manifest body when a key is configured."""
    if key is not None:
        value = hmac.new(key, canonical(body), hashlib.sha256).hexdigest()
        body["signature"] = {"alg": "hmac-sha256", "value": value}


def check_signature(body: Mapping[str, Any], key: bytes | None, where: str) -> None:
    """With a key: refuse an unsigned or mis-signed manifest. Without one: nothing to check."""
    if key is None or not isinstance(body, Mapping):
        return  # not an object: validation refuses it
    signature = body.get("signature")
    if signature is not None and not (
        isinstance(signature, Mapping)
        and signature.get("alg") == "hmac-sha256"
        and isinstance(signature.get("value"), str)
    ):
        raise CheckpointError(
            f"Checkpoint {where} has a malformed signature (expected {{alg: 'hmac-sha256', "
            f"value: 64 hex digits}}): refusing it. Load an earlier checkpoint."
        )
    if signature is None:
        raise CheckpointError(
            f"Checkpoint {where} is not signed, but a checkpoint key is configured ({KEY_ENV} or "
            f"Engine(checkpoint_key=...)): refusing it. Load it without a key only if you trust "
            f"where it came from, then save it again to sign it."
        )
    expected = hmac.new(key, canonical(body), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, signature["value"]):
        raise CheckpointError(
            f"Checkpoint {where} has a signature that does not match the configured key: it was "
            f"altered, or signed with another key. Refusing it; check the key, or load an earlier "
            f"checkpoint."
        )


def check_files(root: Path, files: Mapping[str, Any], names: list[str]) -> dict[str, Pin]:
    """Check that each named file is inside ``root`` with the size and digest the manifest lists;
    return the pin of each file hashed (the reads check that they get the same file)."""
    pins: dict[str, Pin] = {}
    for name in names:
        expected = files[name]
        path = confined(root, name, "the manifest lists file")
        if not path.is_file():
            raise CheckpointError(
                f"Checkpoint file {path} is missing (the manifest lists it). The checkpoint is "
                f"incomplete; restore the file or load an earlier checkpoint."
            )
        algorithm, recorded = expected_digest(expected)
        digest, pin = hash_pinned(path, algorithm)
        size = pin[1]
        if size != expected["size"]:
            raise CheckpointError(
                f"Checkpoint file {path} has {size} bytes, the manifest says {expected['size']}: "
                f"it was truncated or changed after saving. Restore it or load an earlier "
                f"checkpoint."
            )
        if digest != recorded:
            raise CheckpointError(
                f"Checkpoint file {path} fails its {algorithm} check ({digest[:12]}..., the "
                f"manifest says {recorded[:12]}...): it was altered or corrupted after saving. "
                f"Restore it or load an earlier checkpoint."
            )
        pins[name] = pin
    return pins


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """This rank's part of the files to verify: each file is hashed by one rank only."""
    return sorted(names)[rank::world_size]
