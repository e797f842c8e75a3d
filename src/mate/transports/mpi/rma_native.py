"""put and get as MPI-3 RMA (`rma="native"`, seed 003).

One dynamic window for the world (`Win_create_dynamic`), exposing is
`Win_attach`, one `Lock_all` epoch for the world's life, request-based
`Rput`/`Rget`. An Rput's request completing means the origin buffer is free
(submission); remote completion is `Win_flush`, done once per target per
progress pass for all the puts that reached that point (batching).

Bounds are checked at the origin against the target's region table, fetched
on first use (`TableRequest`) and fetched again when an address is not in
it, so that a bad address fails with REMOTE_ACCESS and never reaches MPI.
Unexposing revokes the region: the target sends `Revoke` to every peer that
fetched its table; a peer drops the table, flushes what it has in flight to
the target, and answers `RevokeAck`; then the target detaches. Tables carry
an epoch so that a reply overtaken by a revoke is recognised as stale.
"""

from __future__ import annotations

import asyncio
import time

from mpi4py import MPI

from mate.buffers import address_of
from mate.errors import FailureReason
from mate.schedule import Op, Region
from mate.transports.base import Operation
from mate.transports.mpi.control import (
    Control,
    ControlChannel,
    Revoke,
    RevokeAck,
    Table,
    TableRequest,
)
from mate.transports.mpi.progress import TRANSFER_SIZE, Engine, transfer_hold
from mate.transports.mpi.reports import Reporter
from mate.transports.mpi.rma import CallOnLoop, Rma, RmaOp


