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

Leases. MPICH moves a passive-target operation of any size only inside the
target's MPI calls (even an 8 B `Rput` completes locally only once the target
has called MPI: 0.18 ms against a target that called every 0.1 ms, and a
4 MiB one took 0.1 s), and the target sees no sign of it. So an origin
*leases* a target's memory: before its first operation there it sends
`Lease(held=True)`, which reaches the target ahead of the operation's data,
and a rank that a peer holds a lease from does not back off (`Engine.hot`).
The origin lets go (`Lease(held=False)`) once its check every `LINGER` finds
nothing in flight there and nothing issued or ended since the check before.
A stream of operations costs two control messages; the first operation after
a lull waits for the target's next pass, as a two-sided message to an idle
rank does; and a rank whose memory nobody uses backs off as any rank does (it
used to poll for good once a peer had looked its table up: a whole core while
it waited, bench/rma_lull.py). A lease ends by its holder's word, not by a
clock at the target: a message sent to renew one would wait in MPI's queue
behind the operations' own data, which a target that had begun to back off
moves a fragment per pass, and a target that served for a time after each
nudge let 4 MiB puts fall to 5-159 MB/s beside a busy process
(bench/results/rma-serve-2026-11-29.txt). Only a lease not renewed for
`LEASE` lapses (its holder may have died), at the target's check every
`LEASE`; a holder in use renews it every `LEASE / 2`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

from mpi4py import MPI

from mate.buffers import address_of
from mate.errors import FailureReason
from mate.schedule import Op, Region
from mate.transports.base import Operation
from mate.transports.mpi.control import (
    Control,
    ControlChannel,
    Lease,
    Revoke,
    RevokeAck,
    Table,
    TableRequest,
)
from mate.transports.mpi.progress import SPIN, TRANSFER_SIZE, Engine, transfer_hold
from mate.transports.mpi.reports import Reporter
from mate.transports.mpi.rma import CallOnLoop, Rma, RmaOp

LINGER: Final = SPIN  # an origin lets a lease go within 1-2 times this after its last use
LEASE: Final = 1.0  # a lease its holder has not renewed for this long lapses at the target


class _Lease:
    """A lease this rank holds on a peer's memory (origin side)."""

    __slots__ = ("in_use", "renewed", "used")

    def __init__(self, now: float) -> None:
        self.renewed = now  # when the last Lease(held=True) went
        self.in_use = 0  # operations issued to the peer and not ended
        self.used = True  # an operation was issued or ended since the last check


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
        self.leases: dict[int, _Lease] = {}  # held on peers' memory (see the module's docstring)
        # Peers holding a lease on this rank's memory -> when they last renewed it.
        self.lessees: dict[int, float] = {}
        self._lapse_check_due = False  # a check for lapsed leases is asked for
        self.leases_taken = self.leases_released = 0  # Lease messages sent (world.stats())
        # MPICH moves an RMA operation along only inside MPI calls, at the origin and at
        # the target (passive target): neither backs off meanwhile.
        engine.hot = lambda: bool(self.issued or self.lessees)

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
        self._use(peer)
        if n >= TRANSFER_SIZE:
            self.nudge(peer, n)
        try:
            if op.op is Op.PUT:
                request = self.win.Rput(state.data, peer, target)
            else:
                request = self.win.Rget(state.data, peer, target)
        except MPI.Exception as exc:
            self._used(peer)
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

    # -- leases (see the module's docstring) ---------------------------------------------

    def _use(self, peer: int) -> None:
        """An operation on `peer`'s memory is about to be issued: hold a lease there."""
        lease = self.leases.get(peer)
        if lease is None:
            lease = self.leases[peer] = _Lease(time.monotonic())
            self._send_lease(peer, True)
            self.engine.call_later(LINGER, lambda: self._check(peer))
        lease.in_use += 1
        lease.used = True

    def _used(self, peer: int) -> None:
        """An operation on `peer`'s memory ended."""
        lease = self.leases[peer]
        lease.in_use -= 1
        lease.used = True

    def _check(self, peer: int) -> None:
        """Every LINGER while the lease on `peer`'s memory is held: let it go if nothing
        was issued or ended since the last check and nothing is in flight, else check
        again later (renewing it once LEASE / 2 old). No clock per operation."""
        lease = self.leases[peer]
        if not (lease.in_use or lease.used):
            del self.leases[peer]
            self._send_lease(peer, False)
            return
        lease.used = False
        now = time.monotonic()
        if now - lease.renewed > LEASE / 2:
            lease.renewed = now
            self._send_lease(peer, True)
        self.engine.call_later(LINGER, lambda: self._check(peer))

    def _send_lease(self, peer: int, held: bool) -> None:
        if self.engine.nudge is None:
            return  # shut down: nothing more goes to peers (MpiTransport._cancel_everything)
        if held:
            self.leases_taken += 1
        else:
            self.leases_released += 1
        self.control.send(peer, Lease(held))

    def _lease_told(self, peer: int, held: bool) -> None:
        """`peer` took or renewed a lease on this rank's memory, or let it go (target
        side). Leases not renewed for LEASE are dropped by a check every LEASE."""
        if not held:
            self.lessees.pop(peer, None)
            return
        self.lessees[peer] = time.monotonic()
        if not self._lapse_check_due:
            self._lapse_check_due = True
            self.engine.call_later(LEASE, self._drop_lapsed)

    def _drop_lapsed(self) -> None:
        now = time.monotonic()
        for peer in [peer for peer, renewed in self.lessees.items() if now - renewed >= LEASE]:
            del self.lessees[peer]
        self._lapse_check_due = bool(self.lessees)
        if self.lessees:
            self.engine.call_later(LEASE, self._drop_lapsed)

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "rma_leases_taken": self.leases_taken,
                "rma_leases_released": self.leases_released, "rma_lessees": len(self.lessees)}

    def local_done(self, op: Operation, error: MPI.Exception | None) -> None:
        self.issued -= 1
        self._used(op.peer)
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
        elif isinstance(message, Lease):
            self._lease_told(source, message.held)
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
