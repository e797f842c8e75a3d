"""mate.faults: the unreliable wire in front of any transport, as SPMD programs.

Every rank injects faults into its own outgoing messages; ring order as in
test_conformance (send right, receive from left). The same file runs under
mpiexec (tests/test_mpi.py) and mate-run (tests/test_ibverbs.py), so each
fault is checked on every transport; but a rank killed in place exists only
on the local transport (a launched rank that is killed takes its pytest with
it: tests/test_killed_rank.py kills them), and the hypothesis properties run
here, on the local transport.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest
from conftest import LAUNCHED, THREADED, Fabric, barrier
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mate
from mate import ANY_SOURCE, ANY_TAG, Event, FailureReason, Schedule, State
from mate.faults import FaultPlan, FaultyTransport, inject
from mate.machine import Input
from mate.schedule import Op
from mate.transports.base import Operation, Report, Transport, failure

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
    plan = FaultPlan.parse("duplicate=0.25,kill_after=50,kill_rank=2")
    assert plan == FaultPlan(duplicate=0.25, kill_after=50, kill_rank=2)
    assert FaultPlan.parse(str(plan)) == plan
    assert FaultPlan.parse(str(FaultPlan(kill_after=3))) == FaultPlan(kill_after=3)
    for bad in ("drop", "lose=0.1", "drop=x", "delay=0.1:y", "drop=1.5", "drop=0.6,fail=0.6",
                "duplicate=0.6,delay=0.6", "duplicate=-0.1", "kill_after=0", "kill_after=1.5",
                "kill_after=x", "kill_rank=1", "kill_after=3,kill_rank=-1"):
        with pytest.raises(mate.InvalidArgument):
            FaultPlan.parse(bad)
    for wrong in ({"delay_seconds": -1}, {"kill_after": True}, {"kill_after": 2.0}):
        with pytest.raises(mate.InvalidArgument):
            FaultPlan(**wrong)


async def test_plan_checked_against_the_world(fabric: Fabric) -> None:
    async def program(world: mate.World) -> None:
        with pytest.raises(mate.InvalidArgument):
            inject(world, FaultPlan(kill_after=1, kill_rank=world.numprocs))
        faulty = inject(world, FaultPlan(drop=0.5))
        with pytest.raises(mate.InvalidArgument):  # the protocol is chosen at injection
            faulty.plan = FaultPlan(duplicate=0.1)
        assert faulty.plan == FaultPlan(drop=0.5) and not faulty.sequenced
        faulty.plan = FaultPlan(kill_after=10**9, kill_rank=world.numprocs - 1)
        with pytest.raises(mate.InvalidArgument):
            faulty.plan = FaultPlan(kill_after=1, kill_rank=world.numprocs)
        await _clean_barrier(world)

    async with fabric.open() as group:
        await group.run(program)


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


# -- duplicate: carried twice, delivered once ----------------------------------------------


def number(data: bytes | bytearray | memoryview) -> int:
    return int.from_bytes(data, "little")


async def test_duplicated_stream_arrives_once_in_order(fabric: Fabric) -> None:
    """Half the sends are carried twice; every receive, whatever its wildcards, gets the
    next number, and the receiver discarded exactly the duplicates its sender made."""
    count = 120
    patterns = [(-1, 12), (ANY_SOURCE, 12), (-1, ANY_TAG), (ANY_SOURCE, ANY_TAG)]

    async def program(world: mate.World) -> None:
        _me, right, left = ring(world)
        faulty = inject(world, FaultPlan(duplicate=0.5, seed=world.mypid))
        assert faulty.sequenced
        buffers = [bytearray(4) for _ in range(count)]

        def receive(i: int) -> mate.Message:
            source, tag = patterns[i % len(patterns)]
            return world.recv(buffers[i], left if source == -1 else source, tag, timeout=10)

        early = [receive(i) for i in range(count // 2)]  # matched as their headers come
        sends = [world.send(i.to_bytes(4, "little"), right, tag=12, timeout=10)
                 for i in range(count)]
        await asyncio.sleep(0.05)
        late = [receive(i) for i in range(count // 2, count)]  # most find theirs waiting
        receipts = await asyncio.gather(*early, *late)
        await asyncio.gather(*sends)
        assert [number(b) for b in buffers] == list(range(count))
        assert {(r.remote_pid, r.tag, r.length) for r in receipts} == {(left, 12, 4)}
        with pytest.raises(mate.MessageTimeout):
            await world.recv(bytearray(4), left, 12, timeout=0.2)  # no copy is left over
        # The left neighbour's sends completed, so their copies reached this layer.
        faulty.plan = FaultPlan()
        made = bytearray(8)
        told = world.recv(made, left, tag=14, timeout=10)
        await world.send(faulty.injected["duplicate"].to_bytes(8, "little"), right, tag=14,
                         timeout=10)
        await told
        assert faulty.discarded == number(made) > 0
        assert world.stats()["duplicates_discarded"] == faulty.discarded
        await _clean_barrier(world)

    async with fabric.open() as group:
        await group.run(program)


async def test_duplicates_with_truncation_cancels_and_timeouts(fabric: Fabric) -> None:
    """Every send carried twice. A receive that times out or is cancelled takes nothing;
    a truncated message fills its buffer and its copy never reaches the next receive;
    receives cancelled while messages arrive leave every message to exactly one receive,
    in order."""
    sentinel = b"\xa5" * 16
    count = 40

    async def program(world: mate.World) -> None:
        _me, right, left = ring(world)
        inject(world, FaultPlan(duplicate=1.0))
        timed, withdrawn = bytearray(sentinel), bytearray(sentinel)
        with pytest.raises(mate.MessageTimeout):
            await world.recv(timed, left, tag=20, timeout=0.05)
        cancelled = world.recv(withdrawn, left, tag=20, timeout=None)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await _clean_barrier(world)  # nothing is sent on tag 20 before both receives ended
        first = world.send(bytes(range(100)), right, tag=20, timeout=10)
        second = world.send(b"short", right, tag=20, timeout=10)
        head = bytearray(10)
        truncated = world.recv(head, left, tag=20, timeout=10)
        with pytest.raises(mate.MessageFailed) as info:
            await truncated
        assert info.value.reason is FailureReason.TRUNCATED
        assert truncated.receipt.length == 10 and head == bytes(range(10))
        tail = bytearray(16)
        receipt = await world.recv(tail, left, tag=20, timeout=10)
        assert bytes(tail[:receipt.length]) == b"short"
        await asyncio.gather(first, second)
        with pytest.raises(mate.MessageTimeout):
            await world.recv(bytearray(100), left, tag=20, timeout=0.2)
        assert timed == sentinel and withdrawn == sentinel

        buffers = [bytearray(sentinel[:4]) for _ in range(count)]
        recvs = [world.recv(b, left, tag=21, timeout=None) for b in buffers]
        sends = [world.send(i.to_bytes(4, "little"), right, tag=21, timeout=10)
                 for i in range(count)]
        for i, recv in enumerate(recvs):  # some before their message came, some after
            if i % 3 == 0:
                recv.cancel()
            if i % 8 == 0:
                await asyncio.sleep(0.001)
        await asyncio.gather(*recvs, return_exceptions=True)
        assert {r.state for r in recvs} <= {State.COMPLETED, State.CANCELLED}
        assert all(b == sentinel[:4] for b, r in zip(buffers, recvs, strict=True)
                   if r.state is State.CANCELLED)
        got = [number(b) for b, r in zip(buffers, recvs, strict=True)
               if r.state is State.COMPLETED]
        rest = [bytearray(4) for _ in range(count - len(got))]
        await asyncio.gather(*(world.recv(b, left, tag=21, timeout=10) for b in rest), *sends)
        assert got + [number(b) for b in rest] == list(range(count))
        await _clean_barrier(world)

    async with fabric.open() as group:
        await group.run(program)


async def test_duplicated_puts_and_gets_land_within_their_window(fabric: Fabric) -> None:
    """A put carried twice completes once both copies landed: the get after it, and every
    later put, find no stale copy landing late."""
    rounds = 30

    async def program(world: mate.World) -> None:
        _me, right, left = ring(world)
        faulty = inject(world, FaultPlan(duplicate=1.0))
        memory = bytearray(8)
        region = world.expose(memory)
        addresses = bytearray(8)
        got = world.recv(addresses, left, tag=22, timeout=10)
        await world.send(region.address.to_bytes(8, "little"), right, tag=22, timeout=10)
        await got
        target, into = number(addresses), bytearray(8)  # the left neighbour's memory
        for i in range(1, rounds + 1):
            await world.put(bytes([i]) * 8, left, target, timeout=10)
            await world.get(into, left, target, timeout=10)
            assert into == bytes([i]) * 8
        assert faulty.injected["duplicate"] == 2 * rounds + 1
        await _clean_barrier(world)
        assert memory == bytes([rounds]) * 8
        await world.unexpose(region)

    async with fabric.open() as group:
        await group.run(program)


async def test_duplicates_with_every_other_fault_keep_each_channel(fabric: Fabric) -> None:
    """Dropped, delayed, failed and duplicated sends on one tag: what arrives is in order,
    once each, never a failed send, and every send that completed."""
    count = 100
    completed, failed = 1, 2  # what the sender's record says of each send

    async def program(world: mate.World) -> None:
        _me, right, left = ring(world)
        faulty = inject(world, FaultPlan(drop=0.1, delay=0.2, fail=0.1, duplicate=0.3,
                                         delay_seconds=0.02, seed=7 + world.mypid))
        sends = [world.send(i.to_bytes(4, "little"), right, tag=23, timeout=0.5)
                 for i in range(count)]
        arrived: list[int] = []
        inbox = bytearray(4)
        theirs = bytearray(count)
        told = world.recv(theirs, left, tag=24, timeout=10)
        await asyncio.gather(*sends, return_exceptions=True)
        assert min(faulty.injected.values()) > 0, faulty.injected
        faulty.plan = FaultPlan()
        # The end of the stream, on its channel: it queues behind any send still delayed.
        end = world.send(b"", right, tag=23, timeout=10)
        record = bytes(completed if s.state is State.COMPLETED else
                       failed if s.state is State.FAILED else 0 for s in sends)
        mine = world.send(record, right, tag=24, timeout=10)
        while (await world.recv(inbox, left, tag=23, timeout=10)).length:
            arrived.append(number(inbox))
        await asyncio.gather(end, mine, told)
        assert arrived == sorted(set(arrived)), arrived  # in order, once each
        assert {i for i in range(count) if theirs[i] == completed} <= set(arrived)
        assert not {i for i in range(count) if theirs[i] == failed} & set(arrived)
        await _clean_barrier(world)

    async with fabric.open() as group:
        await group.run(program)


@pytest.mark.skipif(not THREADED, reason="handlers run in a progress thread (thread mode)")
async def test_duplicates_with_handlers_on_the_progress_thread(fabric: Fabric) -> None:
    """The duplicate protocol with handlers in the progress thread: handlers that send (an
    echo of each message received), completions reported from both threads, no deadlock."""
    count = 30

    async def program(world: mate.World) -> None:
        _me, right, left = ring(world)
        inject(world, FaultPlan(duplicate=0.5, seed=world.mypid))
        completed: list[int] = []

        def echo(receipt: mate.Receipt, data: bytearray) -> None:
            world.send(bytes(data), receipt.remote_pid, tag=28, timeout=5)

        inboxes, echoes = [bytearray(4) for _ in range(count)], [bytearray(4) for _ in range(count)]
        recvs = [world.recv(b, left, tag=27, timeout=5,
                            schedule=Schedule(completion=echo, completion_data=b))
                 for b in inboxes]
        back = [world.recv(b, right, tag=28, timeout=5) for b in echoes]
        sends = [world.send(i.to_bytes(4, "little"), right, tag=27, timeout=5,
                            schedule=Schedule(completion=lambda r, i: completed.append(i),
                                              completion_data=i)) for i in range(count)]
        await asyncio.wait_for(asyncio.gather(*sends, *recvs, *back), 10)
        await asyncio.sleep(0.05)
        # Echoed in the order the receives completed, which need not be the posting order.
        assert sorted(number(b) for b in echoes) == list(range(count))
        assert [number(b) for b in inboxes] == list(range(count))
        assert sorted(completed) == list(range(count))
        await _clean_barrier(world)

    async with fabric.open(handlers="progress") as group:
        await group.run(program)


class Reordering(Transport):
    """A world's transport behind a sink that hands on each loop iteration's reports in one
    batch, its receives' outcomes in reverse order (as MPI_Testsome may report them)."""

    def __init__(self, world: mate.World) -> None:
        self.inner = world.transport
        self.mypid, self.numprocs = self.inner.mypid, self.inner.numprocs
        self.tag_max = self.inner.tag_max
        self._sink = world.sink
        self._loop = asyncio.get_running_loop()
        self._batch: list[Report] = []
        self.reversed = 0  # batches whose receives' outcomes were reversed
        self.inner.bind(self)

    def post(self, op: Operation) -> None:
        self.inner.post(op)

    def cancel(self, op: Operation) -> None:
        self.inner.cancel(op)

    def expose(self, buffer: memoryview) -> mate.Region:
        return self.inner.expose(buffer)

    async def unexpose(self, region: mate.Region) -> None:
        await self.inner.unexpose(region)

    async def shutdown(self) -> None:
        await self.inner.shutdown()

    def submitted(self, op: Operation) -> None:
        self.report_all((Report(Input.SUBMITTED, op),))

    def completed(self, op: Operation, length: int, peer: int, tag: int) -> None:
        self.report_all((Report(Input.COMPLETED, op, length, peer, tag),))

    def failed(self, op: Operation, reason: FailureReason, detail: str = "", *,
               cause: BaseException | None = None, length: int = 0,
               peer: int | None = None, tag: int | None = None) -> None:
        self.report_all((Report(Input.FAILED, op, length, peer, tag,
                                failure(reason, detail, cause)),))

    def cancelled(self, op: Operation) -> None:
        self.report_all((Report(Input.CANCELLED, op),))

    def report_all(self, reports: Sequence[Report]) -> None:
        if not self._batch:
            self._loop.call_soon(self._flush)
        self._batch += reports

    def call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        self._sink.call_on_loop(fn, *args)

    @property
    def loop_work(self) -> int:
        return self._sink.loop_work

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        receives = [r for r in batch if r.op.op is Op.RECV]  # one report each: their outcome
        self.reversed += len(receives) > 1
        backwards = iter(receives[::-1])
        self._sink.report_all([next(backwards) if r.op.op is Op.RECV else r for r in batch])


