"""Machine instructions per request in the MPI transport's progress engine.

One rank sends 8 B to itself: an `Irecv` and an `Isend`, both given to mate's
engine (`Engine.add`) and completed by its passes (`Engine.test`), N times;
``raw`` does the same with mpi4py alone (`Test` on each). Under callgrind, the
difference of two runs' totals over the difference of their N is the count
per pair of requests, start-up taken out; engine minus raw is the engine's own:

    for way in raw engine; do for n in 20000 70000; do
        mpiexec -n 1 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
            python bench/engine_instructions.py $n $way 2>&1 | grep Collected
    done; done

(`bench/core_instructions.py` counts the core's path the same way.)
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import mate


async def run(pairs: int, way: str) -> None:
    async with mate.startup("mpi") as world:
        transport: Any = world._ledger.transport  # the MPI transport: its comm and engine
        comm, engine = transport.comm, transport.engine
        out, into = bytearray(8), bytearray(8)
        done: list[bool] = []

        def action(owner: Any, status: Any, error: Any) -> None:
            done.append(True)

        for _ in range(pairs):
            if way == "raw":
                receive, send = comm.Irecv(into, 0, 1), comm.Isend(out, 0, 1)
                while not receive.Test():
                    pass
                while not send.Test():
                    pass
            else:
                done.clear()
                engine.add(comm.Irecv(into, 0, 1), action)
                engine.add(comm.Isend(out, 0, 1), action)
                while len(done) < 2:
                    engine.test()


if __name__ == "__main__":
    asyncio.run(run(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000,
                    sys.argv[2] if len(sys.argv) > 2 else "engine"))
