"""How a window of MPI requests is best completed from Python: raw mpi4py, no mate.

    mpiexec -n 2 python bench/window_tests.py [--window 64] [--windows 2000] [--front 4]

Rank 0 posts a window of 8 B `Issend`s, rank 1 a window of `Irecv`s, then one
acknowledgement (the pattern of `mate-bench rate`). Both ranks complete their
window in one of four ways, the same on both sides:

* ``waitall``: `MPI.Request.Waitall`, the raw baseline of `mate-bench rate`;
* ``testsome``: a Python loop of `Testsome` over the outstanding requests, as
  an asyncio program that tests every outstanding request does;
* ``front``: a Python loop of `Testsome` over the oldest `--front` requests
  first, the whole window only when those did not move (mate's engine);
* ``test``: a Python loop of `Test` on each request in posting order.

Rank 0 prints messages per second and the calls per window. MPICH takes in one
message per progress call, so every way makes about one call per message; what
differs is what a call costs (mpi4py converts every request it is given).
"""

from __future__ import annotations

import argparse
import time

from mpi4py import MPI

WAYS = ("waitall", "testsome", "front", "test")


def complete(way: str, requests: list[MPI.Request], front: int) -> int:
    """Complete `requests` the given way; the number of MPI calls it took."""
    testsome = MPI.Request.Testsome
    calls = 0
    if way == "waitall":
        MPI.Request.Waitall(requests)
        return 1
    if way == "test":
        for request in requests:
            calls += 1
            while not request.Test():
                calls += 1
        return calls
    oldest, end = 0, len(requests)
    while oldest < end:
        moved = False
        if way == "front":
            calls += 1
            moved = bool(testsome(requests[oldest:oldest + front]))
        if not moved:
            calls += 1
            testsome(requests[oldest:])
        while oldest < end and requests[oldest] == MPI.REQUEST_NULL:
            oldest += 1
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--windows", type=int, default=2000)
    parser.add_argument("--front", type=int, default=4)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    me, out, into, ack = comm.rank, bytearray(8), bytearray(8), bytearray(1)
    for way in WAYS:
        comm.Barrier()
        calls, start = 0, time.perf_counter()
        for _ in range(args.windows):
            if me == 0:
                acknowledged = comm.Irecv(ack, 1, 2)
                calls += complete(way, [comm.Issend(out, 1, 1) for _ in range(args.window)],
                                  args.front)
                acknowledged.Wait()
            else:
                calls += complete(way, [comm.Irecv(into, 0, 1) for _ in range(args.window)],
                                  args.front)
                comm.Send(ack, 0, 2)
        elapsed = time.perf_counter() - start
        if me == 0:
            rate = args.windows * args.window / elapsed
            print(f"{way:>9}: {rate / 1e3:7.1f} k messages/s, "
                  f"{calls / args.windows:6.1f} calls per window of {args.window}")
    comm.Free()


if __name__ == "__main__":
    main()
