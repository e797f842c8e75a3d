"""Where a large ping-ping exchange's time goes: the copy, and the gap between copies.

    perf record -a -o exchange.data \\
        -e syscalls:sys_enter_process_vm_readv -e syscalls:sys_exit_process_vm_readv \\
        -- mpiexec -n 2 python bench/exchange_phases.py run [SIZE] [--progress MODE]
    python bench/exchange_phases.py analyse exchange.data [SIZE]

With CMA, MPICH moves a large message by one `process_vm_readv` on the
receiving rank, inside whichever MPI call finds the sender's request (mate's
passes, the floor's tests, raw MPI's Waitall). In a ping-ping both ranks copy
at once, so an exchange is: both copies, then a *gap* from the end of the later
copy to the start of the next one, in which each rank completes its two
requests, returns to its program, posts the next receive and send, and finds
its peer's. `run` makes mate's exchange (``r = recv; s = send; await s; await
r``), the asyncio floor's (`mate.bench.patterns`: each request awaited through
loop callbacks) and raw mpi4py's (Irecv + Isend + Waitall) take turns on one
set of buffers, a block of exchanges each per round, and prints each side's
median exchange time. `analyse` reads the kernel's record of the copies
(``perf script``), pairs the two ranks' copies exchange by exchange, and
prints for each side the medians of: the copy, the skew of the copies' starts
and ends, the gap, and the exchange (start of one pair of copies to the next).

Root (or perf_event_paranoid <= -1) is needed for the tracepoints. Without CMA
(Yama's ptrace_scope >= 1) MPICH copies through shared memory, no
`process_vm_readv` is made and `analyse` says so.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import time

ROUNDS = 10  # the first is a warm-up, timed but left out of the medians
EXCHANGES = 100  # per side per round
SIDES = ("mate", "floor", "raw")
TAG = 7


async def run(size: int, progress: str) -> None:
    from mpi4py import MPI

    import mate
    from mate.bench.patterns import await_request

    async with mate.startup("mpi", progress=progress) as world:
        comm = MPI.COMM_WORLD.Dup()  # the floor's and raw MPI's, apart from mate's
        peer = 1 - world.mypid
        out, into = memoryview(bytearray(b"\x5a" * size)), memoryview(bytearray(size))
        send, recv = world.send, world.recv
        irecv, isend, waitall = comm.Irecv, comm.Isend, MPI.Request.Waitall

        async def mate_exchange() -> None:
            r = recv(into, peer, TAG)
            s = send(out, peer, TAG)
            await s
            await r

        async def floor_exchange() -> None:
            incoming = irecv(into, peer, TAG)
            await await_request(comm.Issend(out, peer, TAG))
            await await_request(incoming)

        async def raw_exchange() -> None:
            waitall([irecv(into, peer, TAG), isend(out, peer, TAG)])

        exchanges = {"mate": mate_exchange, "floor": floor_exchange, "raw": raw_exchange}
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        for round_ in range(ROUNDS):
            for side in SIDES:
                exchange = exchanges[side]
                comm.Barrier()
                for _ in range(EXCHANGES):
                    start = time.perf_counter()
                    await exchange()
                    if round_:
                        times[side].append(time.perf_counter() - start)
        comm.Free()
        if world.mypid == 0:
            raw = statistics.median(times["raw"])
            for side in SIDES:
                median = statistics.median(times[side])
                print(f"{side:6} exchange {median * 1e6:7.1f} us   raw/{side} {raw / median:.3f}")


_LINE = re.compile(r"\s*(\d+)\s+([\d.]+):\s+syscalls:sys_(enter|exit)_process_vm_readv:\s*(\S*)")


def parse_copies(script: str, size: int) -> dict[int, list[tuple[float, float]]]:
    """Each process's copies of `size` bytes, (start, end) in microseconds, from the
    text of ``perf script -F pid,time,event,trace``."""
    entered: dict[int, float] = {}
    copies: dict[int, list[tuple[float, float]]] = {}
    for line in script.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        pid, at = int(m.group(1)), float(m.group(2)) * 1e6
        if m.group(3) == "enter":
            entered[pid] = at
        elif pid in entered and int(m.group(4), 16) == size:
            copies.setdefault(pid, []).append((entered.pop(pid), at))
    return copies


def phases(copies: dict[int, list[tuple[float, float]]]) -> dict[str, dict[str, float]]:
    """Per side, the medians of its exchanges' phases (us), the warm-up round left out:
    the copy (both ranks'), the skews of the two copies' starts and ends, the gap (the
    later copy's end to the next exchange's first copy) and the exchange (first copy
    to first copy)."""
    expected = ROUNDS * len(SIDES) * EXCHANGES
    ranks = [pid for pid, made in copies.items() if len(made) == expected]
    if len(ranks) != 2:
        found = {pid: len(made) for pid, made in copies.items()}
        raise ValueError(f"expected two processes with {expected} copies each, found "
                         f"{found or 'none'} (is CMA in use? Yama's ptrace_scope must be 0)")
    a, b = copies[ranks[0]], copies[ranks[1]]
    values: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    for k in range(EXCHANGES * len(SIDES), expected):
        if k % EXCHANGES == EXCHANGES - 1:
            continue  # the next pair of copies is the next side's, after a barrier
        (sa, ea), (sb, eb) = a[k], b[k]
        next_start = min(a[k + 1][0], b[k + 1][0])
        row = values[SIDES[(k // EXCHANGES) % len(SIDES)]]
        for key, value in (("copy", ea - sa), ("copy", eb - sb), ("start skew", abs(sa - sb)),
                           ("end skew", abs(ea - eb)), ("gap", next_start - max(ea, eb)),
                           ("exchange", next_start - min(sa, sb))):
            row.setdefault(key, []).append(value)
    return {side: {key: statistics.median(v) for key, v in row.items()}
            for side, row in values.items()}


def analyse(data: str, size: int) -> None:
    script = subprocess.run(["perf", "script", "-i", data, "-F", "pid,time,event,trace"],
                            capture_output=True, text=True, check=True).stdout
    try:
        medians = phases(parse_copies(script, size))
    except ValueError as exc:
        sys.exit(f"{size} B: {exc}")
    print(f"{size} B ping-ping, medians over {(EXCHANGES - 1) * (ROUNDS - 1)} exchanges a "
          "side (us):")
    print(f"{'':6} {'copy':>8} {'start skew':>11} {'end skew':>9} {'gap':>7} {'exchange':>9}")
    for side, med in medians.items():
        print(f"{side:6} {med['copy']:8.1f} {med['start skew']:11.1f} {med['end skew']:9.1f} "
              f"{med['gap']:7.1f} {med['exchange']:9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="the exchanges (under mpiexec -n 2)")
    run_parser.add_argument("size", nargs="?", type=int, default=4 << 20)
    run_parser.add_argument("--progress", default="poll", choices=("poll", "thread"))
    analyse_parser = sub.add_parser("analyse", help="the copies recorded by perf")
    analyse_parser.add_argument("data")
    analyse_parser.add_argument("size", nargs="?", type=int, default=4 << 20)
    args = parser.parse_args()
    if args.command == "run":
        asyncio.run(run(args.size, args.progress))
    else:
        analyse(args.data, args.size)


if __name__ == "__main__":
    main()
