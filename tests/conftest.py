"""The test harness: conformance tests are SPMD programs run on every rank of a group.

A test receives `group` (or opens one with `fabric.open(**options)` when it
needs options) and calls ``await group.run(program)``: `program(world)` then
runs once per rank, concurrently, and must be written like an MPI program
(branch on ``world.mypid``, size-agnostic where it can be). For the local
transport every rank lives in this process. Under a launcher
(``MATE_TEST_TRANSPORT=mpi pytest`` under mpiexec, later) each process holds
one rank and runs the same test file, so the same code checks every transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

import mate

LAUNCHED = os.environ.get("MATE_TEST_TRANSPORT")  # set by a launcher for multi-process runs
LAUNCH_OPTIONS = json.loads(os.environ.get("MATE_TEST_OPTIONS", "{}"))  # e.g. progress, rma
# Whether the launched transport runs a progress thread (so handlers="progress" works).
THREADED = LAUNCHED is not None and LAUNCH_OPTIONS.get("progress") in (
    mate.registry.TRANSPORTS[LAUNCHED].threaded_progress)
LOCAL_SIZES = (2, 3)
# The event loop every async test runs on: "asyncio", or "uvloop" (a launcher's choice).
LOOP = os.environ.get("MATE_TEST_LOOP", "asyncio")

if LOOP == "uvloop":
    def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                      ) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
        import uvloop

        return {"uvloop": uvloop.new_event_loop}


class Group:
    """The ranks of one test run that live in this process."""

    def __init__(self, worlds: list[mate.World], size: int) -> None:
        self.worlds = worlds
        self.size = size

    async def run(self, program: Callable[[mate.World], Awaitable[Any]],
                  timeout: float = 20.0) -> None:
        """Run `program(world)` on every rank here; fail if any rank fails or hangs."""
        await asyncio.wait_for(asyncio.gather(*(program(w) for w in self.worlds)), timeout)


class Fabric:
    """How to open a group: a transport and a number of ranks."""

    def __init__(self, transport: str, size: int) -> None:
        self.transport = transport
        self.size = size

    @contextlib.asynccontextmanager
    async def open(self, **options: Any) -> AsyncIterator[Group]:
        if self.transport == "local":
            async with mate.local.worlds(self.size, **options) as worlds:
                yield Group(worlds, self.size)
        else:
            async with mate.startup(self.transport, **{**LAUNCH_OPTIONS, **options}) as world:
                yield Group([world], world.numprocs)

    def __repr__(self) -> str:
        extra = "".join(f"-{v}" for v in LAUNCH_OPTIONS.values()) if LAUNCHED else ""
        return f"{self.transport}-{self.size}{extra}"


def _fabrics() -> list[Fabric]:
    if LAUNCHED:
        return [Fabric(LAUNCHED, int(os.environ.get("MATE_TEST_SIZE", "0")))]
    return [Fabric("local", n) for n in LOCAL_SIZES]


@pytest.fixture(params=_fabrics(), ids=repr)
def fabric(request: pytest.FixtureRequest) -> Fabric:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
async def group(fabric: Fabric) -> AsyncIterator[Group]:
    async with fabric.open() as g:
        yield g


async def barrier(world: mate.World) -> None:
    """Wait until every rank reached the barrier (dissemination, on the top tag)."""
    n, me, step = world.numprocs, world.mypid, 1
    token = bytearray(1)
    while step < n:
        r = world.recv(token, (me - step) % n, world.tag_max, timeout=None)
        await world.send(b"\0", (me + step) % n, world.tag_max, timeout=None)
        await r
        step *= 2


@contextlib.contextmanager
def counting_futures() -> Iterator[Callable[[], int]]:
    """Count the futures the running loop makes meanwhile (`loop.create_future`)."""
    loop = asyncio.get_running_loop()
    make, made = loop.create_future, 0

    def counting() -> asyncio.Future[Any]:
        nonlocal made
        made += 1
        return make()

    loop.create_future = counting  # type: ignore[method-assign]
    try:
        yield lambda: made
    finally:
        loop.create_future = make  # type: ignore[method-assign]
