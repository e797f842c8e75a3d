"""Fuzzing the public API: every call works or raises `InvalidArgument`, and what works ends.

Theory of operation
-------------------
Hypothesis draws the arguments of every public call -- `world.send`, `recv`,
`put`, `get`, `expose`, `unexpose`, `progress`, `stats`, `mate.Schedule`,
`mate.startup` and `mate.local.worlds` with their options, and every call
on a world that has shut down -- from strategies that mix good values with
bad ones: buffers of every kind (bytes, bytearray, memoryviews writable,
read-only, released, strided, multi-dimensional and of other formats, NumPy
arrays contiguous or not, read-only, empty and of many dtypes, array.array,
ctypes arrays, mmap, non-buffers), numbers in and out of range, bools,
floats, NumPy scalars, huge ints, NaN and infinities, strings, and the
wildcards where they are not allowed.

Every drawn value carries a verdict, from SPEC §2: GOOD (the call must
accept it), BAD (the call must refuse it with `InvalidArgument`) or EITHER
(the spec does not say: a NumPy float32 as a timeout, a huge int). A call
whose arguments hold a BAD value must raise `InvalidArgument`, one whose
arguments are all GOOD must return; whatever the verdict, no other
exception may come out of the call. Each example draws one argument (or,
a third of the time, all of them) from everything and the others from good
values only, so that a wrongly accepted value is not hidden behind another
bad one. A call that returns a `Message` must
then end: each message goes to this rank itself (loopback, so that ranks
never coordinate per example), with a matching operation posted for it, and
every wait is bounded, so that a message that never ends fails the test
instead of hanging it. Its outcome must be one that a correct call can
have (completion; a timeout if one was armed; a failure only with
TRUNCATED or REMOTE_ACCESS, faults of the transfer, never of an argument),
its data must be right, the canaries around the exposed memory must hold,
`progress()`, `stats()` and timeouts must keep working, handlers must get
receipts with their event and datum, and nothing may reach the loop's
exception handler.

The same tests run on the local transport in this process and, through
`test_*_under_*` below, on real processes: mpi under mpiexec and ibverbs
(soft device) under mate-run, each rank fuzzing its own world. Example
counts are modest; ``MATE_FUZZ_EXAMPLES=N`` sets the number per test
(docs/fuzzing.md has the long run).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import mmap
import os
import pickle
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from decimal import Decimal
from fractions import Fraction
from typing import Any

import attrs
import numpy as np
import pytest
from conftest import LAUNCHED, Fabric
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from launch import run_under_mate_run, run_under_mpiexec

import mate
from mate import ANY_SOURCE, ANY_TAG, UNSET, FailureReason, State
from mate.transports.base import Operation, Transport
from mate.world import World

EXAMPLES = int(os.environ.get("MATE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None,
    # Launched ranks fuzz side by side: no shared example database between them.
    database=None if LAUNCHED else settings.default.database,
    # One world serves every example of a test (a launched world's startup is collective).
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large])
BOUND = 15.0  # seconds any message may take to end here; far beyond what it takes
REGION = 4096  # bytes of the exposed region that put and get aim at
CANARY = 256  # bytes of 0xA5 on either side of it
PATTERN = bytes(range(256)) * (REGION // 256)

GOOD, BAD, EITHER = "good", "bad", "either"


@attrs.frozen
class Arg:
    """A drawn argument and what SPEC §2 says of it."""

    value: Any
    verdict: str
    note: str = ""

    def __repr__(self) -> str:
        return f"<{self.verdict} {self.note or repr(self.value)[:60]}>"


def joint(*verdicts: str) -> str:
    """A call's verdict: BAD if any argument is, GOOD if all are, else EITHER."""
    if BAD in verdicts:
        return BAD
    return GOOD if all(v == GOOD for v in verdicts) else EITHER


def attempt(call: Callable[[], Any], verdict: str) -> Any:
    """Make `call`; what it raised or returned must suit `verdict`. The result, or
    None if it raised InvalidArgument."""
    try:
        result = call()
    except mate.InvalidArgument as exc:
        assert verdict != GOOD, f"a good call was refused: {exc}"
        assert str(exc), "InvalidArgument without a message"
        return None
    except Exception as exc:
        raise AssertionError(f"the call raised {exc!r}, not InvalidArgument") from exc
    assert verdict != BAD, f"a bad call was accepted and returned {result!r}"
    return result


# -- numbers -------------------------------------------------------------------------------

# Values that are no integer however they are looked at.
NOT_INTEGERS = [Arg(True, BAD, "True"), Arg(False, BAD, "False"), Arg(0.0, BAD),
                Arg(1.0, BAD), Arg(float("nan"), BAD), Arg(float("inf"), BAD),
                Arg("0", BAD), Arg(None, BAD), Arg(b"\0", BAD), Arg([0], BAD), Arg(0j, BAD),
                Arg(np.float64(0.0), BAD, "np.float64(0)"), Arg(Decimal(0), BAD, "Decimal(0)"),
                Arg(object(), BAD, "object()")]


def ranks(world: mate.World, *, wildcard: bool, good_only: bool = False
          ) -> st.SearchStrategy[Arg]:
    """A rank for a call on `world`; the only good one is the rank itself (loopback)."""
    me, n = world.mypid, world.numprocs
    good = [Arg(me, GOOD), Arg(np.int64(me), GOOD, f"np.int64({me})"),
            Arg(np.uint8(me), GOOD, f"np.uint8({me})")]
    if wildcard:
        good.append(Arg(ANY_SOURCE, GOOD, "ANY_SOURCE"))
    if good_only:
        return st.sampled_from(good)
    bad = [Arg(n, BAD), Arg(n + 5, BAD), Arg(-2, BAD), Arg(mate.PROC_MAX, BAD),
           Arg(2**64, BAD), Arg(-(2**70), BAD), Arg(np.int64(-3), BAD, "np.int64(-3)"),
           *NOT_INTEGERS]
    if not wildcard:
        bad.append(Arg(ANY_SOURCE, BAD, "ANY_SOURCE"))
    return st.one_of(st.sampled_from(good), st.sampled_from(bad),
                     st.integers(n, 2**80).map(lambda v: Arg(v, BAD)),
                     st.integers(-(2**80), -2).map(lambda v: Arg(v, BAD)))