@pytest.mark.skipif(LAUNCHED is not None, reason="wraps the local transport")
async def test_headers_are_taken_in_posting_order_however_reported(fabric: Fabric) -> None:
    """The layer's standing receives for headers complete in one order and are reported in
    another: it takes the headers in the order of the receives, so each sender's order."""
    count = 100

    async def program(world: mate.World) -> None:
        _me, right, _left = ring(world)
        reordering = Reordering(world)
        world.interpose(reordering)
        inject(world, FaultPlan(duplicate=0.5, seed=world.mypid))
        buffers = [bytearray(4) for _ in range(count)]
        recvs = [world.recv(b, ANY_SOURCE, tag=26, timeout=10) for b in buffers]
        await asyncio.gather(*recvs, *(world.send(i.to_bytes(4, "little"), right, tag=26,
                                                  timeout=10) for i in range(count)))
        assert [number(b) for b in buffers] == list(range(count))
        assert reordering.reversed > 0
        await _clean_barrier(world)

    async with fabric.open() as group:
        await group.run(program)


# -- kill: a rank of the local transport dies in place -------------------------------------


@pytest.mark.skipif(LAUNCHED is not None, reason="a launched rank that is killed ends its "
                    "pytest run: tests/test_killed_rank.py kills those")
@pytest.mark.parametrize("everywhere", [True, False], ids=["same-plan", "victim-only"])
async def test_a_rank_killed_in_place(fabric: Fabric, everywhere: bool) -> None:
    """The last rank dies right after its third post: its messages end with no handler
    run (awaiting them raises CancelledError) and its calls raise InvalidArgument; its
    peers see it gone (what they had outstanding to it, and what they post later, fails
    with PEER_UNREACHABLE) and go on among themselves."""

    async def program(world: mate.World) -> None:
        me, victim = world.mypid, world.numprocs - 1
        await barrier(world)
        plan = FaultPlan(kill_after=3, kill_rank=victim) if everywhere else (
            FaultPlan(kill_after=3) if me == victim else FaultPlan())
        faulty = inject(world, plan)
        if me == victim:
            calls: list[Event] = []
            note = lambda receipt, data: calls.append(receipt.event)  # noqa: E731
            schedule = Schedule(completion=note, submission=note, failure=note, timeout=note)
            await world.recv(bytearray(2), 0, tag=1, timeout=10)  # "go"
            last = [world.send(b"last", 0, tag=2, schedule=schedule, timeout=1)]
            assert not faulty.killed
            last.append(world.recv(bytearray(4), 0, tag=3, schedule=schedule, timeout=1))
            assert faulty.killed  # from inside the third post
            for msg in last:
                with pytest.raises(asyncio.CancelledError):
                    await msg
                assert msg.state is State.CANCELLED
            await asyncio.sleep(1.2)  # past their timeouts
            assert calls == []
            with pytest.raises(mate.InvalidArgument):
                world.send(b"x", 0, tag=4)
            return
        outstanding = [world.recv(bytearray(8), victim, tag=5, timeout=None)]
        if me == 0:
            outstanding += [world.send(bytes(100_000), victim, tag=6, timeout=None),  # rendezvous
                            world.recv(bytearray(8), victim, tag=2, timeout=None)]
            await world.send(b"go", victim, tag=1, timeout=10)
        for msg in outstanding:  # ends at the death
            with pytest.raises(mate.MessageFailed) as info:
                await asyncio.wait_for(msg, 5)
            assert info.value.reason is FailureReason.PEER_UNREACHABLE
        for msg in (world.send(b"x", victim, tag=7, timeout=None),
                    world.recv(bytearray(8), victim, tag=7, timeout=None)):
            with pytest.raises(mate.MessageFailed) as info:
                await asyncio.wait_for(msg, 5)
            assert info.value.reason is FailureReason.PEER_UNREACHABLE
        if victim == 2:  # ranks 0 and 1 survive: they go on, each message once, in order
            peer, inbox = 1 - me, bytearray(4)
            for i in range(20):
                got = world.recv(inbox, peer, tag=8, timeout=10)
                await world.send(i.to_bytes(4, "little"), peer, tag=8, timeout=10)
                await got
                assert number(inbox) == i
        await world.shutdown()

    async with fabric.open() as group:
        await group.run(program)


