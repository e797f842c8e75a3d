"""MPI-specific behaviour, run on real ranks by tests/test_mpi.py (skipped elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from conftest import LAUNCH_OPTIONS, LAUNCHED, THREADED, Fabric, barrier, counting_futures

import mate

pytestmark = pytest.mark.skipif(LAUNCHED != "mpi", reason="runs under mpiexec (test_mpi.py)")

EAGER = 1024
# The tests of an awaiting task's own passes (`await_spin`): poll and thread mode.
awaiting_task_passes = pytest.mark.skipif(
    LAUNCH_OPTIONS.get("progress") not in ("poll", "thread"),
    reason="an awaiting task's passes (poll and thread mode)")


@contextlib.asynccontextmanager
async def counting_wake_ups(pause: float = 0.0) -> AsyncIterator[Callable[[], int]]:
    """Count meanwhile the wake-ups of a task that sleeps `pause` s at a time: with no
    pause, the event loop's turns (the task yields in every turn)."""
    wake_ups, done = 0, False

    async def count() -> None:
        nonlocal wake_ups
        while not done:
            wake_ups += 1
            await asyncio.sleep(pause)

    counter = asyncio.ensure_future(count())
    try:
        yield lambda: wake_ups
    finally:
        done = True
        await counter


def compute(seconds: float) -> None:
    """Keep the calling thread (the loop's) busy for `seconds`, never yielding."""
    busy_until = time.monotonic() + seconds
    while time.monotonic() < busy_until:
        sum(range(1000))


async def fewest_turns(attempt: Callable[[], Awaitable[None]], attempts: int = 10) -> int:
    """The fewest turns of the event loop that `attempt` took in `attempts` runs. A
    spin is bounded in time, so a host that takes a rank's core away (another job on
    these 2 cores) makes it give up whatever mate does: one quiet run must show it.
    (Three runs were too few with three busy processes beside the ranks; a run of
    200 round trips takes some milliseconds.)"""
    fewest = sys.maxsize
    for _ in range(attempts):
        async with counting_wake_ups() as turns:
            await attempt()
        fewest = min(fewest, turns())
    return fewest


async def round_trip(world: mate.World, out: bytearray, into: bytearray, tag: int) -> None:
    """One round of a ping-pong between ranks 0 and 1: rank 0 sends `out` and receives
    the answer into `into`, rank 1 receives into `into` and answers with `out`."""
    peer = 1 - world.mypid
    if world.mypid == 0:
        reply = world.recv(into, peer, tag=tag)
        await world.send(out, peer, tag=tag)
        await reply
    else:
        await world.recv(into, peer, tag=tag)
        await world.send(out, peer, tag=tag)


async def test_send_completes_only_after_the_receiver_matched(fabric: Fabric) -> None:
    async def program(world: mate.World) -> None:
        for size in (EAGER, EAGER + 1):  # an eager send and one sent from the user's buffer
            if world.mypid == 0:
                msg = world.send(bytes(size), 1, tag=1)
                await asyncio.sleep(0.2)
                world.progress()  # manual mode: the submission is reported by a pass
                assert not msg.done()
                # Within eager_size the data was copied: submitted, but not completed.
                expected = mate.State.SUBMITTED if size <= EAGER else mate.State.POSTED
                assert msg.state is expected
                await world.send(b"go", 1, tag=2)
                receipt = await msg
                assert receipt.length == size
            elif world.mypid == 1:
                await world.recv(bytearray(2), 0, tag=2)
                buf = bytearray(size)
                receipt = await world.recv(buf, 0, tag=1)
                assert receipt.length == size
            await barrier(world)

    async with fabric.open(eager_size=EAGER) as group:
        await group.run(program)


async def test_many_outstanding_puts_all_land(fabric: Fabric) -> None:
    count, chunk = 500, 1024

    async def program(world: mate.World) -> None:
        if world.mypid == 1:
            memory = bytearray(count * chunk)
            region = world.expose(memory)
            await world.send(region.address.to_bytes(8, "little"), 0, tag=3)
            await world.recv(bytearray(1), 0, tag=4)
            for i in range(count):
                assert memory[i * chunk:(i + 1) * chunk] == bytes([i % 251]) * chunk, i
            await world.unexpose(region)
        elif world.mypid == 0:
            raw = bytearray(8)
            await world.recv(raw, 1, tag=3)
            base = int.from_bytes(raw, "little")
            order: list[tuple[int, str]] = []
            schedule = mate.Schedule(
                submission=lambda r, i: order.append((i, "s")),
                completion=lambda r, i: order.append((i, "c")))
            puts = []
            for i in range(count):
                data = bytes([i % 251]) * chunk
                sched = mate.Schedule(submission=schedule.submission, submission_data=i,
                                      completion=schedule.completion, completion_data=i)
                puts.append(world.put(data, 1, base + i * chunk, schedule=sched))
            receipts = await asyncio.gather(*puts)
            assert all(r.event is mate.Event.COMPLETION for r in receipts)
            await asyncio.sleep(0.05)  # let the last handlers run
            seen: dict[int, list[str]] = {}
            for i, what in order:
                seen.setdefault(i, []).append(what)
            assert all(seen[i] == ["s", "c"] for i in range(count))
            await world.send(b"!", 1, tag=4)
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