def tags(world: mate.World, *, wildcard: bool, good_only: bool = False
         ) -> st.SearchStrategy[Arg]:
    top = world.tag_max
    good = st.one_of(st.integers(0, 40), st.just(top), st.integers(0, top)).map(
        lambda v: Arg(v, GOOD))
    special = [Arg(np.int32(7), GOOD, "np.int32(7)"), Arg(np.uint64(top), GOOD, "np.uint64(max)")]
    if wildcard:
        special.append(Arg(ANY_TAG, GOOD, "ANY_TAG"))
    if good_only:
        return st.one_of(good, st.sampled_from(special))
    bad = [Arg(top + 1, BAD, "tag_max + 1"), Arg(-2, BAD), Arg(2**63, BAD),
           Arg(np.int64(-5), BAD, "np.int64(-5)"), *NOT_INTEGERS]
    if not wildcard:
        bad.append(Arg(ANY_TAG, BAD, "ANY_TAG"))
    return st.one_of(good, st.sampled_from(special), st.sampled_from(bad),
                     st.integers(top + 1, 2**70).map(lambda v: Arg(v, BAD)))


def addresses(region: mate.Region, n: int, *, good_only: bool = False
              ) -> st.SearchStrategy[Arg]:
    """Target addresses for an `n`-byte put or get; in the region, or anywhere in 2**64."""
    limit = 2**64
    inside = st.integers(0, max(region.length - n, 0)).map(
        lambda off: Arg(region.address + off, GOOD, f"region+{off}"))
    near = st.integers(-64, region.length + 64).filter(
        lambda off: 0 <= region.address + off <= limit - n).map(
        lambda off: Arg(region.address + off, GOOD, f"region{off:+d}"))
    anywhere = st.integers(0, limit - max(n, 1)).map(lambda v: Arg(v, GOOD))
    good = [Arg(0, GOOD), Arg(limit - max(n, 1), GOOD, "2**64 - max(n, 1)"),
            Arg(np.uint64(region.address), GOOD, "np.uint64(region)")]
    if good_only:
        return st.one_of(inside, inside, near, anywhere, st.sampled_from(good))
    special = [*good, Arg(-1, BAD), Arg(limit, BAD, "2**64"), Arg(2**70, BAD),
               Arg(-(2**64), BAD), Arg(np.int64(-1), BAD, "np.int64(-1)"), *NOT_INTEGERS]
    if n:
        special.append(Arg(limit - n + 1, BAD, "ends past 2**64"))
    return st.one_of(inside, inside, near, anywhere, st.sampled_from(special),
                     st.integers(-(2**80), -1).map(lambda v: Arg(v, BAD)))


TIMEOUTS = [Arg(UNSET, GOOD, "UNSET"), Arg(None, GOOD), Arg(0, GOOD), Arg(0.0, GOOD),
            Arg(1e-4, GOOD), Arg(0.05, GOOD), Arg(1, GOOD), Arg(1e6, GOOD), Arg(1e300, GOOD),
            Arg(sys.float_info.max, GOOD, "float max"), Arg(np.float64(0.01), GOOD, "np.f64"),
            Arg(-1, BAD), Arg(-1e-9, BAD), Arg(float("nan"), BAD), Arg(float("inf"), BAD),
            Arg(float("-inf"), BAD), Arg(True, BAD), Arg(False, BAD), Arg("1", BAD),
            Arg([], BAD), Arg(1j, BAD), Arg(object(), BAD, "object()"),
            Arg(np.float64("nan"), BAD, "np.f64(nan)"),
            # Numbers SPEC §2 says nothing of: refused or taken, but never a crash.
            Arg(np.float32(0.01), EITHER, "np.f32"), Arg(np.int64(1), EITHER, "np.int64(1)"),
            Arg(10**400, EITHER, "10**400"), Arg(Decimal("0.01"), EITHER, "Decimal"),
            Arg(Fraction(1, 100), EITHER, "Fraction")]


def timeouts(*, good_only: bool = False) -> st.SearchStrategy[Arg]:
    small = st.floats(0, 0.05).map(lambda v: Arg(v, GOOD))
    if good_only:
        return st.one_of(st.sampled_from([t for t in TIMEOUTS if t.verdict == GOOD]), small)
    return st.one_of(st.sampled_from(TIMEOUTS), small,
                     st.floats(max_value=-1e-300).map(lambda v: Arg(v, BAD)),
                     st.integers(-(2**1100), 2**1100).map(_int_seconds))


def _int_seconds(value: int) -> Arg:
    """An int timeout: good if a float can hold it, bad if negative; else for mate to say."""
    return Arg(value, BAD if value < 0 else GOOD if value < 2**1024 else EITHER,
               f"int of {value.bit_length()} bits")


# -- buffers -------------------------------------------------------------------------------

RW, RO = "writable", "read-only"  # buffer verdicts besides BAD and EITHER


def buffer_verdict(arg: Arg, writes: bool) -> str:
    """A read-only buffer is good to send or put from, bad to receive, get or expose into."""
    if arg.verdict == RW:
        return GOOD
    if arg.verdict == RO:
        return BAD if writes else GOOD
    return arg.verdict


def released() -> memoryview:
    view = memoryview(bytearray(8))
    view.release()
    return view


def closed_mmap() -> mmap.mmap:
    m = mmap.mmap(-1, 16)
    m.close()
    return m


def readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


DTYPES = ["u1", "i2", "<i4", ">i4", "u8", "f4", "f8", "c16", "?", "f2", "S3", "U2",
          [("a", "u1"), ("b", "<f8")]]


WRITABLE_KINDS = ["bytearray", "mv", "mv-2d", "mv-int", "mv-strided-short", "np", "np-2d",
                  "np-empty-2d", "array", "ctypes", "mmap", "picklebuffer"]
