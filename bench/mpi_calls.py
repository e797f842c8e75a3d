"""What the MPI transport's per-message calls cost through mpi4py and from C (`mate._mpi`).

One process, COMM_SELF: the time of an Irecv and of an Issend posted (then
cancelled or matched outside the timing), and of a Testsome over 1, 3 and 8
pending receives, each the median of `--reps` batches of `--calls` calls, the
two implementations taking turns batch by batch.

    python bench/mpi_calls.py [--calls 20000] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from mate import _mpi

IMPLEMENTATIONS = {
    "mpi4py": (MPI.Comm.Issend, MPI.Comm.Irecv, MPI.Request.Testsome),
    "mate._mpi": (_mpi.issend, _mpi.irecv, _mpi.testsome),
}


def timed(calls: int, call: Callable[..., Any], *args: Any) -> tuple[float, list[Any]]:
    """Seconds per call of `calls` calls of `call(*args)`, and what they returned."""
    out: list[Any] = [None] * calls
    start = time.perf_counter()
    for i in range(calls):
        out[i] = call(*args)
    return (time.perf_counter() - start) / calls, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    comm = MPI.COMM_SELF.Dup()
    into, out = bytearray(8), memoryview(bytearray(8))
    pending = [comm.Irecv(bytearray(8), 0, 100 + i) for i in range(8)]
    statuses = [MPI.Status() for _ in pending]
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.reps):
        for name, (issend, irecv, testsome) in IMPLEMENTATIONS.items():
            seconds, receives = timed(args.calls, irecv, comm, into, 0, 1)
            samples.setdefault(("Irecv", name), []).append(seconds)
            seconds, sends = timed(args.calls, issend, comm, out, 0, 1)
            samples.setdefault(("Issend", name), []).append(seconds)
            MPI.Request.Waitall(receives + sends)
            for n in (1, 3, 8):
                seconds, _ = timed(args.calls, testsome, pending[:n], statuses)
                samples.setdefault((f"Testsome over {n}", name), []).append(seconds)
    for request in pending:
        request.Cancel()
    MPI.Request.Waitall(pending)
    comm.Free()
    print(f"{'call':20s} {'mpi4py us':>10s} {'mate._mpi us':>13s}")
    for call in dict.fromkeys(call for call, _ in samples):
        a, b = (statistics.median(samples[call, name]) * 1e6 for name in IMPLEMENTATIONS)
        print(f"{call:20s} {a:10.3f} {b:13.3f}")


if __name__ == "__main__":
    main()
