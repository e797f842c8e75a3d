"""How much where a buffer lies moves raw MPI's large transfers, with no mate at all.

    mpiexec -n 2 python bench/buffer_placement.py [--size 4M] [--sets 3] [--rounds 9]
        [--iterations 100]

Each rank allocates `--sets` pairs of send and receive buffers the way
`mate.bench.patterns.Buffers` does (bytearrays of the largest size), then runs
the raw ping-ping of `mate-bench` (`Irecv` + `Isend` + `Waitall`) on each pair
in turn, one repetition of `--iterations` exchanges per pair per round, after a
barrier and a few untimed exchanges. The code and the MPI calls are the same
for every pair; only the memory differs. Rank 0 prints the median time per
exchange of each pair and each pair's bandwidth against the first's.

This is why every side of a `mate-bench` comparison (mate, raw MPI, the floor,
TCP) uses one set of buffers: with a set each, the placement of mate's and raw
MPI's buffers weighed on their ratio as much as mate did.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mpi4py import MPI

from mate.bench.stats import parse_size


def exchanges(comm: MPI.Intracomm, out: bytearray, into: bytearray, n: int) -> None:
    peer = 1 - comm.Get_rank()
    requests: list[MPI.Request] = [MPI.REQUEST_NULL, MPI.REQUEST_NULL]
    for _ in range(n):
        requests[0] = comm.Irecv(into, peer, 1)
        requests[1] = comm.Isend(out, peer, 1)
        MPI.Request.Waitall(requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=4 << 20)
    parser.add_argument("--sets", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iterations", type=int, default=100)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    pairs = [(bytearray(b"\x5a" * args.size), bytearray(args.size)) for _ in range(args.sets)]
    times: list[list[float]] = [[] for _ in pairs]
    for _ in range(args.rounds):
        for (out, into), samples in zip(pairs, times, strict=True):
            comm.Barrier()
            exchanges(comm, out, into, max(1, args.iterations // 10))
            start = time.perf_counter()
            exchanges(comm, out, into, args.iterations)
            samples.append((time.perf_counter() - start) / args.iterations * 1e6)
    if comm.Get_rank() == 0:
        medians = [statistics.median(samples) for samples in times]
        print(f"raw ping-ping, {args.size} B, {args.sets} sets of buffers, medians of "
              f"{args.rounds} rounds of {args.iterations}: "
              + "  ".join(f"{us:.1f} us ({medians[0] / us:.3f}x)" for us in medians))


if __name__ == "__main__":
    main()
