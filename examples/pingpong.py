"""Ping-pong between rank 0 and rank 1, written the Progressive Messages way.

Rank 1 never loops: a completion handler answers each ping and posts the
next receive. Rank 0 awaits each round trip. Runs two ranks in one process
over the local transport, or one rank per process under a launcher:

    python examples/pingpong.py                      # local transport, 2 ranks
    mate-run -n 2 python examples/pingpong.py --transport mpi   # (MPI transport)
"""

from __future__ import annotations

import argparse
import asyncio
import time

import mate


async def ping(world: mate.World, size: int, rounds: int) -> float:
    """Rank 0: send `rounds` pings of `size` bytes; return the mean one-way latency in µs."""
    out, back = bytearray(size), bytearray(size)
    start = time.perf_counter()
    for i in range(rounds):
        out[:1] = bytes([i % 256]) if size else b""
        reply = world.recv(back, 1, tag=1)
        world.send(out, 1, tag=0)
        await reply
        if back != out:
            raise SystemExit(f"round {i}: the pong does not echo the ping")
    return (time.perf_counter() - start) / rounds / 2 * 1e6


async def pong(world: mate.World, size: int, rounds: int) -> None:
    """Rank 1: echo every ping from a completion handler; finish after `rounds`."""
    buf = bytearray(size)
    done = asyncio.get_running_loop().create_future()
    left = rounds

    def answer(receipt: mate.Receipt, data: None) -> None:
        nonlocal left
        left -= 1
        # The echo copies the ping first, so that the next recv may reuse `buf` at once.
        world.send(bytes(buf[: receipt.length]), 0, tag=1)
        if left:
            world.recv(buf, 0, tag=0, schedule=schedule)
        elif not done.done():
            done.set_result(None)

    schedule = mate.Schedule(completion=answer)
    world.recv(buf, 0, tag=0, schedule=schedule)
    await done


async def run(world: mate.World, sizes: list[int], rounds: int) -> None:
    for size in sizes:
        if world.mypid == 0:
            latency = await ping(world, size, rounds)
            print(f"{size:>9} B  {latency:10.2f} us", flush=True)
        elif world.mypid == 1:
            await pong(world, size, rounds)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="local", help="local (default) or another")
    parser.add_argument("--sizes", default="0,8,1024,65536,1048576",
                        help="comma-separated message sizes in bytes")
    parser.add_argument("--rounds", type=int, default=1000)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.transport == "local":
        async with mate.local.worlds(2) as worlds:
            await asyncio.gather(*(run(w, sizes, args.rounds) for w in worlds))
        rank = 0  # this one process holds both ranks: print once
    else:
        async with mate.startup(args.transport) as world:
            await run(world, sizes, args.rounds)
            rank = world.mypid
    if rank == 0:  # rank 0 checked every echo; one result line per run, not per rank
        print("pingpong: every pong echoed its ping: verified")


if __name__ == "__main__":
    asyncio.run(main())
