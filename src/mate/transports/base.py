"""The contract between the core and a transport.

The core (`mate.world`, `mate.message`) owns everything the user sees:
argument checks, states, deadlines, handlers and awaitables. A transport owns
only the wire. It implements `Transport`, sees each message as an `Operation`
(never a `mate.message.Message`, never an asyncio future), and reports what
happens to it through the `Sink` it was opened with. Data flows like this:

    world.send(buf, 1)  ->  Message (an Operation, POSTED)  ->  transport.post(op)
    ... the wire ...
    transport  ->  sink.submitted(op) / sink.completed(op, ...) / sink.failed(op, ...)
    sink (the world)  ->  one hop to the loop if needed  ->  state machine
                      ->  schedule handlers and awaiters

Rules a transport keeps:

* `post` starts the operation and returns; it never reports an event from
  inside `post` (handlers never run inside the posting call), and it never
  raises for a fault of the transfer: faults are `sink.failed`.
* Every posted operation gets exactly one terminal report: `completed`,
  `failed`, or (only after `cancel` was asked) `cancelled`. `submitted` is
  reported at most once, for send and put, before or together with
  `completed` (a transport may skip it: `completed` implies it).
* `cancel` is a request. If the operation can still be stopped without
  losing data, the transport stops it and reports `cancelled`; if the data
  has already landed it reports `completed` instead. It may answer from
  inside `cancel` or later. A send it can neither recall nor abandon safely
  (MPI still reading the user's buffer) completes instead.
* Sends from one rank to one destination with one tag match receives in the
  order they were posted (non-overtaking); receives match in posting order.
* Put and get touch only memory inside a region the target exposed; anything
  else fails with `FailureReason.REMOTE_ACCESS` before touching memory.

Threads:

* `post`, `cancel`, `expose` and `progress` are called on the event loop's
  thread, and, when the world runs handlers in the progress thread
  (``handlers="progress"``), also from a handler in that thread and (`cancel`)
  from the core's timeout thread: a transport with threads makes them safe to
  call from any of these. `unexpose` and `shutdown` are coroutines on the
  loop; `awaiting` is called on the loop's thread.
* The sink may be called from any thread, at any time but from inside `post`.
  The core alone moves work onto the loop's thread (one lock and one
  `call_soon_threadsafe` per batch), so a transport has no hop of its own:
  a progress pass that completes many operations hands them over at once
  with `sink.report_all`, and a transport that must wake something of its
  own on the loop (an `unexpose` waiting for peers) uses `sink.call_on_loop`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, Protocol, final

from mypy_extensions import mypyc_attr

from mate.errors import FailureReason, MessageFailed
from mate.machine import Input
from mate.schedule import Op, Region


class Operation:
    """What a transport sees of a posted message: the fields it may read and write.

    Read only: `op`, `buffer` (a flat byte memoryview, kept alive until the
    terminal report), `peer` (the destination of send and put, the source of
    recv and get, possibly `ANY_SOURCE`), `tag` (possibly `ANY_TAG` for recv; 0
    for put and get), `address` (the target address of put and get) and
    `deadline` (`time.monotonic()` seconds, or None: an operation with a
    deadline may be abandoned by a cancel, so a transport that cannot recall
    it works on a copy). Read and write: `transport_data`, the transport's own
    slot. A layer (`mate.faults`) makes operations of its own to post below it.
    """

    __slots__ = ("address", "buffer", "deadline", "op", "peer", "tag", "transport_data")

    def __init__(self, op: Op, buffer: memoryview, peer: int, tag: int = 0,
                 address: int = 0, deadline: float | None = None) -> None:
        self.op = op
        self.buffer = buffer
        self.peer = peer
        self.tag = tag
        self.address = address
        self.deadline = deadline
        self.transport_data: Any = None


@final
class Report:
    """One thing a transport tells the core about one operation (`Sink.report_all`).

    A plain class rather than a NamedTuple: one is made for every report a
    transport makes, and a compiled class is several times cheaper to build.
    """

    __slots__ = ("error", "input", "length", "op", "peer", "tag")

    def __init__(self, input: Input, op: Operation, length: int | None = None,
                 peer: int | None = None, tag: int | None = None,
                 error: MessageFailed | None = None) -> None:
        self.input = input  # SUBMITTED, COMPLETED, FAILED or CANCELLED
        self.op = op
        self.length = length  # bytes moved (completed, failed)
        self.peer = peer  # resolves a wildcard source
        self.tag = tag  # resolves a wildcard tag
        self.error = error  # failed

    def __repr__(self) -> str:
        return (f"Report({self.input.name}, {self.op!r}, length={self.length}, "
                f"peer={self.peer}, tag={self.tag}, error={self.error!r})")


def failure(reason: FailureReason, detail: str = "",
            cause: BaseException | None = None) -> MessageFailed:
    """The error a failed operation ends with, `cause` chained."""
    error = MessageFailed(reason, detail)
    error.__cause__ = cause
    return error


class Sink(Protocol):
    """What a transport reports back to the core; callable from any thread."""

    @property
    def loop_work(self) -> int:
        """How many times reports (and `call_on_loop`) gave the event loop work: a
        woken awaiter, a handler to run. A transport whose awaiting task runs passes
        itself (`Transport.awaiting`) stops when it moves: the task would hold that
        work up."""

    def submitted(self, op: Operation) -> None:
        """The local buffer is no longer read (send and put)."""

    def completed(self, op: Operation, length: int, peer: int, tag: int) -> None:
        """The operation completed: `length` bytes moved; `peer` and `tag` resolve wildcards."""

    def failed(
        self,
        op: Operation,
        reason: FailureReason,
        detail: str = "",
        *,
        cause: BaseException | None = None,
        length: int = 0,
        peer: int | None = None,
        tag: int | None = None,
    ) -> None:
        """The operation can never complete (`cause` is chained to the error)."""

    def cancelled(self, op: Operation) -> None:
        """A cancel that the core asked for took effect at this end.

        A receive consumed no message. A send or put was stopped or abandoned:
        a transport that cannot recall data already handed to the wire (MPI)
        may still deliver it, from an internal copy, never from the user's
        buffer (SPEC §1: a send that timed out may still have arrived).
        """

    def report_all(self, reports: Sequence[Report]) -> None:
        """Many reports at once, in order: what one progress pass found."""

    def call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the event loop's thread: now if there, else soon."""


