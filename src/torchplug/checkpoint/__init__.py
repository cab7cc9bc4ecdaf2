"""The portable checkpoint: one on-disk format for every backend.

A checkpoint is a directory::

    ckpt/
      manifest.json      what the checkpoint holds (entries, tensor index, files with sizes and
                         sha256), a digest of all of it, and an HMAC signature when a key is set
      tensors/rank-N/    tensor data written by torch.distributed.checkpoint, each rank its own

Modules: `torchplug.checkpoint.manifest` (format, structure, schema),
`torchplug.checkpoint.files` (atomic directory I/O, path confinement),
`torchplug.checkpoint.verify` (hashes and signatures),
`torchplug.checkpoint.tensors` (the DCP tensor store and its JSON index),
`torchplug.checkpoint.coordinate` (how ranks agree), `torchplug.checkpoint.io` (the
save and load phases) and `torchplug.cli.conversion` (to safetensors). Nothing here has a
branch for a particular backend: backends take part through the state hooks of
`torchplug.contract.spec`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchplug import _lazy

# Names load on first use: the Engine imports ``torchplug.checkpoint.settings`` and friends at
# import time, and the save/load machinery (DCP, hashing) only when a checkpoint is touched.
_EXPORTS = {
    **dict.fromkeys(
        ("load", "open_checkpoint", "read_manifest", "save"), "torchplug.checkpoint.io"
    ),
    **dict.fromkeys(
        ("MANIFEST", "TENSORS", "decode", "encode", "kind_of", "tensor_paths"),
        "torchplug.checkpoint.manifest",
    ),
}  # (``files`` is a submodule: ``from torchplug.checkpoint import files`` imports it)

__all__ = [
    "MANIFEST",
    "TENSORS",
    "decode",
    "files",
    "encode",
    "kind_of",
    "load",
    "open_checkpoint",
    "read_manifest",
    "save",
    "tensor_paths",
]

if TYPE_CHECKING:
    from torchplug.checkpoint import files
    from torchplug.checkpoint.io import load, open_checkpoint, read_manifest, save
    from torchplug.checkpoint.manifest import (
        MANIFEST,
        TENSORS,
        decode,
        encode,
        kind_of,
        tensor_paths,
    )

__getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals())