async def test_mpi_errors_become_failure_events(fabric: Fabric) -> None:
    from mpi4py import MPI

    async def program(world: mate.World) -> None:
        if world.mypid == 0:
            await world.send(bytes(100), 1, tag=5)
        elif world.mypid == 1:
            msg = world.recv(bytearray(10), 0, tag=5)
            with pytest.raises(mate.MessageFailed) as info:
                await msg
            assert info.value.reason is mate.FailureReason.TRUNCATED
            assert isinstance(info.value.__cause__, MPI.Exception)
            assert msg.receipt.length == 10 and msg.receipt.remote_pid == 0
            # An MPI call that fails (an invalid rank slipped past the checks) is a
            # failure event with the MPI error chained, not an exception or an abort.
            from mate.message import Message
            from mate.schedule import Op, Schedule

            bad = Message(world._ledger, Op.SEND, memoryview(b"x"), world.numprocs + 5, 0, 0,
                          Schedule())
            world._ledger.post(bad)  # as World.send would, without its checks
            with pytest.raises(mate.MessageFailed) as info:
                await bad
            assert info.value.reason is mate.FailureReason.TRANSPORT
            assert isinstance(info.value.__cause__, MPI.Exception)
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


async def test_progress_handlers_answer_while_the_loop_computes(fabric: Fabric) -> None:
    if fabric.size < 2:
        pytest.skip("needs two ranks")

    async def program(world: mate.World) -> None:
        if world.mypid == 1:
            request = bytearray(8)
            answered = []

            def answer(receipt: mate.Receipt, data: None) -> None:
                world.send(bytes(request), 0, tag=7)
                answered.append(time.monotonic())
                if len(answered) < 5:
                    world.recv(request, 0, tag=6, schedule=server)

            server = mate.Schedule(completion=answer)
            world.recv(request, 0, tag=6, schedule=server)
            await world.send(b"ready", 0, tag=8)
            compute(1.5)  # the loop's thread computes, never yields
            assert len(answered) == 5, "requests were not answered while the loop was busy"
        elif world.mypid == 0:
            await world.recv(bytearray(5), 1, tag=8)
            latencies = []
            for i in range(5):
                reply = bytearray(8)
                r = world.recv(reply, 1, tag=7)
                start = time.monotonic()
                world.send(i.to_bytes(8, "little"), 1, tag=6)
                await r
                latencies.append(time.monotonic() - start)
                assert int.from_bytes(reply, "little") == i
            assert max(latencies) < 0.5, latencies
        await barrier(world)

    async with fabric.open(progress="thread", handlers="progress") as group:
        await group.run(program)


async def test_the_progress_thread_takes_over_from_a_loop_that_stops_helping(
        fabric: Fabric) -> None:
    """Thread mode, handlers on the loop: while a task awaits, the loop runs the passes
    and the progress thread stands back. When the loop then computes without yielding,
    the thread must take over: rank 0's synchronous send completes only once rank 1's
    MPI library has matched it, which happens only in a pass."""
    if fabric.size < 2:
        pytest.skip("needs two ranks")

    async def program(world: mate.World) -> None:
        if world.mypid == 1:
            inbox = bytearray(8)
            recv = world.recv(inbox, 0, tag=6)
            for _ in range(20):  # the loop helps now: it ran the passes of these awaits
                await world.send(b"ready", 0, tag=8)
            compute(1.0)  # the loop's thread computes, never yields
            receipt = await recv
            assert bytes(inbox) == b"matched!" and receipt.length == 8
        elif world.mypid == 0:
            for _ in range(20):
                await world.recv(bytearray(5), 1, tag=8)
            start = time.monotonic()
            await world.send(b"matched!", 1, tag=6)
            assert time.monotonic() - start < 0.5, "rank 1 made no progress while computing"
        await barrier(world)

    async with fabric.open(progress="thread", handlers="loop") as group:
        await group.run(program)


