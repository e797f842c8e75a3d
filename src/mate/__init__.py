"""mate: Progressive Messages for asyncio (the MATE library of Aycock's thesis).

Every ``send``, ``recv``, ``put`` and ``get`` starts a message and returns a
`Message` at once; the message's events (submission, completion, timeout,
failure) reach the handlers of its `Schedule` and whoever awaits it.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from types import TracebackType
from typing import Any

from mate import local
from mate.constants import ANY_SOURCE, ANY_TAG, PROC_MAX, UNSET
from mate.errors import FailureReason, InvalidArgument, MateError, MessageFailed, MessageTimeout
from mate.message import Message
from mate.schedule import Event, Op, Receipt, Region, Schedule, State
from mate.transports.mpi import launched_by_mpiexec
from mate.world import World, check_handlers, check_seconds, open_world

__version__ = "0.1.0"

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "PROC_MAX",
    "UNSET",
    "Event",
    "FailureReason",
    "InvalidArgument",
    "MateError",
    "Message",
    "MessageFailed",
    "MessageTimeout",
    "Op",
    "Receipt",
    "Region",
    "Schedule",
    "State",
    "World",
    "__version__",
    "local",
    "startup",
]

TRANSPORTS = ("local", "mpi")


def _choose_transport(transport: str | None) -> str:
    if transport is None:
        transport = os.environ.get("MATE_TRANSPORT") or (
            "mpi" if launched_by_mpiexec() else "local")
    if transport not in TRANSPORTS:
        raise InvalidArgument(f"unknown transport {transport!r}; available: {TRANSPORTS}")
    return transport


async def _open(transport: str, options: dict[str, Any]) -> World:
    if transport == "local":
        (world,) = await local.open_worlds(1, **options)
        return world
    from mate.transports.mpi import open_transport

    return await open_world(open_transport, **options)


class startup:
    """Start this process's world (mate_startup).

    Use ``async with mate.startup(...) as world:`` (leaving the block is
    mate_shutdown), or ``world = await mate.startup(...)`` and later
    ``await world.shutdown()``. `transport` is "local", or None for
    ``$MATE_TRANSPORT`` (default "local").
    """

    def __init__(self, transport: str | None = None, *, default_timeout: float = 1.0,
                 progress: str | None = None, handlers: str = "loop", **options: Any) -> None:
        self._transport = _choose_transport(transport)
        check_seconds(default_timeout, "default_timeout")
        check_handlers(handlers)
        self._options = dict(options, default_timeout=default_timeout, progress=progress,
                             handlers=handlers)
        self._world: World | None = None

    def __await__(self) -> Generator[Any, None, World]:
        return _open(self._transport, self._options).__await__()

    async def __aenter__(self) -> World:
        self._world = await _open(self._transport, self._options)
        return self._world

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._world is not None:
            await self._world.shutdown()
