"""Regressions for the defects that adversarial testing found (issue 13), as SPMD programs.

Each test is named for what it checks and runs on every transport where it
applies: in-process on the local transport, and under mpiexec (test_mpi.py)
in every progress mode and RMA mode, with handlers on the loop and, where the
MPI transport has a progress thread, in that thread.
"""

from __future__ import annotations

import asyncio
import struct
import time

import pytest
from conftest import LAUNCHED, THREADED, Fabric, barrier

import mate
from mate import FailureReason, Schedule, State

SLACK = 0.1  # SPEC §2: a timeout fires no later than 0.1 s + 10 % after its value
LOADED = 0.25  # extra allowance on a loaded 2-core CI machine; far below the defects' 1 s
HANDLER_MODES = ["loop", "progress"] if THREADED else ["loop"]


def mpi_only(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(LAUNCHED != "mpi", reason=reason)


@pytest.mark.parametrize("handlers", HANDLER_MODES)
async def test_timeouts_racing_matches_lose_nothing(fabric: Fabric, handlers: str) -> None:
    """Defect 1: receives that time out (timeout=0) while their data is already there.

    Each cancel races a match; the progress thread used to die on the cancel of
    a receive that had just matched. Every message must arrive exactly once and
    in order, whether its first receive matched or timed out.
    """
    count = 2000

    async def program(world: mate.World) -> None:
        if world.mypid == 0:
            sends = [world.send(struct.pack("<Q", i), 1, tag=5) for i in range(count)]
            await asyncio.wait_for(asyncio.gather(*sends), 30)
        elif world.mypid == 1:
            await asyncio.sleep(0.5)  # the sends are waiting at this end by now
            buffers = [bytearray(8) for _ in range(count)]
            first = [world.recv(b, 0, tag=5, timeout=0.0) for b in buffers]
            outcomes = await asyncio.wait_for(
                asyncio.gather(*first, return_exceptions=True), 30)
            got = [struct.unpack("<Q", b)[0] for b, o in zip(buffers, outcomes, strict=True)
                   if not isinstance(o, BaseException)]
            assert all(isinstance(o, mate.MessageTimeout) or not isinstance(o, BaseException)
                       for o in outcomes), {type(o) for o in outcomes}
            for _ in range(count - len(got)):  # what timed out was not consumed
                buffer = bytearray(8)
                await world.recv(buffer, 0, tag=5, timeout=10)
                got.append(struct.unpack("<Q", buffer)[0])
            assert got == list(range(count))
        await barrier(world)

    async with fabric.open(handlers=handlers) as group:
        await group.run(program, timeout=90)


async def test_timeouts_fire_without_progress_calls(fabric: Fabric) -> None:
    """Defect 6: a timeout is the core's clock; it fires on time in every progress mode.

    Nothing here awaits the messages or calls `world.progress()` (manual mode used
    to fire the handler only at the next call).
    """
    async def program(world: mate.World) -> None:
        me, n = world.mypid, world.numprocs
        fired: dict[str, float] = {}
        schedule = Schedule(timeout=lambda receipt, key: fired.setdefault(key, time.monotonic()))
        t0 = time.monotonic()
        recv = world.recv(bytearray(8), (me - 1) % n, 41,
                          schedule=Schedule(timeout=schedule.timeout, timeout_data="recv"),
                          timeout=0.1)
        # a large send nobody receives: it times out (MPI: orphaned from its copy)
        send = world.send(bytes(1 << 20), (me + 1) % n, 42,
                          schedule=Schedule(timeout=schedule.timeout, timeout_data="send"),
                          timeout=0.1)
        await asyncio.sleep(0.1 + SLACK + 0.01 + LOADED)
        assert set(fired) == {"recv", "send"}, fired
        for key, when in fired.items():
            assert 0.1 <= when - t0 <= 0.1 + SLACK + 0.01 + LOADED, (key, when - t0)
        assert recv.state is send.state is State.TIMED_OUT
        await barrier(world)
        # the timed-out send may still arrive: take it, so it leaves nothing behind
        late = world.recv(bytearray(1 << 20), (me - 1) % n, 42, timeout=0.5)
        await asyncio.gather(late, return_exceptions=True)
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


async def test_addresses_past_64_bits_are_refused(fabric: Fabric) -> None:
    """Defect 4: an address no region can hold is refused by the call, on every transport."""
    async def program(world: mate.World) -> None:
        peer = (world.mypid + 1) % world.numprocs
        for address, length in ((2**64, 1), (2**64 - 4, 8), (2**70, 0), (2**64, 0)):
            with pytest.raises(mate.InvalidArgument, match="2\\*\\*64"):
                world.put(bytes(length), peer, address)
            with pytest.raises(mate.InvalidArgument, match="2\\*\\*64"):
                world.get(bytearray(length), peer, address)
        # the last 8 bytes a 64-bit address can name: a valid address, in no region
        for msg in (world.put(bytes(8), peer, 2**64 - 8, timeout=5),
                    world.get(bytearray(8), peer, 2**64 - 8, timeout=5)):
            with pytest.raises(mate.MessageFailed) as failure:
                await msg
            assert failure.value.reason is FailureReason.REMOTE_ACCESS
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


@pytest.mark.skipif(LAUNCHED is None,
                    reason="ranks of the local transport share one loop: none can be busy alone")
@pytest.mark.parametrize("rma", ["native", "emulated", "auto"] if LAUNCHED == "mpi" else [None])
async def test_one_sided_timeouts_bound_a_busy_target(fabric: Fabric, rma: str | None) -> None:
    """Defect 5: put and get with timeout=0.1 to a target whose loop is blocked for 1 s.

    Each ends (times out, or completes if the target's progress thread served it)
    within 0.1 s + 10 % (plus an allowance for a loaded machine), not when the
    target wakes up; a get that timed out never writes the buffer afterwards.
    """
    size = 64 * 1024  # above the emulated protocol's eager size: the rendezvous path

    async def program(world: mate.World) -> None:
        if world.mypid == 1:
            memory = bytearray(b"\x11" * size)
            region = world.expose(memory)
            await world.send(struct.pack("<Q", region.address), 0, tag=1)
            await world.recv(bytearray(1), 0, tag=2)
            time.sleep(1.0)  # the loop is blocked: no progress unless a thread makes it
            await barrier(world)
            await world.unexpose(region)
        elif world.mypid == 0:
            raw = bytearray(8)
            await world.recv(raw, 1, tag=1)
            (address,) = struct.unpack("<Q", raw)
            await world.put(b"\x22", 1, address)  # fetches the region table
            await world.send(b"!", 1, tag=2)
            await asyncio.sleep(0.1)  # the target is asleep now
            buffers = {"get": bytearray(b"\x33" * size), "small get": bytearray(b"\x33" * 8)}
            t0 = time.monotonic()
            msgs = {
                "put": world.put(b"\x44" * size, 1, address, timeout=0.1),
                "small put": world.put(b"\x44" * 8, 1, address, timeout=0.1),
                "get": world.get(buffers["get"], 1, address, timeout=0.1),
                "small get": world.get(buffers["small get"], 1, address, timeout=0.1),
            }

            async def ended(msg: mate.Message) -> float:
                await asyncio.gather(msg, return_exceptions=True)
                return time.monotonic() - t0

            ends = await asyncio.gather(*map(ended, msgs.values()))
            for (key, msg), end in zip(msgs.items(), ends, strict=True):
                assert msg.state in (State.TIMED_OUT, State.COMPLETED), (key, msg.state)
                assert end <= 0.1 + SLACK + 0.01 + LOADED, (key, msg.state, end)
                if msg.state is State.TIMED_OUT:
                    assert end >= 0.1, (key, end)
            await barrier(world)  # the target is awake: late data would land now
            await asyncio.sleep(0.1)
            for key, buffer in buffers.items():
                if msgs[key].state is State.TIMED_OUT:
                    assert set(buffer) == {0x33}, key
                else:
                    assert set(buffer) <= {0x11, 0x22, 0x44}, key
        else:
            await barrier(world)

    async with fabric.open(**({} if rma is None else {"rma": rma})) as group:
        await group.run(program)


@mpi_only("only the MPI transport orphans sends (the others can recall them)")
async def test_orphaned_sends_are_bounded_and_kept_apart(fabric: Fabric) -> None:
    """Defect 3: sends that timed out unreceived ("orphans") cost later messages nothing.

    They are kept apart from the live requests (so a progress pass does not test
    them), at most `orphan_limit` per destination; beyond it new sends fail with
    RESOURCES; once the destination receives them they are freed.
    """
    limit = 50
    drain_after = 1.5  # rank 1 starts receiving then; rank 0 checks the bound before

    async def program(world: mate.World) -> None:
        await barrier(world)
        if world.mypid == 0:
            t0 = time.monotonic()
            sends = [world.send(struct.pack("<Q", i), 1, tag=7, timeout=0.05)
                     for i in range(limit)]
            outcomes = await asyncio.gather(*sends, return_exceptions=True)
            assert all(isinstance(o, mate.MessageTimeout) for o in outcomes), outcomes
            stats = world.stats()
            assert stats["orphaned_sends"] == limit, stats
            assert stats["requests"] == 0, stats  # no pass tests the orphans
            # every send to rank 1 now fails at once: it is not receiving
            with pytest.raises(mate.MessageFailed) as failure:
                await world.send(b"more", 1, tag=8)
            assert failure.value.reason is FailureReason.RESOURCES
            assert time.monotonic() - t0 < drain_after, "too slow to check the bound"
            deadline = time.monotonic() + drain_after + 5
            while world.stats()["orphaned_sends"] and time.monotonic() < deadline:
                world.progress()  # what drives manual mode (a no-op in the others)
                await asyncio.sleep(0.01)
            assert world.stats()["orphaned_sends"] == 0  # received, so freed
            await world.send(b"again", 1, tag=8, timeout=10)
        elif world.mypid == 1:
            await asyncio.sleep(drain_after)
            for i in range(limit):  # the orphans are still delivered, in order
                buffer = bytearray(8)
                await world.recv(buffer, 0, tag=7, timeout=10)
                assert struct.unpack("<Q", buffer)[0] == i
            buffer = bytearray(5)
            await world.recv(buffer, 0, tag=8, timeout=10)
            assert buffer == b"again"
        await barrier(world)

    async with fabric.open(orphan_limit=limit) as group:
        await group.run(program)


@mpi_only("injects a fault into an action of the MPI transport's progress engine")
async def test_an_exception_in_the_progress_context_fails_one_message(fabric: Fabric) -> None:
    """A bug in an action must not stop progress: its message fails, the next one works.

    The fault is an action that raises, added to the transport's progress engine
    for a request that completes at once (a send to self on COMM_SELF), about the
    message that the test expects to fail."""
    from mpi4py import MPI

    def faulty(owner: object, status: object, error: object) -> None:
        raise RuntimeError("injected into an action")

    async def program(world: mate.World) -> None:
        if world.mypid == 1:
            first = world.recv(bytearray(4), 0, tag=9, timeout=10)
            landing = MPI.COMM_SELF.Irecv(bytearray(1), 0, 0)
            engine = world.transport.engine  # type: ignore[attr-defined]
            engine.add(MPI.COMM_SELF.Isend(b"x", 0, 0), faulty, owner=first)
            with pytest.raises(mate.MessageFailed) as failure:
                await first
            landing.Wait()
            assert failure.value.reason is FailureReason.TRANSPORT
            assert isinstance(failure.value.__cause__, RuntimeError)
            # Only now may rank 0 send: "one" lands in the failed receive's MPI
            # request (its completion is ignored), "two" in the next receive.
            await world.send(b"go", 0, tag=10)
            buffer = bytearray(4)
            assert (await world.recv(buffer, 0, tag=9, timeout=10)).length == 3
            assert buffer[:3] == b"two"
        elif world.mypid == 0:
            await world.recv(bytearray(2), 1, tag=10)
            await world.send(b"one", 1, tag=9)
            await world.send(b"two", 1, tag=9)
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)
