"""put and get for the MPI transport: native MPI-3 RMA, or emulated over messages.

Both keep this rank's exposed regions (`_Regions`) and answer peers' requests
on the control channel (`on_control`), with no help from the application.

Native (`rma="native"`, seed 003): one dynamic window for the world
(`Win_create_dynamic`), exposing is `Win_attach`, one `Lock_all` epoch for the
world's life, request-based `Rput`/`Rget`. An Rput's request completing means
the origin buffer is free (submission); remote completion is `Win_flush`,
done once per target per progress pass for all the puts that reached that
point (batching). Bounds are checked at the origin against the target's
region table, fetched on first use and fetched again when an address is not in
it, so that a bad address fails with REMOTE_ACCESS and never reaches MPI.
Unexposing revokes the region: the target sends REVOKE to every peer that
fetched its table; a peer drops the table, flushes what it has in flight to
the target, and acknowledges; then the target detaches. Table replies carry
an epoch so that a reply overtaken by a revoke is recognised as stale.

Emulated (`rma="emulated"`, thesis §5.2.1): get is a request answered with the
data on a private tag; put up to `CONTROL_EAGER` bytes carries its data in the
request and the target copies it (eager); a larger put asks first (RTS), the
target answers with a private tag on which it has posted a receive straight
into the destination, the origin sends the data, the target acknowledges
(rendezvous). The target checks its own regions; unexposing waits until no
transfer into or out of the region is in flight.

Once issued, put and get cannot be recalled (MPI offers no way to stop an RMA
operation), but one with an armed timeout can be *abandoned*: it works on an
internal copy (put: the data, copied at post, so it is submitted at once;
get: a scratch buffer, copied into the user's buffer only on completion), so
a timeout or a cancel ends the message at once, in the progress context,
whatever the target does. An abandoned put may still land at the target
(like a send that timed out); an abandoned get never writes the user's buffer.
Without a timeout an operation works on the user's buffer and can be
cancelled only while it waits for a region table; otherwise it completes or
fails.
"""

from __future__ import annotations

import abc
import asyncio
import struct
import threading
from typing import TYPE_CHECKING

from mpi4py import MPI

from mate.buffers import address_of
from mate.errors import FailureReason
from mate.schedule import Op, Region
from mate.transports.base import Operation
from mate.transports.mpi.transport import CONTROL_EAGER, HEADER

if TYPE_CHECKING:
    from mate.transports.mpi.transport import MpiTransport

# Control message kinds (the header's first byte).
TABLE_REQUEST, TABLE, REVOKE, REVOKE_ACK, GET, GET_REFUSED, PUT, PUT_RTS, REPLY = range(1, 10)
OK, REFUSED = 0, 1
ENTRY = struct.Struct("<QQ")  # (address, length) of a region in a table reply
MAX_REGIONS = 4096


class _Op:
    """The transport's state for one put or get (the message's `transport_data`)."""

    __slots__ = ("abandoned", "copied", "data", "ended", "request", "submitted", "waiting")

    def __init__(self, msg: Operation, *, copy: bool) -> None:
        self.copied = copy  # works on `data`, not the user's buffer: can be abandoned
        if not copy:
            self.data: bytes | bytearray | memoryview = msg.buffer
        elif msg.op is Op.PUT:
            self.data = bytes(msg.buffer)
        else:
            self.data = bytearray(len(msg.buffer))
        self.waiting = False  # native: queued until the target's region table arrives
        self.submitted = False
        self.ended = False  # its terminal outcome was reported
        self.abandoned = False  # timed out or cancelled: whatever happens next is ignored
        self.request: MPI.Request | None = None  # emulated get: the data's receive

    @property
    def live(self) -> bool:
        return not (self.ended or self.abandoned)


