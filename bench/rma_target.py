"""MPICH's native put bandwidth as a function of what the *target* does meanwhile.

    mpiexec -n 2 python bench/rma_target.py [--size 4M] [--puts 40] [--reps 5]
        [--targets ...] [--json F]

Rank 0 does what mate's native RMA does for a put (issue 11, item 5): `Rput`
into rank 1's dynamic window under `Lock_all`, wait for it, `Win_flush`, and
repeats; rank 1 is a passive target, which in MPI needs no call. Yet MPICH
moves a large passive-target put only when the target's library runs (its
progress engine, over shared memory here), so the bandwidth depends on how
the target spends the time:

- ``blocking``: the target sits in a blocking `Recv` (MPICH spins inside it);
- ``spin``: a tight loop of `Test` on an `Irecv`, no Python in between;
- ``loop``: an asyncio loop tests the `Irecv` once per turn (``call_soon``),
  as mate's poll mode drives MPI while a message is outstanding;
- ``idle``: an asyncio loop that tests once a millisecond, as mate's poll
  mode backs off when a rank has nothing of its own outstanding;
- ``every-1us``, ``every-2us``, ``every-4us``: an asyncio loop whose turns test
  for up to `SLICE` each, with that much Python (a busy wait) between tests, as
  a rank that runs passes back to back (a pass costs a few microseconds);
- ``pokes``: the same turns, but as mate's engine pokes while a transfer holds
  its backoff (`Engine._poke`): `MPI_Request_get_status` on a receive that
  nothing matches, and every `LOOK_EVERY` calls on the awaited request.

Each row: the median and range of `--reps` repetitions of `--puts` puts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable

from mpi4py import MPI

from mate.bench.stats import parse_size
from mate.transports.mpi.progress import LOOK_EVERY, SLICE

DONE_TAG = 7


def origin(comm: MPI.Intracomm, win: MPI.Win, source: bytearray, address: int,
           puts: int) -> float:
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(puts):
        win.Rput(source, 1, (address, len(source), MPI.BYTE)).Wait()
        win.Flush(1)
    seconds = time.perf_counter() - start
    comm.Send(bytearray(1), 1, DONE_TAG)
    return len(source) * puts / seconds / 1e6


def target_blocking(comm: MPI.Intracomm) -> None:
    comm.Barrier()
    comm.Recv(bytearray(1), 0, DONE_TAG)


def target_spin(comm: MPI.Intracomm) -> None:
    comm.Barrier()
    request = comm.Irecv(bytearray(1), 0, DONE_TAG)
    while not request.Test():
        pass


def target_loop(comm: MPI.Intracomm) -> None:
    loop_turns(comm, MPI.Request.Test, 0.0)


def target_idle(comm: MPI.Intracomm) -> None:
    async def main() -> None:
        comm.Barrier()
        request = comm.Irecv(bytearray(1), 0, DONE_TAG)
        while not request.Test():
            await asyncio.sleep(0.001)
    asyncio.run(main())


def loop_turns(comm: MPI.Intracomm, between: Callable[[MPI.Request], bool],
               seconds: float = SLICE) -> None:
    """An asyncio loop whose every turn calls `between(request)` (True: the request
    completed) once and then again for up to `seconds`, the request being the
    receive of the origin's end."""
    async def main() -> None:
        comm.Barrier()
        request = comm.Irecv(bytearray(1), 0, DONE_TAG)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def turn() -> None:
            give_up = time.perf_counter() + seconds
            while not between(request):
                if time.perf_counter() >= give_up:
                    loop.call_soon(turn)
                    return
            done.set_result(None)
        loop.call_soon(turn)
        await done
    asyncio.run(main())


def target_every(gap: float) -> Callable[[MPI.Intracomm], None]:
    def target(comm: MPI.Intracomm) -> None:
        def between(request: MPI.Request) -> bool:
            if request.Test():
                return True
            until = time.perf_counter() + gap
            while time.perf_counter() < until:
                pass
            return False
        loop_turns(comm, between)
    return target


def target_pokes(comm: MPI.Intracomm) -> None:
    own = MPI.COMM_SELF.Dup()
    never = own.Irecv(bytearray(1), 0, 0)

    def between(request: MPI.Request) -> bool:
        if request.Get_status():
            request.Wait()
            return True
        for _ in range(LOOK_EVERY - 1):
            never.Get_status()
        return False
    loop_turns(comm, between)
    never.Cancel()
    never.Wait()
    own.Free()


TARGETS: dict[str, Callable[[MPI.Intracomm], None]] = {
    "blocking": target_blocking, "spin": target_spin, "loop": target_loop, "idle": target_idle,
    "every-1us": target_every(1e-6), "every-2us": target_every(2e-6),
    "every-4us": target_every(4e-6), "pokes": target_pokes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=4 << 20)
    parser.add_argument("--puts", type=int, default=40)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    win = MPI.Win.Create_dynamic(MPI.INFO_NULL, comm)
    memory = bytearray(args.size)
    win.Attach(memory)
    address = comm.bcast(MPI.Get_address(memory), root=1)
    win.Lock_all(MPI.MODE_NOCHECK)
    source = bytearray(b"x" * args.size)
    rows = []
    for target in args.targets:
        samples = []
        for _ in range(args.reps):
            if rank == 0:
                samples.append(origin(comm, win, source, address, args.puts))
            else:
                TARGETS[target](comm)
        if rank == 0:
            rows.append({"target": target, "size": args.size, "puts": args.puts,
                         "median_mb_per_s": statistics.median(samples),
                         "samples_mb_per_s": samples})
            print(f"target={target:9s} {statistics.median(samples):8.0f} MB/s "
                  f"(range {min(samples):.0f}-{max(samples):.0f}, {args.reps} x {args.puts} "
                  f"puts of {args.size} B)", flush=True)
    win.Unlock_all()
    win.Detach(memory)
    win.Free()
    if rank == 0 and args.json:
        with open(args.json, "w") as out:
            json.dump({"mpi": MPI.Get_library_version().splitlines()[0], "rows": rows},
                      out, indent=1)


if __name__ == "__main__":
    main()
