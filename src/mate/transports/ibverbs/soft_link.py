"""The soft device's sockets before they carry frames: listening, dialing, the handshake.

Each device listens on one socket: "unix:@name" (Linux's abstract namespace:
no file, so a killed process leaves nothing behind; "unix:/path" is dialed
too) or "tcp:host:port". One socket carries one connected QP pair; the side
with the lower (address, qp_num) dials, sends its `Hello`, and waits for the
other's; a connection refused means the peer device is not open yet and is
tried again until the deadline. A
hello names both QPs and their PSNs (so a connection that meets the wrong
QP, or a stale endpoint, fails at connect time) and what a peer needs for
direct one-sided access: the pid, the host identity, the MR table's path and
a probe (an address whose 16 bytes must read back as `token` through
process_vm_readv, which proves that direct access works).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import struct
import time
from typing import Any, NamedTuple, get_type_hints

from mate.transports.ibverbs.verbs import VerbsError

BACKLOG = 4096
_LEN = struct.Struct("<I")
_HELLO_MAX = 1 << 16
_VERSION = 1


class Hello(NamedTuple):
    address: str  # the sender's device
    qp: int  # the sender's QP
    psn: int
    dst_qp: int  # the QP it wants to reach
    dst_psn: int
    pid: int
    host: str
    table: str
    probe: int
    token: str  # hex
    pd: int  # the sender QP's protection domain, checked against the MR table's entries
    error: str = ""  # a refusal instead of a hello


_FIELD_TYPES = get_type_hints(Hello)


def listen(link: str, host: str) -> tuple[socket.socket, str]:
    """The device's listening socket and its address."""
    if link == "unix":
        name = f"mate-soft-{os.getpid()}-{secrets.token_hex(8)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + name)
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
        return sock, "unix:@" + name
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock, f"tcp:{host}:{sock.getsockname()[1]}"


def dial(address: str, deadline: float) -> socket.socket:
    """A blocking socket connected to the device listening at `address`."""
    kind, _, rest = address.partition(":")
    if kind == "unix":
        family: int = socket.AF_UNIX
        target: Any = "\0" + rest[1:] if rest.startswith("@") else rest
    elif kind == "tcp":
        host, _, port = rest.rpartition(":")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            target = (host, int(port))
        except ValueError:
            raise VerbsError(f"bad soft device address {address!r}") from None
    else:
        raise VerbsError(f"bad soft device address {address!r}")
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            sock.connect(target)
            return sock
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            sock.close()
            if time.monotonic() > deadline:
                raise VerbsError(f"cannot reach {address}: {exc}") from exc
            time.sleep(0.01)  # the peer device is not listening yet
        except OSError as exc:
            sock.close()
            raise VerbsError(f"cannot reach {address}: {exc}") from exc


def send_hello(sock: socket.socket, hello: Hello) -> None:
    data = json.dumps({"v": _VERSION, **hello._asdict()}).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_hello(sock: socket.socket) -> Hello:
    """The peer's hello (VerbsError if it is not one); the socket has a timeout."""
    try:
        (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
        if size > _HELLO_MAX:
            raise VerbsError("oversized handshake")
        raw = json.loads(_recv_exact(sock, size))
        if not isinstance(raw, dict) or raw.pop("v", None) != _VERSION:
            raise VerbsError("not a soft device handshake")
        hello = Hello(**raw)
    except (OSError, ValueError, TypeError, RecursionError) as exc:  # (JSON nested too deep)
        raise VerbsError(f"bad handshake: {exc}") from exc
    for name, kind in _FIELD_TYPES.items():
        if type(getattr(hello, name)) is not kind:  # exact: a bool is no int here
            raise VerbsError(f"bad handshake field {name!r}")
    return hello


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    # Exactly `size` bytes: frames may follow the hello on the same socket.
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise VerbsError("connection closed during the handshake")
        buf += chunk
    return bytes(buf)


def close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
