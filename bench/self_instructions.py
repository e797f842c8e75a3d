"""Machine instructions per 8 B message to itself through mate's MPI transport, or
through the asyncio floor's pattern, counted by callgrind.

A receive is posted, an 8 B send to the same rank is awaited, then the receive,
N times, on uvloop (the loop whose own share is the smallest, so mate's shows
most): the whole per-message path of poll mode, MPI included, in one process.

    for n in 2000 12000; do
        valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
            python bench/self_instructions.py $n mate 2>&1 | grep Collected
    done

(``floor`` instead of ``mate`` counts the floor's pattern: a loop callback that
tests the request and resolves a future.) The difference of the two totals over
10,000 is the count per round of one send and one receive; the smaller run
takes out start-up. `bench/core_instructions.py` counts the core alone.
"""

from __future__ import annotations

import asyncio
import sys

import uvloop
from mpi4py import MPI

import mate


async def _await_request(loop: asyncio.AbstractEventLoop, request: MPI.Request) -> None:
    future = loop.create_future()

    def test() -> None:
        if request.Test():
            future.set_result(None)
        else:
            loop.call_soon(test)

    loop.call_soon(test)
    await future


async def run(rounds: int, way: str) -> None:
    async with mate.startup("mpi", progress="poll") as world:
        out, into = bytearray(8), bytearray(8)
        if way == "mate":
            for _ in range(rounds):
                received = world.recv(into, 0, 0)
                await world.send(out, 0, 0)
                await received
            return
        comm, loop = MPI.COMM_WORLD.Dup(), asyncio.get_running_loop()
        try:
            for _ in range(rounds):
                received = comm.Irecv(into, 0, 0)
                await _await_request(loop, comm.Issend(out, 0, 0))
                await _await_request(loop, received)
        finally:
            comm.Free()


if __name__ == "__main__":
    uvloop.run(run(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "mate"))
