"""What a native put costs after a lull, and what its target's core costs after the last.

    mpiexec -n 2 python bench/rma_lull.py [--progress poll|thread] [--reps 15]

MPICH moves a native put or get only inside its passive target's MPI calls. An
origin holds a lease on its target's memory while it uses it (rma_native.py,
leases), so that a stream of operations moves at full speed while a target that
peers stopped using backs off as any rank does. The price is the first
operation after a lull: it waits for the target's next pass. Rank 0 puts 8 B
into rank 1's exposed memory after lulls of `GAPS` seconds, `--reps` times
each, and prints the median and the worst latency per lull; rank 1 meanwhile
awaits a message, as a program would, and then reports its share of a core
over a wait of `WAIT` seconds that begins with one more put.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import mate

GAPS = (0.0, 0.005, 0.02, 0.05, 0.2)  # seconds between the origin's puts
WAIT = 1.0  # seconds that rank 1 waits after the last put


async def origin(world: mate.World, base: int, reps: int) -> list[str]:
    await world.put(b"warmup!!", 1, base)
    rows = []
    for gap in GAPS:
        latencies = []
        for _ in range(reps):
            if gap:
                await asyncio.sleep(gap)
            start = time.perf_counter()
            await world.put(b"12345678", 1, base)
            latencies.append((time.perf_counter() - start) * 1e6)
        rows.append(f"lull {gap * 1e3:5.0f} ms: put {statistics.median(latencies):8.1f} us "
                    f"(worst {max(latencies):8.1f})")
    await world.send(b"", 1, tag=2)  # the lulls are over: rank 1 waits from now
    await world.put(b"12345678", 1, base)
    await asyncio.sleep(WAIT)
    await world.send(b"", 1, tag=3)
    return rows


async def target(world: mate.World, region: mate.Region) -> str:
    await world.recv(bytearray(0), 0, tag=2, timeout=None)
    cpu, start = time.process_time(), time.monotonic()
    await world.recv(bytearray(0), 0, tag=3, timeout=None)
    share = (time.process_time() - cpu) / (time.monotonic() - start)
    await world.unexpose(region)
    return f"rank 1 waited {WAIT:.1f} s after the last put at {share:.1%} of a core"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--progress", default="poll", choices=("poll", "thread"))
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    async with mate.startup("mpi", progress=args.progress, rma="native") as world:
        address = bytearray(8)
        if world.mypid == 1:
            region = world.expose(bytearray(64))
            await world.send(region.address.to_bytes(8, "little"), 0, tag=1)
            print(f"{args.progress}: {await target(world, region)}", flush=True)
        elif world.mypid == 0:
            await world.recv(address, 1, tag=1)
            rows = await origin(world, int.from_bytes(address, "little"), args.reps)
            print("\n".join(f"{args.progress}: {row}" for row in rows), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
