"""The value types of the model: schedules, receipts, events, states and regions.

These are the thesis's `mate_schedule_t` and `mate_receipt_t` (§5.1.1) as
frozen attrs classes: a schedule names a handler and a datum per event and can
be shared by many messages; a receipt describes one message at one event and
can never be changed by its reader.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import attrs

Handler = Callable[["Receipt", Any], Any]


class IdentityEnum(enum.Enum):
    """An enum whose members hash by identity, as they compare: dict and set lookups
    on the per-message path then call no Python code (`Enum.__hash__` does)."""

    __hash__ = object.__hash__


class Op(IdentityEnum):
    """The four communication calls."""

    SEND = "send"
    RECV = "recv"
    PUT = "put"
    GET = "get"


class Event(IdentityEnum):
    """A change in a message's progress that a schedule can handle."""

    SUBMISSION = "submission"  # the local buffer may be reused (send, put)
    COMPLETION = "completion"
    TIMEOUT = "timeout"
    FAILURE = "failure"


class State(IdentityEnum):
    """Where a message is in its life; the last four are terminal."""

    POSTED = "posted"
    SUBMITTED = "submitted"
    COMPLETED = "completed"
    TIMED_OUT = "timed out"
    FAILED = "failed"
    CANCELLED = "cancelled"

    terminal: bool  # a plain attribute: the core reads it several times per message

    def __init__(self, value: str) -> None:
        self.terminal = value not in ("posted", "submitted")


def _handler(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not callable(value):
        from mate.errors import InvalidArgument

        raise InvalidArgument(
            f"Schedule.{attribute.name} must be callable or None, not {type(value).__name__}"
        )


@attrs.frozen
class Schedule:
    """What to call, and with which datum, at each event of a message.

    A handler is called as ``handler(receipt, data)``; a coroutine function is
    run as a task. Any handler may be None: that event is then not observed
    through the schedule (it can still be awaited on the message).
    """

    completion: Handler | None = attrs.field(default=None, validator=_handler)
    completion_data: Any = None
    submission: Handler | None = attrs.field(default=None, validator=_handler)
    submission_data: Any = None
    timeout: Handler | None = attrs.field(default=None, validator=_handler)
    timeout_data: Any = None
    failure: Handler | None = attrs.field(default=None, validator=_handler)
    failure_data: Any = None

    def handler_for(self, event: Event) -> tuple[Handler | None, Any]:
        """The handler and datum that `event` calls."""
        if event is Event.COMPLETION:
            return self.completion, self.completion_data
        if event is Event.SUBMISSION:
            return self.submission, self.submission_data
        if event is Event.TIMEOUT:
            return self.timeout, self.timeout_data
        return self.failure, self.failure_data


#: The schedule of a message posted without one: no handlers, so the core skips the
#: lookup of each event's handler (it checks identity, not emptiness).
NO_SCHEDULE = Schedule()


# Slotted: a receipt is built for every awaited message, and `mate._receipt` builds
# one by storing each field at its slot's offset (mate.message).
@attrs.frozen
class Receipt:
    """What is known of a message at one event; wildcards are filled in at completion."""

    op: Op
    tag: int | None  # None for put/get, which carry no tag
    length: int  # bytes actually transferred (the buffer's length before completion)
    local_pid: int
    remote_pid: int
    local_address: int
    remote_address: int | None  # the target address of put/get
    event: Event | None  # None while no event has happened yet
    error: BaseException | None = None  # the MessageTimeout or MessageFailed, else None


@attrs.frozen
class Region:
    """Memory that `pid` exposed to one-sided access: `[address, address + length)`."""

    pid: int
    address: int
    length: int = attrs.field(validator=attrs.validators.ge(0))

    def contains(self, address: int, length: int) -> bool:
        """Whether `[address, address + length)` lies inside this region."""
        return self.address <= address and address + length <= self.address + self.length
