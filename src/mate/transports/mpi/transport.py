"""The MPI transport: two-sided messages over mpi4py, and what drives them.

thesis §5.2, improved with MPI-3. The transport works on its own duplicate of
COMM_WORLD with MPI_ERRORS_RETURN, so that MPI errors become failure events
with the MPI error chained, never aborts; a second duplicate (the control channel) carries
the transport's own control traffic (region tables for native RMA, the
emulated put/get protocol), so every user tag stays available.

send is `Issend`: its completion means the receiver matched it, which is what
completion promises. A send up to `eager_size` bytes, or one with an armed
timeout, is sent from an internal copy and reports submission at once; any
other send reads the user's buffer until completion (submission = completion).
The copy is what lets a send be abandoned. MPI_Cancel of a send is
deprecated in MPI-4, and MPICH's ch4 device never cancels one (and crashed
here when asked), so the transport does not try: a timed-out or cancelled
copied send is left to MPI ("orphaned": it may still be delivered, as SPEC §1
allows) while its message times out or is cancelled; an uncopied send cannot
be abandoned while MPI may still read the user's buffer, so it completes when
the receiver matches it. Orphans cost little: the engine tests them apart
from live requests and rarely, and at most `orphan_limit` of them are kept
per destination; while a destination has that many, new sends to it fail
with RESOURCES at once (it is not receiving: more would only pile up).

recv is `Irecv` with the wildcards mapped both ways; a truncated message fails
with TRUNCATED and the receipt's length is what MPI wrote. A cancelled recv is
`MPI_Cancel` + test: if the data had already matched, the recv completes. A
large receive posted after the progress thread ran passes (the program computed)
is issued after the send posted right after it (`_post_recv`).

put and get are one of three strategies (`rma.py`, `rma_native.py`,
`rma_emulated.py`, and `rma_auto.py` choosing between the two by size),
whose requests travel on the control channel (`control.py`); progress
(poll, thread, manual) is `progress.py`; what a pass found reaches the core
through `reports.py`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

from mpi4py import MPI

from mate import debug
from mate.constants import ANY_SOURCE, ANY_TAG
from mate.errors import FailureReason
from mate.schedule import Op, Region
from mate.transports.base import Operation, Sink, Transport
from mate.transports.mpi import calls
from mate.transports.mpi.control import Control, ControlChannel, Nudge
from mate.transports.mpi.progress import TRANSFER_SIZE, Action, Engine, Entry
from mate.transports.mpi.reports import Reporter
from mate.transports.mpi.rma import Rma
from mate.transports.mpi.rma_auto import AutoRma
from mate.transports.mpi.rma_emulated import EmulatedRma
from mate.transports.mpi.rma_native import NativeRma

logger = logging.getLogger("mate")

# Module constants: a read through the enum class is slow on Python 3.11 (mate.message).
_SEND: Final = Op.SEND
_RECV: Final = Op.RECV
# MPI's constants, read once: a compiled read from the module is a dictionary lookup.
_MPI_ANY_SOURCE: Final = MPI.ANY_SOURCE
_MPI_ANY_TAG: Final = MPI.ANY_TAG


class _Send:
    """The transport's state for one send."""

    __slots__ = ("copied", "data", "entry", "orphaned")

    def __init__(self, data: Any, copied: bool) -> None:
        self.data = data  # keeps the buffer MPI reads alive
        self.copied = copied
        self.entry: Any = None  # the engine's handle of the request
        self.orphaned = False


