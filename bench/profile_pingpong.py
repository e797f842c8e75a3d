"""An 8 B mate ping-pong that runs for a while, for a sampling profiler.

    mpiexec -n 2 python bench/profile_pingpong.py 8 &
    mate-run -n 2 --transport ibverbs python bench/profile_pingpong.py 8 progress=loop &
    py-spy record -p <rank 0's pid> -d 4 -r 500 -f raw -o profile.txt

The world is the launcher's transport; ``name=value`` arguments are its options.

`summarise(path)` (python bench/profile_pingpong.py --summarise profile.txt)
prints the self and inclusive shares of the hottest frames.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter

import mate


async def pingpong(seconds: float, options: dict[str, str]) -> None:
    async with mate.startup(**options) as world:
        buf, rounds, start = bytearray(8), 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(1000):
                if world.mypid == 0:
                    reply = world.recv(buf, 1, 0)
                    await world.send(buf, 1, 0)
                    await reply
                else:
                    await world.recv(buf, 0, 0)
                    await world.send(buf, 0, 0)
            rounds += 1000
        if world.mypid == 0:
            print(f"8 B half round trip {seconds / rounds / 2 * 1e6:.1f} us")


def summarise(path: str, top: int = 25) -> None:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    with open(path) as lines:
        for line in lines:
            stack, count = line.rsplit(" ", 1)
            frames, n = stack.split(";"), int(count)
            total += n
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    print(f"{total} samples\n-- self")
    for frame, n in own.most_common(top):
        print(f"{n / total * 100:5.1f}% {frame}")
    print("-- inclusive, mate frames")
    for frame, n in inclusive.most_common():
        if "mate" in frame and n / total > 0.02:
            print(f"{n / total * 100:5.1f}% {frame}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarise"]:
        summarise(sys.argv[2])
    else:
        asyncio.run(pingpong(float(sys.argv[1]) if len(sys.argv) > 1 else 8.0,
                             dict(arg.split("=", 1) for arg in sys.argv[2:])))
