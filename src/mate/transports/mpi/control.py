"""The MPI transport's control channel: its own communicator, one typed message per kind.

The transport's own traffic (region tables and their revocation for native
RMA, the emulated put/get protocol) travels on a duplicate of COMM_WORLD of
its own, so that every user tag stays the user's. Requests go to a standing
receive on `CONTROL_TAG`; answers and bulk data go to private tags that the
asking rank picks (`new_tag`) and posts a receive on first.

Each kind of message is a small value type with its own fields and its own
wire format (`encode`, and `decode` by the kind byte that starts every
message), so that no field carries something other than what its name says.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
from mpi4py import MPI

from mate.transports.mpi.progress import Action, Engine, Entry

logger = logging.getLogger("mate")

CONTROL_TAG = 1  # the standing receive's tag
FIRST_PRIVATE_TAG = 16  # private tags (answers, data) run from here to tag_max, and wrap
CONTROL_EAGER = 1024  # an emulated put carries its data in the request up to this size
MAX_REGIONS = 4096  # the most regions a table reply lists

_REGION = struct.Struct("<QQ")  # (address, length) of a region, in a table


class _Fixed:
    """A message of fixed size: its kind, then its fields in order (`FORMAT`)."""

    KIND: ClassVar[int]
    FORMAT: ClassVar[struct.Struct]

    def encode(self) -> bytes:
        return self.FORMAT.pack(self.KIND, *attrs.astuple(self))  # type: ignore[arg-type]


@attrs.frozen
class TableRequest(_Fixed):
    """Origin -> target: send me your region table on `reply_tag`."""

    KIND: ClassVar[int] = 1
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<Bxxxi")
    reply_tag: int


@attrs.frozen
class Table:
    """Target -> origin: its exposed regions as of `epoch` (bumped by every unexpose)."""

    KIND: ClassVar[int] = 2
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<BxxxIQ")  # kind, count, epoch
    epoch: int
    regions: tuple[tuple[int, int], ...]

    #: The buffer a table reply is received into.
    MAX_SIZE: ClassVar[int] = FORMAT.size + _REGION.size * MAX_REGIONS

    def encode(self) -> bytes:
        regions = self.regions[:MAX_REGIONS]
        return self.FORMAT.pack(self.KIND, len(regions), self.epoch) + b"".join(
            _REGION.pack(address, length) for address, length in regions)

    @classmethod
    def decode_body(cls, data: memoryview) -> Table:
        _, count, epoch = cls.FORMAT.unpack_from(data)
        return cls(epoch, tuple(_REGION.unpack_from(data, cls.FORMAT.size + _REGION.size * i)
                                for i in range(count)))


@attrs.frozen
class Revoke(_Fixed):
    """Target -> origin: forget my table; acknowledge once your operations to me landed."""

    KIND: ClassVar[int] = 3
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<BxxxxxxxQ")
    epoch: int


@attrs.frozen
class RevokeAck(_Fixed):
    """Origin -> target: nothing of mine is in flight to you any more (for `epoch`)."""

    KIND: ClassVar[int] = 4
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<BxxxxxxxQ")
    epoch: int


@attrs.frozen
class Get(_Fixed):
    """Origin -> target (emulated): send `length` bytes at `address` to `reply_tag`."""

    KIND: ClassVar[int] = 5
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<BxxxiQQ")
    reply_tag: int
    address: int
    length: int


@attrs.frozen
class GetRefused(_Fixed):
    """Target -> origin (emulated): the get on `reply_tag` is outside my regions."""

    KIND: ClassVar[int] = 6
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<Bxxxi")
    reply_tag: int


@attrs.frozen
class Put:
    """Origin -> target (emulated, eager): write `data` at `address`; answer on `reply_tag`."""

    KIND: ClassVar[int] = 7
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<BxxxiQ")
    reply_tag: int
    address: int
    data: bytes

    def encode(self) -> bytes:
        return self.FORMAT.pack(self.KIND, self.reply_tag, self.address) + self.data


@attrs.frozen
class PutRequest(_Fixed):
    """Origin -> target (emulated, rendezvous): may I write `length` bytes at `address`?"""

    KIND: ClassVar[int] = 8
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<BxxxiQQ")
    reply_tag: int
    address: int
    length: int


@attrs.frozen
class Reply:
    """Target -> origin (emulated put), on the put's reply tag: cleared (send the data to
    `data_tag`) or done, if `ok`; refused (outside my regions) if not."""

    KIND: ClassVar[int] = 9
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<B?xxi")
    ok: bool
    data_tag: int = 0

    SIZE: ClassVar[int] = FORMAT.size

    def encode(self) -> bytes:
        return self.FORMAT.pack(self.KIND, self.ok, self.data_tag)

    @classmethod
    def decode_body(cls, data: bytes | bytearray | memoryview) -> Reply:
        _, ok, data_tag = cls.FORMAT.unpack_from(data)
        return cls(ok, data_tag)


@attrs.frozen
class Abandon(_Fixed):
    """Origin -> target (emulated): I gave up the get or put I asked for on `reply_tag`
    before its data moved (my receive for it was cancelled, at shutdown): stop holding
    your region for it."""

    KIND: ClassVar[int] = 10
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<Bxxxi")
    reply_tag: int


@attrs.frozen
class Nudge(_Fixed):
    """Either end of a large message -> the other: it has not crossed yet; do not back
    off for a while, and if it is a native put or get (`one_sided`), poke meanwhile
    (see `mate.transports.mpi.progress`, transfers)."""

    KIND: ClassVar[int] = 11
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<BxxxxxxxQ?")
    nbytes: int
    one_sided: bool


@attrs.frozen
class Lease(_Fixed):
    """Origin -> target (native RMA): I use your memory from now on, so do not back off
    (`held`), or I stopped (not `held`); see `mate.transports.mpi.rma_native`, leases."""

    KIND: ClassVar[int] = 12
    FORMAT: ClassVar[struct.Struct] = struct.Struct("<B?")
    held: bool


Control = (TableRequest | Table | Revoke | RevokeAck | Get | GetRefused | Put | PutRequest
           | Reply | Abandon | Nudge | Lease)


def decode(data: memoryview) -> Control:
    """The message `data` holds; ValueError if it is none."""
    kind = data[0] if len(data) else 0
    if kind == Table.KIND:
        return Table.decode_body(data)
    if kind == Reply.KIND:
        return Reply.decode_body(data)
    if kind == Put.KIND:
        _, reply_tag, address = Put.FORMAT.unpack_from(data)
        return Put(reply_tag, address, bytes(data[Put.FORMAT.size:]))
    fixed: tuple[type[_Fixed], ...] = (TableRequest, Revoke, RevokeAck, Get, GetRefused,
                                        PutRequest, Abandon, Nudge, Lease)
    for cls in fixed:
        if kind == cls.KIND:
            return cls(*cls.FORMAT.unpack_from(data)[1:])  # type: ignore[return-value]
    raise ValueError(f"not a control message (kind {kind})")


class ControlChannel:
    """Sends and receives control messages and bulk data on the control communicator.

    Requests that arrive on `CONTROL_TAG` go to `on_message(source, message)`,
    in the progress context. Sends and receives are requests of the engine.

    Shutdown closes the channel once every rank has ended its operations (the
    transport's first meeting), before the last meeting: after that meeting a
    peer may free its communicators at once, and what reaches a freed one stays
    queued in MPI, whose context id MPICH gives to a later communicator, where a
    later world's receive could take it. A closed channel sends nothing (no peer
    needs its answers, abandons or leases by then) and counts what it dropped.
    """

    #: The next private tag, one counter for the whole process: an answer that arrives
    #: after its asker shut down stays queued in MPI, and MPICH gives the freed
    #: communicator's context id to the next one, so a later world in this process
    #: must not ask on the same tags.
    _next_tag = FIRST_PRIVATE_TAG

    def __init__(self, engine: Engine, tag_max: int,
                 on_message: Callable[[int, Control], None]) -> None:
        self.comm = MPI.COMM_WORLD.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._engine = engine
        self._tag_max = tag_max
        self._on_message = on_message
        self._inbox = bytearray(Put.FORMAT.size + CONTROL_EAGER)  # the largest request
        self.closed = False  # progress context only (`close`)
        self.dropped = 0  # sends asked for once closed

    def start(self) -> None:
        """Post the standing receive for requests."""
        self.recv(self._inbox, MPI.ANY_SOURCE, CONTROL_TAG, self._arrived)

    def new_tag(self) -> int:
        """A private tag for something this rank will receive (wraps around)."""
        tag = ControlChannel._next_tag
        ControlChannel._next_tag = tag + 1 if tag < self._tag_max else FIRST_PRIVATE_TAG
        return tag

    def close(self) -> None:
        """Send nothing from now on (shutdown, progress context: see the class)."""
        self.closed = True

    def send(self, dest: int, message: Control, tag: int = CONTROL_TAG) -> None:
        """Send a control message (a request, or an answer on its private tag)."""
        self.send_data(dest, message.encode(), tag, lambda _owner, status, error: None)

    def send_data(self, dest: int, data: Any, tag: int, action: Action, *,
                  owner: Any = None) -> Entry | None:
        """Send `data` to `tag`; run `action` when the send completed. The request keeps
        `data` alive until then; the returned entry lets the engine `disown` it. None,
        and no send and no action, once the channel is closed."""
        if self.closed:
            self.dropped += 1
            return None
        request = self.comm.Isend(data, dest, tag)
        return self._engine.add(request, action, owner=owner, standing=True, peer=dest,
                                nbytes=len(data))

    def recv(self, buffer: Any, source: int, tag: int, action: Action, *,
             owner: Any = None, standing: bool = True) -> Entry:
        """Receive into `buffer`; `standing=False` when a user message waits on it. The
        returned entry lets the engine `cancel` it."""
        request = self.comm.Irecv(buffer, source, tag)
        return self._engine.add(request, action, owner=owner, standing=standing, receive=True,
                                peer=None if source == MPI.ANY_SOURCE else source,
                                nbytes=len(buffer))

    def _arrived(self, _owner: None, status: MPI.Status, error: MPI.Exception | None) -> None:
        if status.Is_cancelled():
            return  # shutting down
        data = memoryview(bytes(self._inbox[: status.Get_count(MPI.BYTE)]))
        self.start()
        if error is not None:
            logger.error("mate: MPI error on the control channel: %s", error)
            return
        self._on_message(status.Get_source(), decode(data))

    def free(self) -> None:
        self.comm.Free()
