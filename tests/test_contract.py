"""The transport contract v2 (issue 9): deadlines, awaiters and the hop across threads.

SPMD programs like the conformance suite: in-process on the local transport,
and under mpiexec (test_mpi.py) in every progress mode. The tests that need
handlers in a progress thread run where the MPI transport has one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
from conftest import THREADED, Fabric, barrier, counting_futures

import mate
from mate.machine import Input
from mate.schedule import Schedule, State
from mate.transports.base import Operation, Report, Transport
from mate.world import World

SLACK = 0.1  # SPEC §2: a timeout fires no later than 0.1 s + 10 % after its value
needs_progress_thread = pytest.mark.skipif(
    not THREADED, reason='handlers="progress" needs a progress thread (thread mode)')


@needs_progress_thread
async def test_a_timeout_fires_while_the_loop_computes(fabric: Fabric) -> None:
    """Point 3: with handlers in the progress thread, deadlines run on a timeout thread.

    The loop's thread is blocked in time.sleep(1): a 0.1 s receive timeout
    still fires its handler within 0.1 s + 10 %.
    """
    async def program(world: mate.World) -> None:
        fired: list[float] = []
        t0 = time.monotonic()
        msg = world.recv(bytearray(8), (world.mypid + 1) % world.numprocs, 51, timeout=0.1,
                         schedule=Schedule(timeout=lambda r, d: fired.append(time.monotonic())))
        time.sleep(1.0)  # the loop computes: it runs no timer, no callback
        assert fired, "the timeout did not fire while the loop was blocked"
        assert 0.1 <= fired[0] - t0 <= 0.1 + SLACK + 0.01, fired[0] - t0
        assert msg.state is State.TIMED_OUT
        await barrier(world)

    async with fabric.open(handlers="progress") as group:
        await group.run(program)


@needs_progress_thread
async def test_no_submission_wake_up_is_lost(fabric: Fabric) -> None:
    """Point 4: `await msg.submitted` returns at submission, not at completion.

    The awaiting task used to read the state without the world's lock, and then
    register: a submission reported in between (handlers="progress") found no
    awaiter to wake, and the task woke only at completion. A slow loop widens
    that gap here (every future the loop makes costs 1 ms), and completion
    comes seconds later (the receiver waits), so a lost wake-up is a timeout.
    """
    count, hold = 200, 4.0

    async def post_and_await_submission(world: mate.World) -> list[mate.Message]:
        loop = asyncio.get_running_loop()
        make = loop.create_future

        def slow_future() -> asyncio.Future[object]:
            time.sleep(0.001)  # the GIL is free: the progress thread runs meanwhile
            return make()

        loop.create_future = slow_future  # type: ignore[method-assign]
        sends = []
        try:
            for i in range(count):
                send = world.send(i.to_bytes(4, "little"), 1, tag=52, timeout=None)
                await asyncio.wait_for(send.submitted, hold / 2)  # type: ignore[arg-type]
                sends.append(send)
        finally:
            loop.create_future = make  # type: ignore[method-assign]
        return sends

    async def program(world: mate.World) -> None:
        if world.mypid == 0:
            await asyncio.gather(*await post_and_await_submission(world))
        elif world.mypid == 1:
            await asyncio.sleep(hold)
            for i in range(count):
                buffer = bytearray(4)
                await world.recv(buffer, 0, tag=52, timeout=10)
                assert int.from_bytes(buffer, "little") == i
        await barrier(world)

    async with fabric.open(handlers="progress") as group:
        await group.run(program, timeout=60)


class _Silent(Transport):
    """A wire that never reports by itself: the test reports for it."""

    def __init__(self) -> None:
        self.mypid, self.numprocs, self.tag_max = 0, 2, 100

    def post(self, op: Operation) -> None:
        pass

    def cancel(self, op: Operation) -> None:
        pass

    def expose(self, buffer: memoryview) -> mate.Region:
        return mate.Region(0, 0, 0)

    async def unexpose(self, region: mate.Region) -> None:
        pass

    async def shutdown(self) -> None:
        pass


async def test_reports_from_another_thread_hop_once_and_a_bad_one_fails_alone() -> None:
    """Points 2 and 5: a pass's reports, from a progress thread, reach the loop in one
    batch; a report that is a transport bug fails its own message with TRANSPORT, and
    the rest of the batch still applies."""
    loop = asyncio.get_running_loop()
    world = World(loop, default_timeout=1.0, handlers="loop")
    world.attach(_Silent())
    recv = world.recv(bytearray(4), 1, 3, timeout=None)
    send = world.send(b"abcd", 1, 3, timeout=None)
    hops = 0
    original = loop.call_soon_threadsafe

    def counting(*args: object, **kwargs: object) -> object:
        nonlocal hops
        hops += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        batch = [Report(Input.SUBMITTED, recv),  # a recv is never submitted: a bug
                 Report(Input.SUBMITTED, send),
                 Report(Input.COMPLETED, send, 4, 1, 3)]
        thread = threading.Thread(target=world.sink.report_all, args=(batch,))
        thread.start()
        thread.join()
        with pytest.raises(mate.MessageFailed) as failure:
            await asyncio.wait_for(recv, 5)
        assert failure.value.reason is mate.FailureReason.TRANSPORT
        assert isinstance(failure.value.__cause__, Exception)
        assert (await asyncio.wait_for(send, 5)).length == 4
    finally:
        loop.call_soon_threadsafe = original  # type: ignore[method-assign]
    assert hops == 1
    await world.shutdown()


class _EndsWhileAwaited(_Silent):
    """A wire whose awaiting task finds the message done, as a poll-mode pass run by
    that task would (`Transport.awaiting`)."""

    def awaiting(self, op: Operation, done: Callable[[], bool]) -> bool:
        assert not done()
        if op.op is mate.Op.SEND:
            self.sink.submitted(op)
        self.sink.completed(op, len(op.buffer), 1, 3)
        return False


async def test_a_message_that_ends_in_the_transport_s_awaiting_makes_no_future() -> None:
    """The transport hears of an awaiter before a future is made for it: what ends
    meanwhile is awaited with no future made, resolved and awaited (a ping-pong round
    took 57.9 k machine instructions with them, 54.8 k without, bench/self_instructions.py)."""
    loop = asyncio.get_running_loop()
    world = World(loop, default_timeout=1.0, handlers="loop")
    wire = _EndsWhileAwaited()
    wire.bind(world.sink)  # where an opener's transport reports from its start
    world.attach(wire)
    with counting_futures() as made:
        receipt = await world.recv(bytearray(4), 1, 3)
        assert receipt.length == 4 and receipt.remote_pid == 1
        send = world.send(b"abcd", 1, 3)
        submitted = await send.submitted  # type: ignore[misc]
        assert submitted.length == 4 and send.done()
        assert (await send).length == 4
    assert made() == 0
    await world.shutdown()


async def _awaiting(msg: mate.Message) -> mate.Receipt:
    return await msg


async def test_the_sink_counts_the_work_its_reports_give_the_loop() -> None:
    """What ends the passes a task runs itself (`Transport.awaiting`): a report that
    wakes an awaiter or queues a handler gives the loop work (`Sink.loop_work`); one
    that ends a message nobody awaits yet gives none, and the passes may go on."""
    loop = asyncio.get_running_loop()
    world = World(loop, default_timeout=1.0, handlers="loop")
    world.attach(_Silent())
    sink = world.sink
    before = sink.loop_work
    unawaited = world.recv(bytearray(4), 1, 3)
    sink.completed(unawaited, 4, 1, 3)
    assert unawaited.done() and sink.loop_work == before

    awaited = world.recv(bytearray(4), 1, 3)
    waiting = asyncio.ensure_future(_awaiting(awaited))
    await asyncio.sleep(0)  # the task now awaits it
    sink.completed(awaited, 4, 1, 3)
    assert sink.loop_work == before + 1
    assert (await waiting).length == 4

    handled: list[mate.Receipt] = []
    scheduled = world.recv(bytearray(4), 1, 3,
                           schedule=Schedule(completion=lambda r, d: handled.append(r)))
    sink.completed(scheduled, 4, 1, 3)
    assert sink.loop_work == before + 2 and not handled  # queued, not run yet
    await asyncio.sleep(0)
    assert handled == [scheduled.receipt]
    await world.shutdown()


class _TurnsWhileAwaited(_Silent):
    """A wire whose awaiting task's passes give the loop `turns` turns (as a poll-mode
    spin that reaches SLICE does, `Transport.awaiting`), then end the message; with
    `turns=None` they never end it."""

    def __init__(self, turns: int | None) -> None:
        super().__init__()
        self.turns, self.asked, self.cancelled = turns, 0, 0

    def awaiting(self, op: Operation, done: Callable[[], bool]) -> bool:
        self.asked += 1
        if self.turns is None or self.asked <= self.turns:
            return True
        if op.op is mate.Op.SEND:
            self.sink.submitted(op)
        self.sink.completed(op, len(op.buffer), 1, 3)
        return False

    def cancel(self, op: Operation) -> None:
        self.cancelled += 1
        self.sink.cancelled(op)


async def _counting_futures_and_turns(body: Callable[[], Awaitable[None]]) -> tuple[int, int]:
    """The futures made and the loop's turns (a task that yields in every turn) while
    `body` runs."""
    turns, running = 0, True

    async def turning() -> None:
        nonlocal turns
        while running:
            await asyncio.sleep(0)
            turns += 1

    turner = asyncio.ensure_future(turning())
    await asyncio.sleep(0)  # the turner runs from now on
    try:
        with counting_futures() as made:
            await body()
    finally:
        running = False
    await turner
    return made(), turns


async def test_an_awaiter_gives_the_loop_the_turns_its_transport_asks_and_makes_no_future() -> None:
    """A transport's awaiting passes that stop only for the loop to turn have the task
    yield one turn and ask again, with no future made, resolved and woken on: a 4 MiB
    message outlasts a poll-mode spin, and with a future the task woke a turn after the
    pass that ended its message. The awaits of a message and of a submission alike."""
    loop = asyncio.get_running_loop()
    world = World(loop, default_timeout=1.0, handlers="loop")
    wire = _TurnsWhileAwaited(turns=3)
    wire.bind(world.sink)
    world.attach(wire)
    results: list[int] = []

    async def body() -> None:
        results.append((await world.recv(bytearray(4), 1, 3)).length)
        wire.asked = 0
        send = world.send(b"abcd", 1, 3)
        results.append((await send.submitted).length)  # type: ignore[misc]
        results.append((await send).length)

    made, turns = await asyncio.wait_for(_counting_futures_and_turns(body), 5.0)
    assert results == [4, 4, 4] and made == 0
    assert wire.asked == 4  # three turns, then the send ended: its completion needs no ask
    assert turns >= 6, turns  # three turns for each of the two awaits that asked
    await world.shutdown()


async def test_a_task_cancelled_at_a_turn_its_transport_asked_cancels_its_message() -> None:
    """As a task cancelled while it waits on its future: the message is cancelled."""
    loop = asyncio.get_running_loop()
    world = World(loop, default_timeout=1.0, handlers="loop")
    wire = _TurnsWhileAwaited(turns=None)
    wire.bind(world.sink)
    world.attach(wire)
    msg = world.recv(bytearray(4), 1, 3, timeout=None)
    waiter = asyncio.ensure_future(_await(msg))
    for _ in range(100):
        await asyncio.sleep(0)
    assert wire.asked >= 50, wire.asked  # asked again after every turn
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert wire.cancelled == 1 and msg.state is State.CANCELLED
    await world.shutdown()


async def _await(msg: mate.Message) -> mate.Receipt:
    return await msg


class _SubmitsWhileAwaited(_Silent):
    """A wire whose awaiting task sees a send submitted, and notes what `done()` said."""

    def __init__(self) -> None:
        super().__init__()
        self.said: list[bool] = []

    def awaiting(self, op: Operation, done: Callable[[], bool]) -> bool:
        before = done()
        if not op.submitted_seen:  # type: ignore[attr-defined]
            self.sink.submitted(op)
        self.said += [before, done()]
        return False


async def test_the_awaiter_of_a_submission_is_done_at_the_submission() -> None:
    """`done()` as the transport hears it is the awaiter's: submitted, for a task
    that awaits the submission (its passes need not run to the completion)."""
    loop = asyncio.get_running_loop()
    world = World(loop, default_timeout=1.0, handlers="loop")
    wire = _SubmitsWhileAwaited()
    wire.bind(world.sink)
    world.attach(wire)
    send = world.send(b"abcd", 1, 3)
    await send.submitted  # type: ignore[misc]
    assert wire.said == [False, True]
    waiting = asyncio.ensure_future(_awaiting(send))
    await asyncio.sleep(0)
    assert wire.said == [False, True, False, False]  # awaiting the completion
    world.sink.completed(send, 4, 1, 3)
    assert (await waiting).length == 4
    await world.shutdown()


async def test_with_handlers_on_the_loop_a_message_takes_no_lock() -> None:
    """Issue 11, point 3: no cross-thread lock when everything runs on the loop's
    thread. Another thread holds the ledger's lock while a message is posted, awaited,
    reported and woken on the loop; had any of these taken the lock, the loop would
    have stopped until the holder gave up."""
    loop = asyncio.get_running_loop()
    world = World(loop, default_timeout=1.0, handlers="loop")
    world.attach(_Silent())
    held, done = threading.Event(), threading.Event()
    gave_up = False

    def hold() -> None:
        nonlocal gave_up
        with world.sink._lock:  # type: ignore[attr-defined]
            held.set()
            gave_up = not done.wait(2.0)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        recv = world.recv(bytearray(4), 1, 3)
        loop.call_soon(world.sink.report_all, [Report(Input.COMPLETED, recv, 4, 1, 3)])
        assert (await recv).length == 4
        recv = world.recv(bytearray(4), 1, 3)
        recv.cancel()
        world.sink.cancelled(recv)  # the transport's confirmation
    finally:
        done.set()
        holder.join()
    assert not gave_up
    assert recv.state is State.CANCELLED
    await world.shutdown()


class _SlowToPost(_Silent):
    """A threaded wire that takes a while to post, and can stop only what it was given."""

    supports_progress_handlers = True

    def __init__(self) -> None:
        super().__init__()
        self.posted: set[Operation] = set()
        self.unknown_cancels = 0

    def post(self, op: Operation) -> None:
        time.sleep(0.05)  # long enough for a zero timeout to fire meanwhile
        self.posted.add(op)

    def cancel(self, op: Operation) -> None:
        if op not in self.posted:  # as MPI's transport finds no request yet: nothing to stop
            self.unknown_cancels += 1
            return
        self.sink.cancelled(op)


async def test_a_deadline_is_armed_only_once_the_transport_has_the_message() -> None:
    """Found by the soak run (issue 12): with handlers="progress" the timeout thread
    expired a zero-timeout receive before `transport.post` had run, the transport was
    asked to cancel what it did not have, and the receive never ended (MPI and ibverbs
    in thread mode). The deadline is armed after the post: the cancel comes after it."""
    world = World(asyncio.get_running_loop(), default_timeout=1.0, handlers="progress")
    wire = _SlowToPost()
    wire.bind(world.sink)
    world.attach(wire)
    try:
        recv = world.recv(bytearray(4), 1, 3, timeout=0.0)
        with pytest.raises(mate.MessageTimeout):
            await asyncio.wait_for(recv, 2)
        assert wire.unknown_cancels == 0
    finally:
        await world.shutdown()
