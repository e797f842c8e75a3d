"""The in-process transport: N ranks in one process and one event loop.

The "wire" is the event loop: `post` queues the operation with `call_soon`,
so it is carried out after the posting call returns and in posting order
(which gives non-overtaking for free). A `Fabric` holds the ranks of one
group; each rank's `LocalTransport` keeps the two matching tables of thesis
§5.3.1 and the regions it exposed.

Protocols, modelled on real transports so that the same semantics are
exercised here as on the wire:

* send up to `eager_limit` bytes is eager: if no receive is waiting, the data
  is copied into the destination's unexpected-message table, and the send is
  submitted and completed at once (the data has reached the destination).
* a larger send is rendezvous: it waits, uncopied, in the destination's
  unexpected table until a receive matches; the data is then copied straight
  into the receive buffer, and only then is the send submitted and completed.
  Until then it can be cancelled, and it can time out.
* put and get check the target's exposed regions first; an access outside
  them fails with REMOTE_ACCESS and touches nothing.
* a receive whose message is longer than its buffer gets the first bytes and
  fails with TRUNCATED; the sender completes (its data did arrive).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator
from typing import Any

from mate import arguments, debug
from mate.buffers import address_of
from mate.constants import ANY_SOURCE
from mate.errors import FailureReason, InvalidArgument
from mate.matching import PostedReceives, UnexpectedMessages
from mate.registry import TRANSPORTS
from mate.schedule import Op, Region
from mate.transports.base import Operation, Sink, Transport
from mate.world import World

DEFAULT_EAGER_LIMIT = 64 * 1024
# The most ranks one local group may have, refused up front rather than failing
# part-way with MemoryError: a rank costs about 2 KB and 20 us to open (measured:
# 100,000 ranks take 0.2 GB and 2 s), so this is about 2 GB and 20 s, while
# PROC_MAX ranks would need 4 TB.
MAX_RANKS = 2**20


class _Stage(enum.Enum):
    QUEUED = "queued"  # posted, waiting for the loop to carry it out
    CANCELLED = "cancelled"  # cancelled while queued
    WAITING = "waiting"  # a receive in the posted table
    DONE = "done"


class _Arrival:
    """An entry of the unexpected-message table."""

    __slots__ = ("data", "sender", "source", "tag")

    def __init__(self, source: int, tag: int, data: bytes | None, sender: Operation | None):
        self.source = source
        self.tag = tag
        self.data = data  # eager: a copy of the message
        self.sender = sender  # rendezvous: the send itself, still uncopied


class Fabric:
    """The ranks of one in-process group, indexed by rank; None once shut down."""

    def __init__(self, size: int) -> None:
        self.ranks: list[LocalTransport | None] = [None] * size


class LocalTransport(Transport):
    def __init__(self, fabric: Fabric, rank: int, sink: Sink,
                 loop: asyncio.AbstractEventLoop, eager_limit: int) -> None:
        self.fabric = fabric
        self.mypid = rank
        self.numprocs = len(fabric.ranks)
        self.tag_max = 2**31 - 1
        self.eager_limit = eager_limit
        self._sink = sink
        self._loop = loop
        self._hot_spot = debug.hot_spot_hook()
        self._posted: PostedReceives[Operation] = PostedReceives()
        self._unexpected: UnexpectedMessages[_Arrival] = UnexpectedMessages()
        self._regions: list[tuple[Region, memoryview]] = []
        # What peers hold that names this rank, with the peer holding it, so that
        # shutting this rank down visits only those (visiting every peer made the
        # shutdown of a group quadratic in its size): receives posted for a
        # message from this rank, and this rank's rendezvous sends parked there.
        self._awaited: dict[Operation, LocalTransport] = {}
        self._parked: dict[Operation, LocalTransport] = {}
        fabric.ranks[rank] = self

    # -- posting and cancelling ------------------------------------------------------

    def post(self, msg: Operation) -> None:
        msg.transport_data = _Stage.QUEUED
        self._loop.call_soon(self._carry_out, msg)

    def _carry_out(self, msg: Operation) -> None:
        if self._hot_spot is not None:
            self._hot_spot("local.carry_out")
        if msg.transport_data is not _Stage.QUEUED or self.fabric.ranks[self.mypid] is not self:
            return  # cancelled while queued, or this rank was shut down
        msg.transport_data = _Stage.DONE
        op = msg.op
        if op is Op.SEND:
            self._send(msg)
        elif op is Op.RECV:
            self._recv(msg)
        else:
            self._one_sided(msg)

    def cancel(self, msg: Operation) -> None:
        if self._hot_spot is not None:
            self._hot_spot("local.cancel")
        stage = msg.transport_data
        if stage is _Stage.QUEUED:
            msg.transport_data = _Stage.CANCELLED
        elif stage is _Stage.WAITING:
            self._posted.remove(msg.peer, msg.tag, msg)
            source = self.fabric.ranks[msg.peer] if msg.peer != ANY_SOURCE else None
            if source is not None:
                del source._awaited[msg]
            msg.transport_data = _Stage.DONE
        elif isinstance(stage, _Arrival):  # a rendezvous send not yet matched
            self._parked.pop(msg)._unexpected.remove(stage.source, stage.tag, stage)
            msg.transport_data = _Stage.DONE
        else:
            return  # already carried out: its terminal outcome is reported
        self._sink.cancelled(msg)

    # -- two-sided -------------------------------------------------------------------

    def _send(self, msg: Operation) -> None:
        dest = self.fabric.ranks[msg.peer]
        if dest is None:
            self._sink.failed(msg, FailureReason.PEER_UNREACHABLE,
                              f"rank {msg.peer} has shut down")
            return
        recv = dest._posted.match(self.mypid, msg.tag)
        if recv is not None:
            if recv.peer == self.mypid:  # not ANY_SOURCE
                del self._awaited[recv]
            recv.transport_data = _Stage.DONE
            dest._deliver(recv, self.mypid, msg.tag, msg.buffer)
            self._sink.completed(msg, len(msg.buffer), msg.peer, msg.tag)
        elif len(msg.buffer) <= self.eager_limit:
            dest._unexpected.add(self.mypid, msg.tag,
                                 _Arrival(self.mypid, msg.tag, bytes(msg.buffer), None))
            self._sink.completed(msg, len(msg.buffer), msg.peer, msg.tag)
        else:
            arrival = _Arrival(self.mypid, msg.tag, None, msg)
            msg.transport_data = arrival
            dest._unexpected.add(self.mypid, msg.tag, arrival)
            self._parked[msg] = dest

    def _recv(self, msg: Operation) -> None:
        arrival = self._unexpected.match(msg.peer, msg.tag)
        if arrival is None:
            if msg.peer != ANY_SOURCE:
                source = self.fabric.ranks[msg.peer]
                if source is None:
                    self._sink.failed(msg, FailureReason.PEER_UNREACHABLE,
                                      f"rank {msg.peer} has shut down")
                    return
                source._awaited[msg] = self
            msg.transport_data = _Stage.WAITING
            self._posted.add(msg.peer, msg.tag, msg)
            return
        if arrival.data is not None:
            self._deliver(msg, arrival.source, arrival.tag, memoryview(arrival.data))
            return
        sender = arrival.sender
        assert sender is not None
        sender.transport_data = _Stage.DONE
        self._deliver(msg, arrival.source, arrival.tag, sender.buffer)
        origin = self.fabric.ranks[arrival.source]
        if origin is not None:
            del origin._parked[sender]
            origin._sink.completed(sender, len(sender.buffer), self.mypid, sender.tag)

    def _deliver(self, recv: Operation, source: int, tag: int, data: memoryview) -> None:
        n, room = len(data), len(recv.buffer)
        if n > room:
            recv.buffer[:] = data[:room]
            self._sink.failed(recv, FailureReason.TRUNCATED,
                              f"a message of {n} bytes arrived for a buffer of {room} bytes",
                              length=room, peer=source, tag=tag)
        else:
            recv.buffer[:n] = data
            self._sink.completed(recv, n, source, tag)

    # -- one-sided -------------------------------------------------------------------

    def _one_sided(self, msg: Operation) -> None:
        target = self.fabric.ranks[msg.peer]
        if target is None:
            self._sink.failed(msg, FailureReason.PEER_UNREACHABLE,
                              f"rank {msg.peer} has shut down")
            return
        n = len(msg.buffer)
        memory = target._region_memory(msg.address, n)
        if memory is None:
            self._sink.failed(
                msg, FailureReason.REMOTE_ACCESS,
                f"[{msg.address:#x}, +{n}) is not inside a region rank {msg.peer} exposed")
            return
        if msg.op is Op.PUT:
            memory[:] = msg.buffer
        else:
            msg.buffer[:] = memory
        self._sink.completed(msg, n, msg.peer, msg.tag)

    def _region_memory(self, address: int, length: int) -> memoryview | None:
        for region, view in self._regions:
            if region.contains(address, length):
                start = address - region.address
                return view[start:start + length]
        return None

    def expose(self, buffer: memoryview) -> Region:
        region = Region(self.mypid, address_of(buffer), len(buffer))
        self._regions.append((region, buffer))
        return region

    async def unexpose(self, region: Region) -> None:
        # Operations are carried out whole inside one loop callback, so none is
        # in flight here: once the entry is gone no peer can reach the memory.
        for i, (candidate, _) in enumerate(self._regions):
            if candidate == region:
                del self._regions[i]
                return

    # -- shutdown --------------------------------------------------------------------

    async def shutdown(self) -> None:
        self.leave()

    def leave(self) -> None:
        """Leave the fabric now: peers then see this rank as gone (PEER_UNREACHABLE).

        Shutdown calls it once the world has ended this rank's messages; a rank
        that `mate.faults` kills in place calls it with them still outstanding:
        they are taken out of the tables all the same, and never reported.
        """
        fabric = self.fabric
        if fabric.ranks[self.mypid] is not self:
            return
        # Our own messages end without us (the world ended them, or is dead):
        # take them out of the tables they wait in.
        for recv in self._posted.items():
            source = fabric.ranks[recv.peer] if recv.peer != ANY_SOURCE else None
            if source is not None:
                del source._awaited[recv]
        for send, dest in self._parked.items():
            arrival = send.transport_data
            dest._unexpected.remove(arrival.source, arrival.tag, arrival)
        fabric.ranks[self.mypid] = None
        # Rendezvous sends that peers parked here can never be delivered now.
        for arrival in self._unexpected.items():
            if arrival.sender is not None:
                origin = fabric.ranks[arrival.source]
                assert origin is not None  # a rank that shut down took its sends back
                del origin._parked[arrival.sender]
                arrival.sender.transport_data = _Stage.DONE
                origin._sink.failed(arrival.sender, FailureReason.PEER_UNREACHABLE,
                                    f"rank {self.mypid} shut down before receiving it")
        # Receives that peers posted for a message from this rank never get one.
        for recv, owner in self._awaited.items():
            owner._posted.remove(self.mypid, recv.tag, recv)
            recv.transport_data = _Stage.DONE
            owner._sink.failed(recv, FailureReason.PEER_UNREACHABLE,
                               f"rank {self.mypid} shut down")
        self._posted.clear()
        self._unexpected.clear()
        self._awaited.clear()
        self._parked.clear()
        self._regions.clear()


def open_transport(sink: Sink, loop: asyncio.AbstractEventLoop, *, handlers: str,
                   eager_limit: int) -> Transport:
    """One rank alone (`mate.startup("local")`); the registry checked the options."""
    return LocalTransport(Fabric(1), 0, sink, loop, eager_limit)


async def open_worlds(n: int, *, default_timeout: float = 1.0, progress: Any = None,
                      handlers: str = "loop", **options: Any) -> list[World]:
    """Open `n` connected local worlds on the running loop (1 <= n <= MAX_RANKS)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument(f"the number of ranks must be an int >= 1, not {n!r}")
    if n > MAX_RANKS:
        raise InvalidArgument(
            f"{n} ranks do not fit in one process: the local transport takes at most "
            f"{MAX_RANKS} (each costs about 2 KB); run more under a launcher (mpi)"
        )
    arguments.seconds(default_timeout, "default_timeout")
    eager_limit = TRANSPORTS["local"].resolve(progress, handlers, options)["eager_limit"]
    loop = asyncio.get_running_loop()
    fabric = Fabric(n)
    worlds = []
    for rank in range(n):
        world = World(loop, default_timeout=default_timeout, handlers=handlers)
        world.attach(LocalTransport(fabric, rank, world.sink, loop, eager_limit))
        worlds.append(world)
    return worlds


@contextlib.asynccontextmanager
async def worlds(n: int, **options: Any) -> AsyncIterator[list[World]]:
    """``async with mate.local.worlds(n) as worlds:`` - n ranks; all shut down at exit."""
    group = await open_worlds(n, **options)
    try:
        yield group
    finally:
        for world in group:
            await world.shutdown()