class NativeRma(Rma):
    name = "native"

    def __init__(self, mypid: int, comm: MPI.Intracomm, engine: Engine, control: ControlChannel,
                 report: Reporter, call_on_loop: CallOnLoop) -> None:
        super().__init__(mypid, engine, control, report, call_on_loop)
        self.win = MPI.Win.Create_dynamic(MPI.INFO_NULL, comm)
        self.win.Set_errhandler(MPI.ERRORS_RETURN)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.epoch = 0  # of this rank's table; bumped by every unexpose
        self.readers: set[int] = set()  # peers that fetched this rank's table
        self.tables: dict[int, tuple[tuple[int, int], ...]] = {}  # peers' tables, cached
        self.revoked: dict[int, int] = {}  # peer -> latest revoke epoch seen
        self.waiting: dict[int, list[Operation]] = {}  # ops waiting for a peer's table
        self.to_flush: dict[int, list[Operation]] = {}  # puts locally complete, not yet flushed
        self.acks: dict[int, tuple[set[int], asyncio.Future[None]]] = {}
        self.issued = 0  # Rput/Rget requests not yet complete
        self.poking: dict[int, float] = {}  # peer -> until when our last nudge has it poking
        # MPICH moves an RMA operation along only inside MPI calls, at the origin
        # and at the target (passive target): neither may back off meanwhile.
        engine.hot = lambda: bool(self.issued or (self.readers and self.regions.entries))

    # -- origin side ---------------------------------------------------------------------

    def start(self, op: Operation, refreshed: bool = False) -> None:
        state: RmaOp = op.transport_data
        if state is None:  # first start: an operation with a timeout can be abandoned
            state = op.transport_data = RmaOp(op, copy=op.deadline is not None)
        peer, n = op.peer, len(op.buffer)
        table = self.tables.get(peer)
        inside = table is not None and any(a <= op.address and op.address + n <= a + size
                                           for a, size in table)
        if not inside and (table is None or not refreshed):
            state.waiting = True
            queue = self.waiting.setdefault(peer, [])
            queue.append(op)
            if len(queue) == 1:
                self.query(peer)
            return
        state.waiting = False
        if not inside:
            self.refuse(op)
            return
        target = (op.address, n, MPI.BYTE)
        if n >= TRANSFER_SIZE:
            self.nudge(peer, n)
        try:
            if op.op is Op.PUT:
                request = self.win.Rput(state.data, peer, target)
            else:
                request = self.win.Rget(state.data, peer, target)
        except MPI.Exception as exc:
            self.failed(op, FailureReason.TRANSPORT, f"MPI_R{op.op.value}: {exc}", exc)
            return
        if op.op is Op.PUT and state.copied:
            self.submitted(op)  # MPI reads the copy
        self.issued += 1
        self.engine.add(request, lambda _op, status, error: self.local_done(op, error),
                        owner=op, peer=peer, nbytes=n, one_sided=True)

    def nudge(self, peer: int, nbytes: int) -> None:
        """Tell `peer` of a large operation on its memory, unless a nudge sent lately
        has it poking for half this operation's hold still.

        A passive target sees no sign of the operation, yet MPICH moves it only inside
        the target's MPI calls: a nudge makes the target poke between passes for as
        long as the operation's posting holds this rank's backoff (`transfer_hold`),
        from the time it takes the nudge in (progress.py), so the target pokes at
        least until `poking[peer]`. While that covers half this operation's hold,
        another nudge would only cost both ends a control message: with a nudge per
        operation, native 64 KiB puts and gets took 39-61 us in poll mode against
        25-34 us without (bench/results/nudge-window-2026-11-29.txt). An operation
        that has not crossed SPIN after its posting nudges again all the same (a
        late nudge).
        """
        nudge, now, hold = self.engine.nudge, time.monotonic(), transfer_hold(nbytes)
        if nudge is not None and self.poking.get(peer, 0.0) < now + hold / 2:  # None: shut down
            self.poking[peer] = now + hold
            nudge(peer, nbytes, True)

    def local_done(self, op: Operation, error: MPI.Exception | None) -> None:
        self.issued -= 1
        if error is not None:
            self.failed(op, FailureReason.TRANSPORT, f"MPI_R{op.op.value}: {error}", error)
        elif op.op is Op.GET:
            self.completed(op)
        elif op.transport_data.live:
            self.submitted(op)
            if not self.to_flush:
                self.engine.after_pass(self.flush)
            self.to_flush.setdefault(op.peer, []).append(op)

    def flush(self) -> None:
        """Remote completion for every put that completed locally in this pass."""
        batches, self.to_flush = self.to_flush, {}
        for peer, ops in batches.items():
            try:
                self.win.Flush(peer)
            except MPI.Exception as exc:
                for op in ops:
                    self.failed(op, FailureReason.TRANSPORT, f"MPI_Win_flush: {exc}", exc)
                continue
            for op in ops:
                self.completed(op)

    def query(self, peer: int) -> None:
        """Ask `peer` for its region table."""
        tag = self.control.new_tag()
        buffer = bytearray(Table.MAX_SIZE)
        self.control.recv(buffer, peer, tag,
                          lambda _owner, status, error: self.on_table(peer, buffer, status, error),
                          standing=False)
        self.control.send(peer, TableRequest(tag))

    def on_table(self, peer: int, buffer: bytearray, status: MPI.Status,
                 error: MPI.Exception | None) -> None:
        if status.Is_cancelled():
            return
        waiting = [op for op in self.waiting.pop(peer, []) if op.transport_data.waiting]
        if error is not None:
            for op in waiting:
                self.failed(op, FailureReason.TRANSPORT, f"region table of rank {peer}: {error}",
                            error)
            return
        table = Table.decode_body(memoryview(buffer))
        if table.epoch < self.revoked.get(peer, 0):  # overtaken by a revoke: ask again
            self.waiting[peer] = waiting
            if waiting:
                self.query(peer)
            return
        self.tables[peer] = table.regions
        for op in waiting:
            self.start(op, refreshed=True)

    def cancel(self, op: Operation) -> None:
        state: RmaOp | None = op.transport_data
        if state is not None and state.waiting:  # not issued yet: nothing to abandon
            state.waiting = False
            state.abandoned = True
            self.report.cancelled(op)
        else:
            super().cancel(op)

    def cancel_all(self) -> None:
        self.waiting.clear()

    # -- target side ---------------------------------------------------------------------

    def expose(self, view: memoryview) -> Region:
        region = Region(self.mypid, MPI.Get_address(view) if len(view) else address_of(view),
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
            future = asyncio.get_running_loop().create_future()
            # The acks' own copy: in thread mode the progress thread takes a RevokeAck
            # out of it, maybe before this loop over the readers is done.
            self.acks[epoch] = (set(readers), future)
            for peer in readers:
                self.control.send(peer, Revoke(epoch))
            self.engine.drive_until(future.done)
            await future
        if view is not None and len(view):
            self.win.Detach(view)

    def on_control(self, source: int, message: Control) -> None:
        if isinstance(message, TableRequest):
            with self.regions.lock:
                self.readers.add(source)
                epoch = self.epoch
            self.control.send(source, Table(epoch, self.regions.table()), message.reply_tag)
        elif isinstance(message, Revoke):
            self.revoked[source] = max(message.epoch, self.revoked.get(source, 0))
            self.tables.pop(source, None)
            self.win.Flush(source)  # whatever was issued to `source` has landed
            self.control.send(source, RevokeAck(message.epoch))
        elif isinstance(message, RevokeAck):
            pending = self.acks.get(message.epoch)
            if pending is not None:
                peers, future = pending
                peers.discard(source)
                if not peers:
                    del self.acks[message.epoch]
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
