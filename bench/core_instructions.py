"""Machine instructions per message on the core's path, counted by callgrind.

A receive is posted through `World.recv`, reported complete from a loop
callback and awaited, N times, on a transport that does nothing: what is
left is mate's own work and asyncio's. Instruction counts, unlike times, do
not move with a noisy host, so two builds compare exactly:

    for n in 2000 12000; do
        valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
            python bench/core_instructions.py $n 2>&1 | grep Collected
    done

(the difference of the two totals over 10,000 is the count per message; the
smaller run takes out start-up). `callgrind_annotate --inclusive=yes` on a
kept output file shows where they go, compiled functions included.
"""

from __future__ import annotations

import asyncio
import sys

from mate.machine import Input
from mate.schedule import Region
from mate.transports.base import Operation, Report, Sink, Transport
from mate.world import World


class NullTransport(Transport):
    """Takes every post and does nothing; the caller reports for it."""

    def __init__(self, sink: Sink) -> None:
        self.mypid, self.numprocs, self.tag_max = 0, 2, 2**31 - 1
        self._sink = sink

    def post(self, op: Operation) -> None:
        pass

    def cancel(self, op: Operation) -> None:
        self._sink.cancelled(op)

    def expose(self, buffer: memoryview) -> Region:
        raise NotImplementedError

    async def unexpose(self, region: Region) -> None:
        pass

    async def shutdown(self) -> None:
        pass


async def run(messages: int) -> None:
    loop = asyncio.get_running_loop()
    world = World(loop, default_timeout=1.0, handlers="loop")
    world.attach(NullTransport(world.sink))
    sink, buffer = world.sink, bytearray(8)
    for _ in range(messages):
        msg = world.recv(buffer, 1, 0)
        loop.call_soon(sink.report_all, [Report(Input.COMPLETED, msg, 8, 1, 0)])
        await msg


if __name__ == "__main__":
    asyncio.run(run(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000))
