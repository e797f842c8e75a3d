"""The message state machine, and the `Message` handle that carries it.

Theory of operation
-------------------
A message is posted, then moves through the states of `mate.State`:

    POSTED ──submission──▶ SUBMITTED ──completion──▶ COMPLETED
       │                       │
       └───────────────────────┴──▶ TIMED_OUT | FAILED | CANCELLED

Three parties feed *inputs* into a message, and this module alone decides what
each input does (`transition`, built once into `TABLE`):

* the transport reports SUBMITTED, COMPLETED, FAILED, and CANCELLED (a cancel
  it was asked for took effect);
* the core reports TIMEOUT (an armed timeout elapsed) and SHUTDOWN;
* the user reports CANCEL (`msg.cancel()`, or a task awaiting it was cancelled).

TIMEOUT and CANCEL do not end a message by themselves: they ask the transport
to cancel it and remember which outcome was asked for (`Pending`). Only the
transport knows whether the data already landed, so only its answer ends the
message: CANCELLED gives the pending outcome, COMPLETED means the match won the
race and the message completes (SPEC §1: no data loss). The first request wins.

Every SPEC §1 invariant is a property of the table:

* a terminal state ignores every input, so exactly one outcome fires and
  nothing fires after it;
* submission exists only for origin ops (send, put) and fires at most once;
  an origin op that completes straight from POSTED emits SUBMISSION then
  COMPLETION in one step;
* an input the transport must never send (submission of a recv, a second
  submission, an unrequested CANCELLED) is a `ProtocolError`: a transport bug.

What the world does with the *outputs* (events for handlers and awaiters, and
"ask the transport to cancel") lives in `mate.world`; this module does no I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, NamedTuple

from mate.buffers import address_of
from mate.errors import MessageFailed, MessageTimeout
from mate.schedule import Event, Op, Receipt, Schedule, State

if TYPE_CHECKING:
    from mate.world import World


class Input(enum.Enum):
    SUBMITTED = "submitted"  # transport: the local buffer is no longer read
    COMPLETED = "completed"  # transport
    FAILED = "failed"  # transport
    CANCELLED = "cancelled"  # transport: the requested cancel took effect
    CANCEL = "cancel"  # user
    TIMEOUT = "timeout"  # core: the armed timeout elapsed
    SHUTDOWN = "shutdown"  # core: the world is shutting down


class Pending(enum.Enum):
    """An outcome that was asked for and awaits the transport's answer."""

    NONE = "none"
    TIMEOUT = "timeout"
    CANCEL = "cancel"


class ProtocolError(RuntimeError):
    """A transport reported an input that its message can never receive."""


class Step(NamedTuple):
    state: State
    pending: Pending
    events: tuple[Event, ...]
    ask_cancel: bool  # ask the transport to cancel the message


_LIVE = (State.POSTED, State.SUBMITTED)


def transition(origin: bool, state: State, pending: Pending, inp: Input) -> Step:
    """What `inp` does to a message; `origin` is True for send and put."""
    if state.terminal:
        return Step(state, pending, (), False)
    if inp is Input.SUBMITTED:
        if not origin or state is State.SUBMITTED:
            raise ProtocolError(f"submission reported for a {'' if origin else 'non-'}origin "
                                f"message in state {state.name}")
        return Step(State.SUBMITTED, pending, (Event.SUBMISSION,), False)
    if inp is Input.COMPLETED:
        first = (Event.SUBMISSION,) if origin and state is State.POSTED else ()
        return Step(State.COMPLETED, Pending.NONE, (*first, Event.COMPLETION), False)
    if inp is Input.FAILED:
        return Step(State.FAILED, Pending.NONE, (Event.FAILURE,), False)
    if inp is Input.CANCELLED:
        if pending is Pending.TIMEOUT:
            return Step(State.TIMED_OUT, Pending.NONE, (Event.TIMEOUT,), False)
        if pending is Pending.CANCEL:
            return Step(State.CANCELLED, Pending.NONE, (), False)
        raise ProtocolError("the transport cancelled a message nobody asked it to cancel")
    if inp in (Input.CANCEL, Input.TIMEOUT):
        if pending is not Pending.NONE:
            return Step(state, pending, (), False)
        asked = Pending.CANCEL if inp is Input.CANCEL else Pending.TIMEOUT
        return Step(state, asked, (), True)
    # SHUTDOWN: cancelled at once, with no handler and no word from the transport.
    return Step(State.CANCELLED, Pending.NONE, (), False)


def _build_table() -> dict[tuple[bool, State, Pending, Input], Step]:
    table = {}
    for key in itertools.product((True, False), State, Pending, Input):
        with contextlib.suppress(ProtocolError):
            table[key] = transition(*key)
    return table


# Every legal (origin, state, pending, input); a missing key is a ProtocolError.
TABLE = _build_table()

_ORIGIN_OPS = (Op.SEND, Op.PUT)