# -- properties: random plans and programs on the local transport ---------------------------

EAGER = 64  # the local transport's eager limit here: larger sends are rendezvous
ID_BYTES = 4
SENTINEL = 0xA5

plans = st.builds(
    FaultPlan, drop=st.sampled_from([0.0, 0.1]), delay=st.sampled_from([0.0, 0.2]),
    fail=st.sampled_from([0.0, 0.1]), duplicate=st.sampled_from([0.0, 0.2, 0.5]),
    delay_seconds=st.sampled_from([0.001, 0.005]), seed=st.integers(0, 2**16))


def steps(n: int) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    rank, tag = st.integers(0, n - 1), st.sampled_from([0, 1])
    sizes = st.one_of(st.integers(ID_BYTES, 12), st.integers(EAGER - 2, EAGER + 2),
                      st.integers(100, 160))
    send = st.tuples(st.just("send"), rank, rank, tag, sizes)
    recv = st.tuples(st.just("recv"), rank, st.sampled_from([ANY_SOURCE, *range(n)]),
                     st.sampled_from([ANY_TAG, 0, 1]), st.sampled_from([8, 64, 200]),
                     st.sampled_from([None, None, 0.002, 0.01]))
    cancel = st.tuples(st.just("cancel"), st.integers(0, 31))
    pause = st.tuples(st.just("yield"), st.integers(1, 3))
    return st.lists(st.one_of(send, send, recv, recv, cancel, pause), min_size=2, max_size=40)


