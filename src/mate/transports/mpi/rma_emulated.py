"""put and get over two-sided messages (`rma="emulated"`, thesis §5.2.1).

Get is a `Get` request that the target answers with the data on the origin's
private tag (or `GetRefused`). A put up to `CONTROL_EAGER` bytes carries its
data in a `Put` request and the target copies it (eager); a larger put asks
first (`PutRequest`), the target answers with a `Reply` naming a private tag
on which it has posted a receive straight into the destination, the origin
sends the data there, and the target answers again when it landed
(rendezvous). The target checks its own regions; unexposing waits until no
transfer into or out of the region is in flight.

A target that has answered a get or cleared a put holds the region for the
origin's next step. An origin that shuts down before that step cancels its
receive; once MPI confirms nothing was matched it sends `Abandon`, and the
target lets go: it cancels its receive into the region (MPI either cancels it
untouched or completes it), or hands its send out of the region to the
engine's orphans (its receiver is gone, so it is never matched and never reads
the region again). Without this a target unexposing after its origin left
would wait for ever.
"""

from __future__ import annotations

import asyncio

from mpi4py import MPI

from mate.buffers import address_of
from mate.errors import FailureReason
from mate.schedule import Op, Region
from mate.transports.base import Operation
from mate.transports.mpi.control import (
    CONTROL_EAGER,
    Abandon,
    Control,
    ControlChannel,
    Get,
    GetRefused,
    Put,
    PutRequest,
    Reply,
)
from mate.transports.mpi.progress import Engine, Entry
from mate.transports.mpi.reports import Reporter
from mate.transports.mpi.rma import CallOnLoop, Regions, Rma, RmaOp


