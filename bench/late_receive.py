"""Where MPICH copies a large message whose receive is posted after it arrived.

    mpiexec -n 2 python bench/late_receive.py [--size 4M] [--rounds 100]

Raw mpi4py, no mate. Each round, after a barrier, both ranks exchange one
message (Irecv and Issend, then Waitall), posted in either order. Rank 1 may
come late (200 us), either idle meanwhile or calling MPI (Testall on a request
of its own, as a progress thread or a rank's passes would), so that it has
taken rank 0's message in (an RTS in its unexpected queue) before it posts its
receive. The figures: the median time of rank 1's MPI_Irecv call, and of the
whole exchange on each rank. With the message taken in, the copy (with CMA) is
made inside MPI_Irecv, and a send posted after that receive leaves only once
the copy is done, while the peer waits for it to make its own: the two copies
then run one after the other. This is why mate's thread mode issues a large
receive after the send posted right after it (`MpiTransport._post_recv`).
"""

from __future__ import annotations

import argparse
import statistics
import time

from mpi4py import MPI

from mate.bench.stats import parse_sizes

LATE = 200e-6


def exchange(comm: MPI.Comm, out: bytearray, into: bytearray, send_first: bool,
             late: str, busy: MPI.Request) -> tuple[float, float]:
    """One exchange; (rank 1's Irecv, the exchange) in seconds."""
    peer = 1 - comm.Get_rank()
    comm.Barrier()
    if late != "no" and comm.Get_rank() == 1:
        end = time.perf_counter() + LATE
        while time.perf_counter() < end:
            if late == "calling MPI":
                MPI.Request.Testall([busy])
    start = time.perf_counter()
    send = comm.Issend(out, peer, 0) if send_first else None
    posted = time.perf_counter()
    receive = comm.Irecv(into, peer, 0)
    irecv = time.perf_counter() - posted
    if send is None:
        send = comm.Issend(out, peer, 0)
    MPI.Request.Waitall([receive, send])
    return irecv, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4M")
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    (size,) = parse_sizes(args.size)
    comm = MPI.COMM_WORLD.Dup()
    alone = MPI.COMM_SELF.Dup()
    busy = alone.Irecv(bytearray(1), 0, 0)  # never matched: Testall only makes progress
    out, into = bytearray(b"\x5a" * size), bytearray(size)
    for send_first in (False, True):
        for late in ("no", "idle", "calling MPI"):
            rounds = [exchange(comm, out, into, send_first, late, busy)
                      for _ in range(args.rounds)]
            irecv = statistics.median(r[0] for r in rounds) * 1e6
            took = statistics.median(r[1] for r in rounds) * 1e6
            totals = comm.gather(took, root=1)
            if comm.Get_rank() == 1:
                assert totals is not None
                order = "send, then receive" if send_first else "receive, then send"
                print(f"{size} B, {order:18s}, rank 1 late: {late:11s}: rank 1's Irecv "
                      f"{irecv:7.1f} us; exchange rank 0 {totals[0]:7.1f} us, "
                      f"rank 1 {totals[1]:7.1f} us", flush=True)
    busy.Cancel()
    busy.Wait()
    alone.Free()
    comm.Free()


if __name__ == "__main__":
    main()
