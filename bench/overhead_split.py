"""Where a message's time goes on the MPI transport: MPI, the event loop, mate's
engine, mate's core. Raw mpi4py and mate's internals, one rank a side.

    mpiexec -n 2 python bench/overhead_split.py [--sizes 8,256K,1M] [--uvloop]

Rank 1 times one operation from its post to the return of its await, the peer
(rank 0) doing its half with a blocking call right after a barrier, so that
the peer costs every way the same. The operation is a receive (``recv``: the
peer sends with `Ssend`) or a send (``send``: mate's `Issend`; the peer
receives with `Recv`), completed five ways, each a layer more than the last:

* ``raw``: `Test` in a loop, no event loop;
* ``floor``: the asyncio floor (`mate.bench.patterns.await_request`: a loop
  callback that tests the request and resolves a future);
* ``engine-tight``: the request given to mate's MPI engine (`Engine.add`),
  whose passes (`Engine.test`) run in a loop, no event loop;
* ``engine``: the same, awaited through the world's own poll progress and a
  future that the request's action resolves;
* ``mate``: `world.recv` / `world.send`, awaited.

So engine-tight - raw is what the engine's passes cost, engine - floor the same
under the event loop, and mate - engine the core's share (arguments, ledger,
message state machine, receipt). Medians over rounds that take the ways in turn.

For ``engine`` and ``mate`` the time is also split where the request's action
runs (the pass that found it complete): the part after it ("after") is the
way from the completion to the awaiting task, which grows with the size of a
message although no work there does: a large copy into the buffer leaves the
CPU's caches cold for the code that runs next (`bench/cache_cold.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from mpi4py import MPI

import mate
from mate.bench.patterns import await_request
from mate.bench.stats import parse_sizes

WAYS = ("raw", "floor", "engine-tight", "engine", "mate")
TAG = 1


async def main(world: mate.World, args: argparse.Namespace) -> None:
    transport: Any = world._ledger.transport  # the MPI transport: its comm and engine
    comm, engine = transport.comm, transport.engine
    loop = asyncio.get_running_loop()
    rank, peer, barrier = world.mypid, 1 - world.mypid, MPI.COMM_WORLD.Barrier
    acted: list[float] = []  # when the request's action ran (engine and mate)

    def stamped(action: Any) -> Any:
        def run(owner: Any, status: Any, error: Any) -> None:
            acted.append(time.perf_counter())
            action(owner, status, error)
        return run

    # The transport's actions for user messages, read at every post: stamp them.
    transport._on_recv_done = stamped(transport._on_recv_done)
    transport._on_send_done = stamped(transport._on_send_done)

    async def once(op: str, way: str, out: bytearray, into: bytearray) -> tuple[float, float]:
        """Rank 1's time for one operation and the part after its action, in µs
        (rank 0: its blocking half, zeros; ways with no action: after 0)."""
        barrier()
        if rank == 0:
            if op == "recv":
                comm.Ssend(out, peer, TAG)
            else:
                comm.Recv(into, peer, TAG)
            return 0.0, 0.0
        acted.clear()
        start = time.perf_counter()
        post = ((lambda: comm.Irecv(into, peer, TAG)) if op == "recv"
                else (lambda: comm.Issend(out, peer, TAG)))
        if way == "raw":
            request = post()
            while not request.Test():
                pass
        elif way == "floor":
            await await_request(post())
        elif way == "engine-tight":
            done: list[bool] = []
            engine.add(post(), lambda owner, status, error: done.append(True))
            while not done:
                engine.test()
        elif way == "engine":
            future = loop.create_future()
            engine.add(post(), stamped(lambda owner, status, error: future.set_result(None)))
            await future
        elif op == "recv":
            await world.recv(into, peer, TAG)
        else:
            await world.send(out, peer, TAG)
        end = time.perf_counter()
        return (end - start) * 1e6, (end - acted[0]) * 1e6 if acted else 0.0

    for size in args.sizes:
        out, into = bytearray(b"\x5a" * size), bytearray(size)
        for op in ("recv", "send"):
            times: dict[str, list[float]] = {way: [] for way in WAYS}
            after: dict[str, list[float]] = {way: [] for way in WAYS}
            for _ in range(args.rounds):
                for way in WAYS:
                    samples = [await once(op, way, out, into) for _ in range(args.operations)]
                    times[way].append(statistics.median(total for total, _ in samples))
                    after[way].append(statistics.median(part for _, part in samples))
            if rank == 1:
                medians = {way: statistics.median(t) for way, t in times.items()}
                tails = {way: statistics.median(after[way]) for way in ("engine", "mate")}
                cells = "  ".join(f"{way} {medians[way]:7.2f}" for way in WAYS)
                print(f"{size:>8} B {op}  {cells}  | engine - floor "
                      f"{medians['engine'] - medians['floor']:5.2f}, mate - engine "
                      f"{medians['mate'] - medians['engine']:5.2f} | after the action: "
                      f"engine {tails['engine']:6.2f}, mate {tails['mate']:6.2f} us", flush=True)


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("8,256K,1M"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--operations", type=int, default=100, help="per way and round")
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()

    async def program() -> None:
        async with mate.startup("mpi") as world:
            await main(world, args)

    if args.uvloop:
        import uvloop

        uvloop.run(program())
    else:
        asyncio.run(program())


if __name__ == "__main__":
    run()