class Record:
    """One message of a random program, and what its handlers saw."""

    def __init__(self, op: str, rank: int, peer: int, tag: int, data: bytearray) -> None:
        self.op, self.rank, self.peer, self.tag, self.data = op, rank, peer, tag, data
        self.events: list[Event] = []
        self.msg: mate.Message | None = None

    def note(self, receipt: mate.Receipt, data: Any) -> None:
        self.events.append(receipt.event)


async def run_random(n: int, plan: FaultPlan, program: list[tuple[Any, ...]]) -> list[Record]:
    records: list[Record] = []
    async with mate.local.worlds(n, eager_limit=EAGER) as worlds:
        for world in worlds:
            inject(world, plan)
        recvs: list[Record] = []

        def post(op: str, rank: int, peer: int, tag: int, data: bytearray,
                 timeout: float | None) -> Record:
            record = Record(op, rank, peer, tag, data)
            schedule = Schedule(completion=record.note, submission=record.note,
                                failure=record.note, timeout=record.note)
            world = worlds[rank]
            call = world.send if op == "send" else world.recv
            record.msg = call(data, peer, tag, schedule=schedule, timeout=timeout)
            records.append(record)
            return record

        for step in program:
            if step[0] == "send":
                _, src, dst, tag, size = step
                key = len(records).to_bytes(ID_BYTES, "big")
                post("send", src, dst, tag, bytearray(key + bytes(size - ID_BYTES)), 0.05)
            elif step[0] == "recv":
                _, rank, source, tag, size, timeout = step
                recvs.append(post("recv", rank, source, tag, bytearray([SENTINEL] * size),
                                  timeout))
            elif step[0] == "cancel" and recvs:
                msg = recvs[-1 - step[1] % len(recvs)].msg
                assert msg is not None
                msg.cancel()
            else:
                for _ in range(step[1]):
                    await asyncio.sleep(0)
        await asyncio.gather(*(r.msg for r in records if r.op == "send"),
                             return_exceptions=True)
        await asyncio.sleep(0.02)  # delayed copies of sends that ended leave meanwhile
        for rank in range(n):  # drain: whatever arrived and no receive took
            while True:
                drain = post("recv", rank, ANY_SOURCE, ANY_TAG, bytearray([SENTINEL] * 256),
                             0.05)
                assert drain.msg is not None
                await asyncio.gather(drain.msg, return_exceptions=True)
                if drain.msg.state is State.TIMED_OUT:
                    break
        for record in records:  # receives no message matched
            assert record.msg is not None
            record.msg.cancel()
        await asyncio.gather(*(r.msg for r in records), return_exceptions=True)
        await asyncio.sleep(0.01)  # handlers run "eventually"
    return records


