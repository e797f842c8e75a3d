"""The ledger: this process's messages, and the sink its transport reports to.

`mate.world` hands each message over in one call, `Ledger.submit`, which
checks the user's arguments (`mate.arguments`); everything after that happens
here, on every message, so this module is compiled
(`mate.native`). The ledger keeps the outstanding messages, arms their
deadlines, posts them to the transport, and turns what the transport reports
into state changes (`Message.apply`, under the ledger's lock when other
threads make changes too), schedule handlers (`mate.dispatch`) and woken
awaiters.

Reports may come from any thread. With handlers on the loop, a report that
comes from another thread is applied on the loop's thread, through the one
entry queue (`mate.entry`): a progress pass's reports make one hop. With
handlers in the progress thread, reports are applied at once, in the thread
that made them, and only the awaiters' wake-up hops to the loop.

The clock starts at post. An elapsed timeout only asks the transport to
cancel: the message times out when the transport confirms, or completes if
its data had already landed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from librt.threading import Lock

from mate import arguments
from mate.deadlines import Deadlines, LoopDeadlines, ThreadDeadlines
from mate.dispatch import Dispatcher
from mate.entry import EntryQueue
from mate.errors import FailureReason, InvalidArgument
from mate.machine import Input, Step
from mate.message import Message, Waiters
from mate.schedule import NO_SCHEDULE, Op, State
from mate.transports.base import Operation, Report, Transport, failure

logger = logging.getLogger("mate")

# Enum members as module constants (see mate.message: a read through the class is
# slow on Python 3.11).
_SUBMITTED: Final = Input.SUBMITTED
_COMPLETED: Final = Input.COMPLETED
_FAILED: Final = Input.FAILED
_CANCELLED: Final = Input.CANCELLED
_TIMEOUT: Final = Input.TIMEOUT
_COMPLETED_STATE: Final = State.COMPLETED
_NO_SCHEDULE: Final = NO_SCHEDULE  # imported: Final, it is not looked up per message


class _Completed:
    """The messages of one op that completed, and their bytes: attributes, which
    compiled code adds to as machine integers (a list's items are objects)."""

    __slots__ = ("messages", "nbytes")

    def __init__(self) -> None:
        self.messages = 0
        self.nbytes = 0


class Ledger:
    def __init__(self, loop: asyncio.AbstractEventLoop, handlers: str) -> None:
        self._loop = loop
        self._entry = EntryQueue(loop)
        self._dispatcher = Dispatcher(loop, handlers, self._entry)
        # Handlers in the progress thread: reports are applied where they come from.
        self._at_once = handlers == "progress"
        self._deadlines: Deadlines = (ThreadDeadlines(self._expire) if self._at_once
                                      else LoopDeadlines(loop, self._expire))
        # Guards message states, waiters and the outstanding set when other threads
        # change them: with handlers in the progress thread, where reports, handlers and
        # the timeout thread run. Otherwise every change is made on the loop's thread
        # (reports from other threads hop there first), and the per-message calls take
        # no lock at all (issue 11: none that a message does not need; test_contract).
        self._lock = Lock()
        self._threaded = self._at_once
        self._outstanding: set[Message] = set()
        # Counters for stats(): messages and bytes completed by op, and other endings.
        self._completed = {op: _Completed() for op in Op}
        self._endings = {State.TIMED_OUT: 0, State.FAILED: 0, State.CANCELLED: 0}
        # The sink's `loop_work`: how many times reports gave the loop work (an awaiter
        # woken, a handler dispatched, a call made on the loop).
        self.loop_work = 0
        self.transport: Transport | None = None  # the world's, set by attach
        self.mypid = 0
        self._numprocs = 0
        self._tag_max = 0
        self.closed = False

    def attach(self, transport: Transport, mypid: int, numprocs: int, tag_max: int) -> None:
        # The world reads these off the transport: a compiled read of an attribute that
        # `Transport` declares would miss a Python subclass's class attribute.
        self.transport = transport
        self.mypid = mypid
        self._numprocs = numprocs
        self._tag_max = tag_max

    # -- the world's calls -----------------------------------------------------------------

    def open_transport(self) -> Transport:
        """The transport, or InvalidArgument once the world has shut down."""
        transport = self.transport
        if self.closed or transport is None:
            raise InvalidArgument("this world has been shut down")
        return transport

    def submit(self, op: Op, obj: Any, peer: Any, key: Any, schedule: Any, timeout: Any,
               default_timeout: float) -> Message:
        """Check the arguments of a send, recv, put or get (`key` is its tag or target
        address), then make and post the message.

        The world's send, recv, put and get end here in one call: they run
        interpreted, and every call they make costs each message."""
        view, rank, tag, address = arguments.operation(op, obj, peer, key, self._numprocs,
                                                       self._tag_max)
        self.open_transport()
        checked = arguments.schedule(schedule)
        seconds = arguments.timeout(timeout, checked, default_timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        return self.post(Message(self, op, view, rank, tag, address, checked, deadline))

    def post(self, msg: Message) -> Message:
        """Record `msg`, hand it to the transport (the world checked that there is one,
        open) and arm its deadline. Armed only once posted: a timeout thread
        (``handlers="progress"``) would otherwise ask the transport to cancel what it
        has not been given, the cancel would be lost and the message never end."""
        transport = self.transport
        assert transport is not None
        if self._threaded:
            with self._lock:
                self._outstanding.add(msg)
        else:
            self._outstanding.add(msg)
        transport.post(msg)
        if msg.deadline is not None:
            self._deadlines.arm(msg, msg.deadline)
        return msg

    def counters(self) -> dict[str, int]:
        with self._lock:
            counters = {"outstanding": len(self._outstanding)}
            for op, completed in self._completed.items():
                counters[f"{op.value}_messages"] = completed.messages
                counters[f"{op.value}_bytes"] = completed.nbytes
            counters["timed_out"] = self._endings[State.TIMED_OUT]
            counters["failed"] = self._endings[State.FAILED]
            counters["cancelled"] = self._endings[State.CANCELLED]
        return counters

    async def close(self) -> None:
        """Shutdown: end every outstanding message with no events, disarm the
        deadlines, and stop the handlers (their tasks cancelled and awaited)."""
        self.closed = True
        with self._lock:
            outstanding = list(self._outstanding)
        for msg in outstanding:
            self.advance(msg, Input.SHUTDOWN)
        self._deadlines.close()
        await self._dispatcher.close()

    def _expire(self, msg: Message) -> None:
        """Its deadline passed (the loop's or the timeout thread's clock)."""
        self.advance(msg, _TIMEOUT)

    # -- the sink: what the transport reports, from any thread -----------------------------

    def submitted(self, op: Operation) -> None:
        self._route(Report(_SUBMITTED, op))

    def completed(self, op: Operation, length: int, peer: int, tag: int) -> None:
        self._route(Report(_COMPLETED, op, length, peer, tag))

    def failed(self, op: Operation, reason: FailureReason, detail: str = "", *,
               cause: BaseException | None = None, length: int = 0,
               peer: int | None = None, tag: int | None = None) -> None:
        self._route(Report(_FAILED, op, length, peer, tag, failure(reason, detail, cause)))

    def cancelled(self, op: Operation) -> None:
        self._route(Report(_CANCELLED, op))

    def report_all(self, reports: Sequence[Report]) -> None:
        if not (self._at_once or self._entry.on_loop_thread()):
            self._entry.run_each_soon(self._apply_later, reports)  # one lock, one hop
            return
        first: Exception | None = None
        for report in reports:  # each applied, even after one that is a transport bug
            try:
                self._apply(report)
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    def call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        self.loop_work += 1
        self._entry.call_on_loop(fn, *args)

    def _route(self, report: Report) -> None:
        if self._at_once or self._entry.on_loop_thread():
            self._apply(report)  # a ProtocolError goes back to the transport that erred
        else:
            self._entry.run_soon(self._apply_later, report)

    def _apply(self, report: Report) -> None:
        msg = report.op
        assert isinstance(msg, Message), msg  # the world posts only its messages
        self.advance(msg, report.input, report.length, report.peer, report.tag, report.error)

    def _apply_later(self, report: Report) -> None:
        """`_apply` on the loop, after a hop: nobody to raise to, so a report that is a
        transport bug fails its message with TRANSPORT (the error chained) and is logged."""
        try:
            self._apply(report)
        except Exception as exc:
            msg = report.op
            assert isinstance(msg, Message), msg
            logger.error("mate: %s reported for %r", report.input.name, msg, exc_info=exc)
            self.advance(msg, Input.FAILED,
                         error=failure(FailureReason.TRANSPORT, f"transport error: {exc!r}", exc))

    # -- state changes ------------------------------------------------------------------------

    def advance(self, msg: Message, inp: Input, length: int | None = None,
                peer: int | None = None, tag: int | None = None,
                error: BaseException | None = None) -> None:
        """Feed `inp` to `msg`'s state machine and carry out what it says."""
        if self._threaded:
            with self._lock:
                step, woken = self._change(msg, inp, length, peer, tag, error)
        else:
            step, woken = self._change(msg, inp, length, peer, tag, error)
        if step.ask_cancel:
            assert self.transport is not None
            self.transport.cancel(msg)
        schedule = msg.schedule
        if schedule is not _NO_SCHEDULE:
            for event in step.events:
                handler, data = schedule.handler_for(event)
                if handler is not None:
                    self.loop_work += 1
                    self._dispatcher.dispatch(handler, msg.receipt_for(event), data)
        if woken:
            self.loop_work += 1
            if self._threaded:
                self._entry.call_on_loop(_wake_all, woken)
            else:  # on the loop's thread already
                _wake_all(woken)

    def _change(self, msg: Message, inp: Input, length: int | None, peer: int | None,
                tag: int | None, error: BaseException | None) -> tuple[Step, Waiters | None]:
        """`advance`'s part under the lock: the state change and its bookkeeping."""
        was_live = not msg.done()
        step = msg.apply(inp)
        ended = was_live and msg.done()
        if ended:
            msg.settle(length, peer, tag, error)
            self._outstanding.discard(msg)
            if step.state is _COMPLETED_STATE:
                completed = self._completed[msg.op]
                completed.messages += 1
                completed.nbytes += msg.length
            else:
                self._endings[step.state] += 1
            if msg.deadline is not None:
                self._deadlines.ended()
        woken = msg.take_waiters() if step.events or ended else None
        return step, woken

    # -- awaitables ---------------------------------------------------------------------------

    def waiter(self, msg: Message, *, submission: bool) -> asyncio.Future[None] | None:
        """A future for a task that awaits `msg` (its submission if `submission`);
        None if that has happened already, or if the loop is due a turn first. The
        awaiter cancels the message if the future is cancelled, and asks again after
        the turn (`Message.__await__`).

        The transport hears of the awaiter first: a transport whose awaiting task runs
        passes itself (poll mode) may end the message there, and then no future is
        made, resolved and awaited for it. If its passes stopped only for the loop to
        turn (`Transport.awaiting`), none is made either: the task yields once, the
        pass queued on the loop runs in that turn, and the task finds the message
        ended or spins again, where a future would wake it one turn later."""
        if self.transport is not None and not self.closed:
            turn = self.transport.awaiting(
                msg, msg.submitted_or_done if submission else msg.done)
            if turn or msg.done() or (submission and msg.submitted_seen):
                return None
        future = self._loop.create_future()
        if self._threaded:
            with self._lock:
                added = msg.add_waiter(future, submission=submission)
        else:
            added = msg.add_waiter(future, submission=submission)
        return future if added else None


def _wake_all(futures: Waiters) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)
