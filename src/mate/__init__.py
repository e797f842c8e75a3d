"""mate: Progressive Messages for asyncio (the MATE library of Aycock's thesis).

Every ``send``, ``recv``, ``put`` and ``get`` starts a message and returns a
`Message` at once; the message's events (submission, completion, timeout,
failure) reach the handlers of its `Schedule` and whoever awaits it.
"""

from __future__ import annotations

from collections.abc import Generator
from types import TracebackType
from typing import Any

import mate.native  # noqa: F401 (first: it decides whether compiled modules are used)
from mate import arguments, local
from mate.constants import ANY_SOURCE, ANY_TAG, PROC_MAX, UNSET
from mate.errors import FailureReason, InvalidArgument, MateError, MessageFailed, MessageTimeout
from mate.message import Message
from mate.registry import TRANSPORTS, choose
from mate.schedule import Event, Op, Receipt, Region, Schedule, State
from mate.world import World

__version__ = "0.1.0"

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "PROC_MAX",
    "TRANSPORTS",
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

class startup:
    """Start this process's world (mate_startup).

    Use ``async with mate.startup(...) as world:`` (leaving the block is
    mate_shutdown), or ``world = await mate.startup(...)`` and later
    ``await world.shutdown()``. `transport` is a name of `mate.registry.TRANSPORTS`
    ("local", "mpi", "ibverbs"), or None: ``$MATE_TRANSPORT``, else the transport whose
    launcher started this process, else "local".
    """

    def __init__(self, transport: str | None = None, *, default_timeout: float = 1.0,
                 progress: str | None = None, handlers: str = "loop", **options: Any) -> None:
        self._entry = choose(transport)
        self._options = dict(options, default_timeout=default_timeout, progress=progress,
                             handlers=handlers)
        arguments.seconds(default_timeout, "default_timeout")
        self._entry.resolve(progress, handlers, options)  # bad options fail here, at once
        self._world: World | None = None

    def __await__(self) -> Generator[Any, None, World]:
        return self._entry.open(**self._options).__await__()

    async def __aenter__(self) -> World:
        self._world = await self._entry.open(**self._options)
        return self._world

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._world is not None:
            await self._world.shutdown()
