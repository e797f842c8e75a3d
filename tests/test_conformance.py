"""Conformance suite: every invariant and API point of SPEC §1-§2, as SPMD programs.

Each test defines ``async def program(world)`` that branches on ``world.mypid``,
works for any world size >= 2, and runs it on every rank with
``await group.run(program)``. Ranks share nothing but mate messages (each
program keeps its own records and checks them itself), so the same file runs
unchanged under mpiexec, one rank per process. Where a transport may choose
between outcomes (a send that timed out may or may not have reached its
destination; a cancel may lose the race with a match), the test accepts every
outcome the spec allows and fails on the forbidden ones. The few tests that
depend on the local transport say so and are skipped elsewhere.

Most two-sided tests use a ring: each rank sends to ``right = me + 1`` and
receives from ``left = me - 1`` (for two ranks both are the other rank). No
wildcard-tag receive is ever outstanding across a `barrier` (it would swallow
the barrier's messages).
"""

from __future__ import annotations

import array
import asyncio
import gc
import logging
import math
import struct
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
from conftest import LOOP, barrier

import mate
from mate import ANY_SOURCE, ANY_TAG, Event, FailureReason, Op, Region, Schedule, State

LARGE = 256 * 1024  # above the local eager limit (64 KiB): the send waits for a match
SLACK = 0.1  # SPEC §2: a timeout fires no later than 0.1 s + 10 % after its value
SETTLE = 0.1  # time given to stray (forbidden) events to show up before checking
PAD = 32  # bytes around an exposed slice, to see that nothing outside it is touched
# How early the loop's own timers may fire by time.monotonic(): uvloop's (libuv's) count
# whole milliseconds from a loop time cached at the start of the loop's turn.
LOOP_EARLY = 0.001 if LOOP == "uvloop" else 0.0

EVENT_OF = {
    State.COMPLETED: Event.COMPLETION,
    State.TIMED_OUT: Event.TIMEOUT,
    State.FAILED: Event.FAILURE,
}


# -- helpers -------------------------------------------------------------------------------


def ring(world: mate.World) -> tuple[int, int, int]:
    """(me, right, left): this rank and its neighbours on the ring of all ranks."""
    me, n = world.mypid, world.numprocs
    return me, (me + 1) % n, (me - 1) % n


def message(*key: int, size: int = 64) -> bytes:
    """`size` deterministic bytes that name `key` (up to four ints >= 0) in the first 16."""
    key4 = (*key, *(0,) * (4 - len(key)))
    head = struct.pack("<4i", *key4)
    body = np.random.default_rng(list(key4)).integers(0, 256, max(size - 16, 0), dtype=np.uint8)
    return (head + body.tobytes())[:size]


def key_of(buf: Any) -> tuple[int, ...]:
    return struct.unpack_from("<4i", bytes(memoryview(buf).cast("B")[:16]))


def check_message(buf: Any, length: int, *key: int) -> None:
    """`buf[:length]` is exactly `message(*key, size=length)`."""
    got = bytes(memoryview(buf).cast("B")[:length])
    assert got == message(*key, size=length), f"wrong data: wanted {key}, got {key_of(buf)}"


def address(obj: Any) -> int:
    """The address of the first byte of a buffer (read-only ones included)."""
    return int(np.frombuffer(obj, dtype=np.uint8).ctypes.data)


async def wait_until(predicate: Callable[[], bool], world: mate.World | None = None,
                     timeout: float = 2.0) -> None:
    """Poll `predicate`, driving `world`'s progress (progress="manual" needs it)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        if world is not None:
            world.progress()
        await asyncio.sleep(0.002)


async def outcome(msg: mate.Message) -> mate.Receipt | BaseException:
    """The message's outcome: its receipt, or the exception awaiting it raised."""
    try:
        return await msg
    except (mate.MessageTimeout, mate.MessageFailed, asyncio.CancelledError) as exc:
        return exc


async def exchange_regions(world: mate.World, region: Region, tag: int) -> dict[int, int]:
    """Send `region.address` to every other rank (by message); return each peer's address."""
    peers = [p for p in range(world.numprocs) if p != world.mypid]
    bufs = {p: bytearray(16) for p in peers}
    recvs = [world.recv(bufs[p], p, tag) for p in peers]
    sends = [world.send(struct.pack("<QQ", region.address, region.length), p, tag)
             for p in peers]
    await asyncio.gather(*sends, *recvs)
    return {p: struct.unpack("<QQ", bufs[p])[0] for p in peers}


def expect_invalid(call: Callable[[], Any], *words: str) -> mate.InvalidArgument:
    """`call()` raises InvalidArgument (a ValueError) whose text names each of `words`."""
    with pytest.raises(mate.InvalidArgument) as info:
        call()
    exc = info.value
    assert isinstance(exc, ValueError) and isinstance(exc, mate.MateError)
    for word in words:
        assert word in str(exc), f"{word!r} not in {str(exc)!r}"
    return exc


class Recorder:
    """Every handler call of one rank, by message key, to check the event invariants."""

    def __init__(self, world: mate.World) -> None:
        self.me = world.mypid
        self.calls: dict[Any, list[mate.Receipt]] = defaultdict(list)
        self.times: dict[tuple[Any, Event], float] = {}
        self.wrong: list[Any] = []  # handlers called with a receipt of another event

    def schedule(self, key: Any) -> Schedule:
        def handler_for(event: Event) -> Callable[[mate.Receipt, Any], None]:
            def handler(receipt: mate.Receipt, data: Any) -> None:
                if receipt.event is not event:
                    self.wrong.append((data, event, receipt))
                self.times.setdefault((data, event), time.monotonic())
                self.calls[data].append(receipt)
            return handler

        return Schedule(
            completion=handler_for(Event.COMPLETION), completion_data=key,
            submission=handler_for(Event.SUBMISSION), submission_data=key,
            timeout=handler_for(Event.TIMEOUT), timeout_data=key,
            failure=handler_for(Event.FAILURE), failure_data=key,
        )

    def events(self, key: Any) -> list[Event | None]:
        return [r.event for r in self.calls.get(key, [])]

    def check(self, key: Any, msg: mate.Message, *states: State) -> list[mate.Receipt]:
        """`msg` ended in one of `states`; its handlers saw exactly the events that allows."""
        assert not self.wrong, self.wrong
        assert msg.done() and msg.state in states, (key, msg, states)
        receipts = self.calls.get(key, [])
        events = [r.event for r in receipts]
        origin = msg.op in (Op.SEND, Op.PUT)
        assert events.count(Event.SUBMISSION) <= (1 if origin else 0), (key, events)
        for receipt in receipts:
            assert receipt.op is msg.op and receipt.local_pid == self.me
        if msg.state is State.CANCELLED:  # no terminal handler (and no submission after it)
            assert set(events) <= {Event.SUBMISSION}, (key, events)
            return receipts
        final = EVENT_OF[msg.state]
        assert [e for e in events if e is not Event.SUBMISSION] == [final], (key, events)
        assert events[-1] is final, (key, events)
        if origin and final is Event.COMPLETION:
            assert events == [Event.SUBMISSION, Event.COMPLETION], (key, events)
        last = receipts[-1]
        assert last == msg.receipt
        if final is Event.COMPLETION:
            assert last.error is None
        elif final is Event.TIMEOUT:
            assert isinstance(last.error, mate.MessageTimeout)
        else:
            assert isinstance(last.error, mate.MessageFailed)
        if events[0] is Event.SUBMISSION:
            assert receipts[0].error is None
        return receipts


# -- identity, constants, startup ----------------------------------------------------------


async def test_runs_on_the_chosen_loop(group):
    # The launched suites run on uvloop too (MATE_TEST_LOOP): check that they do.
    module = type(asyncio.get_running_loop()).__module__
    assert module.startswith("uvloop" if LOOP == "uvloop" else "asyncio"), module


async def test_world_identity_and_constants(group):
    async def program(world):
        me, n = world.mypid, world.numprocs
        assert type(me) is int and type(n) is int
        assert 0 <= me < n <= mate.PROC_MAX and n == group.size >= 2
        assert world.tag_max >= 32767
        assert world.default_timeout == 1.0
        assert mate.ANY_SOURCE not in range(n) and mate.ANY_TAG not in range(world.tag_max + 1)
        assert repr(mate.UNSET) == "mate.UNSET"
        assert world.progress() is None
        # every rank has a distinct pid: all others report theirs to rank 0
        if me == 0:
            seen = set()
            for _ in range(n - 1):
                buf = bytearray(4)
                receipt = await world.recv(buf, ANY_SOURCE, 11)
                (pid,) = struct.unpack("<i", buf)
                assert pid == receipt.remote_pid
                seen.add(pid)
            assert seen == set(range(1, n))
        else:
            await world.send(struct.pack("<i", me), 0, 11)

    await group.run(program)


