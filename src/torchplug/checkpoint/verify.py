"""Verification and signing.

Threat model, in short (docs/checkpoints.md has it in full): the manifest digest and the per-file
sha256 catch *corruption* (truncation, flipped bits, a partial copy); they do not stop someone who
can write the checkpoint from rewriting a file and the manifest together. A signature (HMAC-SHA256
over the manifest, which holds every file's sha256) does: without the key no one can produce a
checkpoint that loads where a key is configured. Neither hides a checkpoint's contents, and a
signature proves only that someone holding the key wrote it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import io
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from torchplug.checkpoint import sealed
from torchplug.checkpoint.files import (
    Pin,
    confined,
    expected_digest,
    hash_pinned,
    hasher,
    open_pinned,
)
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


class VerifiedBytes:
    """Each file's bytes read once into this process's memory and hashed from that memory, so
    that what a load uses is exactly what was hashed: no later change to the file (``write``, a
    shared ``mmap`` whose page was dirty already, truncation, rename, a hard link) reaches the
    caller, because the file is never read again.

    ``keep=None`` keeps every file read (a load reads all it needs before it copies anything:
    all or nothing, each byte hashed once); ``keep=1`` only the last one (a reader that walks
    the files in pieces with bounded memory: a file met again is read and hashed again)."""

    def __init__(self, root: Path, files: Mapping[str, Any], keep: int | None = None) -> None:
        self.root = root
        self.files = files
        self.keep = keep
        self._read: dict[str, memoryview] = {}
        #: name -> the sealed memory file this rank read it into for its host's other ranks
        self._offered: dict[str, int] = {}

    def __call__(self, name: str) -> memoryview:
        """The verified bytes of the file the manifest lists as ``name``."""
        found = self._read.get(name)
        if found is None:
            found = self._read_and_check(name)
            while self.keep is not None and len(self._read) >= self.keep:
                self._read.pop(next(iter(self._read)))
            self._read[name] = found
        return found

    @contextlib.contextmanager
    def stream(self, name: str) -> Iterator[Any]:
        """A stream over the file's verified bytes (DCP reads its non-raw chunks so)."""
        yield _BytesView(self(name))

    @contextlib.contextmanager
    def filler(self, name: str) -> Iterator[Callable[[int, torch.Tensor], None]]:
        """``fill(start, tensor)``: copy the verified bytes at ``start`` into ``tensor``."""
        data, path = self(name), self.root / name

        def fill(start: int, tensor: torch.Tensor) -> None:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes == 0:
                return
            if start < 0 or start + nbytes > len(data):
                raise CheckpointError(
                    f"Checkpoint file {path} ends before the tensor data it should hold: it "
                    f"was truncated. Load an earlier checkpoint."
                )
            source = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=start)
            tensor.reshape(-1).view(torch.uint8).copy_(source)

        yield fill

    def prefetch(self, names: Iterable[str]) -> None:
        """Read and check ``names`` now (the verification phase of a load)."""
        for name in sorted(names):
            self(name)

    def seal(self, names: Iterable[str]) -> dict[str, Any]:
        """Read and check ``names`` each into a sealed memory file that the host's other ranks
        map instead of reading the file (`torchplug.checkpoint.sealed`); returns what they need
        to open them: ``{"pid": ..., "fds": {name: descriptor}}``."""
        for name in sorted(names):
            if name not in self._read:
                self._read[name] = self._read_and_check(name, share=True)
        return {"pid": os.getpid(), "fds": dict(self._offered)}

    def take(
        self,
        names: Iterable[str],
        offers: list[Any],
        owners: Mapping[str, int],
        host: str,
        rank: int,
    ) -> None:
        """Map the files of ``names`` that another rank of this host sealed (`seal`'s
        ``offers``, by rank); any it cannot map are read here by `prefetch`."""
        for name in sorted(names):
            owner = owners.get(f"{host}/{name}")
            if owner is None or owner == rank or name in self._read:
                continue
            offer = offers[owner] or {}
            fd = offer.get("fds", {}).get(name)
            if fd is not None:
                view = sealed.map_peer(int(offer["pid"]), int(fd), self.files[name]["size"])
                if view is not None:
                    self._read[name] = view

    def release(self) -> None:
        """Close the memory files this rank offered (once every rank has mapped its own: the
        maps keep them)."""
        for fd in self._offered.values():
            os.close(fd)
        self._offered.clear()

    def _read_and_check(self, name: str, share: bool = False) -> memoryview:
        if name not in self.files:
            raise CheckpointError(
                f"Checkpoint {self.root}: file {name!r} is not listed in its manifest; refusing "
                f"to read it."
            )
        expected = self.files[name]
        path = confined(self.root, name, "a tensor chunk refers to file")
        size = expected["size"]
        algorithm, recorded = expected_digest(expected)
        digest = hasher(algorithm)
        fd = None
        try:
            with path.open("rb", buffering=0) as handle:
                if share:
                    try:  # sealed first, then hashed: nothing can change what was hashed
                        fd, view = sealed.copy_sealed(handle.fileno(), size)
                    except (OSError, EOFError):
                        fd = None  # read here as below (a short file is reported there)
                if fd is not None:
                    for at in range(0, size, _BLOCK):
                        digest.update(view[at : at + _BLOCK])
                    done, longer = size, bool(os.pread(handle.fileno(), 1, size))
                else:
                    view = _fresh(size)
                    done = 0
                    while done < size:  # a block at a time, hashed while it is in the cache
                        got = handle.readinto(view[done : done + _BLOCK])
                        if not got:
                            break
                        digest.update(view[done : done + got])
                        done += got
                    longer = done == size and handle.read(1)
        except FileNotFoundError:
            raise CheckpointError(
                f"Checkpoint file {path} is missing (the manifest lists it). The checkpoint is "
                f"incomplete; restore the file or load an earlier checkpoint."
            ) from None
        try:
            if done != size or longer:
                raise CheckpointError(
                    f"Checkpoint file {path} has {'more than ' if longer else ''}{done} bytes, "
                    f"the manifest says {size}: it was truncated or changed after saving (or "
                    f"while this load read it). Restore it or load an earlier checkpoint."
                )
            if digest.hexdigest() != recorded:
                raise CheckpointError(
                    f"Checkpoint file {path} fails its {algorithm} check as read for this load: "
                    f"it was altered or corrupted after saving (or while this load read it). "
                    f"Nothing read from it was used; restore it or load an earlier checkpoint."
                )
        except CheckpointError:
            if fd is not None:
                os.close(fd)
            raise
        if fd is not None:
            self._offered[name] = fd
        return view


