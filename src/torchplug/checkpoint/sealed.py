"""Sealed memory files: a signed load's verified bytes, read and hashed once per host.

With a checkpoint key every byte a load uses must be a byte that was hashed, so each rank used
to read the files it needs into its own memory and hash them there: on a host whose ranks all
hold the whole model, every rank read and hashed every byte. Here one rank of the host reads
each file into a memory file (``memfd_create``), seals it against any write, growth or
shrinking (``F_SEAL_WRITE``, ``F_SEAL_GROW``, ``F_SEAL_SHRINK``, then ``F_SEAL_SEAL``) and only
then hashes it; the host's other ranks that need the file open it through
``/proc/<pid>/fd/<n>`` and map it. A sealed file cannot change, so what they map is what was
hashed, and the file on disk is never read again. A rank that cannot open or map a peer's file
(another host, another pid namespace, ``/proc`` hidden, no ``memfd_create``) reads the file into
its own memory and hashes it, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
from pathlib import Path

#: The seals a shared file must carry: nobody can write it, grow it or shrink it any more.
_SEALS = (
    getattr(fcntl, "F_SEAL_WRITE", 0x0008)
    | getattr(fcntl, "F_SEAL_GROW", 0x0004)
    | getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
)
_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
#: ``madvise(MADV_POPULATE_READ)`` (Linux 5.14): a mapping's page tables made in one call.
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def host() -> str:
    """Where this process may share memory files: its kernel (boot id), pid namespace and host
    name; ``""`` where it cannot (no ``memfd_create``, no ``/proc``)."""
    if not hasattr(os, "memfd_create"):
        return ""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}:{namespace}:{socket.gethostname()}"


def owners(needs: list[list[str]], hosts: list[str]) -> dict[str, int]:
    """For each file that two or more ranks of one host need, the rank of that host that reads
    and hashes it for them (the host's files dealt to its ranks in turn), keyed ``host/name``.

    Args:
        needs: Each rank's files.
        hosts: Each rank's `host` (``""``: shares nothing).
    """
    wanted = [set(names) for names in needs]
    chosen: dict[str, int] = {}
    turn: dict[str, int] = {}
    for name in sorted(set().union(*wanted)):
        ranks: dict[str, list[int]] = {}
        for rank, names in enumerate(wanted):
            if name in names and hosts[rank]:
                ranks.setdefault(hosts[rank], []).append(rank)
        for where, sharing in ranks.items():
            if len(sharing) > 1:
                chosen[f"{where}/{name}"] = sharing[turn.get(where, 0) % len(sharing)]
                turn[where] = turn.get(where, 0) + 1
    return chosen


def copy_sealed(handle: int, size: int) -> tuple[int, memoryview]:
    """The first ``size`` bytes of the open file ``handle`` copied into a new memory file, sealed;
    returns its descriptor and a map of it. Raises OSError where the kernel cannot."""
    fd = os.memfd_create("torchplug-checkpoint", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        done = 0
        while done < size:  # the kernel copies: page cache to the memory file
            sent = os.sendfile(fd, handle, done, size - done)
            if not sent:
                break
            done += sent
        if done != size:
            raise EOFError(done)
        fcntl.fcntl(fd, _ADD_SEALS, _SEALS | _SEAL_SEAL)
        return fd, _mapped(fd, size)
    except BaseException:
        os.close(fd)
        raise


def map_peer(pid: int, fd: int, size: int) -> memoryview | None:
    """Another rank's sealed memory file, mapped here; ``None`` when it cannot be opened or is
    not sealed against change (then read the file yourself)."""
    try:
        mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if fcntl.fcntl(mine, _GET_SEALS) & _SEALS != _SEALS or os.fstat(mine).st_size != size:
            return None
        return _mapped(mine, size)
    except OSError:  # not a memory file (no seals), or no memory to map it
        return None
    finally:
        os.close(mine)


def _mapped(fd: int, size: int) -> memoryview:
    """A private, writable-looking map of a sealed file (torch reads it without a warning; a
    write would only copy the page, the file stays sealed), its page tables made in one call."""
    if size == 0:
        return memoryview(bytearray())
    memory = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with contextlib.suppress(OSError):  # before Linux 5.14: the pages as they fault
        memory.madvise(_POPULATE_READ)
    return memoryview(memory)
