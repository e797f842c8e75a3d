"""The asyncio TCP streams ping-pong on loopback, SPEC §7's peer baseline for the
ibverbs soft device: the echo, the timed round trips, and `TcpBench`, the
ping-pong as a side of a launched `mate-bench pingpong --tcp` run.

`TcpBench` takes turns with mate a repetition each at every size, as the
baseline and the floor do: rank 1 is the echo server, in its own event loop
(which mate leaves idle meanwhile), and rank 0 the client. A phase is one
connection: rank 0 opens it at the phase's first batch and closes it at its
end, and rank 1's phase ends when the connection does. `mate.bench.tcp` runs
the same ping-pong on its own, against an echo server process.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Mapping

import mate
from mate.bench.measure import Batch, Sample, clock

HOST = "127.0.0.1"
CHUNK = 1 << 20
PORT = struct.Struct("<H")  # the echo server's port, rank 1 to rank 0 (TcpBench)
PORT_TAG = 6  # beside the tags of mate.bench.patterns and the driver's closing 3


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo what comes until the client closes."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


def round_trips(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                out: memoryview) -> Batch:
    """A batch of `n` round trips of `out`: write it, read its echo."""
    size = len(out)
    write, readexactly = writer.write, reader.readexactly

    async def batch(n: int) -> Sample:
        start = clock()
        for _ in range(n):
            write(out)
            await readexactly(size)
        return Sample.since(n, start)

    return batch


class TcpBench:
    """One rank's side of the TCP ping-pong in a launched mate-bench run (see the
    module's docstring): rank 0 the client, rank 1 the echo server."""

    def __init__(self, world: mate.World, outs: Mapping[int, memoryview]) -> None:
        self.world = world
        self.outs = outs  # the rank's send buffer of each size, every side's (patterns.Buffers)
        self._port = 0
        self._server: asyncio.Server | None = None
        self._ended: asyncio.Queue[None] = asyncio.Queue()  # rank 1: a connection ended
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def setup(self) -> None:
        word = bytearray(PORT.size)
        if self.world.mypid == 1:
            self._server = await asyncio.start_server(self._serve, HOST, 0)
            PORT.pack_into(word, 0, self._server.sockets[0].getsockname()[1])
            await self.world.send(word, 0, PORT_TAG)
        else:
            await self.world.recv(word, 1, PORT_TAG)
            (self._port,) = PORT.unpack(word)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await echo(reader, writer)
        finally:
            self._ended.put_nowait(None)

    def batch(self, size: int) -> Batch:
        """Rank 0: `n` round trips of `size` bytes, on the phase's connection."""
        out = self.outs[size]

        async def batch(n: int) -> Sample:
            if self._stream is None:
                self._stream = await asyncio.open_connection(HOST, self._port)
            reader, writer = self._stream
            return await round_trips(reader, writer, out)(n)

        return batch

    async def end_phase(self, size: int) -> None:
        """Rank 0: close the phase's connection, which ends rank 1's phase."""
        if self._stream is not None:
            writer, self._stream = self._stream[1], None
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def serve_phase(self) -> None:
        """Rank 1: echo the phase's connection until rank 0 closes it."""
        await self._ended.get()

    async def teardown(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
