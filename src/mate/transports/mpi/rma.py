"""put and get for the MPI transport: what its strategies share.

`rma="native"` (`rma_native.py`) uses MPI-3 RMA; `rma="emulated"`
(`rma_emulated.py`) the thesis's protocol over two-sided messages;
`rma="auto"` (`rma_auto.py`, the default) the first below `rma_threshold`
bytes and the second from it on. Each keeps
this rank's exposed regions (`Regions`) and answers peers' requests on the
control channel (`control.py`), in the progress context, with no help from
the application. Each is given its collaborators: the progress engine,
the control channel, the reporter, and the one way onto the loop.

Once issued, put and get cannot be recalled (MPI offers no way to stop an RMA
operation), but one with an armed timeout can be *abandoned*: it works on an
internal copy (put: the data, copied at post, so it is submitted at once;
get: a scratch buffer, copied into the user's buffer only on completion), so
a timeout or a cancel ends the message at once, in the progress context,
whatever the target does. An abandoned put may still land at the target
(like a send that timed out); an abandoned get never writes the user's buffer.
Without a timeout an operation works on the user's buffer; it can be
cancelled only while it is not issued yet, else it completes or fails.
"""

from __future__ import annotations

import abc
import asyncio
import threading
from collections.abc import Callable
from typing import Any

from mate.errors import FailureReason
from mate.schedule import Op, Region
from mate.transports.base import Operation
from mate.transports.mpi.control import Control, ControlChannel
from mate.transports.mpi.progress import Engine, Entry
from mate.transports.mpi.reports import Reporter

CallOnLoop = Callable[..., None]


class RmaOp:
    """The transport's state for one put or get (the operation's `transport_data`)."""

    __slots__ = ("abandoned", "copied", "data", "ended", "receive", "submitted", "waiting")

    def __init__(self, op: Operation, *, copy: bool) -> None:
        self.copied = copy  # works on `data`, not the user's buffer: can be abandoned
        if not copy:
            self.data: bytes | bytearray | memoryview = op.buffer
        elif op.op is Op.PUT:
            self.data = bytes(op.buffer)
        else:
            self.data = bytearray(len(op.buffer))
        self.waiting = False  # native: queued until the target's region table arrives
        self.submitted = False
        self.ended = False  # its terminal outcome was reported
        self.abandoned = False  # timed out or cancelled: whatever happens next is ignored
        self.receive: Entry | None = None  # emulated get: the data's receive

    @property
    def live(self) -> bool:
        return not (self.ended or self.abandoned)


class Regions:
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

    def table(self) -> tuple[tuple[int, int], ...]:
        with self.lock:
            return tuple((r.address, r.length) for r, _ in self.entries)


class Rma(abc.ABC):
    """One RMA strategy: origin side (start, cancel) and target side (on_control)."""

    name = ""  # the `rma` option that selects it

    def __init__(self, mypid: int, engine: Engine, control: ControlChannel, report: Reporter,
                 call_on_loop: CallOnLoop, regions: Regions | None = None) -> None:
        self.mypid = mypid
        self.engine = engine
        self.control = control
        self.report = report
        self._call_on_loop = call_on_loop
        self.regions = Regions() if regions is None else regions  # (auto: one for both)
        self.submits = 0  # puts and gets this strategy carried (world.stats())

    def submit(self, op: Operation) -> None:
        """Start a put or get in the progress context, after the posting call returns."""
        self.submits += 1
        self.engine.call(self.start, op, owner=op)

    def counters(self) -> dict[str, int]:
        """Its part of `world.stats()`."""
        return {f"rma_{self.name}_ops": self.submits}

    @abc.abstractmethod
    def start(self, op: Operation) -> None:
        """Issue a put or get (progress context)."""

    @abc.abstractmethod
    def on_control(self, source: int, message: Control) -> None:
        """A control message from `source` (progress context)."""

    @abc.abstractmethod
    def expose(self, view: memoryview) -> Region:
        """Make `view` a target of peers' put and get."""

    @abc.abstractmethod
    async def unexpose(self, region: Region) -> None:
        """Return once no peer operation can touch `region` any more."""

    def cancel(self, op: Operation) -> None:
        """Abandon `op` if it works on a copy (progress context)."""
        state: RmaOp | None = op.transport_data
        if state is not None and state.live and state.copied:
            state.abandoned = True
            self.report.cancelled(op)

    def cancel_all(self) -> None:  # noqa: B027 - nothing to forget for some strategies
        """Shutdown: forget the operations still waiting (the core ended them)."""

    def free(self) -> None:  # noqa: B027 - nothing beyond the communicators for some
        """Release the strategy's MPI objects (all ranks met at shutdown)."""

    # -- reporting, once per operation ---------------------------------------------------

    def submitted(self, op: Operation) -> None:
        state: RmaOp = op.transport_data
        if state.live and not state.submitted:
            state.submitted = True
            self.report.submitted(op)

    def completed(self, op: Operation) -> None:
        state: RmaOp = op.transport_data
        if state.live:
            state.ended = True
            if op.op is Op.GET and state.copied:
                op.buffer[:] = state.data
            self.report.completed(op, len(op.buffer), op.peer, 0)

    def failed(self, op: Operation, reason: FailureReason, detail: str,
               cause: BaseException | None = None) -> None:
        state: RmaOp = op.transport_data
        if state.live:
            state.ended = True
            self.report.failed(op, reason, detail, cause)

    def refuse(self, op: Operation) -> None:
        self.failed(op, FailureReason.REMOTE_ACCESS,
                    f"[{op.address:#x}, +{len(op.buffer)}) is not inside a region "
                    f"rank {op.peer} exposed")

    def resolve(self, future: asyncio.Future[None]) -> None:
        """Wake `future` (an unexpose waiting for peers) on the loop's thread."""
        self._call_on_loop(_set_done, future)


def _set_done(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(None)