READ_ONLY_KINDS = ["bytes", "mv-bytes", "mv-readonly", "np-readonly"]
BUFFER_KINDS = [*WRITABLE_KINDS, *READ_ONLY_KINDS, "mv-released", "mv-strided", "np-strided",
                "np-fortran", "np-transposed", "np-object", "np-datetime", "ctypes-object",
                "mmap-closed", "str", "int", "float", "none", "object", "list", "bool"]


@st.composite
def buffers(draw: st.DrawFn, good_for: bool | None = None) -> Arg:
    """A buffer argument: its verdict is RW, RO, BAD or EITHER. `good_for`: only buffers
    good for a call that writes into them (True) or reads them (False)."""
    n = draw(st.one_of(st.integers(0, 16), st.integers(0, 16), st.integers(0, 16),
                       st.sampled_from([63, 4096, 4097, 8192, 8193, 70_000])))
    fill = bytes((i * 7 + n) & 0xFF for i in range(n))
    kind = draw(st.sampled_from(BUFFER_KINDS if good_for is None else WRITABLE_KINDS
                                if good_for else WRITABLE_KINDS + READ_ONLY_KINDS))
    if kind == "bytes":
        return Arg(bytes(fill), RO, f"bytes[{n}]")
    if kind == "bytearray":
        return Arg(bytearray(fill), RW, f"bytearray[{n}]")
    if kind == "mv":
        return Arg(memoryview(bytearray(fill)), RW, f"memoryview[{n}]")
    if kind == "mv-bytes":
        return Arg(memoryview(bytes(fill)), RO, f"memoryview(bytes[{n}])")
    if kind == "mv-readonly":
        return Arg(memoryview(bytearray(fill)).toreadonly(), RO, f"readonly memoryview[{n}]")
    if kind == "mv-released":
        return Arg(released(), BAD, "released memoryview")
    if kind == "mv-strided":  # every other byte: contiguous with one item, empty with none
        view = memoryview(bytearray(2 * n))[::2]
        return Arg(view, BAD if n > 1 else RW, f"memoryview[::2] of {n}")
    if kind == "mv-strided-short":  # a stride, over one item or none: contiguous after all
        m = n % 2
        return Arg(memoryview(bytearray(2 * m))[::2], RW, f"memoryview[::2] of {m}")
    if kind == "mv-2d":  # (memoryview casts to no shape with a zero in it)
        rows = draw(st.integers(1, 4))
        return Arg(memoryview(bytearray(rows * max(n, 1))).cast("B", (rows, max(n, 1))), RW,
                   f"memoryview {rows}x{max(n, 1)}")
    if kind == "mv-int":
        return Arg(memoryview(bytearray(4 * n)).cast("i"), RW, f"memoryview 'i'[{n}]")
    if kind.startswith("np"):
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        if kind == "np":
            return Arg(np.zeros(n, dtype), RW, f"np {dtype}[{n}]")
        if kind == "np-2d":
            return Arg(np.zeros((3, n), dtype), RW, f"np {dtype}[3,{n}]")
        if kind == "np-readonly":
            return Arg(readonly(np.zeros(n, dtype)), RO, f"read-only np {dtype}[{n}]")
        if kind == "np-strided":
            return Arg(np.zeros(2 * n, dtype)[::2], BAD if n > 1 else RW, f"np[::2] of {n}")
        if kind == "np-fortran":
            return Arg(np.zeros((3, n), dtype, order="F"), BAD if n > 1 else RW,
                       f"Fortran np {dtype}[3,{n}]")
        if kind == "np-transposed":
            return Arg(np.zeros((n, 2), dtype).T, BAD if n > 1 else RW, f"np[{n},2].T")
        if kind == "np-empty-2d":
            return Arg(np.zeros((0, n), dtype), RW, f"np {dtype}[0,{n}]")
        if kind == "np-object":  # references to Python objects: never bytes on a wire
            return Arg(np.empty(max(n, 1), object), BAD, f"np object[{max(n, 1)}]")
        return Arg(np.zeros(n, "M8[s]"), BAD, "np datetime64")  # no buffer protocol
    if kind == "array":
        code = draw(st.sampled_from("bBhHiIlLqQfdu"))
        return Arg(array.array(code, bytes(array.array(code).itemsize * n)), RW,
                   f"array('{code}')[{n}]")
    if kind == "ctypes":
        return Arg((ctypes.c_int32 * n)(), RW, f"c_int32[{n}]")
    if kind == "ctypes-object":
        return Arg((ctypes.py_object * max(n, 1))(), BAD, "py_object array")
    if kind == "mmap":
        m = mmap.mmap(-1, max(n, 1))
        m.write(fill or b"\0")
        return Arg(m, RW, f"mmap[{max(n, 1)}]")
    if kind == "mmap-closed":
        return Arg(closed_mmap(), BAD, "closed mmap")
    if kind == "picklebuffer":
        return Arg(pickle.PickleBuffer(bytearray(fill)), RW, f"PickleBuffer[{n}]")
    return Arg({"str": "abc", "int": 7, "float": 1.5, "none": None, "object": object(),
                "list": [1, 2], "bool": True}[kind], BAD, kind)


def flat(obj: Any) -> bytes:
    """The bytes of a buffer, in C order."""
    return memoryview(obj).tobytes()


# -- schedules -----------------------------------------------------------------------------

class Events:
    """What the handlers of the fuzzed schedules saw: (receipt, datum) per call."""

    def __init__(self) -> None:
        self.seen: list[tuple[mate.Receipt, Any]] = []

    def handler(self, receipt: mate.Receipt, data: Any) -> None:
        self.seen.append((receipt, data))

    async def async_handler(self, receipt: mate.Receipt, data: Any) -> None:
        await asyncio.sleep(0)
        self.seen.append((receipt, data))

    def check(self) -> None:
        """Every handler got a receipt of its event, and its schedule's datum (only the
        completion handler has one here)."""
        seen, self.seen = self.seen, []
        for receipt, data in seen:
            assert isinstance(receipt, mate.Receipt) and isinstance(receipt.event, mate.Event)
            assert data == ("c" if receipt.event is mate.Event.COMPLETION else None), (
                receipt, data)


