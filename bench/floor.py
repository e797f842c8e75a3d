"""The asyncio floor: the least an asyncio program can pay to await MPI requests.

Each rank awaits every request through a loop callback that tests it with
MPI_Test and resolves a future, as any asyncio integration of MPI must; no mate
code is involved. Its latency bounds from below what mate (or anything built on
asyncio futures) can reach on this machine, next to raw blocking mpi4py.

    mpiexec -n 2 python bench/floor.py [--uvloop] [--rounds N]

`mate-bench pingpong --floor` measures the same floor beside mate, per size, in
the same run (`mate.bench.patterns.FloorBench`); this script is the floor alone.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from mpi4py import MPI

from mate.bench.patterns import await_request


async def pingpong(comm: MPI.Comm, rounds: int) -> float:
    buf, rank = bytearray(8), comm.Get_rank()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            reply = comm.Irecv(buf, 1, 0)
            await await_request(comm.Issend(buf, 1, 0))
            await await_request(reply)
        else:
            await await_request(comm.Irecv(buf, 0, 0))
            await await_request(comm.Issend(buf, 0, 0))
    return (time.perf_counter() - start) / rounds / 2 * 1e6


def raw_pingpong(comm: MPI.Comm, rounds: int) -> float:
    buf, rank = bytearray(8), comm.Get_rank()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            comm.Ssend(buf, 1, 0)
            comm.Recv(buf, 1, 0)
        else:
            comm.Recv(buf, 0, 0)
            comm.Ssend(buf, 0, 0)
    return (time.perf_counter() - start) / rounds / 2 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--rounds", type=int, default=5000)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    raw_pingpong(comm, 500)
    raw = raw_pingpong(comm, args.rounds)
    runner = asyncio.run
    if args.uvloop:
        import uvloop

        runner = uvloop.run
    runner(pingpong(comm, 500))
    floor = runner(pingpong(comm, args.rounds))
    if comm.Get_rank() == 0:
        loop = "uvloop" if args.uvloop else "asyncio"
        print(f"8 B half round trip: raw Ssend/Recv {raw:.1f} us, "
              f"{loop} floor {floor:.1f} us ({floor / raw:.1f}x raw)")


if __name__ == "__main__":
    main()