def check_random(records: list[Record]) -> None:
    terminal = {State.COMPLETED: Event.COMPLETION, State.FAILED: Event.FAILURE,
                State.TIMED_OUT: Event.TIMEOUT}
    sends = {number(r.data[:ID_BYTES]): (i, r) for i, r in enumerate(records) if r.op == "send"}
    received: dict[int, Record] = {}
    for record in records:
        msg = record.msg
        assert msg is not None
        # One terminal outcome, its handler once and last; submission only for sends, first.
        ending = [e for e in record.events if e is not Event.SUBMISSION]
        assert ending == ([terminal[msg.state]] if msg.state in terminal else []), record.events
        if Event.SUBMISSION in record.events:
            assert record.op == "send" and record.events[0] is Event.SUBMISSION
            assert record.events.count(Event.SUBMISSION) == 1
        if record.op != "recv":
            continue
        error = msg.receipt.error
        truncated = isinstance(error, mate.MessageFailed) and (
            error.reason is FailureReason.TRUNCATED)
        if msg.state is not State.COMPLETED and not truncated:
            assert msg.state in (State.CANCELLED, State.TIMED_OUT), (msg.state, error)
            assert record.data == bytearray([SENTINEL] * len(record.data))  # untouched
            continue
        key = number(record.data[:ID_BYTES])
        assert key not in received, f"message {key} delivered twice"  # no duplicate delivery
        received[key] = record
        _, send = sends[key]
        receipt = msg.receipt
        assert (receipt.remote_pid, receipt.tag) == (send.rank, send.tag)
        assert truncated == (len(send.data) > len(record.data))
        assert record.data[:receipt.length] == send.data[:receipt.length]
    for key, (_, send) in sends.items():
        assert send.msg is not None
        if send.msg.state is State.COMPLETED:
            assert key in received, f"completed send {key} was never received"
        if send.msg.state is State.FAILED:
            assert key not in received, f"failed send {key} was received"
    # Non-overtaking: receives of one rank, in posting order, got the messages of any one
    # channel (source, destination, tag) in their sending order.
    got = [(i, r) for i, r in enumerate(records) if r.op == "recv" and r in received.values()]
    for a, (i, first) in enumerate(got):
        for j, second in got[a + 1:]:
            one, two = (sends[number(x.data[:ID_BYTES])] for x in (first, second))
            if first.rank == second.rank and (one[1].rank, one[1].tag) == (two[1].rank,
                                                                             two[1].tag):
                assert one[0] < two[0], f"receive #{i} got a later message than #{j}"


@pytest.mark.skipif(LAUNCHED is not None, reason="local transport only")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(2, 3).flatmap(lambda n: st.tuples(st.just(n), plans, steps(n))))
def test_random_plans_keep_the_contract(case: tuple[int, FaultPlan, list[tuple[Any, ...]]]
                                        ) -> None:
    """No duplicate delivery, no completed send lost, no failed send delivered, no data
    changed, non-overtaking, and one terminal outcome per message, whatever the plan."""
    n, plan, program = case
    check_random(asyncio.run(run_random(n, plan, program)))


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
