"""The `Message` handle: one posted message, its state, its receipt, its awaitables.

A `Message` is what the user holds; to its transport it is an `Operation`
(`mate.transports.base`), the fields the wire needs. Its state changes only by
`apply`, which looks the input up in the pure state machine of
`mate.machine`; the ledger (`mate.ledger`) calls it (under its lock, where
other threads make changes) and carries
out the outputs.

The handle owns its awaiters: one future per awaiting task (so that
cancelling one task never cancels another's await), registered by `waiter`
and detached by `take_waiters`, both under the ledger's lock (or both on the
loop's thread), so that no
wake-up is lost between a task's look at the state and its registration; the
ledger wakes them on the loop's thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Final

import attrs

from mate.buffers import address_of
from mate.errors import MessageFailed, MessageTimeout
from mate.machine import TABLE, Input, Pending, ProtocolError, Step
from mate.schedule import Event, Op, Receipt, Schedule, State
from mate.transports.base import Operation

if TYPE_CHECKING:
    from mate.ledger import Ledger

# Enum members as module constants: on Python 3.11 a read through the class
# (`State.POSTED`) goes through the hook of `EnumType.__getattr__`, which costs
# more than the rest of a state change; the per-message path reads these.
_SEND: Final = Op.SEND
_PUT: Final = Op.PUT
_GET: Final = Op.GET
_POSTED: Final = State.POSTED
_SUBMITTED: Final = State.SUBMITTED
_COMPLETED: Final = State.COMPLETED
_TIMED_OUT: Final = State.TIMED_OUT
_FAILED: Final = State.FAILED
_CANCELLED: Final = State.CANCELLED
_NO_PENDING: Final = Pending.NONE
_USER_CANCEL: Final = Input.USER_CANCEL
_SUBMISSION: Final = Event.SUBMISSION
_COMPLETION: Final = Event.COMPLETION
_TIMEOUT: Final = Event.TIMEOUT
_FAILURE: Final = Event.FAILURE
# An imported name is read from the module's dictionary unless made Final here.
_ADDRESS_OF: Final = address_of
Waiters = list[asyncio.Future[None]]

#: `TABLE` by row: the step of each legal input from one (origin, state, pending), and
#: the row that step leads to. A message keeps its row, so that applying an input is
#: one lookup keyed by the input alone, not a 4-tuple made and hashed per change.
Row = dict[Input, tuple[Step, "Row"]]


def _start(origin: bool) -> Row:
    """The row where a message starts (POSTED, nothing pending), every row that it
    can reach built from `TABLE` and linked."""
    rows: dict[tuple[State, Pending], Row] = {}
    for (of_origin, state, pending, inp), step in TABLE.items():
        if of_origin == origin:
            after = rows.setdefault((step.state, step.pending), {})
            rows.setdefault((state, pending), {})[inp] = (step, after)
    return rows[State.POSTED, Pending.NONE]


_ORIGIN_ROW: Final = _start(True)
_OTHER_ROW: Final = _start(False)


def _receipt_builder() -> Callable[..., Receipt]:
    """Receipt's constructor, or `mate._receipt.build`, which takes the same fields in
    the same order and stores them straight into the slots (a tenth of the cost)."""
    try:
        from mate._receipt import bind, build
    except ImportError:  # pure Python
        return Receipt
    bind(Receipt, tuple(field.name for field in attrs.fields(Receipt)))
    return build


_build_receipt: Final = _receipt_builder()


class Message(Operation):
    """The handle of one posted message: its state, its receipt, and awaitables.

    `await msg` returns the final Receipt at completion, or raises
    MessageTimeout, MessageFailed or asyncio.CancelledError. Cancelling a task
    that awaits a message cancels the message; a receive whose data already
    landed completes all the same (the awaiting task still sees its own
    cancellation, and `msg.state` says COMPLETED).
    """

    __slots__ = (
        "_address",
        "_ledger",
        "_pending",
        "_row",
        "_state",
        "_submission_waiters",
        "_waiters",
        "error",
        "length",
        "origin",
        "remote_pid",
        "remote_tag",
        "schedule",
        "submitted_seen",
    )

    def __init__(
        self,
        ledger: Ledger,
        op: Op,
        buffer: memoryview,
        peer: int,
        tag: int,
        address: int,
        schedule: Schedule,
        deadline: float | None = None,
    ) -> None:
        super().__init__(op, buffer, peer, tag, address, deadline)
        self._ledger = ledger
        self.origin = op is _SEND or op is _PUT
        self.schedule = schedule
        self._state = _POSTED
        self._pending = _NO_PENDING
        self._row: Row = _ORIGIN_ROW if self.origin else _OTHER_ROW
        self.submitted_seen = False
        # Facts the transport reports at the end; wildcards resolved at completion.
        self.length = len(buffer) if self.origin else 0
        self.remote_pid = peer
        self.remote_tag = tag
        self.error: BaseException | None = None
        self._address: int | None = None
        self._waiters: Waiters | None = None  # made by the first await
        self._submission_waiters: Waiters | None = None

    # -- what users read --------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    def done(self) -> bool:
        """True once the message has its terminal outcome."""
        state = self._state
        return state is not _POSTED and state is not _SUBMITTED

    def submitted_or_done(self) -> bool:
        """True once an awaiter of the submission has nothing left to wait for."""
        return self.submitted_seen or self.done()

    @property
    def receipt(self) -> Receipt:
        """What is known of the message now; final once it is done."""
        return self.receipt_for(self.last_event())

    def last_event(self) -> Event | None:
        state = self._state
        if state is _COMPLETED:
            return _COMPLETION
        if state is _TIMED_OUT:
            return _TIMEOUT
        if state is _FAILED:
            return _FAILURE
        if self.submitted_seen:
            return _SUBMISSION
        return None

    def receipt_for(self, event: Event | None) -> Receipt:
        if self._address is None:
            self._address = _ADDRESS_OF(self.buffer)
        op = self.op
        origin = op is _PUT or op is _GET
        return _build_receipt(
            op, None if origin else self.remote_tag, self.length, self._ledger.mypid,
            self.remote_pid, self._address, self.address if origin else None, event,
            self.error if event is _TIMEOUT or event is _FAILURE else None)

    def cancel(self) -> bool:
        """Ask for the message to be cancelled; False if it had already ended.

        The outcome is CANCELLED unless the transport finds that the data has
        already landed, in which case the message completes (no data loss).
        """
        if self.done():
            return False
        self._ledger.advance(self, _USER_CANCEL)
        return True

    @property
    def submitted(self) -> _Submitted | None:
        """Awaitable that returns at submission (send and put only; else None)."""
        return _Submitted(self) if self.origin else None

    def __await__(self) -> Generator[Any, None, Receipt]:
        while not self.done():
            future = self._ledger.waiter(self, submission=False)
            # Inline, not a helper generator shared with `_Submitted` (one generator
            # fewer per await): a task cancelled while it waits (its future cancelled,
            # or at its turn) cancels the message. Not a done callback on the future,
            # which would cost a loop callback on every wake-up.
            try:
                if future is None:
                    if not self.done():
                        yield  # the loop is due a turn (Ledger.waiter); then ask again
                else:
                    yield from future
            except asyncio.CancelledError:
                if future is None or future.cancelled():
                    self.cancel()
                raise
        return self.outcome()

    def outcome(self) -> Receipt:
        """The final receipt, or the exception that the outcome stands for."""
        state = self._state
        if state is _COMPLETED:
            return self.receipt_for(_COMPLETION)
        if state is _CANCELLED:
            raise asyncio.CancelledError(f"{self!r} was cancelled")
        assert isinstance(self.error, (MessageTimeout, MessageFailed)), state
        raise self.error

    # -- what the ledger calls (under its lock where other threads make changes) --------

    def apply(self, inp: Input) -> Step:
        """Apply `inp` to this message; ProtocolError if it can never receive it."""
        try:
            step, self._row = self._row[inp]
        except KeyError:
            raise ProtocolError(
                f"{inp.name} reported for {self!r} (pending {self._pending.name})"
            ) from None
        self._state = step.state
        self._pending = step.pending
        if _SUBMISSION in step.events:
            self.submitted_seen = True
        return step

    def settle(self, length: int | None, peer: int | None, tag: int | None,
               error: BaseException | None) -> None:
        """Record the facts of the terminal outcome just applied."""
        if length is not None:
            self.length = length
        if peer is not None:
            self.remote_pid = peer
        if tag is not None:
            self.remote_tag = tag
        if self._state is _TIMED_OUT:
            self.error = MessageTimeout(f"{self!r} timed out")
        elif self._state is _FAILED:
            self.error = error

    def add_waiter(self, future: asyncio.Future[None], *, submission: bool) -> bool:
        """Register an awaiter; False if what it awaits has happened already."""
        if self.done() or (submission and self.submitted_seen):
            return False
        if submission:
            if self._submission_waiters is None:
                self._submission_waiters = []
            self._submission_waiters.append(future)
        else:
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(future)
        return True

    def take_waiters(self) -> Waiters | None:
        """Detach the awaiters that the state reached now lets go."""
        done = self.done()
        woken = self._submission_waiters if self.submitted_seen or done else None
        if woken is not None:
            self._submission_waiters = None
        if done and self._waiters:
            woken = self._waiters if woken is None else woken + self._waiters
            self._waiters = None
        return woken

    def __repr__(self) -> str:
        where = "tag" if self.op in (Op.SEND, Op.RECV) else "address"
        what = self.tag if where == "tag" else self.address
        return (f"<Message {self.op.value} peer={self.peer} {where}={what} "
                f"len={len(self.buffer)} {self._state.name}>")


class _Submitted:
    """`await msg.submitted`: returns the submission receipt once the buffer is free."""

    __slots__ = ("_msg",)

    def __init__(self, msg: Message) -> None:
        self._msg = msg

    def __await__(self) -> Generator[Any, None, Receipt]:
        msg = self._msg
        while not msg.submitted_seen and not msg.done():
            future = msg._ledger.waiter(msg, submission=True)
            try:  # as in Message.__await__
                if future is None:
                    if not (msg.submitted_seen or msg.done()):
                        yield
                else:
                    yield from future
            except asyncio.CancelledError:
                if future is None or future.cancelled():
                    msg.cancel()
                raise
        if msg.submitted_seen:
            return msg.receipt_for(_SUBMISSION)
        return msg.outcome()  # ended without submission: raises its outcome