class _Regions:
    """This rank's exposed regions; read by the progress context, changed by the loop."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: list[tuple[Region, memoryview]] = []
        self.in_flight: dict[Region, int] = {}  # emulated transfers touching a region

    def add(self, region: Region, view: memoryview) -> None:
        with self.lock:
            self.entries.append((region, view))

    def remove(self, region: Region) -> memoryview | None:
        with self.lock:
            for i, (candidate, view) in enumerate(self.entries):
                if candidate == region:
                    del self.entries[i]
                    return view
        return None

    def find(self, address: int, length: int) -> tuple[Region, memoryview] | None:
        with self.lock:
            for region, view in self.entries:
                if region.contains(address, length):
                    start = address - region.address
                    return region, view[start:start + length]
        return None

    def table(self) -> list[tuple[int, int]]:
        with self.lock:
            return [(r.address, r.length) for r, _ in self.entries]


class _Rma(abc.ABC):
    def __init__(self, transport: MpiTransport) -> None:
        self.t = transport
        self.regions = _Regions()

    def submit(self, msg: Operation) -> None:
        """Start a put or get in the progress context, after the posting call returns."""
        self.t.engine.call(self.start, msg, owner=msg)

    put = get = submit

    @abc.abstractmethod
    def start(self, msg: Operation) -> None:
        """Issue a put or get (progress context)."""

    def cancel(self, msg: Operation) -> None:
        """Abandon `msg` if it works on a copy (progress context); see the docstring."""
        op: _Op | None = msg.transport_data
        if op is not None and op.live and op.copied:
            op.abandoned = True
            self.t.report_cancelled(msg)

    def report_submitted(self, msg: Operation) -> None:
        op: _Op = msg.transport_data
        if op.live and not op.submitted:
            op.submitted = True
            self.t.report_submitted(msg)

    def report_completed(self, msg: Operation) -> None:
        op: _Op = msg.transport_data
        if op.live:
            op.ended = True
            if msg.op is Op.GET and op.copied:
                msg.buffer[:] = op.data
            self.t.report_completed(msg, len(msg.buffer), msg.peer, 0)

    def report_failed(self, msg: Operation, reason: FailureReason, detail: str,
                      cause: BaseException | None = None) -> None:
        op: _Op = msg.transport_data
        if op.live:
            op.ended = True
            self.t.report_failed(msg, reason, detail, cause)

    def reply(self, dest: int, tag: int, flag: int, value: int = 0) -> None:
        self.t.control_send(dest, HEADER.pack(REPLY, flag, value, 0, 0), tag)

    def refuse(self, msg: Operation) -> None:
        n = len(msg.buffer)
        self.report_failed(msg, FailureReason.REMOTE_ACCESS,
                           f"[{msg.address:#x}, +{n}) is not inside a region "
                           f"rank {msg.peer} exposed")

    def resolve(self, future: asyncio.Future[None]) -> None:
        """Wake `future` (an unexpose waiting for peers) on the loop's thread."""
        self.t.sink.call_on_loop(_set_done, future)


