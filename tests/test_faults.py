"""mate.faults: the unreliable wire in front of any transport, as SPMD programs.

Every rank injects faults into its own outgoing messages; ring order as in
test_conformance (send right, receive from left). The same file runs under
mpiexec (tests/test_mpi.py), so each fault is checked on every transport.
"""

from __future__ import annotations

import asyncio
import time

import attrs
import pytest
from conftest import THREADED, Fabric, barrier

import mate
from mate import Event, FailureReason, Schedule, State
from mate.faults import FaultPlan, FaultyTransport, inject

SLACK = 0.1
SKEW = 0.01  # how much later one rank may leave a barrier than another


def ring(world: mate.World) -> tuple[int, int, int]:
    me, n = world.mypid, world.numprocs
    return me, (me + 1) % n, (me - 1) % n


# -- the plan ----------------------------------------------------------------------------


def test_plan_parses_and_validates() -> None:
    plan = FaultPlan.parse("drop=0.05, delay=0.1:0.5,fail=0.02", seed=3)
    assert plan == FaultPlan(drop=0.05, delay=0.1, fail=0.02, delay_seconds=0.5, seed=3)
    assert FaultPlan.parse(str(plan), seed=3) == plan
    assert FaultPlan.parse("") == FaultPlan()
    for bad in ("drop", "lose=0.1", "drop=x", "delay=0.1:y", "drop=1.5", "drop=0.6,fail=0.6"):
        with pytest.raises(mate.InvalidArgument):
            FaultPlan.parse(bad)
    with pytest.raises(mate.InvalidArgument):
        FaultPlan(delay_seconds=-1)


# -- each fault ----------------------------------------------------------------------------


async def test_dropped_send_times_out_and_never_arrives(fabric: Fabric) -> None:
    async def program(world: mate.World) -> None:
        _me, right, left = ring(world)
        inject(world, FaultPlan(drop=1.0))
        inbox = bytearray(8)
        recv = world.recv(inbox, left, tag=1, timeout=0.3)
        send = world.send(b"lost", right, tag=1, timeout=0.2)
        with pytest.raises(mate.MessageTimeout):
            await send
        with pytest.raises(mate.MessageTimeout):
            await recv  # the left neighbour's send was dropped too
        assert world.transport.injected["drop"] >= 1  # type: ignore[attr-defined]
        await _clean_barrier(world)

    async with fabric.open() as group:
        await group.run(program)


async def test_failed_send_reports_failure_after_the_call(fabric: Fabric) -> None:
    async def program(world: mate.World) -> None:
        _me, right, left = ring(world)
        inject(world, FaultPlan(fail=1.0))
        events: list[Event] = []
        schedule = Schedule(failure=lambda r, d: events.append(r.event))
        send = world.send(b"x", right, tag=2, schedule=schedule)
        assert events == [] and send.state is State.POSTED  # never inside the call
        with pytest.raises(mate.MessageFailed) as info:
            await send
        assert info.value.reason is FailureReason.TRANSPORT
        await asyncio.sleep(0)
        assert events == [Event.FAILURE]
        recv = world.recv(bytearray(1), left, tag=2, timeout=0.1)
        with pytest.raises(mate.MessageTimeout):
            await recv  # a failed message is never carried out
        await _clean_barrier(world)

    async with fabric.open() as group:
        await group.run(program)