class EmulatedRma(Rma):
    name = "emulated"

    def __init__(self, mypid: int, engine: Engine, control: ControlChannel, report: Reporter,
                 call_on_loop: CallOnLoop, regions: Regions | None = None) -> None:
        super().__init__(mypid, engine, control, report, call_on_loop, regions)
        self.gets: dict[int, Operation] = {}  # gets by reply tag, until the data or a refusal
        self.drained: dict[Region, asyncio.Future[None]] = {}
        # Target side: transfers that hold a region until the origin's next step, by
        # (origin, its reply tag): the region, and the send (get) or receive (put).
        self.serving: dict[tuple[int, int], tuple[Region, Entry]] = {}

    # -- origin side ---------------------------------------------------------------------

    def start(self, op: Operation) -> None:
        n = len(op.buffer)
        tag = self.control.new_tag()
        eager = op.op is Op.PUT and n <= CONTROL_EAGER  # its data travels in the request
        state = op.transport_data = RmaOp(op, copy=eager or op.deadline is not None)
        if op.op is Op.GET:
            self.gets[tag] = op
            state.receive = self.control.recv(
                state.data, op.peer, tag,
                lambda _op, status, error: self.got(op, tag, status, error), owner=op,
                standing=False)
            self.control.send(op.peer, Get(tag, op.address, n))
        elif eager:
            self.await_reply(op, tag)
            self.control.send(op.peer, Put(tag, op.address, bytes(state.data)))
            self.submitted(op)
        else:
            reply = bytearray(Reply.SIZE)
            self.control.recv(
                reply, op.peer, tag,
                lambda _op, status, error: self.cleared(op, tag, reply, status, error),
                owner=op, standing=False)
            self.control.send(op.peer, PutRequest(tag, op.address, n))
            if state.copied:
                self.submitted(op)

    def got(self, op: Operation, tag: int, status: MPI.Status,
            error: MPI.Exception | None) -> None:
        op.transport_data.receive = None
        if self.gets.pop(tag, None) is None:  # refused: the receive was cancelled
            self.refuse(op)
        elif status.Is_cancelled():  # by shutdown, before the data came
            self.control.send(op.peer, Abandon(tag))
        elif error is not None:
            self.failed(op, FailureReason.TRANSPORT, f"emulated get: {error}", error)
        else:
            self.completed(op)

    def cleared(self, op: Operation, tag: int, buffer: bytearray, status: MPI.Status,
                error: MPI.Exception | None) -> None:
        """The target answered a rendezvous put's request: send the data to its tag.

        An abandoned put still sends it (from its copy): the target has posted a
        receive into the region and holds the region busy until the data lands.
        """
        if status.Is_cancelled():  # by shutdown, before the target answered
            self.control.send(op.peer, Abandon(tag))
            return
        if error is not None:
            self.failed(op, FailureReason.TRANSPORT, f"emulated put: {error}", error)
            return
        reply = Reply.decode_body(buffer)
        if not reply.ok:
            self.refuse(op)
            return
        self.control.send_data(op.peer, op.transport_data.data, reply.data_tag,
                               lambda _op, status, error: self.submitted(op), owner=op)
        self.await_reply(op, tag)

    def await_reply(self, op: Operation, tag: int) -> None:
        """The target's last word on a put: landed (completion), or refused."""
        buffer = bytearray(Reply.SIZE)

        def answered(_op: Operation, status: MPI.Status, error: MPI.Exception | None) -> None:
            if error is not None:
                self.failed(op, FailureReason.TRANSPORT, f"emulated put: {error}", error)
            elif not Reply.decode_body(buffer).ok:
                self.refuse(op)
            else:
                self.completed(op)

        self.control.recv(buffer, op.peer, tag, answered, owner=op, standing=False)

    # -- target side ---------------------------------------------------------------------

    def expose(self, view: memoryview) -> Region:
        region = Region(self.mypid, address_of(view), len(view))
        self.regions.add(region, view)
        return region

    async def unexpose(self, region: Region) -> None:
        self.regions.remove(region)
        with self.regions.lock:
            busy = self.regions.in_flight.get(region, 0) > 0
            if busy:
                future = asyncio.get_running_loop().create_future()
                self.drained[region] = future
        if busy:
            self.engine.drive_until(future.done)
            await future

    def hold(self, key: tuple[int, int], region: Region, transfer: Entry) -> None:
        """`transfer` (a get's send, a put's receive) holds `region` until `served(key)`."""
        self.serving[key] = (region, transfer)
        with self.regions.lock:
            self.regions.in_flight[region] = self.regions.in_flight.get(region, 0) + 1

    def served(self, key: tuple[int, int]) -> None:
        """The transfer `key` ended (its data moved, or it was let go): free its region."""
        held = self.serving.pop(key, None)
        if held is None:
            return
        region = held[0]
        with self.regions.lock:
            left = self.regions.in_flight[region] - 1
            if left:
                self.regions.in_flight[region] = left
                return
            del self.regions.in_flight[region]
            future = self.drained.pop(region, None)
        if future is not None:
            self.resolve(future)

    def on_control(self, source: int, message: Control) -> None:
        if isinstance(message, GetRefused):
            op = self.gets.pop(message.reply_tag, None)
            if op is not None and op.transport_data.receive is not None:
                self.engine.cancel(op.transport_data.receive)  # got() reports the refusal
        elif isinstance(message, Get):
            found = self.regions.find(message.address, message.length)
            if found is None:
                self.control.send(source, GetRefused(message.reply_tag))
                return
            region, view = found
            key = (source, message.reply_tag)
            send = self.control.send_data(source, view, message.reply_tag,
                                          lambda _owner, status, error: self.served(key))
            if send is not None:  # None: shutting down, and the origin is too
                self.hold(key, region, send)
        elif isinstance(message, Put):
            found = self.regions.find(message.address, len(message.data))
            if found is not None:
                found[1][:] = message.data
            self.control.send(source, Reply(found is not None), message.reply_tag)
        elif isinstance(message, PutRequest):
            found = self.regions.find(message.address, message.length)
            if found is None:
                self.control.send(source, Reply(False), message.reply_tag)
                return
            region, view = found
            data_tag = self.control.new_tag()
            key = (source, message.reply_tag)

            def landed(_owner: None, status: MPI.Status, error: MPI.Exception | None) -> None:
                self.served(key)
                if not status.Is_cancelled():
                    self.control.send(source, Reply(error is None), message.reply_tag)

            self.hold(key, region, self.control.recv(view, source, data_tag, landed))
            self.control.send(source, Reply(True, data_tag), message.reply_tag)
        elif isinstance(message, Abandon):
            self.let_go((source, message.reply_tag))

    def let_go(self, key: tuple[int, int]) -> None:
        """The origin of `key` abandoned it: stop holding the region for it."""
        held = self.serving.get(key)
        if held is None:
            return  # it ended already (or was never granted)
        if held[1].receive:
            self.engine.cancel(held[1])  # a put's receive: `landed` runs once MPI settled it
        else:
            self.engine.disown(held[1])  # a get's send: never matched now
            self.served(key)
