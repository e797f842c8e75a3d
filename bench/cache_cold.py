"""What a large copy costs the code that runs after it: a cold cache, no MPI.

    python bench/cache_cold.py [--sizes 0,64K,256K,1M,4M] [--uvloop]

A receive of a large message ends with MPI copying it into the user's buffer;
the copy passes the whole message through the CPU's caches and evicts what
the event loop and mate had there. So the code that runs next, from the
completion to the awaiting task, runs slower than the same code after a
small message, although it does the same work (`bench/overhead_split.py`
shows it in place, after the request's action).

This measures that alone: one fixed step of asyncio (a loop callback resolves
a future that a task awaits, as the asyncio floor does, then a little Python
work) timed right after copying `size` bytes into a buffer, the sizes taken
in turn within each round; medians over rounds, in µs. The step after a
0-byte copy is the warm reference.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from mate.bench.stats import parse_sizes


def work() -> int:
    """A little Python, as a program does when its await returns."""
    table = {}
    for i in range(20):
        table[i] = (i, str(i))
    return len(table)


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    largest = max(args.sizes)
    source, into = bytearray(b"\x5a" * largest), bytearray(largest)
    times: dict[int, list[float]] = {size: [] for size in args.sizes}
    for _ in range(args.rounds):
        for size in args.sizes:
            into[:size] = source[:size]  # one memcpy, as MPI's into a receive buffer
            start = time.perf_counter()
            future = loop.create_future()
            loop.call_soon(future.set_result, None)
            await future
            work()
            times[size].append((time.perf_counter() - start) * 1e6)
    skip = args.rounds // 10  # the first rounds warm the interpreter up
    warm = statistics.median(times[min(args.sizes)][skip:])
    for size, samples in times.items():
        median = statistics.median(samples[skip:])
        print(f"{size:>9} B copied, then the step: {median:7.2f} us "
              f"({median - warm:+7.2f} against {min(args.sizes)} B)", flush=True)


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("0,64K,256K,1M,4M"))
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.run(main(args))
    else:
        asyncio.run(main(args))


if __name__ == "__main__":
    run()
