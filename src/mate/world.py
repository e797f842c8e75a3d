"""The world: the MATE API of one process.

`World` hands each message to its ledger (`mate.ledger`) in one call,
`Ledger.submit`, which checks every argument with `mate.arguments` (raising
`InvalidArgument` from the call itself), makes the `Message` and posts it to
the transport. The ledger is also the sink the transport reports to, and
turns the reports into events, handlers and woken awaiters. This module stays interpreted: a
compiled call would reject a numpy integer with a TypeError before
`mate.arguments` could accept or refuse it.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from mate import arguments
from mate.constants import ANY_SOURCE, ANY_TAG, UNSET, UnsetType
from mate.dispatch import MODES
from mate.errors import InvalidArgument
from mate.ledger import Ledger
from mate.message import Message
from mate.schedule import Op, Region, Schedule
from mate.transports.base import Sink, Transport

Timeout = float | None | UnsetType
# Module constants: a read through the enum class is slow on Python 3.11 (mate.message).
_SEND, _RECV, _PUT, _GET = Op.SEND, Op.RECV, Op.PUT, Op.GET


class World:
    """One process's view of the communicating processes (mate_startup's result)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, *, default_timeout: float, handlers: str
    ) -> None:
        self._loop = loop
        self.default_timeout = arguments.seconds(default_timeout, "default_timeout")
        self.handlers = arguments.choice(handlers, "handlers", MODES)
        self._ledger = Ledger(loop, self.handlers)
        self._exposed: Counter[Region] = Counter()

    def attach(self, transport: Transport) -> None:
        if self.handlers == "progress" and not transport.supports_progress_handlers:
            raise InvalidArgument(
                f'handlers="progress" needs a transport with a progress thread; '
                f"{type(transport).__name__} runs handlers on the loop only"
            )
        self.mypid = transport.mypid
        self.numprocs = transport.numprocs
        self.tag_max = transport.tag_max
        self._ledger.attach(transport, self.mypid, self.numprocs, self.tag_max)

    @property
    def sink(self) -> Sink:
        """What this world's transport reports to (a layer such as `mate.faults` too)."""
        return self._ledger

    @property
    def transport(self) -> Transport:
        """The transport this world posts to (`InvalidArgument` after shutdown)."""
        return self._open()

    def interpose(self, layer: Transport) -> None:
        """Put `layer` (which forwards to `self.transport`) between this world and the wire.

        For layers such as `mate.faults.FaultyTransport`. Messages posted
        before keep working: the layer forwards their cancels.
        """
        self._open()
        self.attach(layer)

    # -- the API -----------------------------------------------------------------

    def send(self, buffer: Any, dest: int, tag: int = 0, *,
             schedule: Schedule | None = None, timeout: Timeout = UNSET) -> Message:
        """Send `buffer` to `dest` with `tag`; completion means it reached `dest`.

        A send that times out may still have reached its destination.
        """
        return self._ledger.submit(_SEND, buffer, dest, tag, schedule, timeout,
                                   self.default_timeout)

    def recv(self, buffer: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, *,
             schedule: Schedule | None = None, timeout: Timeout = UNSET) -> Message:
        """Receive into `buffer` a message from `source` with `tag` (wildcards allowed)."""
        return self._ledger.submit(_RECV, buffer, source, tag, schedule, timeout,
                                   self.default_timeout)

    def put(self, buffer: Any, dest: int, address: int, *,
            schedule: Schedule | None = None, timeout: Timeout = UNSET) -> Message:
        """Write `buffer` into `dest`'s exposed memory at `address`."""
        return self._ledger.submit(_PUT, buffer, dest, address, schedule, timeout,
                                   self.default_timeout)

    def get(self, buffer: Any, source: int, address: int, *,
            schedule: Schedule | None = None, timeout: Timeout = UNSET) -> Message:
        """Read `source`'s exposed memory at `address` into `buffer`."""
        return self._ledger.submit(_GET, buffer, source, address, schedule, timeout,
                                   self.default_timeout)

    def expose(self, buffer: Any) -> Region:
        """Make `buffer` a target of peers' put and get; no collective call."""
        transport = self._open()
        region = transport.expose(arguments.buffer(buffer, writable=True, what="exposed buffer"))
        self._exposed[region] += 1
        return region

    async def unexpose(self, region: Region) -> None:
        """Return once no peer operation can touch `region`; later access fails."""
        transport = self._open()
        if not isinstance(region, Region) or region not in self._exposed:
            raise InvalidArgument(f"{region!r} is not a region this world exposed")
        self._exposed[region] -= 1
        if self._exposed[region] == 0:
            del self._exposed[region]
        await transport.unexpose(region)

    def progress(self) -> None:
        """Drive progress by hand (mate_progress); a no-op with independent progress."""
        self._open().progress()

    def stats(self) -> dict[str, int]:
        """Counters: messages outstanding here; messages and bytes completed by op
        (``send_messages``, ``send_bytes``, ... ``get_bytes``); messages that timed
        out, failed or were cancelled; then the transport's own counters."""
        transport = self._open()
        return {**self._ledger.counters(), **transport.stats()}

    async def shutdown(self) -> None:
        """Cancel every outstanding message (no handlers run) and release the transport."""
        ledger = self._ledger
        if ledger.closed:
            return
        await ledger.close()
        if ledger.transport is not None:
            await ledger.transport.shutdown()

    # -- argument checks -----------------------------------------------------------

    def _open(self) -> Transport:
        return self._ledger.open_transport()

    def __repr__(self) -> str:
        transport = self._ledger.transport
        name = type(transport).__name__ if transport else "unattached"
        state = "shut down" if self._ledger.closed else "open"
        return f"<World {self.mypid}/{self.numprocs} {name} {state}>"


Opener = Callable[..., "Transport | Awaitable[Transport]"]


async def open_world(opener: Opener, *, default_timeout: float = 1.0,
                     handlers: str = "loop", **options: Any) -> World:
    """Open this process's world on the transport that `opener(sink, loop, ...)` makes.

    The opener may be a coroutine function: a transport whose bootstrap waits
    for its peers (exchanging addresses) does so without blocking the loop.
    """
    loop = asyncio.get_running_loop()
    world = World(loop, default_timeout=default_timeout, handlers=handlers)
    transport = opener(world.sink, loop, handlers=handlers, **options)
    if inspect.isawaitable(transport):
        transport = await transport
    world.attach(transport)
    return world

