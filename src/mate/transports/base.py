"""The contract between the core and a transport.

The core (`mate.world`, `mate.message`) owns everything the user sees:
argument checks, states, timeouts, handlers and awaitables. A transport owns
only the wire. It implements `Transport`, and reports what happens to each
message through the `Sink` it was opened with. Data flows like this:

    world.send(buf, 1)  ->  Message (POSTED)  ->  transport.post(msg)
    ... the wire ...
    transport  ->  sink.submitted(msg) / sink.completed(msg, ...) / sink.failed(msg, ...)
    sink (the world)  ->  state machine  ->  schedule handlers and awaiters

Rules a transport keeps:

* `post` starts the operation and returns; it never reports an event from
  inside `post` (handlers never run inside the posting call), and it never
  raises for a fault of the transfer: faults are `sink.failed`.
* Every posted message gets exactly one terminal report: `completed`,
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
* Reports come on the event loop's thread, except when the world was opened
  with `handlers="progress"` (and the transport supports it), when they may
  come from the transport's progress thread. The sink is thread-safe.

A transport reads a message's public fields (`op`, `buffer` - a flat byte
memoryview -, `peer`, `tag`, `address`) and may keep its own state in
`msg.transport_data`.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Protocol

from mate.errors import FailureReason
from mate.schedule import Region

if TYPE_CHECKING:
    from mate.message import Message


class Sink(Protocol):
    """What a transport reports back to the core."""

    def submitted(self, msg: Message) -> None: ...

    def completed(self, msg: Message, length: int, peer: int, tag: int) -> None:
        """The operation completed: `length` bytes moved; `peer` and `tag` resolve wildcards."""

    def failed(
        self,
        msg: Message,
        reason: FailureReason,
        detail: str = "",
        *,
        cause: BaseException | None = None,
        length: int = 0,
        peer: int | None = None,
        tag: int | None = None,
    ) -> None:
        """The operation can never complete (`cause` is chained to the error)."""

    def cancelled(self, msg: Message) -> None:
        """A cancel that the core asked for took effect at this end.

        A receive consumed no message. A send or put was stopped or abandoned:
        a transport that cannot recall data already handed to the wire (MPI)
        may still deliver it, from an internal copy, never from the user's
        buffer (SPEC §1: a send that timed out may still have arrived).
        """


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
    def post(self, msg: Message) -> None:
        """Start `msg` (send, recv, put or get); report its events to the sink."""

    @abc.abstractmethod
    def cancel(self, msg: Message) -> None:
        """Stop `msg` if no data has landed (report `cancelled`), else let it complete."""

    @abc.abstractmethod
    def expose(self, buffer: memoryview) -> Region:
        """Make `buffer` a target of peers' put and get; return its region."""

    @abc.abstractmethod
    async def unexpose(self, region: Region) -> None:
        """Return once no peer operation can touch `region` any more."""

    def progress(self) -> None:  # noqa: B027 - a no-op is right for independent progress
        """Drive progress by hand (mate_progress); a no-op with independent progress."""

    def awaiting(self, msg: Message) -> None:  # noqa: B027 - see above
        """A task has started awaiting `msg`: transports driven by hand drive it until done."""

    def stats(self) -> dict[str, int]:
        """The transport's counters (`world.stats()`); none by default."""
        return {}

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Release everything. Outstanding messages were already ended by the core."""

