"""Linux calls the soft device needs that Python 3.11's standard library lacks.

`Timer` wraps a timerfd (RNR retry timing on a pollable descriptor),
`PeerMemory` wraps `process_vm_readv`/`process_vm_writev` (one-sided access
to a peer process's memory), `lock_range` takes open-file-description byte
range locks (`F_OFD_SETLKW`: unlike POSIX record locks they conflict between
two descriptors of one process, so two devices in one process exclude each
other too), and `host_identity` names the kernel and PID namespace a pid is
valid in.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import math
import os
import struct

_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.timerfd_create.restype = ctypes.c_int
_libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec),
                                  ctypes.c_void_p]
_libc.timerfd_settime.restype = ctypes.c_int
for _call in (_libc.process_vm_readv, _libc.process_vm_writev):
    _call.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                      ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    _call.restype = ctypes.c_ssize_t

_CLOCK_MONOTONIC = 1
_TFD_FLAGS = os.O_NONBLOCK | os.O_CLOEXEC  # TFD_NONBLOCK | TFD_CLOEXEC share these values


def _oserror() -> OSError:
    code = ctypes.get_errno()
    return OSError(code, os.strerror(code))


class Timer:
    """A one-shot monotonic timerfd: readable once the armed delay has passed."""

    def __init__(self) -> None:
        fd = _libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_FLAGS)
        if fd < 0:
            raise _oserror()
        self.fd: int = fd
        self._spec = _Itimerspec()

    def arm(self, delay: float) -> None:
        # A zero it_value would disarm: the shortest delay is one microsecond. Rounded up,
        # so that the timer never fires before the deadline it stands for.
        seconds, fraction = divmod(max(delay, 1e-6), 1.0)
        self._spec.it_value.tv_sec = int(seconds)
        self._spec.it_value.tv_nsec = min(math.ceil(fraction * 1e9), 999_999_999)
        if _libc.timerfd_settime(self.fd, 0, ctypes.byref(self._spec), None) < 0:
            raise _oserror()

    def disarm(self) -> None:
        self._spec.it_value.tv_sec = 0
        self._spec.it_value.tv_nsec = 0
        if _libc.timerfd_settime(self.fd, 0, ctypes.byref(self._spec), None) < 0:
            raise _oserror()

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)

    def close(self) -> None:
        os.close(self.fd)


class PeerMemory:
    """Another process's memory, read and written with process_vm_readv/writev."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._local = _Iovec()
        self._remote = _Iovec()
        self._local_p = ctypes.pointer(self._local)
        self._remote_p = ctypes.pointer(self._remote)

    def copy(self, write: bool, local: int, remote: int, length: int) -> int:
        """Copy `length` bytes local -> remote (write) or remote -> local; 0 or an errno."""
        call = _libc.process_vm_writev if write else _libc.process_vm_readv
        done = 0
        while done < length:
            self._local.iov_base = local + done
            self._remote.iov_base = remote + done
            self._local.iov_len = self._remote.iov_len = length - done
            n = call(self.pid, self._local_p, 1, self._remote_p, 1, 0)
            if n < 0:
                return ctypes.get_errno() or errno.EIO
            if n == 0:  # a partial transfer stopped at an unmapped page
                return errno.EFAULT
            done += n
        return 0


# struct flock on Linux x86-64/aarch64: l_type, l_whence, l_start, l_len, l_pid (+ padding).
_FLOCK = struct.Struct("@hhqqi4x")


def lock_range(fd: int, kind: int, start: int, length: int) -> None:
    """An OFD lock (`fcntl.F_RDLCK`, `F_WRLCK` or `F_UNLCK`) on [start, start+length), waiting."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))


def host_identity() -> str:
    """Equal for two processes iff their pids name each other (same boot, same PID namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""  # unknown: never treated as the same host
    return f"{boot}/{pidns}"
