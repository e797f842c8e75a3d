"""MPI thread mode: what the hop from the progress thread onto the loop costs.

    MATE_PURE_PYTHON=1 mpiexec -n 2 python bench/trace_hop.py [ROUNDS]

An 8 B ping-pong with ``progress="thread"`` in which rank 1 stamps the entry
queue (`mate.entry`): when the progress thread asks the loop to run a batch
(`_hop`, one ``call_soon_threadsafe``), when the loop starts it (`_drain`),
and when the task that awaited the receive resumes. It patches `EntryQueue`,
so it runs on the pure-Python modules (a compiled class cannot be patched);
the hop itself -- the self-pipe, the loop's wake-up, the GIL -- is the event
loop's and the kernel's either way.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import mate
from mate import entry, native

STAMPS: dict[str, list[int]] = {"hop": [], "drain": []}


def stamped(method: str, key: str) -> None:
    original = getattr(entry.EntryQueue, method)

    def stamp(self: entry.EntryQueue) -> None:
        STAMPS[key].append(time.perf_counter_ns())
        original(self)

    setattr(entry.EntryQueue, method, stamp)


async def main(rounds: int) -> None:
    async with mate.startup("mpi", progress="thread") as world:
        buf = bytearray(8)
        hop, drain = [], []
        start = time.perf_counter()
        for i in range(rounds):
            if world.mypid == 0:
                answer = world.recv(buf, 1, 0)
                await world.send(buf, 1, 0)
                await answer
                continue
            STAMPS["hop"].clear()
            STAMPS["drain"].clear()
            await world.recv(buf, 0, 0)
            resumed = time.perf_counter_ns()
            if STAMPS["hop"] and STAMPS["drain"] and i >= rounds // 10:
                hop.append(STAMPS["drain"][0] - STAMPS["hop"][0])
                drain.append(resumed - STAMPS["drain"][0])
            await world.send(buf, 0, 0)
        half = (time.perf_counter() - start) / rounds / 2 * 1e6
        if world.mypid == 1:
            print(f"half round trip {half:.1f} us; the hop (call_soon_threadsafe -> the "
                  f"loop runs the batch) {statistics.median(hop) / 1e3:.1f} us; the batch "
                  f"-> the task resumes {statistics.median(drain) / 1e3:.1f} us "
                  f"({len(hop)} rounds)", flush=True)


if __name__ == "__main__":
    if native.compiled():
        sys.exit("run with MATE_PURE_PYTHON=1: a compiled EntryQueue cannot be stamped")
    stamped("_hop", "hop")
    stamped("_drain", "drain")
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5000))