async def test_startup_forms(fabric):
    # `world = await mate.startup(...)` + `await world.shutdown()`, and `async with`.
    world = await mate.startup(fabric.transport)
    try:
        assert 0 <= world.mypid < world.numprocs
        buf = bytearray(5)
        r = world.recv(buf, world.mypid, 3)
        await world.send(b"hello", world.mypid, 3)
        assert (await r).length == 5 and buf == b"hello"
    finally:
        await world.shutdown()
    await world.shutdown()  # a second shutdown is harmless
    expect_invalid(lambda: world.send(b"x", world.mypid), "shut down")
    async with mate.startup(fabric.transport, default_timeout=0.5) as world2:
        assert world2.default_timeout == 0.5
        r2 = world2.recv(bytearray(0), world2.mypid, 1)
        await world2.send(b"", world2.mypid, 1)
        await r2
    expect_invalid(lambda: world2.recv(bytearray(1)), "shut down")


async def test_invalid_startup_arguments(fabric, monkeypatch):
    # unknown transport names: raised by the call itself
    expect_invalid(lambda: mate.startup("carrier-pigeon"), "carrier-pigeon")
    expect_invalid(lambda: mate.startup(42), "42")
    monkeypatch.setenv("MATE_TRANSPORT", "smoke-signals")
    expect_invalid(lambda: mate.startup(), "smoke-signals")
    monkeypatch.delenv("MATE_TRANSPORT")
    # unknown options, bad handlers= and default_timeout= values
    bad: list[tuple[dict[str, Any], str]] = [
        ({"bogus_option": 1}, "bogus_option"),
        ({"handlers": "sometimes"}, "handlers"),
        ({"handlers": 3}, "handlers"),
        ({"default_timeout": -1}, "default_timeout"),
        ({"default_timeout": math.nan}, "default_timeout"),
        ({"default_timeout": "1"}, "default_timeout"),
    ]
    if fabric.transport == "local":
        bad += [({"eager_limit": -1}, "eager_limit"), ({"progress": "thread"}, "progress"),
                ({"handlers": "progress"}, "progress")]
    for options, word in bad:
        with pytest.raises(mate.InvalidArgument) as info:
            async with fabric.open(**options):
                pytest.fail(f"opened with {options}")
        assert isinstance(info.value, ValueError) and word in str(info.value), (options, info)
    # the same through mate.startup, in both of its forms
    for options, word in bad[:2]:
        with pytest.raises(mate.InvalidArgument, match=word):
            await mate.startup(fabric.transport, **options)
        with pytest.raises(mate.InvalidArgument, match=word):
            async with mate.startup(fabric.transport, **options):
                pytest.fail(f"opened with {options}")


# -- send and recv -------------------------------------------------------------------------


async def test_send_recv_receipts_and_wildcards(group):
    async def program(world):
        me, right, left = ring(world)
        buf = bytearray(200)
        r = world.recv(buf, left, 5)
        assert r.submitted is None
        s = world.send(message(me, 5, size=100), right, 5)
        rs = await s
        assert isinstance(rs, mate.Receipt) and rs == s.receipt
        assert (rs.op, rs.tag, rs.length, rs.local_pid, rs.remote_pid, rs.remote_address,
                rs.event, rs.error) == (Op.SEND, 5, 100, me, right, None, Event.COMPLETION, None)
        assert type(rs.local_address) is int
        rr = await r
        assert rr == r.receipt and r.state is State.COMPLETED and r.done()
        assert (rr.op, rr.tag, rr.length, rr.local_pid, rr.remote_pid, rr.remote_address,
                rr.event, rr.error) == (Op.RECV, 5, 100, me, left, None, Event.COMPLETION, None)
        assert rr.local_address == address(buf)
        check_message(buf, 100, left, 5)
        assert buf[100:] == bytes(100)
        assert s.state is State.COMPLETED and s.done()
        # awaiting a finished message again gives the same receipt
        assert await r == rr and await s == rs
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            rr.length = 0  # receipts are immutable
        # every field set, as Receipt's own __init__ would (mate.message builds them)
        assert attrs.evolve(rr) == rr and attrs.evolve(rs) == rs
        assert repr(attrs.evolve(rr)) == repr(rr) and hash(attrs.evolve(rr)) == hash(rr)

        # wildcards are filled in at completion
        await barrier(world)
        buf2 = bytearray(64)
        r2 = world.recv(buf2)  # ANY_SOURCE, ANY_TAG by default
        s2 = world.send(message(me, 60 + me, size=40), right, 60 + me)
        rr2 = await r2
        assert (rr2.remote_pid, rr2.tag, rr2.length) == (left, 60 + left, 40)
        check_message(buf2, 40, left, 60 + left)
        await s2
        r3 = world.recv(buf2, ANY_SOURCE, 7)
        r4 = world.recv(bytearray(64), left, ANY_TAG)
        await world.send(message(me, 7, size=20), right, 7)
        await world.send(message(me, 8, size=30), right, 8)
        rr3, rr4 = await r3, await r4
        assert (rr3.remote_pid, rr3.tag, rr3.length) == (left, 7, 20)
        assert (rr4.remote_pid, rr4.tag, rr4.length) == (left, 8, 30)

    await group.run(program)


async def test_zero_length_messages(group):
    async def program(world):
        _, right, left = ring(world)
        rec = Recorder(world)
        keep = bytearray(b"untouched")
        recvs = [
            world.recv(bytearray(0), left, 1, schedule=rec.schedule("r1")),
            world.recv(keep, left, 2, schedule=rec.schedule("r2")),
            world.recv(np.zeros((0, 3)), left, 3, schedule=rec.schedule("r3")),
        ]
        sends = [
            world.send(b"", right, 1, schedule=rec.schedule("s1")),
            world.send(memoryview(bytearray(5))[2:2], right, 2, schedule=rec.schedule("s2")),
            world.send(np.zeros((0, 3)), right, 3, schedule=rec.schedule("s3")),
        ]
        for i, msg in enumerate([*recvs, *sends]):
            receipt = await msg
            assert receipt.length == 0 and receipt.event is Event.COMPLETION
            assert receipt.remote_pid == (left if i < 3 else right)
            assert receipt.tag == i % 3 + 1
        assert keep == b"untouched"
        await asyncio.sleep(SETTLE)
        for i in range(3):
            rec.check(f"r{i + 1}", recvs[i], State.COMPLETED)
            rec.check(f"s{i + 1}", sends[i], State.COMPLETED)

    await group.run(program)


