"""Large messages between ranks that back off, where MPI copies them a fragment per
call (MPICH without CMA): run on real ranks by tests/test_mpi.py, with CMA off.

Either end may have waited long enough to back off; the message must cross at
once all the same (the engine's transfers and nudges, mate.transports.mpi.progress).
Before them, a 4 MiB message took 2.1 s here in either case (1 ms on ranks that
spin), so the bound below, a quarter of that, tells the two apart.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import LAUNCHED, Fabric, barrier

import mate

pytestmark = pytest.mark.skipif(LAUNCHED != "mpi", reason="runs under mpiexec (test_mpi.py)")

SIZE = 4 << 20
LATE = 0.2  # long enough for the waiting end to back off fully
BOUND = 0.5  # seconds


@pytest.mark.parametrize("late", ["sender", "receiver"])
async def test_a_large_message_crosses_at_once_after_one_end_waited(fabric: Fabric,
                                                                    late: str) -> None:
    async def program(world: mate.World) -> None:
        for round_ in range(3):
            if world.mypid == 0:
                data = bytearray(SIZE)
                data[0], data[-1] = round_, 7
                if late == "sender":
                    await asyncio.sleep(LATE)
                start = time.monotonic()
                await world.send(data, 1, tag=1)
                took = time.monotonic() - start
                assert took < BOUND, f"{SIZE} B took {took:.3f} s to a receiver that waited"
            else:
                buf = bytearray(SIZE)
                if late == "receiver":
                    await asyncio.sleep(LATE)
                start = time.monotonic()
                receipt = await world.recv(buf, 0, tag=1)
                took = time.monotonic() - start
                assert receipt.length == SIZE and buf[0] == round_ and buf[-1] == 7
                if late == "receiver":
                    assert took < BOUND, f"{SIZE} B took {took:.3f} s from a sender that waited"
            await barrier(world)

    async with fabric.open() as group:
        await group.run(program)
