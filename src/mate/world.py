"""The world: the MATE API of one process, and the sink its transport reports to.

`World` checks every argument (raising `InvalidArgument` from the call
itself), creates `Message`s, arms their deadlines (`mate.deadlines`), hands
them to the transport, and turns what the transport reports into state
changes (`mate.machine`, applied by `Message.apply` under the world's lock),
schedule handlers (`mate.dispatch`) and woken awaiters.

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
import functools
import inspect
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mate import arguments
from mate.buffers import byte_view
from mate.constants import ANY_SOURCE, ANY_TAG, UNSET, UnsetType
from mate.deadlines import Deadlines, LoopDeadlines, ThreadDeadlines
from mate.dispatch import MODES, Dispatcher
from mate.entry import EntryQueue
from mate.errors import FailureReason, InvalidArgument
from mate.machine import Input
from mate.message import Message, Waiters
from mate.schedule import Op, Region, Schedule, State
from mate.transports.base import Operation, Report, Transport, failure

logger = logging.getLogger("mate")

_NO_SCHEDULE = Schedule()
Timeout = float | None | UnsetType


class World:
    """One process's view of the communicating processes (mate_startup's result)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, *, default_timeout: float, handlers: str
    ) -> None:
        self._loop = loop
        self.default_timeout = arguments.seconds(default_timeout, "default_timeout")
        self.handlers = arguments.choice(handlers, "handlers", MODES)
        self._entry = EntryQueue(loop)
        self._dispatcher = Dispatcher(loop, self.handlers, self._entry)
        # Handlers in the progress thread: reports are applied where they come from.
        self._inline = self.handlers == "progress"
        self._deadlines: Deadlines = (ThreadDeadlines(self._expire) if self._inline
                                      else LoopDeadlines(loop, self._expire))
        self._lock = threading.Lock()  # guards message states, waiters, the outstanding set
        self._outstanding: set[Message] = set()
        # Counters for stats(): [messages, bytes] completed by op, and other endings.
        self._completed = {op: [0, 0] for op in Op}
        self._endings = {State.TIMED_OUT: 0, State.FAILED: 0, State.CANCELLED: 0}
        self._exposed: Counter[Region] = Counter()
        self._transport: Transport | None = None
        self._closed = False

    def attach(self, transport: Transport) -> None:
        if self.handlers == "progress" and not transport.supports_progress_handlers:
            raise InvalidArgument(
                f'handlers="progress" needs a transport with a progress thread; '
                f"{type(transport).__name__} runs handlers on the loop only"
            )
        self._transport = transport
        self.mypid = transport.mypid
        self.numprocs = transport.numprocs
        self.tag_max = transport.tag_max

    @property
    def transport(self) -> Transport:
        """The transport this world posts to (`InvalidArgument` after shutdown)."""
        return self._open()

    def interpose(self, layer: Transport) -> None:
        """Put `layer` (which forwards to `self.transport`) between this world and the wire.

        For layers such as `mate.faults.FaultyTransport`. Messages posted
        before keep working: the layer forwards their cancels.
        """
        self._open()
        self.attach(layer)

    # -- the API -----------------------------------------------------------------

    def send(self, buffer: Any, dest: int, tag: int = 0, *,
             schedule: Schedule | None = None, timeout: Timeout = UNSET) -> Message:
        """Send `buffer` to `dest` with `tag`; completion means it reached `dest`.

        A send that times out may still have reached its destination.
        """
        transport = self._open()
        view = byte_view(buffer, writable=False, what="send buffer")
        dest = arguments.rank(dest, "dest", self.numprocs, wildcard=False)
        tag = arguments.tag(tag, transport.tag_max, wildcard=False)
        return self._post(transport, Op.SEND, view, dest, tag, 0, schedule, timeout)

    def recv(self, buffer: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, *,
             schedule: Schedule | None = None, timeout: Timeout = UNSET) -> Message:
        """Receive into `buffer` a message from `source` with `tag` (wildcards allowed)."""
        transport = self._open()
        view = byte_view(buffer, writable=True, what="recv buffer")
        source = arguments.rank(source, "source", self.numprocs, wildcard=True)
        tag = arguments.tag(tag, transport.tag_max, wildcard=True)
        return self._post(transport, Op.RECV, view, source, tag, 0, schedule, timeout)

    def put(self, buffer: Any, dest: int, address: int, *,
            schedule: Schedule | None = None, timeout: Timeout = UNSET) -> Message:
        """Write `buffer` into `dest`'s exposed memory at `address`."""
        transport = self._open()
        view = byte_view(buffer, writable=False, what="put buffer")
        dest = arguments.rank(dest, "dest", self.numprocs, wildcard=False)
        address = arguments.address(address, len(view))
        return self._post(transport, Op.PUT, view, dest, 0, address, schedule, timeout)

    def get(self, buffer: Any, source: int, address: int, *,
            schedule: Schedule | None = None, timeout: Timeout = UNSET) -> Message:
        """Read `source`'s exposed memory at `address` into `buffer`."""
        transport = self._open()
        view = byte_view(buffer, writable=True, what="get buffer")
        source = arguments.rank(source, "source", self.numprocs, wildcard=False)
        address = arguments.address(address, len(view))
        return self._post(transport, Op.GET, view, source, 0, address, schedule, timeout)

    def expose(self, buffer: Any) -> Region:
        """Make `buffer` a target of peers' put and get; no collective call."""
        transport = self._open()
        region = transport.expose(byte_view(buffer, writable=True, what="exposed buffer"))
        self._exposed[region] += 1
        return region

    async def unexpose(self, region: Region) -> None:
        """Return once no peer operation can touch `region`; later access fails."""
        transport = self._open()
        if not isinstance(region, Region) or region not in self._exposed:
            raise InvalidArgument(f"{region!r} is not a region this world exposed")
        self._exposed[region] -= 1
        if self._exposed[region] == 0:
            del self._exposed[region]
        await transport.unexpose(region)

    def progress(self) -> None:
        """Drive progress by hand (mate_progress); a no-op with independent progress."""
        self._open().progress()

    def stats(self) -> dict[str, int]:
        """Counters: messages outstanding here; messages and bytes completed by op
        (``send_messages``, ``send_bytes``, ... ``get_bytes``); messages that timed
        out, failed or were cancelled; then the transport's own counters."""
        transport = self._open()
        with self._lock:
            counters = {"outstanding": len(self._outstanding)}
            for op, (messages, nbytes) in self._completed.items():
                counters[f"{op.value}_messages"] = messages
                counters[f"{op.value}_bytes"] = nbytes
            counters["timed_out"] = self._endings[State.TIMED_OUT]
            counters["failed"] = self._endings[State.FAILED]
            counters["cancelled"] = self._endings[State.CANCELLED]
        return {**counters, **transport.stats()}

    async def shutdown(self) -> None:
        """Cancel every outstanding message (no handlers run) and release the transport."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            outstanding = list(self._outstanding)
        for msg in outstanding:
            self.advance(msg, Input.SHUTDOWN)
        self._deadlines.close()
        await self._dispatcher.close()
        if self._transport is not None:
            await self._transport.shutdown()

    # -- argument checks -----------------------------------------------------------

    def _open(self) -> Transport:
        if self._closed or self._transport is None:
            raise InvalidArgument("this world has been shut down")
        return self._transport

    def _post(self, transport: Transport, op: Op, view: memoryview, peer: int, tag: int,
              address: int, schedule: Schedule | None, timeout: Timeout) -> Message:
        if schedule is None:
            schedule = _NO_SCHEDULE
        elif not isinstance(schedule, Schedule):
            raise InvalidArgument(f"schedule must be a mate.Schedule or None, not {schedule!r}")
        if timeout is UNSET:
            seconds = self.default_timeout if schedule.timeout is not None else None
        elif timeout is None:
            seconds = None
        else:
            seconds = arguments.seconds(timeout, "timeout")
        deadline = None if seconds is None else time.monotonic() + seconds
        msg = Message(self, op, view, peer, tag, address, schedule, deadline)
        with self._lock:
            self._outstanding.add(msg)
        if deadline is not None:
            self._deadlines.arm(msg, deadline)
        transport.post(msg)
        return msg

    def _expire(self, msg: Message) -> None:
        """Its deadline passed (the loop's or the timeout thread's clock)."""
        self.advance(msg, Input.TIMEOUT)

    # -- the sink: what the transport reports, from any thread ---------------------------

    def submitted(self, op: Operation) -> None:
        self._route(Report(Input.SUBMITTED, op))

    def completed(self, op: Operation, length: int, peer: int, tag: int) -> None:
        self._route(Report(Input.COMPLETED, op, length, peer, tag))

    def failed(self, op: Operation, reason: FailureReason, detail: str = "", *,
               cause: BaseException | None = None, length: int = 0,
               peer: int | None = None, tag: int | None = None) -> None:
        self._route(Report(Input.FAILED, op, length, peer, tag, failure(reason, detail, cause)))

    def cancelled(self, op: Operation) -> None:
        self._route(Report(Input.CANCELLED, op))

    def report_all(self, reports: Sequence[Report]) -> None:
        if not (self._inline or self._entry.on_loop_thread()):
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
        self._entry.call_on_loop(fn, *args)

    def _route(self, report: Report) -> None:
        if self._inline or self._entry.on_loop_thread():
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

    def advance(self, msg: Message, inp: Input, length: int | None = None,
                peer: int | None = None, tag: int | None = None,
                error: BaseException | None = None) -> None:
        """Feed `inp` to `msg`'s state machine and carry out what it says."""
        with self._lock:
            was_live = not msg.done()
            step = msg.apply(inp)
            ended = was_live and step.state.terminal
            if ended:
                msg.settle(length, peer, tag, error)
                self._outstanding.discard(msg)
                if step.state is State.COMPLETED:
                    completed = self._completed[msg.op]
                    completed[0] += 1
                    completed[1] += msg.length
                else:
                    self._endings[step.state] += 1
                if msg.deadline is not None:
                    self._deadlines.ended()
            woken = msg.take_waiters() if step.events or ended else None
        if step.ask_cancel:
            assert self._transport is not None
            self._transport.cancel(msg)
        for event in step.events:
            handler, data = msg.schedule.handler_for(event)
            if handler is not None:
                self._dispatcher.dispatch(handler, msg.receipt_for(event), data)
        if woken:
            self._entry.call_on_loop(_wake_all, woken)

    # -- awaitables ---------------------------------------------------------------------

    def waiter(self, msg: Message, *, submission: bool) -> asyncio.Future[None] | None:
        """A future for a task that awaits `msg` (its submission if `submission`);
        None if that has happened already. Cancelling it cancels the message."""
        future = self._loop.create_future()
        with self._lock:
            if not msg.add_waiter(future, submission=submission):
                return None
        future.add_done_callback(functools.partial(_cancel_if_abandoned, msg))
        if self._transport is not None and not self._closed:
            self._transport.awaiting(msg, msg.done)
        return future

    def __repr__(self) -> str:
        name = type(self._transport).__name__ if self._transport else "unattached"
        state = "shut down" if self._closed else "open"
        return f"<World {self.mypid}/{self.numprocs} {name} {state}>"


Opener = Callable[..., "Transport | Awaitable[Transport]"]


async def open_world(opener: Opener, *, default_timeout: float = 1.0,
                     handlers: str = "loop", **options: Any) -> World:
    """Open this process's world on the transport that `opener(sink, loop, ...)` makes.

    The opener may be a coroutine function: a transport whose bootstrap waits
    for its peers (exchanging addresses) does so without blocking the loop.
    """
    loop = asyncio.get_running_loop()
    world = World(loop, default_timeout=default_timeout, handlers=handlers)
    transport = opener(world, loop, handlers=handlers, **options)
    if inspect.isawaitable(transport):
        transport = await transport
    world.attach(transport)
    return world


def _wake_all(futures: Waiters) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


def _cancel_if_abandoned(msg: Message, future: asyncio.Future[None]) -> None:
    if future.cancelled():
        msg.cancel()