async def test_buffer_types(group):
    def pairs(rank: int) -> list[tuple[Any, Any]]:
        """(what `rank` sends, where its right neighbour receives it), one tag each."""
        base = np.arange(12, dtype=np.int32) + 100 * rank
        return [
            (message(rank, 1, size=33), bytearray(33)),
            (bytearray(message(rank, 2, size=40)), memoryview(bytearray(40))),
            (memoryview(message(rank, 3, size=50))[5:25], memoryview(bytearray(64))[8:28]),
            (base, np.zeros(12, dtype=np.int32)),
            (base.astype(np.float64).reshape(3, 4), np.empty((3, 4))),
            (base.astype(np.float64).reshape(3, 4), np.empty(12)),  # raw bytes, any shape
            (np.arange(24, dtype=np.uint8).reshape(2, 3, 4)[1], bytearray(12)),  # contiguous
            (array.array("d", [rank, 2.5, -1.0]), array.array("d", [0.0, 0.0, 0.0])),
            (np.array(rank + 0.5), np.zeros(1)),  # 0-d array: 8 bytes
            (memoryview(base).cast("B").cast("i", (3, 4)), bytearray(48)),
        ]

    async def program(world):
        me, right, left = ring(world)
        mine, theirs = pairs(me), pairs(left)
        recvs = [world.recv(dst, left, tag) for tag, (_, dst) in enumerate(theirs)]
        sends = [world.send(src, right, tag) for tag, (src, _) in enumerate(mine)]
        for tag, (msg, (src, dst)) in enumerate(zip(recvs, theirs, strict=True)):
            receipt = await msg
            nbytes = memoryview(src).nbytes
            assert receipt.length == nbytes and receipt.tag == tag
            got = memoryview(dst).cast("B")[:nbytes] if memoryview(dst).ndim < 2 else \
                memoryview(np.ascontiguousarray(dst)).cast("B")
            assert bytes(got) == memoryview(src).tobytes(), tag
        for tag, msg in enumerate(sends):
            assert (await msg).length == memoryview(mine[tag][0]).nbytes
        assert np.array_equal(theirs[4][1], np.arange(12.0).reshape(3, 4) + 100 * left)
        # a larger-than-eager NumPy array, into a 2-D array; the library keeps the send
        # buffer alive until the send's outcome, even when the caller drops it
        big = np.arange(LARGE // 8, dtype=np.float64).reshape(-1, 64) * (me + 1)
        alive = weakref.ref(big)
        s = world.send(big, right, 99)
        nbytes = big.nbytes
        del big
        gc.collect()
        assert alive() is not None
        got = np.empty((LARGE // 8 // 64, 64))
        await barrier(world)  # the send is (usually) still waiting for its match
        r = world.recv(got, left, 99)
        assert (await r).length == nbytes
        await s
        assert np.array_equal(got, np.arange(LARGE // 8, dtype=np.float64).reshape(-1, 64)
                              * (left + 1))
        # non-contiguous buffers are refused by the call itself
        strided = np.arange(20)[::2]
        expect_invalid(lambda: world.send(strided, right, 1), "contiguous")
        expect_invalid(lambda: world.recv(np.zeros((4, 4))[:, :2], left, 1), "contiguous")
        expect_invalid(lambda: world.send(np.asfortranarray(np.zeros((3, 4))), right), "contiguous")
        expect_invalid(lambda: world.recv(memoryview(bytearray(8))[::2]), "contiguous")

    await group.run(program)


async def test_send_to_self_and_tag_bounds(group):
    async def program(world):
        me, right, left = ring(world)
        # a rank may send to itself, small and large, receive posted before or after
        buf = bytearray(LARGE)
        s1 = world.send(message(me, 1, size=LARGE), me, 1)
        r1 = world.recv(buf, me, 1)
        assert (await r1).remote_pid == me
        check_message(buf, LARGE, me, 1)
        await s1
        r2 = world.recv(buf, me, 2)
        await world.send(message(me, 2, size=10), me, 2)
        assert (await r2).length == 10
        # the extreme valid tags: 0 and world.tag_max
        buf0, bufm = bytearray(16), bytearray(16)
        r0 = world.recv(buf0, left, 0)
        rm = world.recv(bufm, left, world.tag_max)
        await world.send(message(me, 0, size=16), right, 0)
        await world.send(message(me, 9, size=16), right, world.tag_max)
        assert (await r0).tag == 0 and (await rm).tag == world.tag_max
        check_message(buf0, 16, left, 0)
        check_message(bufm, 16, left, 9)
        # NumPy integers are accepted as ranks and tags; any finite timeout >= 0 is valid
        r3 = world.recv(buf0, np.int64(left), np.int32(4), timeout=10**6)
        await world.send(b"np", np.int16(right), np.uint8(4), timeout=3600.0)
        assert (await r3).length == 2

    await group.run(program)


# -- truncation ----------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "room", "recv_first"), [
    (100, 50, True), (100, 50, False), (LARGE, 1000, True), (LARGE, 1000, False), (16, 0, True),
])
async def test_truncation(group, size, room, recv_first):
    async def program(world):
        me, right, left = ring(world)
        rec = Recorder(world)
        small = bytearray(room)
        if recv_first:
            r1 = world.recv(small, left, 20, schedule=rec.schedule("trunc"))
        sa = world.send(message(me, 20, 0, size=size), right, 20, schedule=rec.schedule("sa"))
        sb = world.send(message(me, 20, 1, size=24), right, 20, schedule=rec.schedule("sb"))
        if not recv_first:
            await asyncio.sleep(0.02)  # the message is (usually) there first
            r1 = world.recv(small, left, 20, schedule=rec.schedule("trunc"))
        with pytest.raises(mate.MessageFailed) as info:
            await r1
        exc = info.value
        assert exc.reason is FailureReason.TRUNCATED and isinstance(exc, mate.MateError)
        assert r1.state is State.FAILED
        # nothing is lost silently: the next message is the next one sent, intact
        rest = bytearray(64)
        rb = await world.recv(rest, left, 20, timeout=5)
        assert rb.length == 24
        check_message(rest, 24, left, 20, 1)
        # the sender completes: its data did reach the destination
        assert (await sa).length == size and (await sb).length == 24
        await asyncio.sleep(SETTLE)
        (failure,) = rec.check("trunc", r1, State.FAILED)
        assert failure.error is exc and failure.event is Event.FAILURE
        assert failure.op is Op.RECV and failure.local_address == address(small)
        rec.check("sa", sa, State.COMPLETED)
        rec.check("sb", sb, State.COMPLETED)

    await group.run(program)


# -- timeouts ------------------------------------------------------------------------------


async def test_timeout_default_with_timeout_handler(fabric):
    async with fabric.open(default_timeout=0.2) as group:
        async def program(world):
            me, right, left = ring(world)
            assert world.default_timeout == 0.2
            rec = Recorder(world)
            buf = bytearray(16)
            t0 = time.monotonic()
            r = world.recv(buf, left, 30, schedule=rec.schedule("r"))  # timeout=UNSET
            with pytest.raises(mate.MessageTimeout) as info:
                await r
            elapsed = time.monotonic() - t0
            assert isinstance(info.value, TimeoutError) and isinstance(info.value, mate.MateError)
            assert r.state is State.TIMED_OUT and r.done() and r.cancel() is False
            await asyncio.sleep(SETTLE)
            (receipt,) = rec.check("r", r, State.TIMED_OUT)
            fired = rec.times["r", Event.TIMEOUT] - t0
            assert 0.2 <= fired <= 0.2 + SLACK + 0.02, fired
            assert 0.2 <= elapsed <= 0.2 + SLACK + 0.02 + SETTLE, elapsed
            assert receipt.error is info.value and receipt.event is Event.TIMEOUT
            assert (receipt.op, receipt.tag, receipt.remote_pid, receipt.length) == \
                (Op.RECV, 30, left, 0)
            assert buf == bytes(16)
            # no data loss: a message sent after the timeout goes to the next recv
            await barrier(world)
            r2 = world.recv(buf, left, 30, timeout=5)
            await world.send(message(me, 30, size=16), right, 30)
            assert (await r2).length == 16
            check_message(buf, 16, left, 30)

        await group.run(program)


async def test_timeout_explicit_values_and_timing(group):
    async def program(world):
        me, right, left = ring(world)
        rec = Recorder(world)
        sbuf = bytearray(message(me, 35, size=LARGE))
        t0 = time.monotonic()
        armed = {  # world.default_timeout is 1 s: the explicit values win
            "a": world.recv(bytearray(8), left, 31, schedule=rec.schedule("a"), timeout=0.1),
            "b": world.recv(bytearray(8), left, 32, schedule=rec.schedule("b"), timeout=0.25),
            "c": world.recv(bytearray(8), left, 33, timeout=0.15),  # no schedule at all
            "z": world.recv(bytearray(8), left, 34, schedule=rec.schedule("z"), timeout=0),
            # a large send nobody receives (yet): it can only time out
            "s": world.send(sbuf, right, 35, schedule=rec.schedule("s"), timeout=0.15),
        }
        wanted = {"a": 0.1, "b": 0.25, "c": 0.15, "z": 0.0, "s": 0.15}

        async def timed(key: str) -> float:
            with pytest.raises(mate.MessageTimeout):
                await armed[key]
            return time.monotonic() - t0

        ends = dict(zip(armed, await asyncio.gather(*map(timed, armed)), strict=True))
        await asyncio.sleep(SETTLE)
        for key, value in wanted.items():
            msg = armed[key]
            assert msg.state is State.TIMED_OUT
            assert value <= ends[key] <= value + SLACK + value / 10 + SETTLE, (key, ends[key])
            if key != "c":
                rec.check(key, msg, State.TIMED_OUT)
                fired = rec.times[key, Event.TIMEOUT] - t0
                assert value <= fired <= value + SLACK + value / 10, (key, fired)
        # the timed-out send may still have reached its destination (SPEC §1), but then it
        # is delivered whole and before what the same sender sends next on that tag; its
        # outcome released the buffer, so reusing it now cannot change what is delivered
        sbuf[:] = bytes(LARGE)
        await barrier(world)
        buf = bytearray(LARGE)
        r = world.recv(buf, left, 35, timeout=5)
        marker = world.send(message(me, 35, 1, size=16), right, 35)
        if (await r).length == LARGE:
            check_message(buf, LARGE, left, 35)
            assert (await world.recv(buf, left, 35, timeout=5)).length == 16
        check_message(buf, 16, left, 35, 1)
        await marker

    await group.run(program)


async def test_unarmed_messages_never_time_out(fabric):
    async with fabric.open(default_timeout=0.1) as group:
        async def program(world):
            me, right, left = ring(world)
            rec = Recorder(world)
            only_completion = Schedule(completion=lambda r, d: rec.calls[d].append(r),
                                       completion_data="r2",
                                       failure=lambda r, d: rec.calls[d].append(r),
                                       failure_data="r2")
            with_timeout = rec.schedule("r3")
            await barrier(world)
            bufs = [bytearray(16) for _ in range(3)]
            msgs = {
                "r1": world.recv(bufs[0], left, 40),  # UNSET, no schedule
                "r2": world.recv(bufs[1], left, 41, schedule=only_completion),  # UNSET, no handler
                "r3": world.recv(bufs[2], left, 42, schedule=with_timeout, timeout=None),
                "s4": world.send(message(me, 43, size=LARGE), right, 43,
                                 schedule=Schedule(completion=lambda r, d: None)),
                "s5": world.send(message(me, 44, size=LARGE), right, 44,
                                 schedule=rec.schedule("s5"), timeout=None),
            }
            await asyncio.sleep(0.35)  # > 3 x default_timeout
            for key, msg in msgs.items():
                allowed = (State.POSTED, State.SUBMITTED) if key[0] == "s" else (State.POSTED,)
                assert msg.state in allowed and not msg.done(), key
            assert set(rec.events("s5")) <= {Event.SUBMISSION} and not rec.calls.get("r3")
            # the receipt of a message with no event yet
            early = msgs["r1"].receipt
            assert (early.op, early.tag, early.length, early.local_pid, early.remote_pid,
                    early.event, early.error) == (Op.RECV, 40, 0, me, left, None, None)
            await barrier(world)
            big = bytearray(LARGE)
            for tag in (40, 41, 42):
                await world.send(message(me, tag, size=16), right, tag)
            for tag in (43, 44):
                assert (await world.recv(big, left, tag)).length == LARGE
                check_message(big, LARGE, left, tag)
            for i, key in enumerate(("r1", "r2", "r3")):
                assert (await msgs[key]).length == 16
                check_message(bufs[i], 16, left, 40 + i)
            assert (await msgs["s4"]).length == (await msgs["s5"]).length == LARGE
            await asyncio.sleep(SETTLE)
            assert rec.events("r2") == [Event.COMPLETION]
            rec.check("r3", msgs["r3"], State.COMPLETED)
            rec.check("s5", msgs["s5"], State.COMPLETED)

        await group.run(program)


# -- cancellation and no data loss ---------------------------------------------------------


async def test_cancel_by_msg_cancel(group):
    async def program(world):
        me, right, left = ring(world)
        rec = Recorder(world)
        buf = bytearray(16)
        r = world.recv(buf, left, 50, schedule=rec.schedule("r"), timeout=0.1)
        assert r.cancel() is True
        with pytest.raises(asyncio.CancelledError):
            await r
        assert r.state is State.CANCELLED and r.done()
        assert r.cancel() is False
        with pytest.raises(asyncio.CancelledError):  # and again: the outcome is final
            await r
        # an unmatched large send: cancelled, or completed if the match won the race
        sbuf = bytearray(message(me, 51, size=LARGE))
        s = world.send(sbuf, right, 51, schedule=rec.schedule("s"))
        assert s.cancel() is True
        s_outcome = await outcome(s)
        sbuf[:] = bytes(LARGE)  # the outcome released the buffer: it may be reused
        assert isinstance(s_outcome, (asyncio.CancelledError, mate.Receipt)), s_outcome
        await asyncio.sleep(0.15)  # past r's timeout: it must not fire after cancellation
        rec.check("r", r, State.CANCELLED)
        rec.check("s", s, State.CANCELLED, State.COMPLETED)
        assert buf == bytes(16)
        await barrier(world)

        # no data loss: the next message on tag 50 goes to the next recv
        r2 = world.recv(buf, left, 50, timeout=5)
        s2 = world.send(message(me, 50, size=16), right, 50)
        assert (await r2).length == 16 and (await s2).length == 16
        check_message(buf, 16, left, 50)
        assert r2.cancel() is False and s2.cancel() is False  # done messages
        # tag 51: a completed send was delivered; a cancelled one may have been, like a send
        # that timed out (SPEC §1), but whole and before the next one; the sender says which
        verdict = b"K" if s.state is State.COMPLETED else b"C"
        big = bytearray(LARGE)
        r51 = world.recv(big, left, 51, timeout=5)
        s51 = world.send(verdict + message(me, 51, 1, size=15), right, 51)
        first = await r51
        if first.length == LARGE:
            check_message(big, LARGE, left, 51)
            first = await world.recv(big, left, 51, timeout=5)
        else:
            assert big[:1] == b"C", "a completed send was lost"
        assert first.length == 16 and bytes(big[1:16]) == message(left, 51, 1, size=15)
        await s51

        # a cancel racing with a message that is (most likely) there already: either the
        # match wins (completed, with the data), or the recv is cancelled and the data is
        # left for the next recv
        await barrier(world)
        s52 = world.send(message(me, 52, size=16), right, 52)
        await asyncio.sleep(0.02)
        buf3 = bytearray(16)
        r3 = world.recv(buf3, left, 52, schedule=rec.schedule("r3"))
        assert r3.cancel() is True
        if isinstance(await outcome(r3), asyncio.CancelledError):
            assert r3.state is State.CANCELLED and buf3 == bytes(16)
            assert (await world.recv(buf3, left, 52, timeout=5)).length == 16
        check_message(buf3, 16, left, 52)
        await s52
        await asyncio.sleep(SETTLE)
        rec.check("r3", r3, State.CANCELLED, State.COMPLETED)

    await group.run(program)


async def test_cancel_by_task_cancellation_and_wait_for(group):
    async def program(world):
        me, right, left = ring(world)
        rec = Recorder(world)
        bufs = [bytearray(16) for _ in range(3)]

        async def waiter(msg):
            return await msg

        # cancelling a task that awaits the message cancels the message
        r1 = world.recv(bufs[0], left, 60, schedule=rec.schedule("r1"))
        task = asyncio.create_task(waiter(r1))
        await asyncio.sleep(0.01)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(r1.done, world)
        assert r1.state is State.CANCELLED
        with pytest.raises(asyncio.CancelledError):
            await r1
        # asyncio.wait_for and asyncio.timeout give up on it: the message is cancelled
        r2 = world.recv(bufs[1], left, 61, schedule=rec.schedule("r2"))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r2, 0.1)
        assert time.monotonic() - t0 >= 0.1 - LOOP_EARLY
        await wait_until(r2.done, world)
        assert r2.state is State.CANCELLED
        r3 = world.recv(bufs[2], left, 62, schedule=rec.schedule("r3"))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await r3
        await wait_until(r3.done, world)
        assert r3.state is State.CANCELLED
        await barrier(world)
        # no data loss: each tag's next message goes to the next recv
        for i, tag in enumerate((60, 61, 62)):
            r = world.recv(bufs[i], left, tag, timeout=5)
            await world.send(message(me, tag, size=16), right, tag)
            assert (await r).length == 16
            check_message(bufs[i], 16, left, tag)
        await asyncio.sleep(SETTLE)
        for key, msg in (("r1", r1), ("r2", r2), ("r3", r3)):
            rec.check(key, msg, State.CANCELLED)

    await group.run(program)


# -- non-overtaking ------------------------------------------------------------------------


K = 12


def size_of(i: int) -> int:
    return LARGE if i % 5 == 2 else 24 + i


async def test_non_overtaking_same_tag(group):
    """Every rank but 0 sends K messages (small and large) to rank 0 on one tag."""

    async def program(world):
        me, n = world.mypid, world.numprocs
        if me != 0:
            sends = [world.send(message(me, 70, i, size=size_of(i)), 0, 70) for i in range(K)]
            sends += [world.send(message(me, 71, i, size=size_of(i)), 0, 71) for i in range(K)]
            for i, s in enumerate(sends):
                assert (await s).length == size_of(i % K)
            return
        # tag 70: receives naming the source, one sender after the other
        buf = bytearray(LARGE)
        for src in range(n - 1, 0, -1):
            for i in range(K):
                receipt = await world.recv(buf, src, 70)
                assert key_of(buf) == (src, 70, i, 0) and receipt.length == size_of(i)
                check_message(buf, receipt.length, src, 70, i)
        # tag 71: ANY_SOURCE receives; each sender's messages arrive in its order
        following = dict.fromkeys(range(1, n), 0)
        for _ in range((n - 1) * K):
            receipt = await world.recv(buf, ANY_SOURCE, 71)
            src, tag, i, _ = key_of(buf)
            assert src == receipt.remote_pid and tag == 71 and i == following[src]
            check_message(buf, receipt.length, src, 71, i)
            following[src] += 1

    await group.run(program)


async def test_non_overtaking_interleaved_tags(group):
    """Tags 80, 81, 82 interleaved; order holds per (sender, tag), also under ANY_TAG."""

    async def program(world):
        me, n = world.mypid, world.numprocs
        tags = (80, 81, 82)
        if me != 0:
            sends = [world.send(message(me, tags[i % 3], i, size=size_of(i)), 0, tags[i % 3])
                     for i in range(3 * K)]
            await asyncio.gather(*sends)
            return
        seen: dict[tuple[int, int], list[int]] = defaultdict(list)

        def take(buf: bytearray, receipt: mate.Receipt) -> None:
            src, tag, i, _ = key_of(buf)
            assert (src, tag) == (receipt.remote_pid, receipt.tag)
            check_message(buf, receipt.length, src, tag, i)
            seen[src, tag].append(i)

        # first every tag-81 message, by tag: the others wait
        bufs = [bytearray(LARGE) for _ in range((n - 1) * K)]
        recvs = [world.recv(b, ANY_SOURCE, 81) for b in bufs]
        for b, r in zip(bufs, recvs, strict=True):
            take(b, await r)
        # then the rest with wildcards: per-source-and-tag order still holds
        for src in range(1, n):
            for _ in range(K):
                take(bufs[0], await world.recv(bufs[0], src, ANY_TAG))
        for _ in range((n - 1) * K):
            take(bufs[0], await world.recv(bufs[0], ANY_SOURCE, ANY_TAG))
        for src in range(1, n):
            for j, tag in enumerate(tags):
                assert seen[src, tag] == list(range(j, 3 * K, 3)), (src, tag)

    await group.run(program)


async def test_receives_are_satisfied_in_posting_order(group):
    async def program(world):
        me, n = world.mypid, world.numprocs
        if me != 0:
            await barrier(world)  # rank 0 has posted its receives
            sends = [world.send(message(me, tag, i, size=size_of(i)), 0, tag)
                     for i in range(K) for tag in (90, 91)]
            await asyncio.gather(*sends)
            return
        named = {src: [(b := bytearray(LARGE), world.recv(b, src, 90)) for _ in range(K)]
                 for src in range(1, n)}
        anysrc = [(b := bytearray(LARGE), world.recv(b, ANY_SOURCE, 91))
                  for _ in range((n - 1) * K)]
        await barrier(world)
        for src, posted in named.items():
            for i, (buf, r) in enumerate(posted):
                receipt = await r
                assert key_of(buf) == (src, 90, i, 0) and receipt.length == size_of(i)
                check_message(buf, receipt.length, src, 90, i)
        following = dict.fromkeys(range(1, n), 0)
        for buf, r in anysrc:
            receipt = await r
            src, tag, i, _ = key_of(buf)
            assert src == receipt.remote_pid and tag == 91 and i == following[src]
            following[src] += 1
        assert all(v == K for v in following.values())

    await group.run(program)


# -- submission and the event invariants ---------------------------------------------------


async def test_submission(group):
    async def program(world):
        me, right, left = ring(world)
        rec = Recorder(world)
        memory = bytearray(64)
        region = world.expose(memory)
        peers = await exchange_regions(world, region, 95)
        s_small = world.send(message(me, 96, size=40), right, 96, schedule=rec.schedule("small"))
        s_large = world.send(message(me, 97, size=LARGE), right, 97, schedule=rec.schedule("large"))
        assert s_small.submitted is not None and s_large.submitted is not None
        r_small = world.recv(bytearray(40), left, 96, schedule=rec.schedule("r_small"))
        r_large = world.recv(bytearray(LARGE), left, 97, schedule=rec.schedule("r_large"))
        assert r_small.submitted is None and r_large.submitted is None
        for msg, tag, length in ((s_small, 96, 40), (s_large, 97, LARGE)):
            sub = await msg.submitted
            assert (sub.op, sub.tag, sub.length, sub.remote_pid, sub.event, sub.error) == \
                (Op.SEND, tag, length, right, Event.SUBMISSION, None)
            assert msg.state in (State.SUBMITTED, State.COMPLETED)
            assert (await msg).event is Event.COMPLETION
            assert await msg.submitted == sub  # awaiting it again: the same receipt
        await r_small
        await r_large
        put = world.put(message(me, 98, size=8), right, peers[right] + 8,
                        schedule=rec.schedule("put"))
        sub = await put.submitted
        assert (sub.op, sub.tag, sub.remote_pid, sub.remote_address, sub.event) == \
            (Op.PUT, None, right, peers[right] + 8, Event.SUBMISSION)
        assert (await put).event is Event.COMPLETION
        get = world.get(bytearray(8), right, peers[right] + 8, schedule=rec.schedule("get"))
        assert get.submitted is None
        await get
        # a send that times out unmatched: its submission either fired, or ends with it
        s_to = world.send(message(me, 99, size=LARGE), right, 99, schedule=rec.schedule("s_to"),
                          timeout=0.1)
        try:
            sub = await s_to.submitted
            assert sub.event is Event.SUBMISSION
        except mate.MessageTimeout:
            assert s_to.state is State.TIMED_OUT
        assert isinstance(await outcome(s_to), mate.MessageTimeout)
        await asyncio.sleep(SETTLE)
        rec.check("small", s_small, State.COMPLETED)
        rec.check("large", s_large, State.COMPLETED)
        rec.check("r_small", r_small, State.COMPLETED)
        rec.check("r_large", r_large, State.COMPLETED)
        rec.check("put", put, State.COMPLETED)
        rec.check("get", get, State.COMPLETED)
        rec.check("s_to", s_to, State.TIMED_OUT)
        assert rec.calls["small"][0] == (await s_small.submitted)
        await barrier(world)
        await world.unexpose(region)

    await group.run(program)


async def test_exactly_one_terminal_outcome(group):
    """A mixture of every outcome; all handler calls are recorded and checked after settling."""

    async def program(world):
        me, right, left = ring(world)
        rec = Recorder(world)
        memory = bytearray(64)
        region = world.expose(memory)
        peers = await exchange_regions(world, region, 100)
        S = rec.schedule
        shared = Schedule(completion=lambda r, d: rec.calls[d].append(r), completion_data="shared")
        msgs: dict[str, tuple[mate.Message, tuple[State, ...]]] = {}

        def post(key: str, msg: mate.Message, *states: State) -> None:
            msgs[key] = (msg, states)

        post("ok_recv", world.recv(bytearray(32), left, 101, schedule=S("ok_recv")),
             State.COMPLETED)
        post("ok_send", world.send(message(me, 101, size=32), right, 101, schedule=S("ok_send")),
             State.COMPLETED)
        post("trunc", world.recv(bytearray(8), left, 102, schedule=S("trunc")), State.FAILED)
        post("trunc_send", world.send(message(me, 102, size=32), right, 102,
                                      schedule=S("trunc_send")), State.COMPLETED)
        post("to_recv", world.recv(bytearray(8), left, 103, schedule=S("to_recv"), timeout=0.05),
             State.TIMED_OUT)
        post("to_send", world.send(message(me, 104, size=LARGE), right, 104,
                                   schedule=S("to_send"), timeout=0.05), State.TIMED_OUT)
        cancelled = world.recv(bytearray(8), left, 105, schedule=S("cancel"), timeout=0.05)
        cancelled.cancel()
        post("cancel", cancelled, State.CANCELLED)
        post("bad_put", world.put(b"x" * 8, right, peers[right] + 60, schedule=S("bad_put")),
             State.FAILED)
        post("bad_get", world.get(bytearray(8), right, peers[right] - 1, schedule=S("bad_get")),
             State.FAILED)
        post("ok_put", world.put(b"y" * 8, right, peers[right], schedule=S("ok_put")),
             State.COMPLETED)
        post("ok_get", world.get(bytearray(8), right, peers[right] + 32, schedule=S("ok_get")),
             State.COMPLETED)
        # one schedule shared by several messages
        shared_recvs = [world.recv(bytearray(4), left, 106 + i, schedule=shared) for i in range(3)]
        shared_sends = [world.send(b"abcd", right, 106 + i, schedule=shared) for i in range(3)]
        await asyncio.gather(*(outcome(m) for m, _ in msgs.values()),
                             *shared_recvs, *shared_sends)
        await asyncio.sleep(SETTLE)
        for key, (msg, states) in msgs.items():
            rec.check(key, msg, *states)
        reasons = {k: msgs[k][0].receipt.error.reason for k in ("trunc", "bad_put", "bad_get")}
        assert reasons == {"trunc": FailureReason.TRUNCATED,
                           "bad_put": FailureReason.REMOTE_ACCESS,
                           "bad_get": FailureReason.REMOTE_ACCESS}
        got = rec.calls["shared"]
        assert len(got) == 6 and all(r.event is Event.COMPLETION for r in got)
        assert sorted((r.op.value, r.tag) for r in got) == sorted(
            (op, 106 + i) for op in ("recv", "send") for i in range(3))
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            shared.completion = None  # schedules are immutable
        await barrier(world)
        assert memory[:8] == b"y" * 8 and memory[8:] == bytes(56)
        await world.unexpose(region)

    await group.run(program)


# -- one-sided -----------------------------------------------------------------------------


def backing_for(rank: int, size: int) -> tuple[bytearray, memoryview, bytes]:
    """A bytearray with `size` bytes of pattern between PAD bytes of 0xEE, and its middle."""
    pattern = message(rank, 200, size=size)
    backing = bytearray(b"\xee" * PAD + pattern + b"\xee" * PAD)
    return backing, memoryview(backing)[PAD:PAD + size], pattern


async def test_put_get(group):
    SIZE, CHUNK = 4096, 256

    async def program(world):
        me = world.mypid
        backing, window, pattern = backing_for(me, SIZE)
        region = world.expose(window)
        assert isinstance(region, Region) and region.pid == me and region.length == SIZE
        assert type(region.address) is int
        peers = await exchange_regions(world, region, 201)
        # get first: each peer's region holds that peer's pattern
        for p, addr in peers.items():
            got = np.zeros(SIZE, dtype=np.uint8)
            receipt = await world.get(got, p, addr)
            assert (receipt.op, receipt.tag, receipt.length, receipt.remote_pid,
                    receipt.remote_address, receipt.event) == \
                (Op.GET, None, SIZE, p, addr, Event.COMPLETION)
            assert got.tobytes() == message(p, 200, size=SIZE)
            part = bytearray(10)
            await world.get(part, p, addr + SIZE - 10)  # the last bytes, exactly
            assert part == message(p, 200, size=SIZE)[-10:]
        await barrier(world)
        # put: rank r writes chunk r of every peer's region, then tells the peer by message
        dones = [world.recv(bytearray(4), p, 203) for p in peers]
        for p, addr in peers.items():
            data = np.frombuffer(message(me, p, 202, size=CHUNK), dtype=np.uint8).reshape(16, 16)
            receipt = await world.put(data, p, addr + me * CHUNK)
            assert (receipt.op, receipt.tag, receipt.length, receipt.remote_pid,
                    receipt.remote_address, receipt.event, receipt.error) == \
                (Op.PUT, None, CHUNK, p, addr + me * CHUNK, Event.COMPLETION, None)
            await world.put(b"", p, addr + SIZE)  # zero length at the very end is inside
            await world.send(b"done", p, 203)
        await asyncio.gather(*dones)
        # completion meant visibility: every peer's chunk is here, the rest untouched
        expected = bytearray(pattern)
        for p in peers:
            expected[p * CHUNK:(p + 1) * CHUNK] = message(p, me, 202, size=CHUNK)
        assert window == expected
        assert backing[:PAD] == backing[-PAD:] == b"\xee" * PAD
        await barrier(world)
        # and every peer reads back what was written there
        for p, addr in peers.items():
            got = bytearray(CHUNK)
            await world.get(got, p, addr + me * CHUNK)
            assert got == message(me, p, 202, size=CHUNK)
        await barrier(world)
        await world.unexpose(region)

    await group.run(program)


async def test_stats_count_messages_and_bytes_by_op(group):
    """world.stats(): what this rank's messages did, counted once each, on every transport."""
    ops = ("send", "recv", "put", "get")

    async def program(world):
        me, n = world.mypid, world.numprocs
        right, left = (me + 1) % n, (me - 1) % n
        window = bytearray(64)
        region = world.expose(window)
        peers = await exchange_regions(world, region, 210)
        await barrier(world)
        before = world.stats()
        assert all(type(v) is int for v in before.values()) and before["outstanding"] == 0
        inbox = bytearray(200)
        r = world.recv(inbox, left, 211)
        await world.send(b"s" * 100, right, 211)
        await r
        await world.put(b"p" * 10, right, peers[right])
        await world.get(bytearray(20), left, peers[left])
        with pytest.raises(mate.MessageTimeout):
            await world.recv(bytearray(1), left, 212, timeout=0.05)
        after = world.stats()
        delta = {key: after[key] - before[key]
                 for key in (*(f"{op}_{what}" for op in ops for what in ("messages", "bytes")),
                             "timed_out", "failed", "cancelled")}
        assert delta == {"send_messages": 1, "send_bytes": 100, "recv_messages": 1,
                         "recv_bytes": 100, "put_messages": 1, "put_bytes": 10,
                         "get_messages": 1, "get_bytes": 20,
                         "timed_out": 1, "failed": 0, "cancelled": 0}
        await barrier(world)
        await world.unexpose(region)

    await group.run(program)


@pytest.mark.parametrize("ops", ["send-recv", "put-get"])
async def test_ended_messages_are_freed_without_the_cycle_collector(group, ops):
    """A message that ended is freed by reference counting. One left in a reference
    cycle (as every MPI send once was: message -> transport state -> engine entry ->
    message) waits for the cyclic garbage collector, whose collections then cost every
    message a share (issue 11: about 13 k instructions per send)."""

    async def program(world):
        me, n = world.mypid, world.numprocs
        right, left = (me + 1) % n, (me - 1) % n
        window = bytearray(64 * 8)
        region = world.expose(window)
        peers = await exchange_regions(world, region, 215)

        async def burst(count):
            if ops == "send-recv":
                recvs = [world.recv(bytearray(8), left, 216) for _ in range(count)]
                msgs = [*(world.send(b"12345678", right, 216) for _ in range(count)), *recvs]
            else:
                msgs = [*(world.put(b"p" * 8, right, peers[right] + 8 * i) for i in range(count)),
                        *(world.get(bytearray(8), left, peers[left] + 8 * i)
                          for i in range(count))]
            for msg in msgs:
                await msg

        await burst(4)  # whatever is made once (tables, caches) is made now
        await barrier(world)
        gc.collect()  # garbage from before this test is gone; what is saved now is new
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            await burst(32)
            await barrier(world)
            gc.collect()
            cyclic = [obj.op.value for obj in gc.garbage if isinstance(obj, mate.Message)]
            await barrier(world)  # ranks sharing this process have all counted
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert not cyclic, f"ended messages left to the cycle collector: {cyclic}"
        await world.unexpose(region)

    await group.run(program)


async def test_one_sided_bounds(group):
    SIZE = 64

    async def program(world):
        me, right, left = ring(world)
        rec = Recorder(world)
        backing, window, _ = backing_for(me, SIZE)
        hidden = bytearray(b"\x55" * 64)  # never exposed
        region = world.expose(window)
        # tell left (who targets me) where my region and my hidden buffer are
        info = bytearray(16)
        r = world.recv(info, right, 210)
        await world.send(struct.pack("<QQ", region.address, address(hidden)), left, 210)
        await r
        addr, hidden_addr = struct.unpack("<QQ", info)
        bad = {
            "before": (addr - 1, 1),
            "across_start": (addr - 4, 8),
            "across_end": (addr + SIZE - 4, 8),
            "after": (addr + SIZE, 1),
            "too_long": (addr, SIZE + 1),
            "hidden": (hidden_addr, 8),
            "nowhere": (16, 8),
        }
        msgs = {}
        for key, (where, length) in bad.items():
            msgs["put_" + key] = world.put(b"\x99" * length, right, where,
                                           schedule=rec.schedule("put_" + key))
            msgs["get_" + key] = world.get(bytearray(length), right, where,
                                           schedule=rec.schedule("get_" + key))
        for key, msg in msgs.items():
            with pytest.raises(mate.MessageFailed) as failure:
                await msg
            assert failure.value.reason is FailureReason.REMOTE_ACCESS, key
        ok = world.put(b"\x77" * SIZE, right, addr, schedule=rec.schedule("ok"))  # exactly fits
        await ok
        done = world.recv(bytearray(4), left, 211)
        await world.send(b"done", right, 211)
        await done
        # my memory: the region has left's one valid put, nothing outside it was touched
        assert window == b"\x77" * SIZE
        assert backing[:PAD] == backing[-PAD:] == b"\xee" * PAD
        assert hidden == b"\x55" * 64
        await asyncio.sleep(SETTLE)
        for key, msg in msgs.items():
            # A put may be submitted before the target refuses it (emulated RMA copies
            # small puts into the request); the failure is the last event either way.
            receipt = rec.check(key, msg, State.FAILED)[-1]
            where, length = bad[key[4:]]
            assert (receipt.remote_pid, receipt.remote_address, receipt.length) == \
                (right, where, 0), key
        rec.check("ok", ok, State.COMPLETED)
        await barrier(world)
        await world.unexpose(region)

    await group.run(program)


async def test_expose_unexpose(group):
    SIZE = 32

    async def program(world):
        me, right, left = ring(world)
        backing, window, pattern = backing_for(me, SIZE)
        region = world.expose(window)
        assert (region.pid, region.length) == (me, SIZE)
        info = bytearray(8)
        r = world.recv(info, right, 220)
        await world.send(struct.pack("<Q", region.address), left, 220)
        await r
        (addr,) = struct.unpack("<Q", info)
        # phase 1: put into right's region works
        await world.put(b"\x01\x02\x03\x04", right, addr)
        told = world.recv(bytearray(4), left, 221)
        await world.send(b"put1", right, 221)
        await told
        assert window[:4] == b"\x01\x02\x03\x04" and window[4:] == pattern[4:]
        # phase 2: I unexpose mine and tell left; then right's region is gone for me
        await world.unexpose(region)
        told = world.recv(bytearray(4), right, 222)
        await world.send(b"gone", left, 222)
        await told
        for msg in (world.put(b"\xff" * 4, right, addr), world.get(bytearray(4), right, addr)):
            with pytest.raises(mate.MessageFailed) as failure:
                await msg
            assert failure.value.reason is FailureReason.REMOTE_ACCESS
        told = world.recv(bytearray(4), left, 223)
        await world.send(b"put2", right, 223)
        await told
        assert window[:4] == b"\x01\x02\x03\x04" and window[4:] == pattern[4:]
        assert backing[:PAD] == backing[-PAD:] == b"\xee" * PAD
        # bad unexposes: raised by the call, as InvalidArgument
        for what in (region, Region(me, 12345, 10), Region(right, addr, SIZE), "region", None):
            with pytest.raises(mate.InvalidArgument) as info_:
                await world.unexpose(what)
            assert isinstance(info_.value, ValueError) and "region" in str(info_.value).lower()
        # bad exposes
        expect_invalid(lambda: world.expose(b"read-only"), "read-only")
        expect_invalid(lambda: world.expose(memoryview(bytearray(8)).toreadonly()), "read-only")
        frozen = np.zeros(8)
        frozen.setflags(write=False)
        expect_invalid(lambda: world.expose(frozen), "read-only")
        expect_invalid(lambda: world.expose(memoryview(bytearray(8))[::2]), "contiguous")
        expect_invalid(lambda: world.expose(3.0), "buffer")
        # exposing again works, and unexposing that
        region2 = world.expose(np.zeros((4, 4)))
        assert region2.length == 128
        await world.unexpose(region2)
        await barrier(world)

    await group.run(program)


# -- handlers ------------------------------------------------------------------------------


async def test_handlers_run_after_the_call_one_at_a_time(group):
    async def program(world):
        me, right, left = ring(world)
        flags = {"in_call": False, "active": 0}
        poster = threading.get_ident()
        seen: list[tuple[Any, Event | None, bool]] = []
        overlaps: list[Any] = []

        def handler(receipt, data):
            if flags["active"]:
                overlaps.append(data)
            flags["active"] += 1
            # inside the posting call = on the posting thread while the call runs (with
            # handlers="progress" a handler may run on another thread at any time)
            inside = flags["in_call"] and threading.get_ident() == poster
            seen.append((data, receipt.event, inside))
            deadline = time.perf_counter() + 0.0005
            while time.perf_counter() < deadline:  # a little work: any overlap would show
                pass
            flags["active"] -= 1

        def sched(key):
            return Schedule(completion=handler, completion_data=key, submission=handler,
                            submission_data=key, timeout=handler, timeout_data=key,
                            failure=handler, failure_data=key)

        def posted(call):
            flags["in_call"] = True
            try:
                return call()
            finally:
                flags["in_call"] = False

        memory = bytearray(16)
        region = world.expose(memory)
        peers = await exchange_regions(world, region, 230)
        # a message that is (most likely) at this rank already when its recv is posted
        early = world.send(message(me, 231, size=16), right, 231)
        notice = world.recv(bytearray(4), left, 232)
        await world.send(b"sent", right, 232)
        await notice
        await asyncio.sleep(0.01)
        msgs = [
            posted(lambda: world.recv(bytearray(16), left, 231, schedule=sched("arrived"))),
            posted(lambda: world.recv(bytearray(16), left, 233, schedule=sched("t0"), timeout=0)),
            posted(lambda: world.put(b"z" * 4, right, peers[right], schedule=sched("put"))),
            posted(lambda: world.put(b"z" * 4, right, 16, schedule=sched("bad_put"))),
            posted(lambda: world.get(bytearray(4), right, peers[right], schedule=sched("get"))),
            posted(lambda: world.send(b"self", me, 234, schedule=sched("self_send"))),
            posted(lambda: world.recv(bytearray(4), me, 234, schedule=sched("self_recv"))),
        ]
        # many messages at once, all with handlers
        many = [posted(lambda i=i: world.send(b"m", right, 240 + i, schedule=sched(("s", i))))
                for i in range(10)]
        many += [posted(lambda i=i: world.recv(bytearray(1), left, 240 + i,
                                               schedule=sched(("r", i)))) for i in range(10)]
        assert not seen, "a handler ran inside the posting call"
        for msg in [*msgs, *many, early]:
            await outcome(msg)
        await asyncio.sleep(SETTLE)
        assert seen and all(not in_call for _, _, in_call in seen)
        assert not overlaps, overlaps
        keys = {data for data, _, _ in seen}
        assert {"arrived", "t0", "put", "bad_put", "get", "self_send", "self_recv"} <= keys
        assert len([e for d, e, _ in seen if d == "t0"]) == 1
        await barrier(world)
        await world.unexpose(region)

    await group.run(program)


async def test_raising_handlers_are_reported(group, caplog):
    loop = asyncio.get_running_loop()
    contexts: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: contexts.append(context))
    caplog.set_level(logging.ERROR, logger="mate")

    class Boom(Exception):
        pass

    def bad(receipt, data):
        raise data

    async def abad(receipt, data):
        await asyncio.sleep(0)
        raise data

    async def program(world):
        me, right, left = ring(world)
        ok: list[Any] = []
        booms = {k: Boom(k, me) for k in ("sync", "async", "submission")}

        def good(receipt, data):
            ok.append(data)

        s = world.send(b"x", right, 250, schedule=Schedule(
            submission=bad, submission_data=booms["submission"],  # raises ...
            completion=good, completion_data="after"))  # ... the next event still runs
        r1 = world.recv(bytearray(1), left, 250, schedule=Schedule(
            completion=bad, completion_data=booms["sync"]))
        r2 = world.recv(bytearray(1), left, 251, schedule=Schedule(
            completion=abad, completion_data=booms["async"]))
        s2 = world.send(b"y", right, 251)
        for msg in (s, r1, r2, s2):
            assert (await msg).event is Event.COMPLETION  # awaiters are not disturbed

        def reported(exc: Boom) -> bool:
            return any(c.get("exception") is exc for c in contexts) and any(
                rec.name == "mate" and rec.levelno >= logging.ERROR and rec.exc_info
                and rec.exc_info[1] is exc for rec in caplog.records)

        await wait_until(lambda: all(map(reported, booms.values())))
        for exc in booms.values():
            (context,) = [c for c in contexts if c.get("exception") is exc]
            assert isinstance(context.get("message"), str) and context["message"]
        # later messages and handlers still work
        r3 = world.recv(bytearray(1), left, 252, schedule=Schedule(completion=good,
                                                                    completion_data="r3"))
        s3 = world.send(b"z", right, 252, schedule=Schedule(completion=good,
                                                            completion_data="s3"))
        await r3
        await s3
        await wait_until(lambda: {"after", "r3", "s3"} <= set(ok))
        await asyncio.sleep(SETTLE)
        assert sorted(ok) == ["after", "r3", "s3"]

    try:
        await group.run(program)
    finally:
        loop.set_exception_handler(old)