async def test_delayed_send_arrives_late_submitted_first(fabric: Fabric) -> None:
    delay = 0.15

    async def program(world: mate.World) -> None:
        me, right, left = ring(world)
        # `start` is this rank's clock, the delay runs from the sender's post: meet
        # first, so that the two differ by one message's latency at most (SKEW).
        await barrier(world)
        start = time.monotonic()
        inject(world, FaultPlan(delay=1.0, delay_seconds=delay))
        events: list[Event] = []
        note = lambda r, d: events.append(r.event)  # noqa: E731
        payload = bytearray(f"from {me}".encode())
        inbox = bytearray(16)
        recv = world.recv(inbox, left, tag=3, timeout=5)
        send = world.send(payload, right, tag=3, timeout=5,
                          schedule=Schedule(submission=note, completion=note))
        await send.submitted  # type: ignore[misc]
        payload[:] = bytes(len(payload))  # the copy left already: the buffer is free
        receipt = await recv
        assert time.monotonic() - start >= delay - SKEW
        assert bytes(inbox[:receipt.length]) == f"from {left}".encode()
        await send
        await asyncio.sleep(0.01)  # handlers run "eventually"
        assert events == [Event.SUBMISSION, Event.COMPLETION]
        await _clean_barrier(world)

    async with fabric.open() as group:
        await group.run(program)


async def test_delayed_send_that_timed_out_still_arrives(fabric: Fabric) -> None:
    """SPEC §1: a send that timed out may have reached its destination."""

    async def program(world: mate.World) -> None:
        me, right, left = ring(world)
        inject(world, FaultPlan(delay=1.0, delay_seconds=0.3))
        inbox = bytearray(16)
        send = world.send(f"late {me}".encode(), right, tag=4, timeout=0.05)
        with pytest.raises(mate.MessageTimeout):
            await send
        receipt = await world.recv(inbox, left, tag=4, timeout=5)
        assert bytes(inbox[:receipt.length]) == f"late {left}".encode()
        await _clean_barrier(world)

    async with fabric.open() as group:
        await group.run(program)


async def test_delayed_and_dropped_one_sided(fabric: Fabric) -> None:
    async def program(world: mate.World) -> None:
        me, right, left = ring(world)
        memory = bytearray(f"memory of {me:3d}".encode())
        region = world.expose(memory)
        addresses = bytearray(8)
        got = world.recv(addresses, left, tag=5, timeout=5)
        await world.send(region.address.to_bytes(8, "little"), right, tag=5, timeout=5)
        await got
        target = int.from_bytes(addresses, "little")  # the left neighbour's memory
        await barrier(world)
        faulty = inject(world, FaultPlan(delay=1.0, delay_seconds=0.05))
        start = time.monotonic()
        into = bytearray(len(memory))
        await world.get(into, left, target, timeout=5)
        assert into == f"memory of {left:3d}".encode()
        await world.put(b"PUT", left, target, timeout=5)
        assert time.monotonic() - start >= 0.1
        faulty.plan = FaultPlan(drop=1.0)
        with pytest.raises(mate.MessageTimeout):
            await world.put(b"NO!", left, target + 3, timeout=0.1)
        await barrier_through(world, faulty)
        assert memory == f"PUTory of {me:3d}".encode()  # the dropped put never landed
        await world.unexpose(region)

    async with fabric.open() as group:
        await group.run(program)


async def test_cancel_a_held_message(fabric: Fabric) -> None:
    async def program(world: mate.World) -> None:
        _me, right, _left = ring(world)
        inject(world, FaultPlan(drop=1.0))
        send = world.send(b"x", right, tag=6, timeout=None)
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        assert send.state is State.CANCELLED
        await _clean_barrier(world)

    async with fabric.open() as group:
        await group.run(program)


async def test_shutdown_with_delayed_messages_in_flight(fabric: Fabric) -> None:
    async def program(world: mate.World) -> None:
        _me, right, _left = ring(world)
        inject(world, FaultPlan(delay=1.0, delay_seconds=30))
        sends = [world.send(b"x", right, tag=7, timeout=None) for _ in range(5)]
        await asyncio.sleep(0.01)
        await world.shutdown()
        for send in sends:
            assert send.state is State.CANCELLED

    start = time.monotonic()
    async with fabric.open() as group:
        await group.run(program)
    assert time.monotonic() - start < 10