HANDLER_FIELDS = ("completion", "submission", "timeout", "failure")


@st.composite
def handler_values(draw: st.DrawFn, events: Events) -> Arg:
    return draw(st.sampled_from([
        Arg(None, GOOD), Arg(events.handler, GOOD, "handler"),
        Arg(events.async_handler, GOOD, "async handler"),
        Arg(print, GOOD, "builtin"), Arg(Events, GOOD, "a class"),
        Arg("handler", BAD), Arg(1, BAD), Arg(b"", BAD), Arg([events.handler], BAD),
        Arg(object(), BAD, "object()")]))


def schedules(events: Events, *, good_only: bool = False) -> st.SearchStrategy[Arg]:
    """A `schedule=` argument: None, a Schedule, or something else."""
    good = st.builds(lambda c, t, f: Arg(mate.Schedule(completion=c, completion_data="c",
                                                       timeout=t, failure=f), GOOD,
                                         "Schedule"),
                     st.sampled_from([None, events.handler, events.async_handler]),
                     st.sampled_from([None, events.handler]), st.sampled_from([None,
                                                                               events.handler]))
    if good_only:
        return st.one_of(st.just(Arg(None, GOOD)), good)
    return st.one_of(st.just(Arg(None, GOOD)), good, st.sampled_from([
        Arg(mate.Schedule(), GOOD, "Schedule()"), Arg("schedule", BAD),
        Arg(events.handler, BAD, "a handler, not a Schedule"), Arg({}, BAD),
        Arg(1, BAD)]))


# -- the harness ---------------------------------------------------------------------------

class Harness:
    """One world under fuzz, for every example of a test: its exposed region (with
    canaries), and the loop's exception handler, which must stay silent."""

    def __init__(self, world: mate.World) -> None:
        self.world = world
        self.me = world.mypid
        self.memory = bytearray(b"\xa5" * CANARY + PATTERN + b"\xa5" * CANARY)
        self.area = memoryview(self.memory)[CANARY:CANARY + REGION]
        self.region = world.expose(self.area)
        self.events = Events()
        self.errors: list[dict[str, Any]] = []
        # Set once a message ended without its data being taken (a send that timed out
        # may still arrive later, a put may still land): exact data checks stop there.
        self.stale = False
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: self.errors.append(ctx))

    def region_bytes(self, address: int, n: int) -> bytes:
        offset = address - self.region.address
        return bytes(self.area[offset:offset + n])

    async def settle(self, *msgs: mate.Message) -> None:
        """Wait, bounded, until every message has ended."""
        waiting = [asyncio.ensure_future(_quiet(m)) for m in msgs]
        _, late = await asyncio.wait(waiting, timeout=BOUND)
        for task in late:
            task.cancel()
        assert not late, f"still going after {BOUND} s: {[m for m in msgs if not m.done()]}"

    async def check(self) -> None:
        """After each example: canaries, progress, a timeout still fires, stats, and no
        error reported to the loop."""
        await asyncio.sleep(0)  # handlers queued on the loop run
        assert self.memory[:CANARY] == self.memory[-CANARY:] == b"\xa5" * CANARY
        self.world.progress()
        # A receive nothing is sent for: it ends (by its timeout; a stray message would
        # do too) whatever the examples before did to the deadlines.
        await self.settle(self.world.recv(bytearray(8), self.me, self.world.tag_max - 1,
                                          timeout=0.001))
        stats = self.world.stats()
        assert all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in stats.items())
        self.events.check()
        assert not self.errors, self.errors


async def _quiet(msg: mate.Message) -> None:
    with contextlib.suppress(mate.MessageTimeout, mate.MessageFailed, asyncio.CancelledError):
        await msg


def assert_fair(msg: mate.Message, *, cancelled: bool = False) -> None:
    """`msg` ended as a message with good arguments may: never failed by an argument."""
    state = msg.state
    allowed = {State.COMPLETED, State.TIMED_OUT, State.FAILED}
    if cancelled:
        allowed.add(State.CANCELLED)
    assert state in allowed, f"{msg!r} ended {state.name}"
    if state is State.FAILED:
        assert isinstance(msg.error, mate.MessageFailed)
        fair = {mate.Op.RECV: {FailureReason.TRUNCATED},
                mate.Op.PUT: {FailureReason.REMOTE_ACCESS},
                mate.Op.GET: {FailureReason.REMOTE_ACCESS}}.get(msg.op, set())
        assert msg.error.reason in fair, f"{msg!r} failed: {msg.error!r}"
    if state is State.TIMED_OUT:
        assert msg.deadline is not None, f"{msg!r} timed out with no timeout armed"


@pytest.fixture
async def harness(fabric: Fabric) -> AsyncIterator[Harness]:
    """One world for all the examples of a test (launched, its options come from the
    launcher: handlers="progress" with a progress thread)."""
    async with fabric.open() as group:
        h = Harness(group.worlds[0])
        yield h
        await asyncio.wait_for(h.world.unexpose(h.region), BOUND)


@pytest.fixture
async def dead_world(fabric: Fabric) -> AsyncIterator[tuple[mate.World, mate.Region]]:
    """A world that has shut down, with a region it exposed and a receive it left."""
    async with fabric.open() as group:
        world = group.worlds[0]
        region = world.expose(bytearray(64))
        pending = world.recv(bytearray(8), world.mypid, 1)
    assert pending.state is State.CANCELLED  # ended by the shutdown, with no event
    await world.shutdown()  # again: nothing to do
    yield world, region


