"""What orphaned sends cost later messages: 8 B pingpong before and after N orphans.

An orphan is a send that timed out unreceived, which MPI still holds (mate
cannot recall it: see transports/mpi/transport.py). Rank 0 makes N of them
towards rank 1 (which never receives them on their tag), then both ranks
measure the 8 B pingpong again. Raw mpi4py (Ssend/Recv) is measured in the
same run before and after the orphans exist: MPI's own cost of N unmatched
messages (rank 1's unexpected-message queue), which no library above it can
avoid. RSS is rank 0's resident set.

    mate-run -n 2 python bench/orphans.py [--orphans 20000] [--progress poll|thread]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from mpi4py import MPI

import mate

ORPHAN_TAG, PING_TAG = 1, 2


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def mate_pingpong(world: mate.World, rounds: int) -> float:
    """Median over 5 repetitions of the half round trip, in µs."""
    buf, peer = bytearray(8), 1 - world.mypid
    results = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(rounds):
            if world.mypid == 0:
                reply = world.recv(buf, peer, PING_TAG, timeout=None)
                await world.send(buf, peer, PING_TAG, timeout=None)
                await reply
            else:
                await world.recv(buf, peer, PING_TAG, timeout=None)
                await world.send(buf, peer, PING_TAG, timeout=None)
        results.append((time.perf_counter() - start) / rounds / 2 * 1e6)
    return statistics.median(results)


def raw_pingpong(comm: MPI.Comm, rounds: int) -> float:
    buf, rank = bytearray(8), comm.Get_rank()
    results = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(rounds):
            if rank == 0:
                comm.Ssend(buf, 1, PING_TAG)
                comm.Recv(buf, 1, PING_TAG)
            else:
                comm.Recv(buf, 0, PING_TAG)
                comm.Ssend(buf, 0, PING_TAG)
        results.append((time.perf_counter() - start) / rounds / 2 * 1e6)
    return statistics.median(results)


async def measure(args: argparse.Namespace) -> dict[str, object]:
    async with mate.startup("mpi", progress=args.progress,
                            orphan_limit=args.orphans + 1) as world:
        row: dict[str, object] = {"progress": args.progress, "orphans": args.orphans}
        comm = MPI.COMM_WORLD
        comm.Barrier()
        row["raw_before_us"] = raw_pingpong(comm, args.rounds)
        row["mate_before_us"] = await mate_pingpong(world, args.rounds)
        rss_before = rss_mib()
        if world.mypid == 0:
            sends = [world.send(b"orphan!!", 1, ORPHAN_TAG, timeout=0.001)
                     for _ in range(args.orphans)]
            await asyncio.gather(*sends, return_exceptions=True)
            row["orphaned_sends"] = world.stats()["orphaned_sends"]
            row["rss_per_orphan_KiB"] = (rss_mib() - rss_before) * 1024 / max(args.orphans, 1)
        row["mate_after_us"] = await mate_pingpong(world, args.rounds)
        comm.Barrier()
        row["raw_after_us"] = raw_pingpong(comm, args.rounds)
        comm.Barrier()
        if world.mypid == 1:  # receive the orphans, so that they end
            for _ in range(args.orphans):
                await world.recv(bytearray(8), 0, ORPHAN_TAG, timeout=None)
        comm.Barrier()
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orphans", type=int, default=20000)
    parser.add_argument("--progress", choices=("poll", "thread"), default="poll")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--json", default=None, help="write the row to this file")
    args = parser.parse_args()
    row = asyncio.run(measure(args))
    if MPI.COMM_WORLD.Get_rank() == 0:
        before, after = row["mate_before_us"], row["mate_after_us"]
        assert isinstance(before, float) and isinstance(after, float)
        print(f"{args.progress}: 8 B pingpong {before:.1f} us before, {after:.1f} us with "
              f"{row['orphaned_sends']} orphans ({after / before:.2f}x); raw mpi4py "
              f"{row['raw_before_us']:.1f} -> {row['raw_after_us']:.1f} us; "
              f"RSS {row['rss_per_orphan_KiB']:.2f} KiB per orphan")
        if args.json:
            with open(args.json, "w") as out:
                json.dump(row, out, indent=1)


if __name__ == "__main__":
    main()
