"""How a window of received messages that have all arrived is taken in: time per
message and passes of mate's MPI engine, on rank 1.

    mpiexec -n 2 python bench/window_passes.py [raw|engine|mate] [WINDOWS]

Rank 1 posts a window of 64 receives of 8 B, lets rank 0 send them all (it
sleeps 2 ms: no pass runs meanwhile), then takes them in, timed, three ways:

* ``raw``: mpi4py's `Test` on each request in turn, no event loop;
* ``engine``: the requests given to mate's engine (`Engine.add`), whose passes
  (`Engine.test`) run in a loop;
* ``mate``: `world.recv`, awaited in turn (poll mode).

MPICH takes in one message per call, so the count of passes (engine, mate)
says how many messages a pass found. Medians over WINDOWS windows (default
300); rank 1 prints them.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from functools import partial
from typing import Any

import mate

WINDOW = 64
DATA, ACK = 1, 2


def _taken(taken: list[int], owner: Any, status: Any, error: Any) -> None:
    taken.append(1)  # the engine's action for a request that completed


async def run(way: str, windows: int) -> None:
    async with mate.startup("mpi", progress="poll") as world:
        transport: Any = world._ledger.transport  # the MPI transport: its comm and engine
        comm, engine = transport.comm, transport.engine
        out, into, ack = bytearray(8), bytearray(8), bytearray(1)
        times: list[float] = []
        passes: list[int] = []
        for _ in range(windows):
            if world.mypid == 0:
                acknowledged = world.recv(ack, 1, ACK)
                for message in [world.send(out, 1, DATA) for _ in range(WINDOW)]:
                    await message
                await acknowledged
                continue
            taken: list[int] = []
            take = partial(_taken, taken)
            if way == "raw":
                requests = [comm.Irecv(into, 0, DATA) for _ in range(WINDOW)]
            elif way == "engine":
                requests = [engine.add(comm.Irecv(into, 0, DATA), take) for _ in range(WINDOW)]
            else:
                receives = [world.recv(into, 0, DATA) for _ in range(WINDOW)]
            time.sleep(0.002)  # rank 0's sends all arrive
            start, first_pass = time.perf_counter(), engine.passes
            if way == "raw":
                for request in requests:
                    while not request.Test():
                        pass
            elif way == "engine":
                while len(taken) < WINDOW:
                    engine.test()
            else:
                for message in receives:
                    await message
            times.append(time.perf_counter() - start)
            passes.append(engine.passes - first_pass)
            await world.send(ack, 0, ACK)
        if world.mypid == 1:
            median = statistics.median(times) * 1e6
            print(f"{way}: {median:.1f} us a window of {WINDOW}, {median / WINDOW:.2f} us a "
                  f"message, {statistics.median(passes):g} passes", flush=True)


if __name__ == "__main__":
    asyncio.run(run(sys.argv[1] if len(sys.argv) > 1 else "mate",
                    int(sys.argv[2]) if len(sys.argv) > 2 else 300))