def focus(data: st.DataObject, *names: str) -> dict[str, bool]:
    """Which arguments are drawn from everything: one of them, or (a third of the time)
    all; the others from good values, so that a bad value is not hidden behind another
    bad one (which makes InvalidArgument right whatever the first does)."""
    chosen = data.draw(st.sampled_from([*names, *["all"] * (len(names) // 2)]), "focus")
    return {name: chosen in (name, "all") for name in names}


# -- two-sided -----------------------------------------------------------------------------

@FUZZ
@given(data=st.data())
async def test_send_works_or_refuses(harness: Harness, data: st.DataObject) -> None:
    h = harness
    free = focus(data, "buffer", "dest", "tag", "schedule", "timeout")
    buffer = data.draw(buffers(None if free["buffer"] else False), "buffer")
    dest = data.draw(ranks(h.world, wildcard=False, good_only=not free["dest"]), "dest")
    tag = data.draw(tags(h.world, wildcard=False, good_only=not free["tag"]), "tag")
    schedule = data.draw(schedules(h.events, good_only=not free["schedule"]), "schedule")
    timeout = data.draw(timeouts(good_only=not free["timeout"]), "timeout")
    verdict = joint(buffer_verdict(buffer, False), dest.verdict, tag.verdict,
                    schedule.verdict, timeout.verdict)
    msg = attempt(lambda: h.world.send(buffer.value, dest.value, tag.value,
                                       schedule=schedule.value, timeout=timeout.value), verdict)
    if msg is not None:
        assert isinstance(msg, mate.Message) and msg.op is mate.Op.SEND
        payload = flat(buffer.value)
        inbox = bytearray(len(payload))
        partner = h.world.recv(inbox, h.me, msg.tag, timeout=BOUND / 3)
        await h.settle(msg)
        if msg.state is not State.COMPLETED and not partner.done():
            partner.cancel()  # withdrawn before its match: no data may come
        await h.settle(partner)
        assert_fair(msg)
        assert_fair(partner, cancelled=True)
        if msg.state is not State.COMPLETED or partner.state is not State.COMPLETED:
            h.stale = True
        elif not h.stale:
            assert bytes(inbox) == payload
            assert (partner.receipt.remote_pid, partner.receipt.length) == (h.me, len(payload))
    await h.check()


@FUZZ
@given(data=st.data())
async def test_recv_works_or_refuses(harness: Harness, data: st.DataObject) -> None:
    h = harness
    free = focus(data, "buffer", "source", "tag", "schedule", "timeout")
    buffer = data.draw(buffers(None if free["buffer"] else True), "buffer")
    source = data.draw(ranks(h.world, wildcard=True, good_only=not free["source"]), "source")
    tag = data.draw(tags(h.world, wildcard=True, good_only=not free["tag"]), "tag")
    schedule = data.draw(schedules(h.events, good_only=not free["schedule"]), "schedule")
    timeout = data.draw(timeouts(good_only=not free["timeout"]), "timeout")
    verdict = joint(buffer_verdict(buffer, True), source.verdict, tag.verdict,
                    schedule.verdict, timeout.verdict)
    msg = attempt(lambda: h.world.recv(buffer.value, source.value, tag.value,
                                       schedule=schedule.value, timeout=timeout.value), verdict)
    if msg is not None:
        assert isinstance(msg, mate.Message) and msg.op is mate.Op.RECV
        assert msg.submitted is None
        room = len(flat(buffer.value))
        payload = bytes((i * 13 + 5) & 0xFF for i in range(room))
        sent_tag = 0 if msg.tag == ANY_TAG else msg.tag
        partner = h.world.send(payload, h.me, sent_tag, timeout=BOUND / 3)
        await h.settle(msg)
        assert_fair(msg)
        if msg.state is State.TIMED_OUT:
            # It took nothing: take the partner's message off the wire (or out of the
            # unexpected messages), for the next example's receive must not get it.
            drain = h.world.recv(bytearray(room), h.me, sent_tag, timeout=BOUND / 3)
            await h.settle(drain)
            assert_fair(drain)
        await h.settle(partner)
        assert_fair(partner)
        if partner.state is not State.COMPLETED:
            h.stale = True
        if msg.state is State.COMPLETED and not h.stale:
            receipt = msg.receipt
            assert (receipt.remote_pid, receipt.tag, receipt.length) == (h.me, sent_tag, room)
            assert flat(buffer.value) == payload
    await h.check()


# -- one-sided -----------------------------------------------------------------------------

@FUZZ
@given(data=st.data())
async def test_put_works_or_refuses(harness: Harness, data: st.DataObject) -> None:
    h = harness
    free = focus(data, "buffer", "dest", "address", "schedule", "timeout")
    buffer = data.draw(buffers(None if free["buffer"] else False), "buffer")
    n = len(flat(buffer.value)) if buffer.verdict != BAD else 0
    dest = data.draw(ranks(h.world, wildcard=False, good_only=not free["dest"]), "dest")
    address = data.draw(addresses(h.region, n, good_only=not free["address"]), "address")
    schedule = data.draw(schedules(h.events, good_only=not free["schedule"]), "schedule")
    timeout = data.draw(timeouts(good_only=not free["timeout"]), "timeout")
    verdict = joint(buffer_verdict(buffer, False), dest.verdict, address.verdict,
                    schedule.verdict, timeout.verdict)
    before = bytes(h.area)
    msg = attempt(lambda: h.world.put(buffer.value, dest.value, address.value,
                                      schedule=schedule.value, timeout=timeout.value), verdict)
    if msg is not None:
        assert isinstance(msg, mate.Message) and msg.op is mate.Op.PUT
        await h.settle(msg)
        assert_fair(msg)
        inside = h.region.contains(msg.address, n)
        if msg.state is State.COMPLETED:
            assert inside, f"a put outside the region completed: {msg!r}"
            if not h.stale:
                assert h.region_bytes(msg.address, n) == flat(buffer.value)
        elif msg.state is State.FAILED:
            assert not inside, f"a put inside the region failed: {msg!r}"
            assert h.stale or bytes(h.area) == before  # refused: nothing touched
        else:
            h.stale = True  # timed out: it may still land
    elif not h.stale:
        assert bytes(h.area) == before
    await h.check()


@FUZZ
@given(data=st.data())
async def test_get_works_or_refuses(harness: Harness, data: st.DataObject) -> None:
    h = harness  # nothing writes its region here: it keeps PATTERN
    free = focus(data, "buffer", "source", "address", "schedule", "timeout")
    buffer = data.draw(buffers(None if free["buffer"] else True), "buffer")
    n = len(flat(buffer.value)) if buffer.verdict != BAD else 0
    source = data.draw(ranks(h.world, wildcard=False, good_only=not free["source"]), "source")
    address = data.draw(addresses(h.region, n, good_only=not free["address"]), "address")
    schedule = data.draw(schedules(h.events, good_only=not free["schedule"]), "schedule")
    timeout = data.draw(timeouts(good_only=not free["timeout"]), "timeout")
    verdict = joint(buffer_verdict(buffer, True), source.verdict, address.verdict,
                    schedule.verdict, timeout.verdict)
    before = flat(buffer.value) if buffer.verdict != BAD else b""
    msg = attempt(lambda: h.world.get(buffer.value, source.value, address.value,
                                      schedule=schedule.value, timeout=timeout.value), verdict)
    if msg is not None:
        assert isinstance(msg, mate.Message) and msg.op is mate.Op.GET
        await h.settle(msg)
        assert_fair(msg)
        inside = h.region.contains(msg.address, n)
        if msg.state is State.COMPLETED:
            assert inside, f"a get outside the region completed: {msg!r}"
            assert flat(buffer.value) == h.region_bytes(msg.address, n)
        else:  # refused (outside) or timed out: the buffer is never written
            assert msg.state is State.TIMED_OUT or not inside, f"{msg!r} failed inside"
            assert flat(buffer.value) == before
    assert bytes(h.area) == PATTERN
    await h.check()


@FUZZ
@given(data=st.data())
async def test_expose_and_unexpose_work_or_refuse(harness: Harness,
                                                 data: st.DataObject) -> None:
    h = harness
    world = h.world
    # Everything is drawn first: an example that hypothesis stops at a draw must not
    # leave exposures behind for the next one.
    buffer = data.draw(buffers(), "buffer")
    times = data.draw(st.integers(1, 3), "times exposed")
    strangers = data.draw(st.lists(st.sampled_from([
        Arg(mate.Region(h.me, h.region.address + 1, 8), BAD, "a region never exposed"),
        Arg(mate.Region(h.me + 1, h.region.address, REGION), BAD, "another rank's"),
        Arg(attrs.evolve(h.region, length=REGION + 1), BAD, "a longer region"),
        Arg(None, BAD), Arg(h.region.address, BAD, "an address"),
        Arg((h.me, h.region.address, REGION), BAD, "a tuple"), Arg("region", BAD),
        Arg(object(), BAD, "object()")]), max_size=3), "unexpose")
    regions = []
    for _ in range(times):
        region = attempt(lambda: world.expose(buffer.value), buffer_verdict(buffer, True))
        if region is None:
            break
        n = len(flat(buffer.value))
        assert isinstance(region, mate.Region) and (region.pid, region.length) == (h.me, n)
        payload = bytes((i * 3 + len(regions)) & 0xFF for i in range(n))
        put = world.put(payload, h.me, region.address)  # lands in it, and only there
        await h.settle(put)
        assert put.state is State.COMPLETED and flat(buffer.value) == payload
        regions.append(region)
    for stranger in strangers:
        await attempt_async(world.unexpose, stranger.value, BAD)
    for region in regions:  # each exposure is undone once
        await attempt_async(world.unexpose, region, GOOD)
    if regions:
        await attempt_async(world.unexpose, regions[0], BAD)
    await h.check()


async def attempt_async(call: Callable[[Any], Awaitable[Any]], arg: Any, verdict: str) -> None:
    """`attempt` for a coroutine function: the error may come from the call or from the
    await (a coroutine runs nothing until awaited); the await is bounded."""
    try:
        await asyncio.wait_for(call(arg), BOUND)
    except mate.InvalidArgument as exc:
        assert verdict != GOOD, f"a good call was refused: {exc}"
        return
    except asyncio.TimeoutError:
        raise AssertionError(f"unexpose({arg!r}) did not return within {BOUND} s") from None
    except Exception as exc:
        raise AssertionError(f"the call raised {exc!r}, not InvalidArgument") from exc
    assert verdict != BAD, f"unexpose({arg!r}) was accepted"


# -- after shutdown ------------------------------------------------------------------------

@FUZZ
@given(data=st.data())
async def test_every_call_after_shutdown_is_refused(
        dead_world: tuple[mate.World, mate.Region], data: st.DataObject) -> None:
    world, region = dead_world
    calls: dict[str, Callable[[Any, Any], Any]] = {
        "send": lambda b, a: world.send(b, world.mypid, 0),
        "recv": lambda b, a: world.recv(b),
        "put": lambda b, a: world.put(b, world.mypid, a),
        "get": lambda b, a: world.get(b, world.mypid, a),
        "expose": lambda b, a: world.expose(b),
        "progress": lambda b, a: world.progress(),
        "stats": lambda b, a: world.stats(),
    }
    name = data.draw(st.sampled_from(sorted(calls)), "call")
    buffer = data.draw(buffers(), "buffer")
    address = data.draw(st.one_of(st.just(Arg(region.address, GOOD)), addresses(region, 0)),
                        "address")
    attempt(lambda: calls[name](buffer.value, address.value), BAD)
    await attempt_async(world.unexpose, region, BAD)


# -- Schedule, startup and local.worlds ------------------------------------------------------

@pytest.mark.skipif(LAUNCHED is not None, reason="no transport: once, in this process")
@FUZZ
@given(data=st.data())
def test_schedule_takes_callables_or_none(data: st.DataObject) -> None:
    events = Events()
    fields = {}
    for name in data.draw(st.lists(st.sampled_from(HANDLER_FIELDS), unique=True), "handlers"):
        fields[name] = data.draw(handler_values(events), name)
    datums = {f"{name}_data": data.draw(st.sampled_from([None, 0, "x", [], object()]))
              for name in data.draw(st.lists(st.sampled_from(HANDLER_FIELDS), unique=True))}
    verdict = joint(*(arg.verdict for arg in fields.values()))
    schedule = attempt(lambda: mate.Schedule(**{k: a.value for k, a in fields.items()},
                                             **datums), verdict)
    if schedule is not None:
        for name in HANDLER_FIELDS:
            assert getattr(schedule, name) is (fields[name].value if name in fields else None)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            schedule.completion = None  # type: ignore[misc]


def option_values(name: str) -> st.SearchStrategy[Arg]:
    """Values of a transport option, with their verdicts from the docs (mate.registry)."""
    def counts(minimum: int, maximum: int | None = None) -> st.SearchStrategy[Arg]:
        top = maximum if maximum is not None else 2**40
        return st.one_of(
            st.integers(minimum, top).map(lambda v: Arg(v, GOOD)),
            st.integers(-(2**40), minimum - 1).map(lambda v: Arg(v, BAD)),
            st.sampled_from([Arg(True, BAD), Arg(1.0, BAD), Arg("8", BAD), Arg(None, BAD),
                             Arg(np.int64(minimum), EITHER, "np.int64")]),
            *([st.integers(top + 1, 2**70).map(lambda v: Arg(v, BAD))] if maximum else []))

    def choices(*allowed: Any) -> st.SearchStrategy[Arg]:
        return st.one_of(st.sampled_from([Arg(v, GOOD) for v in allowed]),
                         st.sampled_from([Arg("", BAD), Arg("other", BAD), Arg(1, BAD),
                                          Arg(["x"], BAD), Arg(b"unix", BAD)]))

    seconds = st.one_of(st.floats(0, 1e9).map(lambda v: Arg(v, GOOD)),
                        st.sampled_from([t for t in TIMEOUTS
                                         if t.value not in (UNSET, None)]))
    known = {
        "eager_limit": counts(0), "rma": choices("auto", "native", "emulated"),
        "rma_threshold": counts(0), "eager_size": counts(0),
        "orphan_limit": counts(1), "shutdown_timeout": seconds,
        "device": choices(None, "soft", "pyverbs"), "link": choices("unix", "tcp"),
        "credits": counts(2, 4096), "pin_limit": counts(1),
        "default_timeout": seconds,
    }
    assert set(known) >= KNOWN_OPTIONS, f"no values for {KNOWN_OPTIONS - set(known)}"
    return known.get(name, st.just(Arg(1, BAD, "an unknown option")))


#: Every option a transport documents (mate.registry): `option_values` must know each,
#: or the fuzz would take a new option for an unknown one and expect it refused.
KNOWN_OPTIONS = {name for entry in mate.registry.TRANSPORTS.values() for name in entry.options}


@st.composite
def startup_options(draw: st.DrawFn, transport: str) -> dict[str, Arg]:
    entry = mate.registry.TRANSPORTS[transport]
    names = [*entry.options, "default_timeout", "colour", "progres", "timeout", "handler"]
    options = {name: draw(option_values(name), name)
               for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=4))}
    modes = entry.progress or ()
    options["progress"] = draw(st.one_of(
        st.sampled_from([Arg(None, GOOD), *(Arg(m, GOOD) for m in modes)]),
        st.sampled_from([Arg("spin", BAD), Arg(0, BAD), Arg(["poll"], BAD)])), "progress")
    if not modes and options["progress"].value is not None:
        options["progress"] = Arg(options["progress"].value, BAD)
    handlers = draw(st.sampled_from([Arg("loop", GOOD), Arg("progress", EITHER),
                                     Arg("Loop", BAD), Arg(None, BAD), Arg(1, BAD)]),
                    "handlers")
    if handlers.value == "progress":  # needs a progress thread
        threaded = options["progress"].value in entry.threaded_progress
        handlers = Arg("progress", GOOD if threaded else BAD)
    options["handlers"] = handlers
    return options


TRANSPORT_NAMES = [Arg(name, GOOD) for name in mate.TRANSPORTS] + [Arg(None, GOOD, "None"),
    Arg("", BAD), Arg("nope", BAD), Arg("LOCAL", BAD), Arg(1, BAD), Arg([], BAD),
    Arg(b"local", BAD), Arg(("local",), BAD), Arg(object(), BAD, "object()")]


@pytest.mark.skipif(LAUNCHED is not None, reason="opens local worlds: once, in this process")
@FUZZ
@given(data=st.data())
async def test_startup_and_local_worlds_take_their_options_or_refuse(
        data: st.DataObject) -> None:
    transport = data.draw(st.sampled_from(TRANSPORT_NAMES), "transport")
    name = mate.registry.choose(transport.value).name if transport.verdict == GOOD else "local"
    options = data.draw(startup_options(name), "options")
    n = data.draw(st.one_of(st.integers(1, 3).map(lambda v: Arg(v, GOOD)), st.sampled_from([
        Arg(0, BAD), Arg(-1, BAD), Arg(True, BAD), Arg(2.0, BAD), Arg("2", BAD),
        Arg(None, BAD), Arg(mate.local.MAX_RANKS + 1, BAD, "MAX_RANKS + 1"),
        Arg(np.int64(2), EITHER, "np.int64(2)")])), "n")
    local = data.draw(startup_options("local"), "local options")
    # The constructor checks every option at once; an mpi or ibverbs world is not
    # opened here (its startup is collective: the launched runs open those).
    values = {k: a.value for k, a in options.items()}
    verdict = joint(transport.verdict, *(a.verdict for a in options.values()))
    opener = attempt(lambda: mate.startup(transport.value, **values), verdict)
    if opener is not None and name == "local":
        async with opener as world:
            await _loopback(world)
    verdict = joint(n.verdict, *(a.verdict for a in local.values()))
    try:
        group = await mate.local.open_worlds(n.value, **{k: a.value for k, a in local.items()})
    except mate.InvalidArgument:
        assert verdict != GOOD
        return
    except Exception as exc:
        raise AssertionError(f"open_worlds raised {exc!r}, not InvalidArgument") from exc
    assert verdict != BAD
    try:
        assert len(group) == n.value
        await _loopback(group[-1])
    finally:
        for world in group:
            await world.shutdown()


async def _loopback(world: mate.World) -> None:
    inbox = bytearray(3)
    got = world.recv(inbox, world.mypid, 5, timeout=BOUND)
    await asyncio.wait_for(world.send(b"abc", world.mypid, 5, timeout=BOUND), BOUND)
    await asyncio.wait_for(got, BOUND)
    assert inbox == b"abc"


# -- on real processes -----------------------------------------------------------------------

launcher_only = pytest.mark.skipif(LAUNCHED is not None, reason="this is the launcher")
# A rank that fails stops; the other then waits in the next world's startup: this bounds it.
LAUNCH_TIMEOUT = 300 + EXAMPLES


@launcher_only
@pytest.mark.parametrize("options", [{"progress": "poll"},
                                     {"progress": "thread", "handlers": "progress"}],
                         ids=["poll", "thread-progress-handlers"])
def test_api_fuzz_under_mpiexec(options: dict[str, object]) -> None:
    run_under_mpiexec("test_api_fuzz.py", 2, options, timeout=LAUNCH_TIMEOUT)


@launcher_only
@pytest.mark.parametrize("options", [{"progress": "loop"},
                                     {"progress": "thread", "handlers": "progress"}],
                         ids=["loop", "thread-progress-handlers"])
def test_api_fuzz_under_mate_run(options: dict[str, object]) -> None:
    run_under_mate_run("test_api_fuzz.py", 2, options, timeout=LAUNCH_TIMEOUT)


# -- fixed cases: the defects this fuzzing found ---------------------------------------------


OBJECT_BUFFERS = {"np object": lambda: np.empty(2, object),
                  "np record with an object field": lambda: np.zeros(2, [("a", "i4"),
                                                                         ("b", "O")]),
                  "ctypes py_object": lambda: (ctypes.py_object * 2)()}


@pytest.mark.skipif(LAUNCHED is not None, reason="in this process, on the local transport")
@pytest.mark.parametrize("make", OBJECT_BUFFERS.values(), ids=OBJECT_BUFFERS)
async def test_a_buffer_of_python_objects_is_refused(make: Callable[[], Any]) -> None:
    # Before: accepted by every call; bytes received into an object array were taken for
    # object pointers, and the process died of a segmentation fault when it used them.
    async with mate.local.worlds(2) as (a, b):
        region = b.expose(bytearray(64))
        for call in (lambda: a.send(make(), 1), lambda: a.recv(make()),
                     lambda: a.put(make(), 1, region.address),
                     lambda: a.get(make(), 1, region.address), lambda: a.expose(make())):
            with pytest.raises(mate.InvalidArgument, match="Python objects"):
                call()


@pytest.mark.skipif(LAUNCHED is not None, reason="in this process, on the local transport")
async def test_an_empty_strided_view_is_a_zero_length_buffer() -> None:
    # Before: refused as not C-contiguous (CPython says so of an empty view with a stride).
    def empty() -> memoryview:
        return memoryview(bytearray(0))[::2]

    async with mate.local.worlds(1) as (world,):
        got = world.recv(empty(), 0, 3)
        await asyncio.wait_for(world.send(empty(), 0, 3), BOUND)
        assert (await asyncio.wait_for(got, BOUND)).length == 0
        await world.unexpose(world.expose(empty()))


@pytest.mark.skipif(LAUNCHED is not None, reason="in this process")
@pytest.mark.parametrize("name", [[], {}, ["local"], {"local": 1}], ids=repr)
def test_a_transport_name_that_is_no_string_is_refused(name: Any) -> None:
    # Before: TypeError (unhashable type) from the registry's lookup.
    with pytest.raises(mate.InvalidArgument, match="unknown transport"):
        mate.startup(name)


@pytest.mark.skipif(LAUNCHED is not None, reason="in this process, on the local transport")
@pytest.mark.parametrize("seconds", [10**400, -(10**400)], ids=["10**400", "-10**400"])
async def test_a_number_of_seconds_beyond_every_float_is_refused(seconds: int) -> None:
    # Before: OverflowError from math.isfinite, out of every call that takes seconds.
    with pytest.raises(mate.InvalidArgument, match="finite"):
        mate.startup("local", default_timeout=seconds)
    with pytest.raises(mate.InvalidArgument, match="finite"):
        await mate.local.open_worlds(1, default_timeout=seconds)
    async with mate.local.worlds(1) as (world,):
        with pytest.raises(mate.InvalidArgument, match="finite"):
            world.recv(bytearray(1), timeout=seconds)


class _ThreadedSilence(Transport):
    """A wire that never reports, and says it has a progress thread."""

    supports_progress_handlers = True

    def __init__(self) -> None:
        self.mypid, self.numprocs, self.tag_max = 0, 1, 100

    def post(self, op: Operation) -> None:
        pass

    def cancel(self, op: Operation) -> None:
        self.sink.cancelled(op)

    def expose(self, buffer: memoryview) -> mate.Region:
        return mate.Region(0, 0, 0)

    async def unexpose(self, region: mate.Region) -> None:
        pass

    async def shutdown(self) -> None:
        pass


@pytest.mark.skipif(LAUNCHED is not None, reason="in this process")
async def test_a_far_deadline_does_not_stop_the_timeout_thread() -> None:
    # Before: the timeout thread (handlers="progress") waited for the earliest deadline,
    # and a wait past threading.TIMEOUT_MAX raised OverflowError in it: the thread died,
    # and no timeout of this world fired again.
    world = World(asyncio.get_running_loop(), default_timeout=1.0, handlers="progress")
    transport = _ThreadedSilence()
    transport.bind(world.sink)
    world.attach(transport)
    try:
        far = world.recv(bytearray(1), 0, 1, timeout=1e10)
        await asyncio.sleep(0.1)  # the thread now waits for the far deadline
        near = world.recv(bytearray(1), 0, 2, timeout=0.05)
        with pytest.raises(mate.MessageTimeout):
            await asyncio.wait_for(near, BOUND)
        assert not far.done()
    finally:
        await world.shutdown()
