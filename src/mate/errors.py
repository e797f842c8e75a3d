"""The exceptions mate raises, and the reasons a message can fail.

Two kinds of trouble are kept apart, as §5.1.2 of the thesis asks: a bad
parameter is the caller's mistake and is raised by the call itself
(`InvalidArgument`); a fault during transfer is an *event* of the message
(`MessageTimeout`, `MessageFailed`), seen by a schedule handler and by
whoever awaits the message.
"""

from __future__ import annotations

import enum


class MateError(Exception):
    """Base class of every error mate raises."""


class InvalidArgument(MateError, ValueError):
    """A call was given a parameter it cannot accept; nothing was started."""


class FailureReason(enum.Enum):
    """Why a message is known never to complete."""

    TRUNCATED = "truncated"  # the message was longer than the receive buffer
    PEER_UNREACHABLE = "peer unreachable"
    REMOTE_ACCESS = "remote access"  # put/get outside the target's exposed regions
    RESOURCES = "resources"
    REFUSED = "refused"
    TRANSPORT = "transport"  # anything else; the underlying error is chained


class MessageTimeout(MateError, TimeoutError):
    """An armed timeout elapsed before completion; the message was cancelled locally.

    A send or put that timed out may still have reached its destination
    (thesis §5.1.1): the timeout says only that completion was not seen in time.
    """


class MessageFailed(MateError):
    """The message is known never to complete; `reason` says why."""

    def __init__(self, reason: FailureReason, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
