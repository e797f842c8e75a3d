"""The frames the ibverbs engine sends: one fixed header, then eager data.

Every SEND starts with `HEADER` (48 bytes, little-endian). Only an EAGER
frame has anything behind it: `length` bytes of the message. The fields:

    source   u32   the sender's rank (checked against the QP the frame came on)
    kind     u8    `Kind`
    flags    u8    `CREDIT_REQUEST` | `TRUNCATED` | `FAILED`
    grant    u16   receive credits returned to the receiver of this frame
    ack      u16   explicit CREDIT frames processed from the receiver, mod 2**16
    tag      i32   EAGER/RTS: the message tag; KEY_REPLY/REVOKE/REVOKE_ACK: region id
    length   u64   EAGER/RTS: message bytes; KEY_REQ: range bytes; KEY_REPLY: region bytes
    msg_id   u64   RTS/FIN/CANCEL_*: the sender's message id; KEY_*: the request id
    addr     u64   RTS: source buffer; KEY_REQ: range start; KEY_REPLY: region start
    rkey     u32   RTS, KEY_REPLY: the remote key

A frame that is too short, names an unknown kind or flag, or whose size does
not match its kind is refused with `ProtocolError` (the engine then treats
its sender as broken, see engine.py).
"""

from __future__ import annotations

import enum
import struct
from typing import Final, NamedTuple


class ProtocolError(Exception):
    """A frame that no correct peer sends."""


class Kind(enum.IntEnum):
    EAGER = 1  # a whole small message
    RTS = 2  # ready to send: a large message, to be RDMA-read by the receiver
    FIN = 3  # the receiver finished reading (TRUNCATED: it took less; FAILED: it could not)
    CANCEL_REQ = 4  # the sender asks to drop an RTS not yet matched
    CANCEL_ACK = 5  # ... dropped: the message will never be read
    KEY_REQ = 6  # give me a key for [addr, addr + length)
    KEY_REPLY = 7  # the region that contains it, and its key
    KEY_REFUSED = 8  # no exposed region contains it
    REVOKE = 9  # forget the key of this region; ack once nothing of yours uses it
    REVOKE_ACK = 10
    CREDIT = 11  # only credits (uses the control slot, consumes no data credit)


CREDIT_REQUEST: Final = 1  # the sender is low on credits to the receiver: return them soon
TRUNCATED: Final = 2  # FIN: the receive buffer was shorter than the message
FAILED: Final = 4  # FIN: the read failed; the send fails too
_FLAGS: Final = CREDIT_REQUEST | TRUNCATED | FAILED

HEADER: Final = struct.Struct("<IBBHH2xiQQQI4x")
HEADER_SIZE: Final = HEADER.size
_KINDS: Final = frozenset(Kind)
_EAGER: Final = Kind.EAGER  # read per frame: an enum read through its class is slow (3.11)


class Header(NamedTuple):
    source: int
    kind: int
    flags: int
    grant: int
    ack: int
    tag: int
    length: int
    msg_id: int
    addr: int
    rkey: int


pack_into: Final = HEADER.pack_into  # (buffer, offset, *the fields of Header in order)
_new_tuple: Final = tuple.__new__  # Header without NamedTuple's interpreted _make
_HEADER_TYPE: Final = Header  # Final: not looked up per frame


def decode(frame: bytes | bytearray | memoryview, offset: int = 0,
           size: int | None = None) -> Header:
    """The header of the `size`-byte frame at `offset` (default: all of `frame`).

    Raises ProtocolError unless it is one a correct peer sends.
    """
    if size is None:
        size = len(frame) - offset
    if size < HEADER_SIZE:
        raise ProtocolError(f"a frame of {size} bytes is shorter than the header")
    header = _new_tuple(_HEADER_TYPE, HEADER.unpack_from(frame, offset))
    if header.kind not in _KINDS:
        raise ProtocolError(f"unknown frame kind {header.kind}")
    if header.flags & ~_FLAGS:
        raise ProtocolError(f"unknown flags {header.flags:#x}")
    expected = HEADER_SIZE + header.length if header.kind == _EAGER else HEADER_SIZE
    if size != expected:
        raise ProtocolError(f"a {Kind(header.kind).name} frame of {size} bytes "
                            f"(expected {expected})")
    return header


def encode(source: int, kind: Kind, *, flags: int = 0, grant: int = 0, ack: int = 0,
           tag: int = 0, length: int = 0, msg_id: int = 0, addr: int = 0, rkey: int = 0,
           data: bytes = b"") -> bytes:
    """A whole frame as bytes (tests and tools; the engine packs into its pools)."""
    return HEADER.pack(source, kind, flags, grant, ack, tag, length, msg_id, addr,
                       rkey) + data