async def test_coroutine_handlers_run_as_tasks(group):
    async def program(world):
        me, right, left = ring(world)
        log: list[Any] = []
        answered = asyncio.Event()

        async def serve(receipt, data):
            # a request answered from a handler (the work-stealing pattern)
            log.append(("task", asyncio.current_task() is not None))
            await asyncio.sleep(0.01)
            reply = struct.pack("<i", struct.unpack("<i", data)[0] * 2)
            await world.send(reply, receipt.remote_pid, 261)
            answered.set()

        request = bytearray(4)
        r = world.recv(request, left, 260, schedule=Schedule(completion=serve,
                                                             completion_data=request))
        reply = bytearray(4)
        rr = world.recv(reply, right, 261)
        await world.send(struct.pack("<i", 21 + me), right, 260)
        await r
        assert (await rr).remote_pid == right
        assert struct.unpack("<i", reply)[0] == 2 * (21 + me)
        await asyncio.wait_for(answered.wait(), 2)
        assert log == [("task", True)]

    await group.run(program)


# -- shutdown ------------------------------------------------------------------------------


async def test_shutdown_with_outstanding_messages(fabric):
    async with fabric.open() as group:
        async def program(world):
            me, right, left = ring(world)
            rec = Recorder(world)
            memory = bytearray(8)
            region = world.expose(memory)
            await barrier(world)
            # outstanding messages that only this rank's own shutdown can end...
            mine = {
                "self_recv": world.recv(bytearray(8), me, 270, schedule=rec.schedule("self_recv"),
                                        timeout=0.15),
                "self_send": world.send(message(me, 271, size=LARGE), me, 271,
                                        schedule=rec.schedule("self_send")),
                "any": world.recv(bytearray(8), ANY_SOURCE, 272, schedule=rec.schedule("any"),
                                  timeout=0.15),
            }
            # ... and some that a peer's earlier shutdown may fail instead (PEER_UNREACHABLE)
            theirs = {
                "peer_recv": world.recv(bytearray(8), left, 273,
                                        schedule=rec.schedule("peer_recv")),
                "peer_send": world.send(message(me, 274, size=LARGE), right, 274,
                                        schedule=rec.schedule("peer_send")),
            }
            waiting = asyncio.create_task(outcome(mine["any"]))
            await asyncio.sleep(0.01)
            await world.shutdown()
            assert isinstance(await waiting, asyncio.CancelledError)
            for msg in mine.values():
                with pytest.raises(asyncio.CancelledError):
                    await msg
                assert msg.state is State.CANCELLED and msg.done() and msg.cancel() is False
            for key, msg in theirs.items():
                result = await outcome(msg)
                if msg.state is State.FAILED:
                    assert result.reason is FailureReason.PEER_UNREACHABLE, key
                else:
                    assert isinstance(result, asyncio.CancelledError), key
            await asyncio.sleep(0.25)  # past the armed timeouts: nothing may fire now
            for key, msg in mine.items():
                rec.check(key, msg, State.CANCELLED)
            for key, msg in theirs.items():
                rec.check(key, msg, State.CANCELLED, State.FAILED)
            # use after shutdown: raised by the call itself
            calls = {
                "send": lambda: world.send(b"x", right, 1),
                "recv": lambda: world.recv(bytearray(1), left, 1),
                "put": lambda: world.put(b"x", right, 1024),
                "get": lambda: world.get(bytearray(1), right, 1024),
                "expose": lambda: world.expose(bytearray(4)),
                "progress": lambda: world.progress(),
            }
            for name, call in calls.items():
                exc = expect_invalid(call, "shut down")
                assert isinstance(exc, mate.MateError), name
            with pytest.raises(mate.MateError, match="shut down"):
                await world.unexpose(region)
            await world.shutdown()  # harmless
            await world.shutdown()
            assert not rec.wrong

        await group.run(program)


