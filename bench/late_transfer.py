"""A large message between two ranks of which one waited: how long it takes to cross.

    mpiexec -n 2 python bench/late_transfer.py [--size 4M] [--late 0.2] [--rounds 5]
        [--progress poll|thread]

Run it with MPIR_CVAR_CH4_CMA_ENABLE=0 to see what the engine's transfers and
nudges are for (mate.transports.mpi.progress): without cross-memory attach,
MPICH moves a large message through shared memory a fragment per MPI call on
both ranks, so a rank that backs off while it waits moves one fragment per
pause. Two cases, each round after a barrier: the sender comes `late` seconds
after the receiver posted (the figure: rank 0's send, from its post to its
completion), and the receiver comes `late` seconds after the sender posted
(the figure: rank 1's receive, from its post to its completion). Milliseconds,
every round, and the nudges each rank sent.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from mpi4py import MPI

import mate
from mate.bench.stats import parse_sizes


async def main(args: argparse.Namespace) -> None:
    async with mate.startup("mpi", progress=args.progress) as world:
        buffer, peer = bytearray(args.size), 1 - world.mypid
        for late in ("sender", "receiver"):
            took = []
            for _ in range(args.rounds):
                MPI.COMM_WORLD.Barrier()
                sending = world.mypid == 0
                if (late == "sender") == sending:
                    await asyncio.sleep(args.late)
                start = time.perf_counter()
                if sending:
                    await world.send(buffer, peer, tag=1)
                else:
                    await world.recv(buffer, peer, tag=1)
                if (late == "sender") == sending:
                    took.append((time.perf_counter() - start) * 1e3)
            rank = 0 if late == "sender" else 1
            if world.mypid == rank:
                what = "send" if rank == 0 else "receive"
                print(f"{args.size} B, the {late} {args.late} s late, {args.progress}: its "
                      f"{what} took (ms) {' '.join(f'{t:.2f}' for t in took)}", flush=True)
        MPI.COMM_WORLD.Barrier()
        print(f"rank {world.mypid}: {world.stats().get('nudges_sent', 0)} nudges sent", flush=True)


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=lambda text: parse_sizes(text)[0], default=4 << 20)
    parser.add_argument("--late", type=float, default=0.2, help="seconds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--progress", choices=("poll", "thread"), default="poll")
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    run()