@mypyc_attr(allow_interpreted_subclasses=True)  # this module is compiled (mate.native)
class Transport(abc.ABC):
    """One rank's end of the wire."""

    mypid: int
    numprocs: int
    tag_max: int
    #: Whether the transport can report from a progress thread (handlers="progress").
    supports_progress_handlers: bool = False
    _sink: Sink

    @property
    def sink(self) -> Sink:
        """Where this transport reports."""
        return self._sink

    def bind(self, sink: Sink) -> None:
        """Report to `sink` from now on: a layer (`mate.faults`) puts itself here."""
        self._sink = sink

    @abc.abstractmethod
    def post(self, op: Operation) -> None:
        """Start `op` (send, recv, put or get); report its events to the sink."""

    @abc.abstractmethod
    def cancel(self, op: Operation) -> None:
        """Stop `op` if no data has landed (report `cancelled`), else let it complete."""

    @abc.abstractmethod
    def expose(self, buffer: memoryview) -> Region:
        """Make `buffer` a target of peers' put and get; return its region."""

    @abc.abstractmethod
    async def unexpose(self, region: Region) -> None:
        """Return once no peer operation can touch `region` any more."""

    def progress(self) -> None:  # noqa: B027 - a no-op is right for independent progress
        """Drive progress by hand (mate_progress); a no-op with independent progress."""

    def awaiting(self, op: Operation, done: Callable[[], bool]) -> bool:
        """A task awaits `op` until `done()`: transports driven by hand drive it until then.

        A transport may also run passes right here, in the awaiting task, until
        `done()` or until the sink's `loop_work` moves. True if those passes stopped
        only because the loop is due a turn while `op` still moves: the task then
        yields for one turn and awaits again, with no future made, resolved and
        woken on (`Ledger.waiter`)."""
        return False

    def stats(self) -> dict[str, int]:
        """The transport's counters (`world.stats()`); none by default."""
        return {}

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Release everything. Outstanding operations were already ended by the core."""
