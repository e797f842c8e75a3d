"""The message state machine: one pure function of (origin, state, pending, input).

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
* the core reports TIMEOUT (the message's deadline passed; `mate.deadlines`)
  and SHUTDOWN;
* the user reports USER_CANCEL (`msg.cancel()`, or a task awaiting it was
  cancelled).

TIMEOUT and USER_CANCEL do not end a message by themselves: they ask the transport
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

This module does no I/O and knows nothing of messages: `mate.message` holds a
message's state and applies the table, `mate.world` carries out the outputs.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import NamedTuple

from mate.schedule import Event, IdentityEnum, State


class Input(IdentityEnum):
    SUBMITTED = "submitted"  # transport: the local buffer is no longer read
    COMPLETED = "completed"  # transport
    FAILED = "failed"  # transport
    CANCELLED = "cancelled"  # transport: the requested cancel took effect
    USER_CANCEL = "user cancel"  # user: msg.cancel(), or an awaiting task was cancelled
    TIMEOUT = "timeout"  # core: the armed timeout elapsed
    SHUTDOWN = "shutdown"  # core: the world is shutting down


class Pending(IdentityEnum):
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
    if inp in (Input.USER_CANCEL, Input.TIMEOUT):
        if pending is not Pending.NONE:
            return Step(state, pending, (), False)
        asked = Pending.CANCEL if inp is Input.USER_CANCEL else Pending.TIMEOUT
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