class Message:
    """The handle of one posted message: its state, its receipt, and awaitables.

    `await msg` returns the final Receipt at completion, or raises
    MessageTimeout, MessageFailed or asyncio.CancelledError. Cancelling a task
    that awaits a message cancels the message; a receive whose data already
    landed completes all the same (the awaiting task still sees its own
    cancellation, and `msg.state` says COMPLETED).
    """

    __slots__ = (
        "_address",
        "_pending",
        "_state",
        "_submission_waiters",
        "_waiters",
        "_world",
        "address",
        "buffer",
        "deadline",
        "error",
        "length",
        "op",
        "origin",
        "peer",
        "remote_pid",
        "remote_tag",
        "schedule",
        "submitted_seen",
        "tag",
        "timer",
        "transport_data",
    )

    def __init__(
        self,
        world: World,
        op: Op,
        buffer: memoryview,
        peer: int,
        tag: int,
        address: int,
        schedule: Schedule,
    ) -> None:
        self._world = world
        self.op = op
        self.origin = op in _ORIGIN_OPS
        self.buffer = buffer
        self.peer = peer  # destination (send, put) or source (recv, get); may be ANY_SOURCE
        self.tag = tag  # may be ANY_TAG for recv; 0 for put and get
        self.address = address  # target address of put/get
        self.schedule = schedule
        self._state = State.POSTED
        self._pending = Pending.NONE
        self.submitted_seen = False
        # Facts the transport reports at the end; wildcards resolved at completion.
        self.length = len(buffer) if self.origin else 0
        self.remote_pid = peer
        self.remote_tag = tag
        self.error: BaseException | None = None
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.transport_data: Any = None  # the transport's own slot
        self._address: int | None = None
        # One future per awaiting task, so that cancelling one task never cancels
        # another's await (that task gets the outcome; the match may win).
        self._waiters: list[asyncio.Future[None]] | None = None  # made by the first await
        self._submission_waiters: list[asyncio.Future[None]] | None = None

    # -- what users read --------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    def done(self) -> bool:
        """True once the message has its terminal outcome."""
        return self._state.terminal

    @property
    def receipt(self) -> Receipt:
        """What is known of the message now; final once it is done."""
        return self.receipt_for(self.last_event())

    def last_event(self) -> Event | None:
        state = self._state
        if state is State.COMPLETED:
            return Event.COMPLETION
        if state is State.TIMED_OUT:
            return Event.TIMEOUT
        if state is State.FAILED:
            return Event.FAILURE
        if self.submitted_seen:
            return Event.SUBMISSION
        return None

    def receipt_for(self, event: Event | None) -> Receipt:
        if self._address is None:
            self._address = address_of(self.buffer)
        origin = self.op in (Op.PUT, Op.GET)
        return Receipt(
            op=self.op,
            tag=None if origin else self.remote_tag,
            length=self.length,
            local_pid=self._world.mypid,
            remote_pid=self.remote_pid,
            local_address=self._address,
            remote_address=self.address if origin else None,
            event=event,
            error=self.error if event in (Event.TIMEOUT, Event.FAILURE) else None,
        )

    def cancel(self) -> bool:
        """Ask for the message to be cancelled; False if it had already ended.

        The outcome is CANCELLED unless the transport finds that the data has
        already landed, in which case the message completes (no data loss).
        """
        if self._state.terminal:
            return False
        self._world.advance(self, Input.CANCEL)
        return True

    @property
    def submitted(self) -> _Submitted | None:
        """Awaitable that returns at submission (send and put only; else None)."""
        return _Submitted(self) if self.origin else None

    def __await__(self) -> Generator[Any, None, Receipt]:
        if not self._state.terminal:
            future = self._world.new_future(self)
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(future)
            yield from future.__await__()
        return self.outcome()

    def outcome(self) -> Receipt:
        """The final receipt, or the exception that the outcome stands for."""
        state = self._state
        if state is State.COMPLETED:
            return self.receipt_for(Event.COMPLETION)
        if state is State.CANCELLED:
            raise asyncio.CancelledError(f"{self!r} was cancelled")
        assert isinstance(self.error, (MessageTimeout, MessageFailed)), state
        raise self.error

    # -- what the world writes (under its lock) ------------------------------------

    def apply(self, inp: Input) -> Step:
        """Apply `inp` to this message; ProtocolError if it can never receive it."""
        try:
            step = TABLE[self.origin, self._state, self._pending, inp]
        except KeyError:
            raise ProtocolError(
                f"{inp.name} reported for {self!r} (pending {self._pending.name})"
            ) from None
        self._state = step.state
        self._pending = step.pending
        if Event.SUBMISSION in step.events:
            self.submitted_seen = True
        return step

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
        if not msg.submitted_seen and not msg.done():
            future = msg._world.new_future(msg)
            if msg._submission_waiters is None:
                msg._submission_waiters = []
            msg._submission_waiters.append(future)
            yield from future.__await__()
        if msg.submitted_seen:
            return msg.receipt_for(Event.SUBMISSION)
        return msg.outcome()  # ended without submission: raises its outcome
