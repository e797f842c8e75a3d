"""Machine instructions per 8 B message to itself through mate's MPI transport, or
through the asyncio floor's pattern, counted by callgrind.

A receive is posted, an 8 B send to the same rank is awaited, then the receive,
N times, on uvloop (the loop whose own share is the smallest, so mate's shows
most): the whole per-message path of poll mode, MPI included, in one process.

    for n in 2000 12000; do
        valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
            python bench/self_instructions.py $n mate 2>&1 | grep Collected
    done

(``floor`` instead of ``mate`` counts the floor's pattern, mate-bench's
`await_request`: a loop callback that tests the request and resolves a
future.) The difference of the two totals over 10,000 is the count per round
of one send and one receive; the smaller run takes out start-up.
`bench/core_instructions.py` counts the core alone.
"""

from __future__ import annotations

import sys

import uvloop
from mpi4py import MPI

import mate
from mate.bench.patterns import await_request


async def run(rounds: int, way: str) -> None:
    async with mate.startup("mpi", progress="poll") as world:
        out, into = bytearray(8), bytearray(8)
        if way == "mate":
            for _ in range(rounds):
                received = world.recv(into, 0, 0)
                await world.send(out, 0, 0)
                await received
            return
        comm = MPI.COMM_WORLD.Dup()
        try:
            for _ in range(rounds):
                received = comm.Irecv(into, 0, 0)
                await await_request(comm.Issend(out, 0, 0))
                await await_request(received)
        finally:
            comm.Free()


if __name__ == "__main__":
    uvloop.run(run(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "mate"))