async def test_events_before_shutdown_keep_their_handlers(fabric):
    """A message that ended just before shutdown is not outstanding: its handler runs."""
    async with fabric.open() as group:
        async def program(world):
            me, right, left = ring(world)
            rec = Recorder(world)
            recvs = [world.recv(bytearray(8), left, 290 + i, schedule=rec.schedule(i))
                     for i in range(4)]
            sends = [world.send(message(me, i, size=8), right, 290 + i) for i in range(4)]
            while not all(r.done() for r in recvs):
                world.progress()  # (needed with progress="manual"; a no-op elsewhere)
                await asyncio.sleep(0)
            await world.shutdown()  # at once: their handlers may still be queued
            await asyncio.sleep(SETTLE)
            for i, r in enumerate(recvs):
                # completed (or failed, if the sender shut down first): either way the
                # handler saw what the awaitable says
                rec.check(i, r, State.COMPLETED, State.FAILED)
                if r.state is State.FAILED:
                    assert r.receipt.error.reason is FailureReason.PEER_UNREACHABLE
            for s in sends:
                assert s.done()

        await group.run(program)


async def test_peer_unreachable_after_shutdown_local(fabric):
    if fabric.transport != "local":
        pytest.skip("local-specific: how a rank that shut down looks to its peers")
    async with fabric.open() as group:
        async def program(world):
            me, n = world.mypid, world.numprocs
            if me == 0:
                await barrier(world)
                await world.shutdown()
                return
            rec = Recorder(world)
            # posted before rank 0 shuts down: they fail instead of hanging
            early = {
                "recv": world.recv(bytearray(8), 0, 280, schedule=rec.schedule("recv")),
                "send": world.send(message(me, 281, size=LARGE), 0, 281,
                                   schedule=rec.schedule("send")),
            }
            await barrier(world)
            for key, msg in early.items():
                with pytest.raises(mate.MessageFailed) as failure:
                    await asyncio.wait_for(msg, 2)
                assert failure.value.reason is FailureReason.PEER_UNREACHABLE, key
            # posted after: they fail too
            late = {
                "late_send": world.send(b"x", 0, 282, schedule=rec.schedule("late_send")),
                "late_large": world.send(message(me, 282, size=LARGE), 0, 282,
                                         schedule=rec.schedule("late_large")),
                "late_recv": world.recv(bytearray(8), 0, 282, schedule=rec.schedule("late_recv")),
                "late_put": world.put(b"x", 0, 4096, schedule=rec.schedule("late_put")),
                "late_get": world.get(bytearray(1), 0, 4096, schedule=rec.schedule("late_get")),
            }
            for key, msg in late.items():
                with pytest.raises(mate.MessageFailed) as failure:
                    await asyncio.wait_for(msg, 2)
                assert failure.value.reason is FailureReason.PEER_UNREACHABLE, key
            # the other live ranks carry on, ANY_SOURCE included
            if n > 2:
                right = 1 + me % (n - 1)
                left = 1 + (me - 2) % (n - 1)
                buf = bytearray(16)
                r = world.recv(buf, ANY_SOURCE, 283)
                await world.send(message(me, 283, size=16), right, 283)
                assert (await r).remote_pid == left
                check_message(buf, 16, left, 283)
            await asyncio.sleep(SETTLE)
            for key, msg in {**early, **late}.items():
                rec.check(key, msg, State.FAILED)

        await group.run(program)