async def test_a_large_receive_reaches_mpi_at_once_while_the_loop_runs_the_passes(
        fabric: Fabric) -> None:
    """Thread mode, handlers on the loop (`MpiTransport._post_recv`): while a task
    awaits, the loop runs the passes and the progress thread stands back, so no pass
    runs between the program's calls and a large receive reaches MPI at once, as in
    poll mode (holding it back for the next send cost a 64 KiB pingping a fifth of its
    speed). After the program computed, it is held back (the tests below)."""
    if fabric.size < 2:
        pytest.skip("needs two ranks")
    from mate.transports.mpi.progress import TRANSFER_SIZE

    async def program(world: mate.World) -> None:
        if world.mypid < 2:
            peer, transport = 1 - world.mypid, world.transport
            out, into = bytes(range(256)) * (TRANSFER_SIZE // 256), bytearray(TRANSFER_SIZE)
            at_once = 0
            for _ in range(10):  # the loop runs the passes of these awaits
                r = world.recv(into, peer, tag=31)
                at_once += not transport._deferred  # type: ignore[attr-defined]
                await world.send(out, peer, tag=31)
                assert (await r).length == TRANSFER_SIZE and into == out
            # (Not every time: a host that takes the core away between an await and the
            # next post may let the thread run a pass.)
            assert at_once > 0
        await barrier(world)

    async with fabric.open(progress="thread", handlers="loop") as group:
        await group.run(program)


async def test_shutdown_does_not_wait_for_a_peer_that_went_away(fabric: Fabric) -> None:
    # Rank 1 leaves at once and gives up meeting the others after 0.3 s; the others
    # shut down much later, with messages to and from rank 1 still outstanding.
    async def program(world: mate.World) -> None:
        if world.mypid == 1:
            start = time.monotonic()
            await world.shutdown()
            assert time.monotonic() - start < 2.0
            return
        recv = world.recv(bytearray(8), 1, tag=20)
        send = world.send(bytes(100_000), 1, tag=21)
        await asyncio.sleep(1.0)
        start = time.monotonic()
        await world.shutdown()
        assert time.monotonic() - start < 2.0
        for msg in (recv, send):
            assert msg.state is mate.State.CANCELLED

    async with fabric.open(shutdown_timeout=0.3) as group:
        await group.run(program)


async def test_unexpose_survives_a_revoke_ack_that_comes_back_at_once(
        fabric: Fabric, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the soak run (issue 12): with native RMA in thread mode, the progress
    thread took the peer's RevokeAck out of the very set that unexpose was still looping
    over to send its Revokes, and unexpose raised RuntimeError. Here the control channel
    sleeps after sending a Revoke (releasing the GIL), so the ack is back every time."""
    from mate.transports.mpi import control

    send = control.ControlChannel.send

    def slow(self: control.ControlChannel, dest: int, message: control.Control,
             tag: int = control.CONTROL_TAG) -> None:
        send(self, dest, message, tag)
        if isinstance(message, control.Revoke):
            time.sleep(0.02)

    monkeypatch.setattr(control.ControlChannel, "send", slow)

    async def program(world: mate.World) -> None:
        for _ in range(3):
            if world.mypid == 1:
                region = world.expose(bytearray(64))
                await world.send(region.address.to_bytes(8, "little"), 0, tag=5)
                await world.recv(bytearray(1), 0, tag=6)  # rank 0 holds the region table
                await world.unexpose(region)
            elif world.mypid == 0:
                raw = bytearray(8)
                await world.recv(raw, 1, tag=5)
                await world.put(b"abcd", 1, int.from_bytes(raw, "little"))
                await world.send(b"x", 1, tag=6)
            await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


@pytest.mark.parametrize("timeout", [None, 5.0])  # on the user's buffer, and on a copy
async def test_auto_rma_moves_small_transfers_natively_and_large_ones_two_sided(
        fabric: Fabric, timeout: float | None) -> None:
    """rma="auto" (the default): below rma_threshold put and get are MPI-3 RMA, from
    it on the two-sided protocol; one region serves both, and unexpose ends both."""
    threshold = 4096

    async def program(world: mate.World) -> None:
        memory = bytearray(3 * threshold)
        region = world.expose(memory) if world.mypid == 1 else None
        raw = bytearray(8)
        if world.mypid == 1:
            assert region is not None
            await world.send(region.address.to_bytes(8, "little"), 0, tag=5)
        elif world.mypid == 0:
            await world.recv(raw, 1, tag=5)
        before = world.stats()
        if world.mypid == 0:
            base = int.from_bytes(raw, "little")
            for size, at in ((threshold - 1, 0), (threshold, threshold)):
                data = bytes((size + i) % 251 for i in range(size))
                await world.put(data, 1, base + at, timeout=timeout)
                back = bytearray(size)
                await world.get(back, 1, base + at, timeout=timeout)
                assert back == data
            outside = world.put(bytes(threshold), 1, base + 2 * threshold + 1, timeout=timeout)
            with pytest.raises(mate.MessageFailed) as failed:
                await outside
            assert failed.value.reason is mate.FailureReason.REMOTE_ACCESS
            after = world.stats()
            assert after["rma_native_ops"] - before["rma_native_ops"] == 2
            assert after["rma_emulated_ops"] - before["rma_emulated_ops"] == 3
        await barrier(world)
        if region is not None:
            await world.unexpose(region)
            assert memory[threshold:threshold + 4] == bytes(
                (threshold + i) % 251 for i in range(4))
        await barrier(world)

    async with fabric.open(rma="auto", rma_threshold=threshold) as group:
        await group.run(program)


async def test_refused_emulated_gets_posted_in_bursts_all_fail_none_times_out(
        fabric: Fabric) -> None:
    """An emulated get outside the target's regions is refused, and the origin then
    cancels the get's receive. In thread mode that receive may still wait in the
    engine's inbox when the refusal comes: such a cancel was lost, and 1.1-1.4 % of
    the gets here timed out instead of failing (Engine.cancel)."""
    bursts, burst = 20, 50

    async def program(world: mate.World) -> None:
        memory = bytearray(64)
        region = world.expose(memory)
        word = bytearray(8)
        if world.mypid <= 1:
            peer = 1 - world.mypid
            incoming = world.recv(word, peer, tag=27)
            await world.send(region.address.to_bytes(8, "little"), peer, tag=27)
            await incoming
            outside = int.from_bytes(word, "little") - 1
            for _ in range(bursts):
                gets = [world.get(bytearray(8), peer, outside, timeout=0.5)
                        for _ in range(burst)]
                outcomes = await asyncio.gather(*gets, return_exceptions=True)
                reasons = {getattr(o, "reason", type(o).__name__) for o in outcomes}
                assert reasons == {mate.FailureReason.REMOTE_ACCESS}, reasons
        await barrier(world)
        await world.unexpose(region)

    async with fabric.open(rma="emulated") as group:
        await group.run(program)


async def exchange_address(world: mate.World, region: mate.Region | None) -> int:
    """Rank 1 tells rank 0 where `region` (its own) is; rank 0's answer, 0 elsewhere."""
    raw = bytearray(8)
    if region is not None:
        await world.send(region.address.to_bytes(8, "little"), 0, tag=5)
    elif world.mypid == 0:
        await world.recv(raw, 1, tag=5)
    await barrier(world)
    return int.from_bytes(raw, "little")


async def test_a_large_native_put_or_get_tells_its_target_to_poll(fabric: Fabric) -> None:
    """A passive target sees no sign of a native put or get, yet MPICH moves a large one
    only inside the target's MPI calls: the origin nudges the target as it issues an
    operation of TRANSFER_SIZE bytes or more, never for a smaller one, and not again
    while its last nudge has the target poking for half the operation's hold still
    (`test_mpi_engine.py` checks the rule on its own). (One still under way SPIN
    later nudges again, late: a loaded host may take that long.)"""
    from mate.transports.mpi.progress import TRANSFER_SIZE, transfer_hold

    async def program(world: mate.World) -> None:
        memory = bytearray(2 * TRANSFER_SIZE)
        region = world.expose(memory) if world.mypid == 1 else None
        base = await exchange_address(world, region)
        before = world.stats()

        def on_time_nudges() -> int:
            stats = world.stats()
            return (stats["nudges_sent"] - before["nudges_sent"]
                    - (stats["nudges_late"] - before["nudges_late"]))

        if world.mypid == 0:
            data = bytes(i % 253 for i in range(TRANSFER_SIZE))
            await world.put(data[:-1], 1, base)  # one byte short: no nudge
            assert on_time_nudges() == 0
            window = transfer_hold(TRANSFER_SIZE) / 2
            before_put = time.monotonic()
            await world.put(data, 1, base + TRANSFER_SIZE)
            assert on_time_nudges() == 1
            back = bytearray(TRANSFER_SIZE)
            await world.get(back, 1, base + TRANSFER_SIZE)
            after_get = time.monotonic()
            assert back == data
            sent = on_time_nudges()
            if after_get < before_put + window:  # the target pokes still: no nudge
                assert sent == 1
            else:  # a loaded host: the put, or the get's start, took that long
                assert sent in (1, 2)
            # Any nudge so far went before after_get: past its half hold, the next nudges.
            await asyncio.sleep(after_get + window + 0.001 - time.monotonic())
            await world.get(back, 1, base + TRANSFER_SIZE)
            assert on_time_nudges() == sent + 1
        await barrier(world)
        if region is not None:
            assert world.stats()["nudges_received"] - before["nudges_received"] >= 2
            await world.unexpose(region)
        await barrier(world)

    async with fabric.open(rma="native") as group:
        await group.run(program)


async def idle_for(world: mate.World, seconds: float) -> None:
    """Let `seconds` pass with passes running in every mode (manual mode's by hand)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        world.progress()
        await asyncio.sleep(0.001)


async def test_a_rank_whose_memory_peers_stopped_using_lets_its_core_rest(
        fabric: Fabric) -> None:
    """A target does not back off while a peer holds a lease on its memory (MPICH moves
    a native put or get only inside the target's MPI calls), and the peer lets the
    lease go LINGER after its last operation there: waiting half a second after a
    peer's put costs the target a small share of a core, not all of it (it used to
    poll for good once a peer had looked its memory up, in every progress mode)."""
    async def program(world: mate.World) -> None:
        region = world.expose(bytearray(64)) if world.mypid == 1 else None
        base = await exchange_address(world, region)
        before = world.stats()
        if world.mypid == 0:
            await world.put(b"12345678", 1, base)
            await idle_for(world, 0.5)
            await world.send(b"", 1, tag=6)
            stats = world.stats()
            assert (stats["rma_leases_taken"] - before["rma_leases_taken"],
                    stats["rma_leases_released"] - before["rma_leases_released"]) == (1, 1)
        elif region is not None:
            cpu, start = time.process_time(), time.monotonic()
            await world.recv(bytearray(0), 0, tag=6, timeout=10)
            share = (time.process_time() - cpu) / (time.monotonic() - start)
            assert world.stats()["rma_lessees"] == 0
            assert share < 0.4, f"{share:.0%} of a core while waiting"
        await barrier(world)
        if region is not None:
            await world.unexpose(region)

    async with fabric.open(rma="auto") as group:
        await group.run(program)


async def test_a_stream_of_native_operations_takes_one_lease_and_a_lull_ends_it(
        fabric: Fabric) -> None:
    """Operations that follow each other closer than LINGER share one lease on their
    target's memory; one after a lull takes a new lease (see rma_native, leases)."""
    from mate.transports.mpi.rma_native import LINGER

    async def program(world: mate.World) -> None:
        region = world.expose(bytearray(4096)) if world.mypid == 1 else None
        base = await exchange_address(world, region)
        if world.mypid == 0:
            before = world.stats()

            def leases() -> tuple[int, int]:
                stats = world.stats()
                return (stats["rma_leases_taken"] - before["rma_leases_taken"],
                        stats["rma_leases_released"] - before["rma_leases_released"])

            back = bytearray(8)
            for i in range(50):
                await world.put(i.to_bytes(8, "little"), 1, base + 8 * i)
                await world.get(back, 1, base + 8 * i)
                assert int.from_bytes(back, "little") == i
            if leases() != (1, 0):  # else this rank lost its core for LINGER meanwhile
                assert leases()[0] > 1
            await idle_for(world, 20 * LINGER)
            assert leases()[0] == leases()[1]  # let go
            taken = leases()[0]
            await world.put(b"12345678", 1, base)
            assert leases()[0] == taken + 1
        await barrier(world)
        if region is not None:
            await world.unexpose(region)

    async with fabric.open(rma="native") as group:
        await group.run(program)


async def test_an_answer_left_by_a_closed_world_never_reaches_the_next(fabric: Fabric) -> None:
    """Found with rma="auto" (issue 11): MPICH gives a freed communicator's context
    id to the next one, so an answer that arrived after its asker shut down (a put's
    last `Reply`, say) stayed queued and matched the next world's first private tag:
    that world's first put read it as its clearance and sent its data to tag 0. Each
    world's private tags now carry on from the last world's."""
    from mate.transports.mpi.control import Reply

    size = 64 * 1024  # above CONTROL_EAGER: the rendezvous put, which waits for a Reply
    async with fabric.open(rma="emulated") as group:
        async def leave_an_answer(world: mate.World) -> None:
            control = world._open().control  # type: ignore[attr-defined]
            if world.mypid == 0:
                # a tag asked on and given up (as a shutdown gives up a put's reply)
                await world.send(control.new_tag().to_bytes(4, "little"), 1, tag=1)
            elif world.mypid == 1:
                raw = bytearray(4)
                await world.recv(raw, 0, tag=1)
                control.send(0, Reply(True), int.from_bytes(raw, "little"))
            await barrier(world)

        await group.run(leave_an_answer)

    async with fabric.open(rma="emulated") as group:
        async def put(world: mate.World) -> None:
            memory = bytearray(size)
            region = world.expose(memory)
            raw = bytearray(8)
            if world.mypid == 1:
                await world.send(region.address.to_bytes(8, "little"), 0, tag=2)
            elif world.mypid == 0:
                await world.recv(raw, 1, tag=2)
                await world.put(b"\x5a" * size, 1, int.from_bytes(raw, "little"), timeout=5)
            await barrier(world)
            if world.mypid == 1:
                assert memory == b"\x5a" * size
            await world.unexpose(region)

        await group.run(put)


@pytest.mark.skipif(THREADED, reason="a progress thread serves the requests while the loop sleeps")
@pytest.mark.parametrize("rma", ["emulated", "auto"])
async def test_unexpose_lets_go_of_what_an_origin_gone_away_abandoned(
        fabric: Fabric, rma: str) -> None:
    """An origin whose put and get timed out at a busy target shuts down before the
    target answered them. The target, once awake, clears the put (a receive into the
    region) and sends the get's data (a send out of it); the origin's shutdown cancelled
    both of its receives and said so (`Abandon`), so the target's unexpose returns at
    once instead of holding the region for ever, and nothing landed in it."""
    size = 64 * 1024  # two-sided rendezvous both ways, under auto as well

    async def program(world: mate.World) -> None:
        if world.mypid == 1:
            memory = bytearray(size)
            region = world.expose(memory)
            await world.send(region.address.to_bytes(8, "little"), 0, tag=1)
            time.sleep(1.0)  # busy: rank 0 times out and shuts down meanwhile
            await asyncio.sleep(0.3)  # now serve its requests (and its Abandons)
            await asyncio.wait_for(world.unexpose(region), 3.0)
            assert memory == bytes(size)
        elif world.mypid == 0:
            raw = bytearray(8)
            await world.recv(raw, 1, tag=1)
            address = int.from_bytes(raw, "little")
            put = world.put(b"\x44" * size, 1, address, timeout=0.1)
            get = world.get(bytearray(size), 1, address, timeout=0.1)
            for msg in (put, get):
                with pytest.raises(mate.MessageTimeout):
                    await msg

    async with fabric.open(rma=rma) as group:
        await group.run(program)


async def test_a_message_a_closed_world_left_unreceived_never_reaches_the_next(
        fabric: Fabric) -> None:
    """The user's side of the stale-answer defect above. There the answer was sent
    after its asker had freed the communicator, and matched the next world's, which
    had the same context id. A user message is always posted before its sender's
    shutdown, which the receiver waits for before freeing: one that timed out
    unreceived must then go with the communicator, not reach the next world's
    receive on the same source and tag."""
    async with fabric.open() as group:
        async def leave_a_message(world: mate.World) -> None:
            if world.mypid == 0:
                with pytest.raises(mate.MessageTimeout):
                    await world.send(b"stale", 1, tag=7, timeout=0.1)
            await barrier(world)

        await group.run(leave_a_message)

    async with fabric.open() as group:
        async def receive_nothing(world: mate.World) -> None:
            if world.mypid == 1:
                with pytest.raises(mate.MessageTimeout):
                    await world.recv(bytearray(8), 0, tag=7, timeout=0.3)
            await barrier(world)

        await group.run(receive_nothing)


async def leave_rank_0_waiting(world: mate.World) -> bool:
    """Every rank but 0 shuts down, rank 1 0.2 s late, so that rank 0's shutdown waits
    at the first meeting meanwhile; True on rank 0, which is left to shut down."""
    if world.mypid == 0:
        return True
    if world.mypid == 1:
        await asyncio.sleep(0.2)
    await world.shutdown()
    return False


async def test_a_shutting_down_rank_nudges_no_peer(fabric: Fabric) -> None:
    """Found by the conformance suite and this module run in one process (issue 11):
    a large send that cannot be abandoned stays a transfer through shutdown, and its
    rank nudged the peer on and on while it waited at the meetings, so a nudge could
    come after the peer had freed its communicators. MPI keeps such a message queued
    and gives the freed context id to a later communicator: a later world's receive
    on tag 1 (the control channel's) took it. Shutdown now sends no nudge."""
    from mate.transports.mpi.progress import TRANSFER_SIZE

    async def program(world: mate.World) -> None:
        if not await leave_rank_0_waiting(world):
            return
        transport = world._open()  # type: ignore[attr-defined]
        world.send(bytes(4 * TRANSFER_SIZE), 1, tag=30)  # never received, never abandoned
        await asyncio.sleep(0.01)
        sent = transport.stats()["nudges_sent"]
        await world.shutdown()
        assert transport.stats()["nudges_sent"] == sent

    async with fabric.open() as group:
        await group.run(program)


async def test_a_rank_between_its_meetings_sends_no_control_message(fabric: Fabric) -> None:
    """Once the ranks met the first time at shutdown, every operation has ended and no
    peer needs a control message; after the second meeting a peer frees its control
    communicator, and what reaches it then stays queued in MPI for a later
    communicator given the same context id. So the control channel closes between
    the meetings: here rank 0's passes send an `Abandon` (for a tag rank 1 never
    served: it ignores it) in every pass through its shutdown, and those after the
    close are dropped, none sent."""
    from mate.transports.mpi.control import FIRST_PRIVATE_TAG, Abandon

    async def program(world: mate.World) -> None:
        if not await leave_rank_0_waiting(world):
            return
        transport = world._open()  # type: ignore[attr-defined]
        engine, control = transport.engine, transport.control
        ticks = {False: 0, True: 0}  # by whether the channel was closed

        def tick() -> None:  # progress context
            ticks[control.closed] += 1
            control.send(1, Abandon(FIRST_PRIVATE_TAG))
            engine.call_later(0.0, tick)

        engine.call(lambda: engine.call_later(0.0, tick))
        await world.shutdown()
        assert ticks[False] >= 1 and ticks[True] >= 1, ticks
        assert control.dropped == ticks[True]

    async with fabric.open(rma="emulated") as group:
        await group.run(program)


async def send_window(world: mate.World, window: int, ready_tag: int, tag: int) -> None:
    """Rank 0: once rank 1 says its receives are posted, send it `window` one-byte
    messages, numbered, and await them."""
    await world.recv(bytearray(0), 1, tag=ready_tag)
    for message in [world.send(bytes([i]), 1, tag=tag) for i in range(window)]:
        await message


def receive_window(world: mate.World, window: int, tag: int
                   ) -> tuple[list[bytearray], list[mate.Message]]:
    """Rank 1: `window` one-byte receives from rank 0, posted; their buffers and messages."""
    buffers = [bytearray(1) for _ in range(window)]
    return buffers, [world.recv(b, 0, tag=tag) for b in buffers]


@pytest.mark.skipif(LAUNCH_OPTIONS.get("progress") != "poll", reason="poll mode's passes")
async def test_a_window_of_messages_completes_in_a_few_loop_callbacks(fabric: Fabric) -> None:
    """Poll mode tests again while passes move. MPICH takes in one message per call, so
    a window of receives whose messages arrive together completes over as many passes:
    they run in a few loop callbacks, not one loop iteration each (counted by a task
    that yields in every iteration)."""
    window, attempts = 64, 3

    async def program(world: mate.World) -> None:
        if world.mypid == 0:
            for _ in range(attempts):
                await send_window(world, window, 22, 21)
        elif world.mypid == 1:

            async def attempt() -> None:
                buffers, receives = receive_window(world, window, 21)
                await world.send(b"", 0, tag=22)
                await asyncio.gather(*receives)
                assert [b[0] for b in buffers] == list(range(window))

            turns = await fewest_turns(attempt, attempts)
            assert turns <= window // 4, turns
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


@pytest.mark.skipif(LAUNCH_OPTIONS.get("progress") != "poll", reason="poll mode's passes")
async def test_a_window_of_arrived_messages_is_taken_in_by_few_passes(fabric: Fabric) -> None:
    """MPICH takes in one message per call, and a pass makes one call (its Testsome):
    while messages flow, a pass first makes a bare progress call for every request of
    the front but one, so that it finds as many completions as the front holds. 64
    receives whose messages have all arrived took 59 passes here without those calls,
    and 10-11 with them."""
    window = 64

    async def program(world: mate.World) -> None:
        if world.mypid == 0:
            await send_window(world, window, 24, 25)
        elif world.mypid == 1:
            buffers, receives = receive_window(world, window, 25)
            await world.send(b"", 0, tag=24)
            time.sleep(0.05)  # no pass meanwhile: rank 0's sends all arrive
            engine = world.transport.engine  # type: ignore[attr-defined]
            before = engine.passes
            for message in receives:
                await message
            assert [b[0] for b in buffers] == list(range(window))
            assert engine.passes - before <= window // 4, engine.passes - before
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


@awaiting_task_passes
async def test_a_ping_pong_awaited_while_passes_spin_needs_few_turns_of_the_loop(
        fabric: Fabric) -> None:
    """A task that awaits a message runs passes itself for a while (`await_spin`): a
    reply that comes meanwhile is awaited with no turn of the loop. Awaited through the
    loop, each of the 200 rounds costs at least two turns on each rank (404 and 800
    counted here; 517 in thread mode); with the spin, 14-24 in most runs, 155 on a busy
    host, and up to 557 with two busy loops beside the ranks (so the best of several
    runs counts)."""
    rounds = 200

    async def program(world: mate.World) -> None:
        await barrier(world)
        if world.mypid <= 1:
            buf = bytearray(8)

            async def attempt() -> None:
                for _ in range(rounds):
                    await round_trip(world, buf, buf, 23)

            turns = await fewest_turns(attempt)
            assert turns < rounds, turns
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


@awaiting_task_passes
async def test_a_ping_ping_awaited_while_passes_spin_needs_few_turns_of_the_loop(
        fabric: Fabric) -> None:
    """Each rank posts its receive, then awaits its send and then the receive: the
    receive usually ends first, while the task spins for the send. Nobody awaits it
    yet, so it gives the loop no work and the spin goes on (`Sink.loop_work`); had it
    stopped at the first pass that moved anything, as it did before, the send would
    be awaited through the loop: 400 turns counted then, 9-23 now (429 in thread mode
    before its tasks spun too)."""
    rounds = 200

    async def program(world: mate.World) -> None:
        await barrier(world)
        if world.mypid <= 1:
            peer = 1 - world.mypid
            out, into = bytearray(8), bytearray(8)

            async def attempt() -> None:
                for _ in range(rounds):
                    incoming = world.recv(into, peer, tag=26)
                    await world.send(out, peer, tag=26)
                    await incoming

            turns = await fewest_turns(attempt)
            assert turns < rounds // 2, turns
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


@awaiting_task_passes
async def test_a_reply_that_outlasts_the_spin_is_awaited_with_no_future(fabric: Fabric) -> None:
    """A reply that comes after SLICE, but while passes still spin (within SPIN): the
    awaiting task's spin gives up for the loop's turn, and the task yields one bare
    turn at a time (`Ledger.waiter`), the queued pass running in each, with no future
    made for the reply. With a future, every round made one (41 of 40 counted) and
    woke a turn after the pass that ended the reply. A host that takes a rank's core
    away stretches the wait past SPIN whatever mate does, so the fewest of ten
    attempts counts (beside a CI run compiling on both cores, one attempt counted
    46 and the fewest of five 12)."""
    from mate.transports.mpi.progress import SLICE, SPIN

    rounds, attempts = 20, 10

    async def program(world: mate.World) -> None:
        await barrier(world)
        if world.mypid <= 1:
            peer, buf, fewest = 1 - world.mypid, bytearray(8), sys.maxsize
            for _ in range(attempts):
                with counting_futures() as made:
                    for _ in range(rounds):
                        if world.mypid == 0:
                            reply = world.recv(buf, peer, tag=27)
                            await world.send(buf, peer, tag=27)
                            await reply
                        else:
                            await world.recv(buf, peer, tag=27)
                            compute(SLICE + (SPIN - SLICE) / 4)  # after rank 0's spin
                            await world.send(buf, peer, tag=27)
                fewest = min(fewest, made())
            if world.mypid == 0:
                assert fewest < rounds // 2, fewest
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


@awaiting_task_passes
async def test_a_ping_pong_awaited_while_passes_spin_leaves_the_loop_to_its_timers(
        fabric: Fabric) -> None:
    """The passes of an awaiting task hold the loop for at most SLICE since it last
    turned, as a loop callback's do: a ping-pong whose every reply comes within the
    spin still lets a task that sleeps 1 ms at a time run (unbounded, the ping-pong
    would never yield and the sleeper would not wake until it ended)."""
    seconds = 0.3

    async def program(world: mate.World) -> None:
        await barrier(world)
        if world.mypid <= 1:
            buf, go_on = bytearray(1), bytearray([1])  # rank 0 says when to stop
            end = time.monotonic() + seconds
            async with counting_wake_ups(0.001) as ticks:
                while go_on[0]:
                    if world.mypid == 0:
                        go_on[0] = time.monotonic() < end
                        await round_trip(world, go_on, buf, 24)
                    else:
                        await round_trip(world, buf, go_on, 24)
            # 1 ms sleeps and holds of at most SLICE (0.5 ms): some 200 ticks in 0.3 s.
            assert ticks() >= 50, ticks()
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


@pytest.mark.skipif(THREADED, reason="calls the engine on the loop's thread: its progress context")
async def test_a_receive_is_cancelled_once_however_often_asked(fabric: Fabric) -> None:
    """MPICH's ch4 device corrupts a request made between two MPI_Cancel calls on one
    wildcard receive. A receive whose cancel is asked again before a pass has tested it
    (a timeout's cancel, then shutdown's of every receive) is cancelled once: the
    request made in between, and the barrier after, still work."""
    from mpi4py import MPI

    async def program(world: mate.World) -> None:
        engine = world.transport.engine  # type: ignore[attr-defined]
        comm = MPI.COMM_WORLD.Dup()
        peer = (world.mypid + 1) % world.numprocs
        seen: list[bool] = []
        entry = engine.add(comm.Irecv(bytearray(8), MPI.ANY_SOURCE, 41),
                           lambda owner, status, error: seen.append(status.Is_cancelled()),
                           receive=True)
        engine.cancel(entry)  # a timeout's cancel ...
        between = comm.Irecv(bytearray(8), peer, 42)  # ... a request made before any pass ...
        engine.cancel_receives(standing=False)  # ... and shutdown's cancel of every receive
        while not seen:
            engine.test()
            await asyncio.sleep(0)
        assert seen == [True]
        comm.Send(bytes(8), peer, 42)
        between.Wait()
        comm.Ibarrier().Wait()  # a request made later: what corrupted ones fail on
        comm.Free()
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


def compute_while_a_progress_thread_runs_passes() -> None:
    """Keep the loop's thread busy for long enough that a progress thread (thread mode)
    takes over from the loop and runs passes: every IDLE_INTERVAL with nothing but its
    standing receives outstanding."""
    from mate.transports.mpi.progress import IDLE_INTERVAL

    compute(10 * IDLE_INTERVAL)


async def test_a_large_receive_posted_before_a_send_reaches_mpi_after_it_in_thread_mode(
        fabric: Fabric) -> None:
    """In thread mode a large receive posted after the progress thread ran passes (the
    program computed) is issued after the send posted right after it
    (`MpiTransport._post_recv`): its message may have been taken in already, and MPI
    then copies it inside MPI_Irecv, which would hold the send, and the peer's copy,
    back. Every receive posted meanwhile waits behind it: the small receive posted
    second still takes the second message (the first would not fit: TRUNCATED). Poll
    and manual mode issue receives as they are posted."""
    big, small = 256 * 1024, 8
    issued: list[tuple[str, int]] = []

    def spy(name: str, call: Any) -> Any:
        def post(comm: Any, buf: Any, rank: int, tag: int) -> Any:
            if tag == 31:
                issued.append((name, len(buf)))
            return call(comm, buf, rank, tag)
        return post

    async def program(world: mate.World) -> None:
        await barrier(world)
        if world.mypid <= 1:
            transport, peer = world.transport, 1 - world.mypid  # type: ignore[attr-defined]
            calls = transport._issend, transport._irecv  # the transport's MPI calls (calls.py)
            transport._issend, transport._irecv = spy("Issend", calls[0]), spy("Irecv", calls[1])
            # No pass of the progress thread between the posts: one would issue the
            # receives before the send (a host that stalls the loop for 5 ms, say).
            no_pass = getattr(transport.engine._progress, "_pass_lock", contextlib.nullcontext())
            try:
                big_in, small_in = bytearray(big), bytearray(small)
                compute_while_a_progress_thread_runs_passes()
                with no_pass:
                    first = world.recv(big_in, peer, tag=31)
                    second = world.recv(small_in, peer, tag=31)
                    sends = [world.send(bytearray([world.mypid + 1]) * big, peer, tag=31),
                             world.send(bytearray([world.mypid + 3]) * small, peer, tag=31)]
                assert (await first).length == big and (await second).length == small
                for send in sends:
                    await send
            finally:
                transport._issend, transport._irecv = calls
            assert big_in == bytearray([peer + 1]) * big
            assert small_in == bytearray([peer + 3]) * small
            if LAUNCH_OPTIONS.get("progress") == "thread":
                assert issued == [("Issend", big), ("Irecv", big), ("Irecv", small),
                                  ("Issend", small)], issued
            else:
                assert issued == [("Irecv", big), ("Irecv", small), ("Issend", big),
                                  ("Issend", small)], issued
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)


async def test_a_large_receive_with_no_send_after_it_is_issued_by_a_pass(
        fabric: Fabric) -> None:
    """A large receive that no send follows (thread mode holds it for one, once the
    progress thread ran passes) is issued by the next pass: one answered late
    completes, and one never answered times out."""
    size = 256 * 1024

    async def program(world: mate.World) -> None:
        await barrier(world)
        if world.mypid == 0:
            answered, unanswered = bytearray(size), bytearray(size)
            compute_while_a_progress_thread_runs_passes()
            receipt = await world.recv(answered, 1, tag=32)
            assert receipt.length == size and answered == bytearray([5]) * size
            compute_while_a_progress_thread_runs_passes()
            with pytest.raises(mate.MessageTimeout):
                await world.recv(unanswered, 1, tag=33, timeout=0.2)
        elif world.mypid == 1:
            await asyncio.sleep(0.05)
            await world.send(bytearray([5]) * size, 0, tag=32)
        await barrier(world)

    async with fabric.open() as group:
        await group.run(program)