async def test_seeded_plans_replay_the_same_faults(fabric: Fabric) -> None:
    async def program(world: mate.World) -> list[State]:
        _me, right, left = ring(world)
        inject(world, FaultPlan(drop=0.3, fail=0.3, seed=11))
        sends = [world.send(b"s", right, tag=8, timeout=0.2) for _ in range(20)]
        recvs = [world.recv(bytearray(1), left, tag=8, timeout=0.5) for _ in range(20)]
        await asyncio.gather(*sends, *recvs, return_exceptions=True)
        await _clean_barrier(world)
        return [send.state for send in sends]

    runs = []
    for _ in range(2):
        async with fabric.open() as group:
            outcomes: dict[int, list[State]] = {}  # by rank: ranks finish in any order

            async def keep(world: mate.World) -> None:
                outcomes[world.mypid] = await program(world)  # noqa: B023

            await group.run(keep)
            runs.append([outcomes[rank] for rank in sorted(outcomes)])
    assert runs[0] == runs[1]
    states = {state for outcome in runs[0] for state in outcome}
    assert {State.COMPLETED, State.TIMED_OUT, State.FAILED} <= states


async def test_delays_keep_each_channel_in_order(fabric: Fabric) -> None:
    """Issue 13, defect 7: a delayed send never lets a later one on its tag overtake it.

    Some sends of a burst on one tag are delayed, the others not; the receiver
    must see the whole burst in posting order (a slow link, not a reordering one).
    Another tag is not held up by them.
    """
    count = 200

    async def program(world: mate.World) -> None:
        _me, right, left = ring(world)
        inject(world, FaultPlan(delay=0.3, delay_seconds=0.05, seed=world.mypid))
        sends = [world.send(i.to_bytes(4, "little"), right, tag=9, timeout=10)
                 for i in range(count)]
        express = world.send(b"fast", right, tag=10, timeout=10)
        express_in = world.recv(bytearray(4), left, tag=10, timeout=10)
        buffers = [bytearray(4) for _ in range(count)]
        recvs = [world.recv(b, left, tag=9, timeout=10) for b in buffers]
        await asyncio.gather(*sends, *recvs, express, express_in)
        assert [int.from_bytes(b, "little") for b in buffers] == list(range(count))
        assert world.transport.injected["delay"] > 0  # type: ignore[attr-defined]
        await _clean_barrier(world)

    async with fabric.open() as group:
        await group.run(program)


@pytest.mark.skipif(not THREADED, reason="handlers run in a progress thread (thread mode)")
async def test_faults_with_handlers_on_the_progress_thread(fabric: Fabric) -> None:
    """Issue 13, defect 2: with handlers="progress" the fault layer deadlocked.

    Its relay ran as a handler, under the handlers' lock, and reported the
    original's outcome, whose handler needed the same lock on the same thread.
    """
    async def program(world: mate.World) -> None:
        _me, right, left = ring(world)
        inject(world, FaultPlan(delay=1.0, delay_seconds=0.02))
        completed: list[int] = []
        schedule = Schedule(completion=lambda receipt, i: completed.append(i))
        sends = [world.send(b"x", right, tag=11, timeout=5, schedule=attrs.evolve(
            schedule, completion_data=i)) for i in range(20)]
        recvs = [world.recv(bytearray(1), left, tag=11, timeout=5) for _ in range(20)]
        await asyncio.wait_for(asyncio.gather(*sends, *recvs), 10)
        await asyncio.sleep(0.05)
        assert sorted(completed) == list(range(20))
        await _clean_barrier(world)

    async with fabric.open(handlers="progress") as group:
        await group.run(program)


async def _clean_barrier(world: mate.World) -> None:
    """A barrier on the faultless wire underneath (the barrier's own sends must arrive)."""
    transport = world.transport
    assert isinstance(transport, FaultyTransport)
    await barrier_through(world, transport)


async def barrier_through(world: mate.World, faulty: FaultyTransport) -> None:
    plan = faulty.plan
    faulty.plan = FaultPlan()
    try:
        await barrier(world)
    finally:
        faulty.plan = plan