# -- invalid arguments ---------------------------------------------------------------------


async def test_invalid_arguments(group):
    async def program(world):
        me, right, left = ring(world)
        n = world.numprocs
        rec = Recorder(world)
        S = rec.schedule("never")  # a valid schedule: its handlers must never run
        T = 140
        ro_array = np.zeros(8)
        ro_array.setflags(write=False)
        buf = bytearray(8)
        region = world.expose(bytearray(8))
        addr = region.address
        send, recv, put, get = world.send, world.recv, world.put, world.get
        cases: list[tuple[Callable[[], Any], tuple[str, ...]]] = [
            # ranks
            *[(lambda d=d: send(b"bad", d, T, schedule=S), ("dest",))
              for d in (-2, n, n + 5, 1.0, "1", None, True, False, ANY_SOURCE)],
            *[(lambda s=s: recv(buf, s, T, schedule=S), ("source",))
              for s in (-2, n, 2 * n, 0.0, "0", True)],
            *[(lambda d=d: put(b"bad", d, addr, schedule=S), ("dest",))
              for d in (ANY_SOURCE, n, True, 1.5)],
            *[(lambda s=s: get(buf, s, addr, schedule=S), ("source",))
              for s in (ANY_SOURCE, n, False, "0")],
            # tags
            *[(lambda t=t: send(b"bad", right, t, schedule=S), ("tag",))
              for t in (ANY_TAG, -5, world.tag_max + 1, 2**63, "3", 1.5, True)],
            *[(lambda t=t: recv(buf, left, t, schedule=S), ("tag",))
              for t in (-2, world.tag_max + 1, "3", 2.0, False)],
            # buffers
            (lambda: recv(b"bytes!!!", left, T, schedule=S), ("read-only",)),
            (lambda: recv(memoryview(bytearray(8)).toreadonly(), left, T, schedule=S),
             ("read-only",)),
            (lambda: recv(ro_array, left, T, schedule=S), ("read-only",)),
            (lambda: get(b"bytes!!!", right, addr, schedule=S), ("read-only",)),
            (lambda: world.expose(b"bytes"), ("read-only",)),
            (lambda: send(np.arange(8)[::2], right, T, schedule=S), ("contiguous",)),
            (lambda: recv(np.zeros((4, 4))[:, 1], left, T, schedule=S), ("contiguous",)),
            (lambda: put(memoryview(b"abcdef")[::2], right, addr, schedule=S), ("contiguous",)),
            (lambda: get(np.zeros((4, 4)).T, right, addr, schedule=S), ("contiguous",)),
            (lambda: world.expose(np.zeros((2, 4))[:, ::2]), ("contiguous",)),
            *[(lambda o=o: send(o, right, T, schedule=S), ("buffer",))
              for o in ("text", 42, [1, 2], None, object())],
            (lambda: recv(None, left, T, schedule=S), ("buffer",)),
            (lambda: recv("text", left, T, schedule=S), ("buffer",)),
            (lambda: put(3.5, right, addr, schedule=S), ("buffer",)),
            (lambda: get([0], right, addr, schedule=S), ("buffer",)),
            # schedules
            *[(lambda v=v: send(b"bad", right, T, schedule=v), ("schedule",))
              for v in ("x", lambda r, d: None, {"completion": print}, Schedule)],
            (lambda: recv(buf, left, T, schedule=42), ("schedule",)),
            (lambda: put(b"x", right, addr, schedule=[S]), ("schedule",)),
            (lambda: get(buf, right, addr, schedule=object()), ("schedule",)),
            (lambda: Schedule(completion=42), ("completion", "callable")),
            (lambda: Schedule(submission="handler"), ("submission", "callable")),
            (lambda: Schedule(timeout=object()), ("timeout", "callable")),
            (lambda: Schedule(failure=[print]), ("failure", "callable")),
            # timeouts
            *[(lambda t=t: send(b"bad", right, T, schedule=S, timeout=t), ("timeout",))
              for t in (-1, -0.001, math.nan, "1", True, [1])],
            *[(lambda t=t: recv(buf, left, T, schedule=S, timeout=t), ("timeout",))
              for t in (-1, math.nan, -math.inf, "0.1")],
            (lambda: put(b"x", right, addr, schedule=S, timeout=-2), ("timeout",)),
            (lambda: get(buf, right, addr, schedule=S, timeout=math.nan), ("timeout",)),
            # addresses
            *[(lambda a=a: put(b"x", right, a, schedule=S), ("address",))
              for a in (-1, -(2**40), "0x10", 1.5, None, True)],
            *[(lambda a=a: get(buf, right, a, schedule=S), ("address",))
              for a in (-100, 2.0, "x")],
        ]
        for call, words in cases:
            expect_invalid(call, *words)
        assert buf == bytes(8)
        # no message was started by a call that raised: the next message from left on
        # tag T is its probe (no bad send went out), and it reaches the probe recv (no bad
        # recv swallowed it); nothing else arrives; no handler ran
        probe = bytearray(16)
        r = recv(probe, left, T, timeout=5)
        await send(message(me, T, size=16), right, T)
        receipt = await r
        assert (receipt.remote_pid, receipt.length) == (left, 16)
        check_message(probe, 16, left, T)
        with pytest.raises(mate.MessageTimeout):
            await recv(bytearray(64), left, T, timeout=0.1)
        await asyncio.sleep(SETTLE)
        assert not rec.calls
        await barrier(world)
        await world.unexpose(region)

    await group.run(program)