class NativeRma(_Rma):
    def __init__(self, transport: MpiTransport) -> None:
        super().__init__(transport)
        self.win = MPI.Win.Create_dynamic(MPI.INFO_NULL, transport.comm)
        self.win.Set_errhandler(MPI.ERRORS_RETURN)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.epoch = 0  # of this rank's table; bumped by every unexpose
        self.readers: set[int] = set()  # peers that fetched this rank's table
        self.tables: dict[int, list[tuple[int, int]]] = {}  # peers' tables, cached
        self.revoked: dict[int, int] = {}  # peer -> latest revoke epoch seen
        self.waiting: dict[int, list[Operation]] = {}  # ops waiting for a peer's table
        self.to_flush: dict[int, list[Operation]] = {}  # puts locally complete, not yet flushed
        self.acks: dict[int, tuple[set[int], asyncio.Future[None]]] = {}
        self.issued = 0  # Rput/Rget requests not yet complete
        # MPICH moves an RMA operation along only inside MPI calls, at the origin
        # and at the target (passive target): neither may back off meanwhile.
        transport.engine.hot = lambda: bool(self.issued or (self.readers and self.regions.entries))

    # -- origin side ---------------------------------------------------------------------

    def start(self, msg: Operation, refreshed: bool = False) -> None:
        op: _Op = msg.transport_data
        if op is None:  # first start: an operation with a timeout can be abandoned
            op = msg.transport_data = _Op(msg, copy=msg.deadline is not None)
        peer, n = msg.peer, len(msg.buffer)
        table = self.tables.get(peer)
        inside = table is not None and any(a <= msg.address and msg.address + n <= a + size
                                           for a, size in table)
        if not inside and (table is None or not refreshed):
            op.waiting = True
            queue = self.waiting.setdefault(peer, [])
            queue.append(msg)
            if len(queue) == 1:
                self.query(peer)
            return
        op.waiting = False
        if not inside:
            self.refuse(msg)
            return
        target = (msg.address, n, MPI.BYTE)
        try:
            if msg.op is Op.PUT:
                request = self.win.Rput(op.data, peer, target)
            else:
                request = self.win.Rget(op.data, peer, target)
        except MPI.Exception as exc:
            self.report_failed(msg, FailureReason.TRANSPORT, f"MPI_R{msg.op.value}: {exc}", exc)
            return
        if msg.op is Op.PUT and op.copied:
            self.report_submitted(msg)  # MPI reads the copy
        self.issued += 1
        self.t.engine.add(request, lambda status, error: self.local_done(msg, error), owner=msg)

    def local_done(self, msg: Operation, error: MPI.Exception | None) -> None:
        self.issued -= 1
        if error is not None:
            self.report_failed(msg, FailureReason.TRANSPORT, f"MPI_R{msg.op.value}: {error}",
                               error)
        elif msg.op is Op.GET:
            self.report_completed(msg)
        elif msg.transport_data.live:
            self.report_submitted(msg)
            if not self.to_flush:
                self.t.engine.after_pass(self.flush)
            self.to_flush.setdefault(msg.peer, []).append(msg)

    def flush(self) -> None:
        """Remote completion for every put that completed locally in this pass."""
        batches, self.to_flush = self.to_flush, {}
        for peer, msgs in batches.items():
            try:
                self.win.Flush(peer)
            except MPI.Exception as exc:
                for msg in msgs:
                    self.report_failed(msg, FailureReason.TRANSPORT, f"MPI_Win_flush: {exc}",
                                       exc)
                continue
            for msg in msgs:
                self.report_completed(msg)

    def query(self, peer: int) -> None:
        tag = self.t.new_tag()
        buffer = bytearray(HEADER.size + ENTRY.size * MAX_REGIONS)
        self.t.control_recv(buffer, peer, tag,
                            lambda status, error: self.on_table(peer, buffer, status, error),
                            standing=False)
        self.t.control_send(peer, HEADER.pack(TABLE_REQUEST, 0, tag, 0, 0))

    def on_table(self, peer: int, buffer: bytearray, status: MPI.Status,
                 error: MPI.Exception | None) -> None:
        if status.Is_cancelled():
            return
        waiting = [msg for msg in self.waiting.pop(peer, []) if msg.transport_data.waiting]
        if error is not None:
            for msg in waiting:
                self.report_failed(msg, FailureReason.TRANSPORT,
                                   f"region table of rank {peer}: {error}", error)
            return
        _, _, _, epoch, count = HEADER.unpack_from(buffer)
        if epoch < self.revoked.get(peer, 0):  # overtaken by a revoke: ask again
            self.waiting[peer] = waiting
            if waiting:
                self.query(peer)
            return
        self.tables[peer] = [ENTRY.unpack_from(buffer, HEADER.size + ENTRY.size * i)
                             for i in range(count)]
        for msg in waiting:
            self.start(msg, refreshed=True)

    def cancel(self, msg: Operation) -> None:
        op: _Op | None = msg.transport_data
        if op is not None and op.waiting:  # not issued yet: nothing to abandon
            op.waiting = False
            op.abandoned = True
            self.t.report_cancelled(msg)
        else:
            super().cancel(msg)

    def cancel_all(self) -> None:
        self.waiting.clear()

    # -- target side ---------------------------------------------------------------------

    def expose(self, view: memoryview) -> Region:
        region = Region(self.t.mypid, MPI.Get_address(view) if len(view) else address_of(view),
                        len(view))
        if len(view):
            self.win.Attach(view)
        self.regions.add(region, view)
        return region

    async def unexpose(self, region: Region) -> None:
        view = self.regions.remove(region)
        with self.regions.lock:
            self.epoch += 1
            epoch, readers = self.epoch, set(self.readers)
            self.readers.clear()
        if readers:
            future = self.t.loop.create_future()
            self.acks[epoch] = (readers, future)
            for peer in readers:
                self.t.control_send(peer, HEADER.pack(REVOKE, 0, 0, epoch, 0))
            self.t.engine.drive_until(future.done)
            await future
        if view is not None and len(view):
            self.win.Detach(view)

    def on_control(self, source: int, kind: int, flag: int, tag: int, address: int,
                   length: int, data: memoryview) -> None:
        if kind == TABLE_REQUEST:
            with self.regions.lock:
                self.readers.add(source)
                epoch = self.epoch
            table = self.regions.table()[:MAX_REGIONS]
            reply = HEADER.pack(TABLE, 0, 0, epoch, len(table)) + b"".join(
                ENTRY.pack(a, n) for a, n in table)
            self.t.control_send(source, reply, tag)
        elif kind == REVOKE:
            self.revoked[source] = max(address, self.revoked.get(source, 0))
            self.tables.pop(source, None)
            self.win.Flush(source)  # whatever was issued to `source` has landed
            self.t.control_send(source, HEADER.pack(REVOKE_ACK, 0, 0, address, 0))
        elif kind == REVOKE_ACK:
            pending = self.acks.get(address)
            if pending is not None:
                peers, future = pending
                peers.discard(source)
                if not peers:
                    del self.acks[address]
                    self.resolve(future)

    def free(self) -> None:
        try:
            self.win.Unlock_all()
            with self.regions.lock:
                views = [view for _, view in self.regions.entries if len(view)]
            for view in views:
                self.win.Detach(view)
            self.win.Free()
        except MPI.Exception:
            pass  # shutdown goes on; MPI_Finalize reclaims the window


