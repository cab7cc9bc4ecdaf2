"""Sealed memory files (`torchplug.checkpoint.sealed`): a signed load's file read and hashed once
per host, the host's other ranks mapping it. What makes that safe is tested here against the
kernel itself: the sealed file cannot be changed by anyone, another process maps exactly its
bytes, and anything that is not a sealed memory file of the right size is refused."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from torchplug.checkpoint import sealed

pytestmark = pytest.mark.skipif(not sealed.host(), reason="no memfd_create or /proc here")


@pytest.fixture
def checkpoint_file(tmp_path):
    path = tmp_path / "chunk.bin"
    data = os.urandom(3 << 20) + b"tail"
    path.write_bytes(data)
    return path, data


def test_a_sealed_copy_holds_the_files_bytes_and_nobody_can_change_it(checkpoint_file):
    """Written, truncated, grown: the kernel refuses each (EPERM). Rewriting the file on disk
    afterwards changes nothing in the copy or its map."""
    path, data = checkpoint_file
    with path.open("rb", buffering=0) as handle:
        fd, view = sealed.copy_sealed(handle.fileno(), len(data))
    try:
        assert bytes(view) == data
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"evil", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 10)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, len(data) + 4096)
        path.write_bytes(b"x" * len(data))  # the file changes after it was sealed
        assert bytes(view) == data
        assert os.pread(fd, len(data), 0) == data
    finally:
        os.close(fd)


def test_a_short_file_is_not_sealed_as_whole(checkpoint_file):
    path, data = checkpoint_file
    with path.open("rb", buffering=0) as handle, pytest.raises(EOFError):
        sealed.copy_sealed(handle.fileno(), len(data) + 1)


MAP_IN_ANOTHER_PROCESS = """
import hashlib, sys
from torchplug.checkpoint import sealed
pid, fd, size = (int(a) for a in sys.argv[1:4])
view = sealed.map_peer(pid, fd, size)
print("refused" if view is None else hashlib.sha256(view).hexdigest())
"""


def mapped_elsewhere(fd: int, size: int) -> str:
    done = subprocess.run(
        [sys.executable, "-c", MAP_IN_ANOTHER_PROCESS, str(os.getpid()), str(fd), str(size)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return done.stdout.strip()


def test_another_process_maps_exactly_the_sealed_bytes(checkpoint_file):
    path, data = checkpoint_file
    with path.open("rb", buffering=0) as handle:
        fd, _ = sealed.copy_sealed(handle.fileno(), len(data))
    try:
        assert mapped_elsewhere(fd, len(data)) == hashlib.sha256(data).hexdigest()
        assert mapped_elsewhere(fd, len(data) - 1) == "refused"  # not the size the manifest says
    finally:
        os.close(fd)


def test_what_is_not_a_sealed_memory_file_is_refused(checkpoint_file):
    """An unsealed memory file (someone could still write it), a file on disk, a descriptor
    that does not exist: each refused, so the rank reads the file itself."""
    path, data = checkpoint_file
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    on_disk = os.open(path, os.O_RDONLY)
    try:
        os.write(unsealed, data)
        assert mapped_elsewhere(unsealed, len(data)) == "refused"
        assert mapped_elsewhere(on_disk, len(data)) == "refused"
        assert mapped_elsewhere(987654, len(data)) == "refused"
    finally:
        os.close(unsealed)
        os.close(on_disk)


def test_owners_deal_a_hosts_shared_files_to_its_ranks_in_turn():
    """Files two ranks of a host both need are dealt to them in turn; a file one rank alone
    needs, ranks on other hosts, and a rank that cannot share (``""``) read their own."""
    needs = [["a", "b", "c", "d"], ["a", "b", "c", "d"], ["a", "b"], ["a"], ["e"], ["e"]]
    hosts = ["h1", "h1", "h2", "h2", "", ""]
    assert sealed.owners(needs, hosts) == {"h1/a": 0, "h1/b": 1, "h1/c": 0, "h1/d": 1, "h2/a": 2}
