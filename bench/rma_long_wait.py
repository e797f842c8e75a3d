"""Native puts into a target whose program awaits one message through the whole stream.

    mpiexec -n 2 python bench/rma_long_wait.py [--progress poll|thread] [--size 4M] [--puts 200]

`mate-bench put` starts every batch with a message to rank 1, so rank 1's task
awaits afresh and, in thread mode, its loop runs passes (which poke) from the
start of each batch. Here rank 1 awaits one message for the whole stream, as a
program that serves its memory and waits for the end would. In thread mode
its loop gives up helping SPIN after that await if no operation came by then,
and from then on only the progress thread's passes, which do not poke, move
the puts (progress.py). The figure: rank 0's put bandwidth after a warm-up
of ten puts.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import mate
from mate.bench.stats import parse_size


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--progress", default="thread", choices=("poll", "thread"))
    parser.add_argument("--size", type=parse_size, default=4 << 20)
    parser.add_argument("--puts", type=int, default=200)
    args = parser.parse_args()
    async with mate.startup("mpi", progress=args.progress, rma="native") as world:
        if world.mypid == 1:
            region = world.expose(bytearray(args.size))
            await world.send(region.address.to_bytes(8, "little"), 0, tag=1)
            await world.recv(bytearray(0), 0, tag=2, timeout=None)
            await world.unexpose(region)
        elif world.mypid == 0:
            address = bytearray(8)
            await world.recv(address, 1, tag=1)
            base, data = int.from_bytes(address, "little"), bytearray(args.size)
            for _ in range(10):
                await world.put(data, 1, base)
            start = time.perf_counter()
            for _ in range(args.puts):
                await world.put(data, 1, base)
            seconds = time.perf_counter() - start
            await world.send(b"", 1, tag=2)
            print(f"{args.progress}: {args.puts} puts of {args.size} B, "
                  f"{args.size * args.puts / seconds / 1e6:.0f} MB/s", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