class EmulatedRma(_Rma):
    def __init__(self, transport: MpiTransport) -> None:
        super().__init__(transport)
        self.refused: dict[int, Operation] = {}  # gets by reply tag, until the data or a refusal
        self.drained: dict[Region, asyncio.Future[None]] = {}

    # -- origin side ---------------------------------------------------------------------

    def start(self, msg: Operation) -> None:
        t, n = self.t, len(msg.buffer)
        tag = t.new_tag()
        eager = msg.op is Op.PUT and n <= CONTROL_EAGER  # its data travels in the request
        op = msg.transport_data = _Op(msg, copy=eager or msg.deadline is not None)
        if msg.op is Op.GET:
            self.refused[tag] = msg
            op.request = t.control_recv(
                op.data, msg.peer, tag,
                lambda status, error: self.got(msg, tag, status, error), standing=False)
            t.control_send(msg.peer, HEADER.pack(GET, 0, tag, msg.address, n))
        elif eager:
            self.await_ack(msg, tag)
            t.control_send(msg.peer, HEADER.pack(PUT, 0, tag, msg.address, n) + op.data)
            self.report_submitted(msg)
        else:
            reply = bytearray(HEADER.size)
            t.control_recv(reply, msg.peer, tag,
                           lambda status, error: self.cleared(msg, tag, reply, error),
                           standing=False)
            t.control_send(msg.peer, HEADER.pack(PUT_RTS, 0, tag, msg.address, n))
            if op.copied:
                self.report_submitted(msg)

    def got(self, msg: Operation, tag: int, status: MPI.Status,
            error: MPI.Exception | None) -> None:
        msg.transport_data.request = None
        if self.refused.pop(tag, None) is None:  # refused: the receive was cancelled
            self.refuse(msg)
        elif error is not None:
            self.report_failed(msg, FailureReason.TRANSPORT, f"emulated get: {error}", error)
        else:
            self.report_completed(msg)

    def cleared(self, msg: Operation, tag: int, reply: bytearray,
                error: MPI.Exception | None) -> None:
        """The target answered a rendezvous put's RTS: send the data to its private tag.

        An abandoned put still sends it (from its copy): the target has posted a
        receive into the region and holds the region busy until the data lands.
        """
        t = self.t
        _, flag, data_tag, _, _ = HEADER.unpack_from(reply)
        if error is not None:
            self.report_failed(msg, FailureReason.TRANSPORT, f"emulated put: {error}", error)
            return
        if flag != OK:
            self.refuse(msg)
            return
        request = t.ctl.Isend(msg.transport_data.data, msg.peer, data_tag)
        t.engine.add(request, lambda status, error: self.report_submitted(msg),
                     owner=msg, standing=True)
        self.await_ack(msg, tag)

    def await_ack(self, msg: Operation, tag: int) -> None:
        ack = bytearray(HEADER.size)

        def acked(status: MPI.Status, error: MPI.Exception | None) -> None:
            if error is not None:
                self.report_failed(msg, FailureReason.TRANSPORT, f"emulated put: {error}",
                                   error)
            elif HEADER.unpack_from(ack)[1] != OK:
                self.refuse(msg)
            else:
                self.report_completed(msg)

        self.t.control_recv(ack, msg.peer, tag, acked, standing=False)

    def cancel_all(self) -> None:
        self.refused.clear()

    # -- target side ---------------------------------------------------------------------

    def expose(self, view: memoryview) -> Region:
        region = Region(self.t.mypid, address_of(view), len(view))
        self.regions.add(region, view)
        return region

    async def unexpose(self, region: Region) -> None:
        self.regions.remove(region)
        with self.regions.lock:
            busy = self.regions.in_flight.get(region, 0) > 0
            if busy:
                future = self.t.loop.create_future()
                self.drained[region] = future
        if busy:
            self.t.engine.drive_until(future.done)
            await future

    def begin(self, region: Region) -> None:
        with self.regions.lock:
            self.regions.in_flight[region] = self.regions.in_flight.get(region, 0) + 1

    def end(self, region: Region) -> None:
        with self.regions.lock:
            left = self.regions.in_flight[region] - 1
            if left:
                self.regions.in_flight[region] = left
                return
            del self.regions.in_flight[region]
            future = self.drained.pop(region, None)
        if future is not None:
            self.resolve(future)

    def on_control(self, source: int, kind: int, flag: int, tag: int, address: int,
                   length: int, data: memoryview) -> None:
        t = self.t
        if kind == GET_REFUSED:
            msg = self.refused.pop(tag, None)
            if msg is not None and msg.transport_data.request is not None:
                msg.transport_data.request.Cancel()  # got() then reports the refusal
            return
        found = self.regions.find(address, length)
        if kind == GET:
            if found is None:
                t.control_send(source, HEADER.pack(GET_REFUSED, 0, tag, address, length))
                return
            region, view = found
            self.begin(region)
            request = t.ctl.Isend(view, source, tag)
            t.engine.add(request, lambda status, error: self.end(region), standing=True)
        elif kind == PUT:
            if found is not None:
                found[1][:] = data[:length]
            self.reply(source, tag, OK if found is not None else REFUSED)
        elif kind == PUT_RTS:
            if found is None:
                self.reply(source, tag, REFUSED)
                return
            region, view = found
            data_tag = t.new_tag()
            self.begin(region)

            def landed(status: MPI.Status, error: MPI.Exception | None) -> None:
                self.end(region)
                self.reply(source, tag, OK if error is None else REFUSED)

            t.control_recv(view, source, data_tag, landed)
            self.reply(source, tag, OK, data_tag)

    def free(self) -> None:
        pass  # nothing beyond the communicators


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
