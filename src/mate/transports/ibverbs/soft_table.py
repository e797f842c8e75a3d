"""The memory-region table a soft device publishes for direct one-sided access.

A device that may be the target of RDMA READ/WRITE performed by a peer
process itself (the "direct" path) writes one 32-byte entry per remotely
accessible region into a shared-memory file: rkey, access flags, address,
length and protection domain. The file is a memfd, named to peers as
/proc/<pid>/fd/<n>: it has no name in /dev/shm, so nothing is left behind
when a process is killed, and a peer's open() of that path makes a new open
file description, which OFD locks need (a descriptor passed with SCM_RIGHTS
would share the owner's and never conflict with it).

An initiator opens the table once per peer device and, for every operation,
takes a shared OFD lock on the entry, checks it, copies, and unlocks. `dereg`
takes the exclusive lock on the entry (so it waits for a copy in progress)
and zeroes it: once it returns, no peer reaches the memory. The entry's slot
is the rkey's low `SLOT_BITS` bits, so a check is one pread.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct

from mate.transports.ibverbs.soft_sys import lock_range

SLOT_BITS = 16
SLOTS = 1 << SLOT_BITS
SLOT_MASK = SLOTS - 1
ENTRY = struct.Struct("<IIQQI4x")  # rkey, access, addr, length, pd
_SIZE = ENTRY.size
_ZERO = bytes(_SIZE)


class MrTable:
    """This device's published table (sparse: untouched slots cost no memory)."""

    def __init__(self) -> None:
        self._fd = os.memfd_create("mate-soft-mr-table", os.MFD_CLOEXEC)
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        try:
            os.ftruncate(self._fd, SLOTS * _SIZE)
        except OSError:
            os.close(self._fd)
            raise

    def publish(self, rkey: int, access: int, addr: int, length: int, pd: int) -> None:
        self._write(rkey & SLOT_MASK, ENTRY.pack(rkey, access, addr, length, pd))

    def revoke(self, rkey: int) -> None:
        """Zero the entry; waits for any peer copying under it."""
        self._write(rkey & SLOT_MASK, _ZERO)

    def _write(self, slot: int, entry: bytes) -> None:
        start = slot * _SIZE
        lock_range(self._fd, fcntl.F_WRLCK, start, _SIZE)
        try:
            os.pwrite(self._fd, entry, start)
        finally:
            lock_range(self._fd, fcntl.F_UNLCK, start, _SIZE)

    def close(self) -> None:
        """Revoke every entry at once (waiting for copies in progress) and close the table."""
        try:
            lock_range(self._fd, fcntl.F_WRLCK, 0, 0)
            os.ftruncate(self._fd, 0)  # a peer's pread now comes back short: no entry matches
        finally:
            os.close(self._fd)  # closing drops the lock; peers' descriptors keep the file


class PeerTable:
    """A peer device's table, opened read-only for checks before direct copies."""

    def __init__(self, path: str) -> None:
        # The path comes from a peer: never block opening it, and accept only a plain file.
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(self._fd).st_mode):
            os.close(self._fd)
            raise OSError(errno.EINVAL, f"{path} is not an MR table")

    def lock(self, rkey: int) -> None:
        """Hold the entry's shared lock: `dereg` cannot complete until `unlock`."""
        lock_range(self._fd, fcntl.F_RDLCK, (rkey & SLOT_MASK) * _SIZE, _SIZE)

    def unlock(self, rkey: int) -> None:
        lock_range(self._fd, fcntl.F_UNLCK, (rkey & SLOT_MASK) * _SIZE, _SIZE)

    def allows(self, rkey: int, need: int, addr: int, length: int, pd: int) -> bool:
        """Whether the entry grants `need` on [addr, addr+length); call between lock and unlock."""
        data = os.pread(self._fd, _SIZE, (rkey & SLOT_MASK) * _SIZE)
        if len(data) < _SIZE:
            return False
        key, access, base, size, owner = ENTRY.unpack(data)
        return bool(key == rkey and access & need == need and owner == pd
                and base <= addr and addr + length <= base + size)

    def close(self) -> None:
        os.close(self._fd)
