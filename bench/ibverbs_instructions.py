"""Machine instructions per round of the 8 B ping-pong on the ibverbs soft device
(loop progress), counted by callgrind on both ranks.

    for n in 300 1300; do
        mate-run -n 2 --transport ibverbs valgrind --tool=callgrind \\
            --callgrind-out-file=/dev/null python bench/ibverbs_instructions.py $n \\
            2>&1 | grep Collected
    done

Each rank prints its total; the difference of a rank's two totals over 1,000 is
its count per round (the smaller run takes out start-up and the connection).
"""

from __future__ import annotations

import asyncio
import sys

import mate


async def run(rounds: int) -> None:
    async with mate.startup("ibverbs", progress="loop") as world:
        peer, out, into = 1 - world.mypid, bytearray(8), bytearray(8)
        for _ in range(rounds):
            if world.mypid == 0:
                received = world.recv(into, peer, 1)
                await world.send(out, peer, 1)
                await received
            else:
                await world.recv(into, peer, 1)
                await world.send(out, peer, 1)


if __name__ == "__main__":
    asyncio.run(run(int(sys.argv[1])))