_BLOCK = 4 << 20


#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14; Python names it from 3.13 only).
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _fresh(size: int) -> memoryview:
    """``size`` bytes of private memory for a file's bytes, its pages made in one call: a page
    fault per 4 KiB page was most of the read's time. In 2 MiB pages where the kernel offers
    them (transparent huge pages on ``madvise``: a third less time than ``MAP_POPULATE``'s
    4 KiB pages for a 200 MB file here), else ``MAP_POPULATE``."""
    if size == 0:
        return memoryview(bytearray())
    anonymous = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge is not None:
        memory = mmap.mmap(-1, size, flags=anonymous)
        try:
            memory.madvise(huge)
            memory.madvise(_POPULATE_WRITE)
        except OSError:  # no huge pages or no populate here: the pages as they fault
            pass
        return memoryview(memory)
    return memoryview(mmap.mmap(-1, size, flags=anonymous | getattr(mmap, "MAP_POPULATE", 0)))


class PinnedFiles:
    """Without a checkpoint key: the files are read where they lie, each refused unless it is
    the very file that was hashed (`files.open_pinned`: same inode, size, mtime and ctime).
    This stops a file replaced or rewritten with ``write()`` during the load; it is not proof
    against a process that writes through a shared mapping (only a signature makes a
    checkpoint proof against someone who can write it; with a key, `VerifiedBytes` reads)."""

    def __init__(self, root: Path, pins: Mapping[str, Pin] | None) -> None:
        self.root = root
        self.pins = pins

    def _pin(self, name: str) -> Pin | None:
        if self.pins is None:
            return None
        if name not in self.pins:
            raise CheckpointError(
                f"Checkpoint {self.root}: file {name!r} was not verified; refusing to read it."
            )
        return self.pins[name]

    @contextlib.contextmanager
    def stream(self, name: str) -> Iterator[Any]:
        with open_pinned(self.root / name, self._pin(name)) as handle:
            yield handle

    @contextlib.contextmanager
    def filler(self, name: str) -> Iterator[Callable[[int, torch.Tensor], None]]:
        path = confined(self.root, name, "a tensor chunk refers to file")
        with open_pinned(path, self._pin(name), buffering=0) as handle:
            yield lambda start, tensor: _read_into(handle, start, tensor, path)


def _read_into(handle: Any, start: int, tensor: torch.Tensor, path: Path) -> None:
    """Read ``tensor.nbytes`` bytes at ``start`` into a contiguous CPU tensor's memory."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    view = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
    handle.seek(start)
    done = 0
    while done < nbytes:
        got = handle.readinto(view[done:])
        if not got:
            raise CheckpointError(
                f"Checkpoint file {path} ends before the tensor data it should hold: it was "
                f"truncated. Load an earlier checkpoint."
            )
        done += got


class _BytesView(io.RawIOBase):
    """A read-only, seekable stream over bytes in memory, without copying them."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._data)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), len(self._data) - self._at))
        memoryview(buffer).cast("B")[:count] = self._data[self._at : self._at + count]
        self._at += count
        return count