class MpiTransport(Transport):
    supports_progress_handlers = True

    def __init__(self, sink: Sink, loop: asyncio.AbstractEventLoop, *, progress: str,
                 handlers: str, rma: str, rma_threshold: int, eager_size: int,
                 orphan_limit: int, shutdown_timeout: float) -> None:
        self._sink = sink
        self._hot_spot = debug.hot_spot_hook()
        self.eager_size = eager_size
        self.orphan_limit = orphan_limit
        self._orphans: Counter[int] = Counter()  # orphaned sends per destination
        self.shutdown_timeout = shutdown_timeout
        self.comm = MPI.COMM_WORLD.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._issend: calls.Post = calls.issend  # a message's MPI calls (calls.py)
        self._irecv: calls.Post = calls.irecv
        self._cancelled: Callable[[MPI.Status], bool] = calls.cancelled  # a status's reads
        self._received: Callable[[MPI.Status], tuple[int, int, int] | None] = calls.received
        self.mypid = self.comm.Get_rank()
        self.numprocs = self.comm.Get_size()
        self.tag_max = int(self.comm.Get_attr(MPI.TAG_UB) or 32767)
        self.report = Reporter(lambda: self._sink)  # the sink of the moment (see bind)
        # Called for every user message: bound once (a bound method is an object).
        self._on_send_done: Action = self._send_done
        self._on_recv_done: Action = self._recv_done
        self._report_submitted = self.report.submitted
        self.engine = Engine(loop, progress, self._contain, self.report.hand_over,
                             self._hot_spot, loop_helps=handlers == "loop")
        self.control = ControlChannel(self.engine, self.tag_max, self._on_control)
        self.engine.nudge = self._nudge
        self.engine.loop_work = lambda: self._sink.loop_work  # the sink of the moment
        self._nudges_sent = self._nudges_received = 0
        # Large receives that wait for the next send or pass (see _post_recv).
        self._deferred: list[Operation] = []  # receives not issued yet, in posting order
        self._deferred_lock = threading.Lock()  # the loop and the progress thread post
        self.rma: Rma
        if rma == "auto":
            self.rma = AutoRma(self.mypid, self.comm, self.engine, self.control, self.report,
                               self._call_on_loop, rma_threshold)
        elif rma == "native":
            self.rma = NativeRma(self.mypid, self.comm, self.engine, self.control, self.report,
                                 self._call_on_loop)
        else:
            self.rma = EmulatedRma(self.mypid, self.engine, self.control, self.report,
                                   self._call_on_loop)
        self.control.start()
        self.engine.start()

    # -- reporting to the core -----------------------------------------------------------

    def fail_later(self, msg: Operation, reason: FailureReason, detail: str,
                   cause: BaseException | None = None) -> None:
        """Fail `msg` from the next pass: never from inside the posting call."""
        self.engine.call(self.report.failed, msg, reason, detail, cause)

    def _call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        self._sink.call_on_loop(fn, *args)

    def _contain(self, exc: BaseException, owner: Any) -> None:
        """An exception escaped a call or action in the progress context.

        It is a bug of the transport, but it must not stop progress: the message
        it concerned fails with TRANSPORT (the exception chained) and the rest
        goes on. A message that already ended ignores the report.
        """
        logger.error("mate: internal error in the MPI transport (%r)", owner, exc_info=exc)
        if isinstance(owner, Operation):
            self.report.failed(owner, FailureReason.TRANSPORT,
                               f"internal error in the MPI transport: {exc!r}", exc)

    # -- two-sided -----------------------------------------------------------------------

    def post(self, msg: Operation) -> None:
        if self._hot_spot is not None:
            self._hot_spot("mpi.post")
        op = msg.op
        if op is _SEND:
            self._post_send(msg)
        elif op is _RECV:
            self._post_recv(msg)
        else:
            self.rma.submit(msg)

    def _post_send(self, msg: Operation) -> None:
        # Orphans are rare: no lookup while there are none (get: no __missing__ call).
        if self._orphans and self._orphans.get(msg.peer, 0) >= self.orphan_limit:
            self.fail_later(msg, FailureReason.RESOURCES,
                            f"rank {msg.peer} holds {self.orphan_limit} sends that timed out "
                            f"unreceived (orphan_limit); it is not receiving")
            return
        buffer = msg.buffer
        copied = len(buffer) <= self.eager_size or msg.deadline is not None
        data = bytes(buffer) if copied else buffer
        self._nudge_if_quiet(msg.peer, len(data))
        try:
            request = self._issend(self.comm, data, msg.peer, msg.tag)
        except MPI.Exception as exc:
            self.fail_later(msg, FailureReason.TRANSPORT, f"MPI_Issend: {exc}", exc)
            return
        state = msg.transport_data = _Send(data, copied)
        # A copied send's buffer is reusable at once: its submission is reported as the
        # request is taken in, before anything can complete it.
        state.entry = self.engine.add(request, self._on_send_done, owner=msg, peer=msg.peer,
                                      nbytes=len(data),
                                      first=self._report_submitted if copied else None)
        if self._deferred:
            self._issue_deferred()

    def _send_done(self, msg: Operation, status: MPI.Status, error: MPI.Exception | None) -> None:
        state: _Send = msg.transport_data
        # Done with: a cancel that comes now finds nothing to orphan, and the cycle
        # message -> state -> entry -> message is broken, so that reference counting
        # frees the message, not the cyclic garbage collector.
        msg.transport_data = None
        if state.orphaned:  # matched at last, or failed: MPI has let go of it
            self._orphans[msg.peer] -= 1
            return
        if error is not None:
            self.report.failed(msg, FailureReason.TRANSPORT,
                        f"MPI_Issend: {error}", cause=error)
        elif self._cancelled(status):
            self.report.cancelled(msg)
        else:
            self.report.completed(msg, len(msg.buffer), msg.peer, msg.tag)

    def _post_recv(self, msg: Operation) -> None:
        """Issue the receive; a large one after the next send while a progress thread
        runs passes.

        A receive whose message has already been taken in by MPI (an RTS in the
        unexpected queue) is copied inside MPI_Irecv: 4 MiB took ~1 ms there
        (bench/late_receive.py). That is often the case while a progress thread runs
        passes during the user's code, and a send posted right after the receive, as
        in an exchange, then reaches MPI only after the copy, while the peer waits for
        it to copy its own: the two copies ran one after the other (a 4 MiB pingping:
        0.79x raw, 0.86x with this; bench/results/deferred-receive-2026-11-28.txt).
        So then a receive of `TRANSFER_SIZE` bytes or more is issued after the next
        send's `Issend`, or by the next pass if no send comes first, and every receive
        posted while one waits queues behind it: receives reach MPI in posting order.
        Not while no pass runs between the user's calls (poll and manual mode, and
        thread mode while the thread has run no pass since the loop's last one:
        `Engine.passes_between_calls`), where holding receives back made a 64 KiB
        pingping take 68 us instead of 57 (poll mode), and read 0.56x raw instead of
        0.69x (thread mode; bench/results/deferred-receive-2026-12-02.txt).
        """
        if self._deferred or (len(msg.buffer) >= TRANSFER_SIZE
                              and self.engine.passes_between_calls()):
            self._defer(msg)
        else:
            self._issue_recv(msg)

    def _defer(self, msg: Operation) -> None:
        with self._deferred_lock:
            if not self._deferred:
                self.engine.call(self._issue_deferred)
            self._deferred.append(msg)

    def _issue_deferred(self) -> None:
        """Issue the receives that wait, in posting order (after a send, or in a pass)."""
        # Cleared only once all are issued: a receive posted meanwhile sees them and
        # queues behind them.
        with self._deferred_lock:
            for msg in self._deferred:
                try:
                    self._issue_recv(msg)
                except Exception as exc:  # a bug: fail the receive from the next pass
                    self.engine.call(self._contain, exc, msg)
            self._deferred.clear()

    def _issue_recv(self, msg: Operation) -> None:
        source = _MPI_ANY_SOURCE if msg.peer == ANY_SOURCE else msg.peer
        tag = _MPI_ANY_TAG if msg.tag == ANY_TAG else msg.tag
        peer = None if source == _MPI_ANY_SOURCE else source
        if peer is not None:
            self._nudge_if_quiet(peer, len(msg.buffer))
        try:
            request = self._irecv(self.comm, msg.buffer, source, tag)
        except MPI.Exception as exc:
            self.fail_later(msg, FailureReason.TRANSPORT, f"MPI_Irecv: {exc}", exc)
            return
        msg.transport_data = self.engine.add(request, self._on_recv_done, owner=msg,
                                             receive=True, peer=peer, nbytes=len(msg.buffer))

    def _recv_done(self, msg: Operation, status: MPI.Status, error: MPI.Exception | None) -> None:
        msg.transport_data = None  # a cancel that comes now finds nothing left to cancel
        fields = self._received(status)
        if fields is None:
            self.report.cancelled(msg)
            return
        length, source, tag = fields
        if error is None:
            self.report.completed(msg, length, source, tag)
        elif MPI.Get_error_class(status.Get_error()) == MPI.ERR_TRUNCATE:
            self.report.failed(msg, FailureReason.TRUNCATED,
                        f"a message from rank {source} with tag {tag} did not fit in "
                        f"{len(msg.buffer)} bytes", cause=error, length=length,
                        peer=source, tag=tag)
        else:
            self.report.failed(msg, FailureReason.TRANSPORT,
                        f"MPI_Irecv: {error}", cause=error)

    def cancel(self, msg: Operation) -> None:
        self.engine.call_at_once(self._cancel, msg, owner=msg)

    def _cancel(self, msg: Operation) -> None:
        if self._hot_spot is not None:
            self._hot_spot("mpi.cancel")
        if msg.op is Op.RECV:
            # None once the recv completed: its completion was reported, and wins.
            if isinstance(msg.transport_data, Entry):
                self.engine.cancel(msg.transport_data)  # it then completes: cancelled, or matched
        elif msg.op is Op.SEND:
            # MPI_Cancel is not called on sends: MPICH's ch4 device cannot cancel
            # them and crashed when asked (see the module's docstring). A copied send
            # that is not complete after one more pass is orphaned; an uncopied one
            # completes when the receiver matches it.
            if isinstance(msg.transport_data, _Send) and msg.transport_data.copied:
                self.engine.after_pass(lambda: self._orphan(msg), owner=msg)
        else:
            self.rma.cancel(msg)

    def _orphan(self, msg: Operation) -> None:
        """A copied send still unmatched: leave it to MPI, end the message now."""
        state: _Send | None = msg.transport_data
        if state is not None and not state.orphaned and self.engine.disown(state.entry):
            state.orphaned = True
            self._orphans[msg.peer] += 1
            self.report.cancelled(msg)

    def _nudge_if_quiet(self, peer: int, nbytes: int) -> None:
        """Before posting a large message: if this rank was quiet, its peer may be
        backing off, so nudge it now. Not later: a nudge sent once the data is under
        way reaches the peer behind it (see progress.py, transfers)."""
        if nbytes >= TRANSFER_SIZE and self.engine.backoff.quiet():
            self._nudge(peer, nbytes, False)

    def _nudge(self, peer: int, nbytes: int, one_sided: bool) -> None:
        self._nudges_sent += 1
        self.control.send(peer, Nudge(nbytes, one_sided))

    def _on_control(self, source: int, message: Control) -> None:
        if isinstance(message, Nudge):
            self._nudges_received += 1
            self.engine.nudged(source, message.nbytes, message.one_sided)
        else:
            self.rma.on_control(source, message)

    # -- the rest of the interface -------------------------------------------------------

    def expose(self, buffer: memoryview) -> Region:
        return self.rma.expose(buffer)

    async def unexpose(self, region: Region) -> None:
        await self.rma.unexpose(region)

    def progress(self) -> None:
        if self.engine.mode != "thread":
            self.engine.test()

    def awaiting(self, op: Operation, done: Callable[[], bool]) -> bool:
        return self.engine.drive_until(done)

    def stats(self) -> dict[str, int]:
        return {"requests": self.engine.user_outstanding, "orphaned_sends": self.engine.orphans,
                "nudges_sent": self._nudges_sent, "nudges_late": self.engine.late_nudges,
                "nudges_received": self._nudges_received, **self.rma.counters()}

    async def shutdown(self) -> None:
        """Cancel what is left, meet the peers (bounded wait), and free the MPI objects.

        Freeing the window is collective, so it needs every rank. The ranks meet
        twice, each time with a non-blocking barrier and at most `shutdown_timeout`
        of waiting, serving peers' control requests meanwhile: first to say "I am
        shutting down", then "I met everyone and will free". Between the two, the
        control channel closes (`ControlChannel`): a peer frees as soon as it leaves
        the second meeting, and a pass of this rank's could still be sending to it.
        A rank that gave up on the first meeting never joins the second, so no rank
        frees a window that a rank gone away will not free; the objects are then
        left to MPI_Finalize and a warning is logged. Nothing waits on a stopped
        peer, and MPI_Finalize will not either (see finalize.py).
        """
        from mate.transports.mpi.finalize import finalize_locally

        self.engine.call(self._cancel_everything)
        met = await self._meet()
        if met:  # every rank has ended its operations: close the control channel first
            self.engine.call(self.control.close)
            met = (await self._progress_until(lambda: self.control.closed)
                   and await self._meet())
        self.engine.stop()
        # Receives can be cancelled whether or not the ranks met: a receive still
        # posted at MPI_Finalize is a request the library never gets back (UCX warns
        # "object ... was not returned to mpool"). Orphaned sends and a meeting given
        # up cannot be cancelled: they stay with MPI.
        self.engine.cancel_receives(standing=True)
        self.engine.drain(time.monotonic() + 0.2)
        self.engine.free()
        if met:
            self.rma.free()
            self.comm.Free()
            self.control.free()
        # Even after the ranks met, one may die before its MPI_Finalize: never wait for it.
        local = finalize_locally()
        if not met:
            logger.warning("mate: not every rank reached shutdown within %.1f s (one may have "
                           "died); the MPI objects shared with them are left unfreed%s",
                           self.shutdown_timeout, "" if local else
                           ", and MPI_Finalize may wait for them: this MPI library cannot be "
                           "told not to (only MPICH can)")

    async def _meet(self) -> bool:
        """A barrier of all ranks, given up after `shutdown_timeout`."""
        barrier = self.control.comm.Ibarrier()  # a collective request cannot be cancelled: if
        return await self._progress_until(barrier.Test)  # given up, MPI keeps it

    async def _progress_until(self, done: Callable[[], bool]) -> bool:
        """Passes run until `done()`, or False after `shutdown_timeout`."""
        deadline = time.monotonic() + self.shutdown_timeout
        while time.monotonic() < deadline:
            if self.engine.mode != "thread":
                self.engine.test()
            if done():
                return True
            await asyncio.sleep(0.0005)
        return False

    def _cancel_everything(self) -> None:
        # No more nudges (a send that cannot be abandoned stays a transfer): a peer may
        # free its communicators while this rank still runs passes, and what reaches a
        # freed communicator stays queued in MPI, which gives its context id to a later
        # one: a later world's receive on tag 1 took such a nudge.
        self.engine.nudge = None
        self.rma.cancel_all()
        self.engine.cancel_receives(standing=False)
