"""Atomic directory I/O: where a checkpoint is written, how it replaces the last one, and which
paths inside it may be read.

A checkpoint is written into a hidden ``.NAME.tmp-*`` directory beside its target and swapped into
place in one ``renameat2(RENAME_EXCHANGE)`` (two renames where that is missing), so a crash never
leaves a half-written checkpoint under the final name and never destroys the last good one.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import hashlib
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchplug.checkpoint.manifest import FILE_DIGESTS, MANIFEST
from torchplug.contract.errors import CheckpointError


def describe_os_error(exc: BaseException) -> str:
    """``ENOSPC: No space left on device`` style text for an OSError (else the message)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        import errno

        name = errno.errorcode.get(exc.errno, str(exc.errno))
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{name}: {exc.strerror or exc}{where}"
    return f"{type(exc).__name__}: {exc}"


def os_error_behind(directory: Path) -> OSError | None:
    """The OS error a failed write was really about, found by writing and fsyncing 64 KiB in
    ``directory`` again: libraries report a full disk or a read-only file system in their own
    words (torch's ``[enforce fail at inline_container.cc] unexpected pos``). ``None`` when the
    probe succeeds (the failure was something else)."""
    probe = directory / f".torchplug-probe-{os.getpid()}"
    try:
        with probe.open("wb") as handle:
            handle.write(bytes(65536))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        return OSError(exc.errno, exc.strerror, str(directory))
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def free_space(directory: Path) -> str:
    """'N MB free of M MB' for the file system holding ``directory`` (or '' if unknown)."""
    try:
        info = os.statvfs(directory)
    except OSError:
        return ""
    return (
        f"{info.f_bavail * info.f_frsize / 1e6:.1f} MB free of "
        f"{info.f_blocks * info.f_frsize / 1e6:.1f} MB"
    )


def fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: The file digests a manifest may record, the one new checkpoints record first. BLAKE3 (the
#: ``blake3`` package, a dependency) is a cryptographic hash at about twice sha256's speed on one
#: core (3.8 against 1.7 GB/s with SHA-NI here): hashing is most of what a verified load costs
#: over plain DCP, and a third of a save. sha256 is what format 2 recorded, and what is written
#: where blake3 cannot be imported.
DIGESTS = FILE_DIGESTS
#: Bytes hashed per read: large enough that the Python loop costs nothing, small enough to stay
#: in cache between the read and the hash.
_BLOCK = 1 << 20


def _blake3() -> Any:
    try:
        import blake3
    except ImportError:
        return None
    return blake3.blake3


def preferred_digest() -> str:
    """The digest a new checkpoint records for its files."""
    return "blake3" if _blake3() is not None else "sha256"


def hasher(name: str) -> Any:
    """A new incremental hash object (``update``/``hexdigest``) for the digest ``name``."""
    if name == "sha256":
        return hashlib.sha256()
    make = _blake3()
    if make is None:
        raise CheckpointError(
            "This checkpoint's files are hashed with BLAKE3 and the blake3 package is not "
            "installed; install it (python -m pip install blake3) and load again."
        )
    # its threads take cores the ranks leave idle (waiting on an fsync, on the other ranks)
    return make(max_threads=make.AUTO)


def expected_digest(entry: Any) -> tuple[str, str]:
    """Which digest of a manifest file entry a load checks, and its recorded value (the first of
    `DIGESTS` it records; blake3 is checked only where it is installed when sha256 is
    recorded too)."""
    found = [(name, entry[name]) for name in DIGESTS if name in entry]
    if len(found) > 1 and _blake3() is None:
        return found[-1]
    return found[0]


def digest(path: Path, name: str | None = None) -> dict[str, str]:
    """The file's digest as a manifest records it: ``{"blake3": hex}`` (or ``name``'s)."""
    name = name or preferred_digest()
    with path.open("rb") as handle:
        return {name: _digest(handle, name)}


def resolve_target(path: str | os.PathLike[str]) -> Path:
    """The directory a save at ``path`` replaces.

    A symlink is kept and what it points to is replaced (``latest -> step_100`` stays a link). A
    regular file, or a non-empty directory that is not a checkpoint, is refused untouched.
    """
    final = Path(os.path.abspath(path))
    if final.is_symlink():
        final = final.resolve()
    if final.exists() and not final.is_dir():
        raise CheckpointError(
            f"Cannot save a checkpoint at {final}: it is a file, not a checkpoint directory. "
            f"Choose another path, or remove the file."
        )
    if final.is_dir() and not (final / MANIFEST).is_file() and any(final.iterdir()):
        raise CheckpointError(
            f"Cannot save a checkpoint at {final}: it is a non-empty directory that is not a "
            f"torchplug checkpoint (no {MANIFEST}), and saving would replace its contents. "
            f"Choose another path, or empty the directory."
        )
    return final


def temporary_dir(final: Path) -> Path:
    """A fresh hidden directory beside ``final``; stale ones from crashed saves are removed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{glob.escape(final.name)}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p] * 2 + [ctypes.c_uint]
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0


def swap_into_place(tmp: Path, final: Path, *, remove_old: bool = True) -> Path | None:
    """Make ``tmp`` the checkpoint at ``final`` in one step.

    The previous checkpoint is removed after (``remove_old``), or its new location is returned
    for the caller to remove (every rank removing the files it wrote: removing a large checkpoint
    costs about as much as writing it). Once the new checkpoint is in place the save has
    happened: failing to remove the old one is a warning, not an error.
    """
    if not final.exists():
        os.rename(tmp, final)
        old = None
    elif _exchange(tmp, final):
        old = tmp  # now holds the previous checkpoint
    else:  # no atomic exchange here: keep the old one under a backup name until the new is in
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(final, old)
        os.rename(tmp, final)
    fsync(final.parent)
    if old is not None and remove_old:
        remove_previous(old, final)
        return None
    return old


def remove_previous(old: Path, final: Path) -> None:
    """Remove (part of) a replaced checkpoint; a failure is a warning (the save has happened)."""
    try:
        shutil.rmtree(old)
    except FileNotFoundError:
        pass
    except OSError as exc:
        warnings.warn(
            f"The checkpoint at {final} was saved, but the previous one left at {old} could "
            f"not be removed ({describe_os_error(exc)}); remove it by hand.",
            stacklevel=3,
        )


def _digest(handle: Any, name: str) -> str:
    """The digest of what remains of an open file, read once into one reused buffer."""
    digest = hasher(name)
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    while True:
        count = handle.readinto(buffer)
        if not count:
            return digest.hexdigest()
        digest.update(view[:count])


#: A file as opened: (inode, size, mtime_ns, ctime_ns). Replacing the path (rename) gives another
#: inode, writing to it moves ctime, which no one can set back; the device is left out because
#: it differs between the nodes that mount one shared file system.
Pin = tuple[int, int, int, int]


def pin_of(handle: Any) -> Pin:
    info = os.fstat(handle.fileno())
    return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def hash_pinned(path: Path, name: str) -> tuple[str, Pin]:
    """The digest ``name`` of the file at ``path`` and the pin of the very file that was hashed
    (opened once, unbuffered; a change while it was being read is an error)."""
    with path.open("rb", buffering=0) as handle:
        before = pin_of(handle)
        digest = _digest(handle, name)
        if pin_of(handle) != before:
            raise CheckpointError(
                f"Checkpoint file {path} changed while it was being verified (another process "
                f"writes to it). Wait until nothing writes to the checkpoint, then load again."
            )
    return digest, before


@contextlib.contextmanager
def open_pinned(path: Path, pin: Pin | None, *, buffering: int = -1) -> Iterator[Any]:
    """Open ``path`` for reading, refusing a file other than the one verified (``pin``), before
    and after it is read: what is loaded is the file whose bytes were hashed."""
    with path.open("rb", buffering=buffering) as handle:
        _same_file(path, pin, handle)
        yield handle
        _same_file(path, pin, handle)


def _same_file(path: Path, pin: Pin | None, handle: Any) -> None:
    if pin is not None and pin_of(handle) != tuple(pin):
        raise CheckpointError(
            f"Checkpoint file {path} is not the file that was verified: it was replaced or "
            f"modified during the load (another process renamed or wrote a file in the "
            f"checkpoint). Refusing its bytes; load again once nothing changes the checkpoint."
        )


def confined(root: Path, name: object, what: str) -> Path:
    """``root / name`` for a relative path that stays inside ``root``; anything else is refused."""
    bad = None
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        bad = "is not a plain relative path"
    elif name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        bad = "is absolute or contains '.', '..' or an empty part"
    else:
        path = root / name
        real_root = root.resolve()
        if not path.resolve().is_relative_to(real_root):
            bad = "leads outside the checkpoint directory (through a symlink)"
    if bad:
        raise CheckpointError(
            f"Checkpoint {root}: {what} {name!r} {bad}; refusing to read it. The manifest was "
            f"altered; load an earlier checkpoint."
        )
    return root / name  # type: ignore[operator]
