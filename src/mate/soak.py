"""The soak run, ``python -m mate.soak``: many messages between two ranks, each accounted for.

    python -m mate.soak --transport local --messages 10000
    mate-run -n 2 python -m mate.soak --transport mpi --progress thread
    mate-run -n 2 --transport ibverbs python -m mate.soak --transport ibverbs --progress poll

Two ranks originate ``--messages`` messages between them (sends, puts and
gets; half each), of random sizes, tags, timeouts and cancels, a window of
them outstanding at once, in both directions at the same time, and receive
the other's sends with receives of their own random kinds (wildcards,
timeouts, cancels). At the end every message must be accounted for, and
memory must have stayed flat. Rank 0 prints one summary line with
``verified`` (exit 0) or ``NOT verified`` and the first problems (exit 1).

Theory of operation
-------------------
*The plan.* Everything a rank originates is drawn from a generator seeded by
(``--seed``, rank, round): each entry's operation, size, tag, target offset,
timeout, cancel and how it is watched. Both ranks compute both plans, so the
receiver of a message knows what was sent in its place (size, tag) without
being told, and the target of a put or get knows its range.

*Rounds.* Traffic runs in rounds of ``--round`` messages per rank. In round
r each rank posts its plan (a window of ``--window`` outstanding), waits
until all of it has ended, and then sends one *marker* on each of the
``--tags`` tags. Meanwhile it keeps ``--window`` receives posted (at most
half of them for a specific tag, the others ANY_TAG, so that a sender's
rendezvous send always finds one) until it has the peer's markers of round
r; then it cancels the receives left and waits for them to end. A rank
starts round r + 1 when both halves of round r are done, so the ranks stay
within a round of each other and no queue grows without bound.

*Why the markers make the accounting exact.* A send that timed out or was
cancelled may or may not be delivered (SPEC §1; on MPI an abandoned send
may arrive much later). But sends from one rank on one tag match receives
in posting order (non-overtaking), and every receive here can match any
message on the tags it names. So when the marker of round r on tag t has
been received, every earlier send on t was matched by a receive posted
before it, or never will be; once those receives have ended, each message
of round r was delivered exactly as often as it ever will be. The marker on
the first tag carries the outcome of each message of the round at its
origin, and the receiver checks: a completed send was delivered exactly
once; one that timed out, was cancelled or failed at most once; nothing
was delivered twice, late (after its round was accounted) or from a round
not begun. No guessing is involved, and none of it depends on a transport.

*Payloads.* Every message, put and exposed slot carries a header (kind,
origin, round, index, size, tag) and a CRC-32 of everything after the CRC
field; the body comes from a seeded random pool at an offset that depends
on the message. A receiver checks the CRC, the header against the plan and
against the receipt (length, tag, source). A sender overwrites the CRC of
its buffer when it sees the message submitted (SPEC §1: the buffer may
then be reused), in the submission handler or after awaiting
``msg.submitted``, so a transport that read it later would deliver a bad
checksum. (Only a handler that also ends the message may touch its
buffer: an awaiter can see the end, and the buffer be reused, before an
earlier event's handler has run, handlers running "eventually".) A
receive is posted with its header zeroed; one that did not complete must
leave it so (it never consumed a message).

*One-sided.* Each rank exposes a region per round, alternating between two
buffers: a put area, zeroed, into which the peer's puts of that round are
laid out one after another, and a get area of slots the owner fills before
exposing it. The region's address travels in the owner's markers of the
round before. After the peer's markers of round r (all its round-r puts
and gets ended), the owner unexposes region r (SPEC §2: when unexpose
returns no peer operation can touch it), so each put range then holds the
put's data (a completed put must) or, for a put that timed out or was
cancelled, either its data or zeros; every byte outside the puts' ranges
must still be zero. A get checks its slot's header and CRC; a get that
timed out or was cancelled keeps a copy of its buffer, which must be
unchanged when it is checked at the end of the next round (it never
writes the buffer afterwards).

*Events.* Every message is watched by its schedule's handlers, by a task
that awaits it, or by both (and some tasks await its submission first);
cancels are by ``msg.cancel()``, at once or after a delay, or by cancelling
the awaiting task. Each round's messages are checked once all have ended:
exactly one terminal handler for a message that completed, timed out or
failed, none for one that was cancelled, agreeing with its state, with the
awaited outcome and with its final receipt; submission at most once, only
for send and put, before the terminal event, and always for a send or put
that completed; no handler after the check.

*Memory.* On MPI, the sends it still holds after a timeout or cancel
(orphans) were all matched before the last markers, so none may be left
shortly after the last round. The resident set is read from /proc/self/statm at the start,
after the warm-up (the first tenth of the rounds: buffer pools, the
transport's caches) and at the end, the last two after a full garbage
collection; its growth from the warm-up to the end must stay under
``--rss-bound``. Buffers are pooled, so the program itself
allocates nothing per message that outlives it; the bound is for the
allocator's fragmentation and the transports' bounded caches
(docs/soak.md says why the default is what it is). On ibverbs the pin
cache's ``bytes_pinned`` must stay within its ``pin_limit`` at every round
end. At the end ``world.stats()`` must show nothing outstanding and the
same counts of completed, timed-out, failed and cancelled messages as the
program saw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import functools
import gc
import json
import math
import mmap
import random
import resource
import struct
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from mate import native, spmd
from mate.arguments import non_negative, positive_int
from mate.constants import ANY_SOURCE, ANY_TAG, UNSET, UnsetType
from mate.errors import InvalidArgument, MessageFailed, MessageTimeout
from mate.message import Message
from mate.registry import TRANSPORTS
from mate.schedule import Event, Op, Receipt, Region, Schedule, State
from mate.world import World

# -- what travels ----------------------------------------------------------------------------

HEADER = struct.Struct("<IBBHiiII")  # crc32, kind, origin, 0, round, index, size, tag
CRC = struct.Struct("<I")  # the CRC covers a payload from the end of this field on
ZERO_HEADER = bytes(HEADER.size)
NEXT_REGION = struct.Struct("<QQ")  # in the first marker of a round: address, length


class Kind(enum.IntEnum):
    DATA = 1  # a send's payload
    PUT = 2  # a put's payload, in the target's put area
    SLOT = 3  # a slot of a get area, written by its owner
    MARKER = 4  # the end of a round on one tag


# A message's ending, one byte in a marker; the order of `State`'s terminal states.
OUTCOMES = (State.COMPLETED, State.TIMED_OUT, State.FAILED, State.CANCELLED)
OUTCOME_CODE = {state: code for code, state in enumerate(OUTCOMES)}
NOT_ENDED = 0xFF


@attrs.frozen
class Header:
    kind: int
    origin: int
    round: int
    index: int
    size: int
    tag: int


def body_start(origin: int, round_: int, index: int, room: int) -> int:
    """Where in the random pool the body of a payload starts (varies by message)."""
    return (origin * 1_000_003 + round_ * 7_919 + index * 104_729) % room


def write_payload(buffer: memoryview, pool: memoryview, header: Header) -> int:
    """Fill `buffer` (exactly `header.size` bytes) with a payload; return its CRC."""
    body = header.size - HEADER.size
    start = body_start(header.origin, header.round, header.index, len(pool) - body + 1)
    buffer[HEADER.size:] = pool[start:start + body]
    HEADER.pack_into(buffer, 0, 0, header.kind, header.origin, 0, header.round, header.index,
                     header.size, header.tag)
    crc = zlib.crc32(buffer[CRC.size:])
    CRC.pack_into(buffer, 0, crc)
    return crc


def read_payload(data: memoryview) -> Header | str:
    """The header of a payload whose CRC and length hold, else what is wrong with it."""
    if len(data) < HEADER.size:
        return f"{len(data)} bytes, shorter than a header"
    crc, kind, origin, _, round_, index, size, tag = HEADER.unpack_from(data)
    if zlib.crc32(data[CRC.size:]) != crc:
        return "its checksum does not match (corrupted, or read after submission)"
    if size != len(data):
        return f"its header says {size} bytes, {len(data)} came"
    return Header(kind, origin, round_, index, size, tag)


def is_zero(data: memoryview) -> bool:
    return data.tobytes() == bytes(len(data))


# -- the plan --------------------------------------------------------------------------------

class Cancel(enum.Enum):
    NONE = "none"
    AT_ONCE = "at once"  # msg.cancel() right after the post
    LATER = "later"  # msg.cancel() after `delay`
    TASK = "task"  # the awaiting task is cancelled after `delay` (which cancels the message)


class Observe(enum.Enum):
    HANDLERS = "handlers"  # the schedule's handlers only
    AWAIT = "await"  # no schedule; a task awaits it
    BOTH = "both"


Timeout = float | None | UnsetType
LONG_TIMEOUT = 5.0  # armed, practically never expires
SHORT_TIMEOUT = 0.003  # short timeouts are uniform in [0, this): many expire
CANCEL_DELAY = 0.002  # delayed cancels are uniform in [0, this)
SMALL, MEDIUM = 1024, 64 * 1024  # the ends of the small and medium size classes


@attrs.frozen
class Choice:
    """How one message is posted and watched."""

    timeout: Timeout
    cancel: Cancel
    delay: float
    observe: Observe
    submission: bool  # the awaiting task awaits msg.submitted first (send, put)


@attrs.frozen
class Planned:
    """One message a rank originates in a round."""

    index: int
    op: Op  # SEND, PUT or GET
    size: int
    tag: int  # a send's tag; 0 for put and get
    offset: int  # put: into the target's put area; get: into its get area
    slot: int  # get: which slot of the target's get area; else -1
    choice: Choice


@attrs.frozen
class Config:
    seed: int = 1
    messages: int = 10**6  # originated, both ranks together
    round: int = 500  # per rank and round
    window: int = 32
    max_size: int = 2**20
    tags: int = 8
    rss_bound: int = 64 * 2**20
    stall: float = 120.0
    large: float = 0.03  # fraction of sizes in [64 KiB, max_size]

    @property
    def area(self) -> int:
        """Bytes of a put area and of a get area."""
        return max(4 * 2**20, 2 * self.max_size)

    @property
    def rounds(self) -> int:
        return math.ceil(self.originated(0) / self.round)

    def originated(self, rank: int) -> int:
        return self.messages // 2 + (self.messages % 2 if rank == 0 else 0)

    def count(self, rank: int, round_: int) -> int:
        """How many messages `rank` originates in `round_` (none in round -1)."""
        if round_ < 0:
            return 0
        return max(0, min(self.round, self.originated(rank) - round_ * self.round))

    @property
    def warm_rounds(self) -> int:
        return max(1, self.rounds // 10)


DEFAULTS = Config()


def _rng(*key: object) -> random.Random:
    return random.Random(":".join(map(str, key)))  # str seeds are stable across processes


def draw_size(rng: random.Random, config: Config) -> int:
    """Mostly small; some medium (past the ibverbs and MPI eager sizes); some large
    (past the local transport's eager limit), up to `max_size`."""
    u = rng.random()
    top = config.max_size
    if u < config.large and top > MEDIUM:
        lo, hi = MEDIUM, top
    elif u < config.large + 0.12 and top > SMALL:
        lo, hi = SMALL, min(MEDIUM, top)
    else:
        return rng.randint(HEADER.size, min(SMALL, top))
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def draw_choice(rng: random.Random, origin: bool) -> Choice:
    u = rng.random()
    timeout: Timeout
    if u < 0.35:
        timeout = None
    elif u < 0.45:
        timeout = UNSET  # the world's default_timeout if the schedule has a timeout handler
    elif u < 0.70:
        timeout = LONG_TIMEOUT
    else:
        timeout = rng.uniform(0.0, SHORT_TIMEOUT)
    u = rng.random()
    observe = Observe.HANDLERS if u < 0.35 else Observe.AWAIT if u < 0.65 else Observe.BOTH
    cancel = Cancel.NONE
    if observe is not Observe.HANDLERS:  # a cancelled message fires no handler: await it
        u = rng.random()
        cancel = (Cancel.AT_ONCE if u < 0.05 else Cancel.LATER if u < 0.10
                  else Cancel.TASK if u < 0.15 else Cancel.NONE)
    return Choice(timeout, cancel, rng.uniform(0.0, CANCEL_DELAY), observe,
                  origin and observe is not Observe.HANDLERS and rng.random() < 0.5)


@functools.lru_cache(maxsize=8)
def get_slots(config: Config, owner: int, round_: int) -> tuple[tuple[int, int], ...]:
    """The slots (offset, size) of `owner`'s get area in `round_`."""
    rng = _rng("slots", config.seed, owner, round_)
    slots, offset = [], 0
    while config.area - offset >= HEADER.size:
        size = min(draw_size(rng, config), config.area - offset)
        slots.append((offset, size))
        offset += size
    return tuple(slots)


def plan_round(config: Config, rank: int, round_: int) -> tuple[Planned, ...]:
    """What `rank` originates in `round_`, the same on both ranks."""
    rng = _rng("plan", config.seed, rank, round_)
    slots = get_slots(config, 1 - rank, round_)
    plan, put_offset = [], 0
    for index in range(config.count(rank, round_)):
        u = rng.random()
        size = draw_size(rng, config)
        op, tag, offset, slot = Op.SEND, rng.randrange(config.tags), 0, -1
        if u < 0.15 and put_offset + size <= config.area:
            op, tag, offset = Op.PUT, 0, put_offset
            put_offset += size
        elif 0.15 <= u < 0.30:
            op, tag, slot = Op.GET, 0, rng.randrange(len(slots))
            offset, size = slots[slot]
        plan.append(Planned(index, op, size, tag, offset, slot,
                            draw_choice(rng, op is not Op.GET)))
    return tuple(plan)


# -- the checks (pure: each is tested on hand-made wrong records) ----------------------------

TERMINAL_EVENT = {State.COMPLETED: Event.COMPLETION, State.TIMED_OUT: Event.TIMEOUT,
                  State.FAILED: Event.FAILURE}


def check_events(op: Op, state: State, events: Sequence[Receipt] | None,
                 awaited: State | None, final: Receipt) -> list[str]:
    """SPEC §1 for one ended message: `events` are the receipts its schedule's handlers
    got, in order (None: no schedule); `awaited` what awaiting it gave (None: not
    awaited); `final` its receipt once ended."""
    what = f"{op.value} ended {state.name}"
    if not state.terminal:
        return [f"{what}: not a terminal state"]
    problems = []
    if awaited is not None and awaited is not state:
        problems.append(f"{what}, but awaiting it gave {awaited.name}")
    if events is None:
        return problems
    kinds = [receipt.event for receipt in events]
    terminal = [i for i, event in enumerate(kinds) if event is not Event.SUBMISSION]
    expected = TERMINAL_EVENT.get(state)
    fired = [kinds[i] for i in terminal]
    if fired != ([] if expected is None else [expected]):
        names = ", ".join(e.value if e else "?" for e in fired) or "none"
        problems.append(f"{what}, but its terminal handlers fired: {names}")
    elif terminal and events[terminal[0]] != final:
        problems.append(f"{what}: its {fired[0].value if fired[0] else '?'} handler got "
                        f"{events[terminal[0]]!r}, its final receipt is {final!r}")
    submissions = [i for i, event in enumerate(kinds) if event is Event.SUBMISSION]
    if submissions and op in (Op.RECV, Op.GET):
        problems.append(f"{what}, with a submission event")
    elif len(submissions) > 1:
        problems.append(f"{what}, with {len(submissions)} submission events")
    elif submissions and terminal and submissions[0] > terminal[0]:
        problems.append(f"{what}: submission came after the terminal event")
    elif op in (Op.SEND, Op.PUT) and state is State.COMPLETED and not submissions:
        problems.append(f"{what} without a submission event")
    return problems


def account(plan: Sequence[Planned], outcomes: bytes, delivered: bytes | bytearray, origin: int,
            round_: int) -> list[str]:
    """The deliveries of a round's messages against their endings at the origin."""
    where = f"rank {origin}'s round {round_}"
    if len(outcomes) != len(plan) or len(delivered) != len(plan):
        return [f"{where}: {len(plan)} messages planned, {len(outcomes)} outcomes, "
                f"{len(delivered)} delivery counts"]
    problems = []
    for entry, code, times in zip(plan, outcomes, delivered, strict=True):
        if code >= len(OUTCOMES):
            problems.append(f"{where}: message {entry.index} has no outcome ({code})")
            continue
        state = OUTCOMES[code]
        if entry.op is not Op.SEND:
            if times:
                problems.append(f"{where}: {entry.op.value} {entry.index} was delivered "
                                f"as a message")
        elif state is State.COMPLETED and times != 1:
            problems.append(f"{where}: send {entry.index} completed but was delivered "
                            f"{times} times" + (" (lost)" if times == 0 else ""))
        elif times > 1:
            problems.append(f"{where}: send {entry.index} ({state.name}) was delivered "
                            f"{times} times")
    return problems


def check_put_area(area: memoryview, plan: Sequence[Planned], outcomes: bytes, origin: int,
                   round_: int) -> list[str]:
    """A put area after unexpose: each put's range holds its data (or, for a put that
    did not complete, its data or zeros); nothing else was written. Zeroes the area."""
    problems = []
    for entry, code in zip(plan, outcomes, strict=True):
        if entry.op is not Op.PUT:
            continue
        view = area[entry.offset:entry.offset + entry.size]
        landed = read_payload(view)
        whole = landed == Header(Kind.PUT, origin, round_, entry.index, entry.size, 0)
        state = OUTCOMES[code] if code < len(OUTCOMES) else None
        if not whole and (state is State.COMPLETED or not is_zero(view)):
            found = landed if isinstance(landed, str) else f"the header {landed}"
            problems.append(f"rank {origin}'s round {round_}: put {entry.index} "
                            f"({state.name if state else '?'}) left {found}")
        view[:] = bytes(len(view))
    if not is_zero(area):
        problems.append(f"rank {origin}'s round {round_}: bytes outside every put's range "
                        f"were written")
        area[:] = bytes(len(area))
    return problems


# -- a rank ----------------------------------------------------------------------------------

class Record:
    """One posted message and what was seen of it."""

    __slots__ = ("awaited", "buffer", "choice", "closed", "crc", "entry", "events", "finished",
                 "msg", "op", "round", "specific", "started", "task", "task_cancelled", "view")

    def __init__(self, op: Op, round_: int, entry: Planned | None, choice: Choice,
                 buffer: bytearray | None, view: memoryview) -> None:
        self.op = op
        self.round = round_
        self.entry = entry  # None for receives and markers
        self.choice = choice
        self.buffer = buffer  # from a pool, given back when the message ends
        self.view = view
        self.crc = 0  # of the payload it sends or puts
        self.specific = False  # a receive for one tag (not ANY_TAG)
        self.msg: Message | None = None
        self.events: list[Receipt] | None = None if choice.observe is Observe.AWAIT else []
        self.awaited: State | None = None
        self.task: asyncio.Future[None] | None = None
        self.started = False
        self.task_cancelled = False
        self.finished = False
        self.closed = False


class Buffers:
    """A pool of equal buffers, made up front: the program allocates nothing per message
    (a get that did not complete holds its buffer a while; then the pool grows)."""

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        self.free = [bytearray(size) for _ in range(count)]

    def take(self) -> bytearray:
        return self.free.pop() if self.free else bytearray(self.size)

    def give(self, buffer: bytearray) -> None:
        self.free.append(buffer)


class Window:
    """At most `size` messages outstanding; wakes its one poster when that changes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.outstanding = 0
        self._waiter: asyncio.Future[None] | None = None

    def take(self) -> None:
        self.outstanding += 1

    def release(self) -> None:
        self.outstanding -= 1
        self.wake()

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def changed(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    async def room(self) -> None:
        while self.outstanding >= self.size:
            await self.changed()

    async def drained(self) -> None:
        while self.outstanding:
            await self.changed()


class Stalled(Exception):
    """A round did not end within `Config.stall` seconds."""


PAGE = mmap.PAGESIZE
MAX_PROBLEMS = 20  # kept as text per rank; all are counted
HANDLER_GRACE = 10.0  # seconds a round waits for handlers still due after the last await
ORPHAN_GRACE = 2.0  # seconds the end waits for MPI's orphaned sends to be let go


def resident() -> int:
    """This process's resident set in bytes (the peak, where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * PAGE
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def settled_resident() -> int:
    """`resident()` after a full garbage collection: garbage that the collector
    happens to free between two samples (cycles left by whatever ran before) is
    no leak, and its release must not hide one either."""
    gc.collect()
    return resident()


class Rank:
    """One rank of the soak: rounds of traffic, then its report."""

    def __init__(self, world: World, config: Config, pin_limit: int | None) -> None:
        self.world = world
        self.config = config
        self.me = world.mypid
        self.peer = 1 - self.me
        self.pin_limit = pin_limit
        self.loop = asyncio.get_running_loop()
        self.on_loop: Callable[[Callable[[Record], None], Record], None] = (
            self._call_here if world.handlers == "loop" else self._call_soon)
        pool = random.Random(config.seed).randbytes(config.max_size + 65536)
        self.pool = memoryview(pool)
        self.origin_buffers = Buffers(config.max_size, config.window)  # send, put, get
        self.recv_buffers = Buffers(config.max_size, config.window)
        self.send_window = Window(config.window)
        self.recv_window = Window(config.window)
        self.recv_rng = _rng("receives", config.seed, self.me)
        self.regions = (bytearray(2 * config.area), bytearray(2 * config.area))
        self.exposed: dict[int, Region] = {}  # my regions, by round
        self.peer_regions: dict[int, tuple[int, int]] = {}  # the peer's, by round
        self.peer_plans: dict[int, tuple[Planned, ...]] = {}
        self.delivered: dict[int, bytearray] = {}  # the peer's round -> deliveries by index
        self.markers: dict[int, set[int]] = {}  # the peer's round -> tags whose marker came
        self.accounts: dict[int, tuple[int, int, bytes]] = {}  # round -> next region, outcomes
        self.outcomes: dict[int, bytearray] = {}  # my round -> outcome codes by index
        self.accounted = -2  # the peer's rounds up to this one are closed
        self.receiving = -1  # the round my receives are in
        self.live_receives: set[Record] = set()
        self.specific = 0  # live receives for one tag (not ANY_TAG)
        self.held_gets: list[tuple[int, Record, bytes]] = []  # (round, get, its buffer's copy)
        self.records: list[Record] = []  # this round's, checked at its end
        # what was seen
        self.problem_count = 0
        self.problems: list[str] = []
        self.ended: Counter[tuple[Op, State]] = Counter()
        self.completed_bytes: Counter[Op] = Counter()
        self.originated: Counter[Op] = Counter()
        self.receives = 0
        self.cancels = 0
        self.markers_sent = 0
        self.rss: dict[str, int] = {}
        self.rss_trace: list[tuple[int, int]] = []  # (rounds done, resident bytes), 50 of them
        self.pinned_max = 0
        self.traffic_seconds = 0.0

    # -- the program ---------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        config = self.config
        self.rss["start"] = self.rss["peak"] = resident()
        await self._round(-1)  # exposes region 0 and tells the peer about it
        start = time.perf_counter()
        every = max(1, config.rounds // 50)
        for round_ in range(config.rounds):
            await self._round(round_)
            rss = resident()
            self.rss["peak"] = max(self.rss["peak"], rss)
            if round_ % every == every - 1:
                self.rss_trace.append((round_ + 1, rss))
            if round_ + 1 == min(config.warm_rounds, config.rounds):
                self.rss["warm"] = settled_resident()
            self._sample_pins()
        self.traffic_seconds = time.perf_counter() - start
        self.rss.setdefault("warm", self.rss["start"])
        self.rss["end"] = settled_resident()
        self._release_gets(config.rounds)
        await self._orphans_let_go()
        self._check_counters()
        return self.report()

    async def _round(self, round_: int) -> None:
        both = asyncio.gather(self._send_round(round_), self._recv_round(round_))
        try:
            await asyncio.wait_for(both, self.config.stall)
        except asyncio.TimeoutError:
            raise Stalled(f"round {round_} did not end within {self.config.stall:g} s "
                          f"({self._where()})") from None
        records, self.records = self.records, []
        await self._check(records)

    async def abandon(self) -> None:
        """After a stall: cancel the receives left, so that none takes the final
        exchange's messages, and give them a few seconds to end."""
        for rec in list(self.live_receives):
            if rec.msg is not None:
                rec.msg.cancel()
        deadline = time.monotonic() + 5.0
        while self.live_receives and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _where(self) -> str:
        """What a stalled round is waiting for."""
        live = Counter(f"{rec.op.value} {rec.msg.state.name if rec.msg else '?'}"
                       for rec in self.records if not rec.finished)
        markers = len(self.markers.get(self.receiving, ()))
        return (f"{self.send_window.outstanding} sent and {self.recv_window.outstanding} "
                f"receives outstanding, {markers} of {self.config.tags} markers of round "
                f"{self.receiving} in; unfinished: {dict(live)}")

    def problem(self, text: str) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(f"rank {self.me}: {text}")

    # -- origin side ---------------------------------------------------------------------

    async def _send_round(self, round_: int) -> None:
        config = self.config
        plan = plan_round(config, self.me, round_)
        outcomes = self.outcomes[round_] = bytearray([NOT_ENDED]) * len(plan)
        region = self.peer_regions.pop(round_, None)
        window = self.send_window
        for entry in plan:
            await window.room()
            self._post_origin(entry, round_, region)
        await window.drained()
        if NOT_ENDED in outcomes:
            self.problem(f"round {round_}: a message ended without an outcome")
        if round_ + 1 < config.rounds:
            next_region = self._expose(round_ + 1)
            address, length = next_region.address, next_region.length
        else:
            address = length = 0
        markers = [self._post_marker(round_, tag, address, length, outcomes)
                   for tag in range(config.tags)]
        await asyncio.gather(*markers)
        del self.outcomes[round_]

    def _post_origin(self, entry: Planned, round_: int, region: tuple[int, int] | None) -> None:
        op, size = entry.op, entry.size
        if op is not Op.SEND and region is None:
            self.problem(f"round {round_}: no region of rank {self.peer} to "
                         f"{op.value} into")
            self.outcomes[round_][entry.index] = OUTCOME_CODE[State.FAILED]
            return
        buffer = self.origin_buffers.take()
        view = memoryview(buffer)[:size]
        rec = Record(op, round_, entry, entry.choice, buffer, view)
        if op is Op.GET:
            view[:HEADER.size] = ZERO_HEADER
        else:
            kind = Kind.DATA if op is Op.SEND else Kind.PUT
            header = Header(kind, self.me, round_, entry.index, size, entry.tag)
            rec.crc = write_payload(view, self.pool, header)
        schedule, timeout = self._schedule(rec), entry.choice.timeout
        world = self.world
        if op is Op.SEND:
            rec.msg = world.send(view, self.peer, entry.tag, schedule=schedule, timeout=timeout)
        else:
            assert region is not None
            address = region[0] + entry.offset + (self.config.area if op is Op.GET else 0)
            post = world.put if op is Op.PUT else world.get
            rec.msg = post(view, self.peer, address, schedule=schedule, timeout=timeout)
        self.originated[op] += 1
        self.send_window.take()
        self._watch(rec)

    async def _post_marker(self, round_: int, tag: int, address: int, length: int,
                           outcomes: bytearray) -> None:
        extra = NEXT_REGION.size + len(outcomes) if tag == 0 else 0
        buffer = bytearray(HEADER.size + extra)
        view = memoryview(buffer)
        if tag == 0:
            NEXT_REGION.pack_into(view, HEADER.size, address, length)
            view[HEADER.size + NEXT_REGION.size:] = outcomes
        HEADER.pack_into(view, 0, 0, Kind.MARKER, self.me, 0, round_, tag, len(view), tag)
        CRC.pack_into(view, 0, zlib.crc32(view[CRC.size:]))
        choice = Choice(None, Cancel.NONE, 0.0, Observe.BOTH, False)
        rec = Record(Op.SEND, round_, None, choice, None, view)
        rec.msg = self.world.send(view, self.peer, tag, schedule=self._schedule(rec),
                                  timeout=None)
        self.markers_sent += 1
        self.records.append(rec)
        try:
            await rec.msg
            rec.awaited = State.COMPLETED
        except (MessageTimeout, MessageFailed) as exc:  # (cancelled: the round was given up)
            rec.awaited = _state_of(exc)
            self.problem(f"round {round_}: the marker on tag {tag} ended {rec.awaited.name}")
        rec.finished = True
        self._count_end(rec)

    def _expose(self, round_: int) -> Region:
        """Fill my region of `round_` (zeroed put area, then get slots) and expose it."""
        config = self.config
        buffer = memoryview(self.regions[round_ % 2])
        gets = buffer[config.area:]
        for index, (offset, size) in enumerate(get_slots(config, self.me, round_)):
            write_payload(gets[offset:offset + size], self.pool,
                          Header(Kind.SLOT, self.me, round_, index, size, 0))
        region = self.exposed[round_] = self.world.expose(buffer)
        return region

    # -- receiving -----------------------------------------------------------------------

    async def _recv_round(self, round_: int) -> None:
        self.receiving = round_
        window = self.recv_window
        while not self._markers_in(round_):
            if window.outstanding >= window.size:
                await window.changed()
            else:
                self._post_recv(round_)
        for rec in list(self.live_receives):  # they can only match the next round's now
            msg = rec.msg
            assert msg is not None
            if rec.task is None:
                rec.task = asyncio.ensure_future(self._await(rec))
            msg.cancel()
        await window.drained()
        await self._close_round(round_)

    def _markers_in(self, round_: int) -> bool:
        return len(self.markers.get(round_, ())) == self.config.tags and round_ in self.accounts

    def _post_recv(self, round_: int) -> None:
        rng, config = self.recv_rng, self.config
        missing = [t for t in range(config.tags) if t not in self.markers.get(round_, ())]
        specific = bool(missing) and self.specific < config.window // 2 and rng.random() < 0.4
        tag = rng.choice(missing) if specific else ANY_TAG
        source = ANY_SOURCE if rng.random() < 0.5 else self.peer
        buffer = self.recv_buffers.take()
        view = memoryview(buffer)
        view[:HEADER.size] = ZERO_HEADER
        rec = Record(Op.RECV, round_, None, draw_choice(rng, False), buffer, view)
        rec.msg = self.world.recv(view, source, tag, schedule=self._schedule(rec),
                                  timeout=rec.choice.timeout)
        self.receives += 1
        self.specific += specific
        rec.specific = specific
        self.live_receives.add(rec)
        self.recv_window.take()
        self._watch(rec)

    def _received(self, rec: Record, state: State) -> None:
        msg = rec.msg
        assert msg is not None and rec.buffer is not None
        self.live_receives.discard(rec)
        self.specific -= rec.specific
        if state is State.COMPLETED:
            receipt = msg.receipt
            self._deliver(rec.view[:receipt.length], receipt)
        elif rec.view[:HEADER.size] != ZERO_HEADER:
            self.problem(f"a receive that ended {state.name} wrote its buffer")
        self.recv_buffers.give(rec.buffer)
        self.recv_window.release()

    def _deliver(self, data: memoryview, receipt: Receipt) -> None:
        """Check and count one message that a receive completed with."""
        header = read_payload(data)
        where = f"a message from rank {receipt.remote_pid} with tag {receipt.tag}"
        if isinstance(header, str):
            self.problem(f"{where}: {header}")
            return
        if receipt.remote_pid != self.peer or header.origin != self.peer:
            self.problem(f"{where} says it is from rank {header.origin}")
            return
        if header.tag != receipt.tag:
            self.problem(f"{where} was sent with tag {header.tag}")
            return
        if header.kind == Kind.MARKER:
            self._marker(header, data)
            return
        round_ = header.round
        if header.kind != Kind.DATA:
            self.problem(f"{where} is a {header.kind} payload, not a message")
        elif round_ <= self.accounted:
            self.problem(f"{where}: message {header.index} of round {round_} came after its "
                         f"round was accounted")
        elif round_ > self.receiving + 1:
            self.problem(f"{where}: message of round {round_}, while receiving round "
                         f"{self.receiving}")
        else:
            plan = self._peer_plan(round_)
            entry = plan[header.index] if 0 <= header.index < len(plan) else None
            if entry is None or (entry.op, entry.size, entry.tag) != (Op.SEND, header.size,
                                                                        header.tag):
                self.problem(f"{where}: message {header.index} of round {round_} is not the "
                             f"send planned there ({entry})")
                return
            counts = self.delivered.setdefault(round_, bytearray(len(plan)))
            counts[header.index] = min(255, counts[header.index] + 1)

    def _marker(self, header: Header, data: memoryview) -> None:
        round_, tag = header.round, header.index
        if not (self.receiving <= round_ <= self.receiving + 1) or round_ <= self.accounted:
            self.problem(f"the marker of round {round_} on tag {tag} came while receiving "
                         f"round {self.receiving}")
            return
        seen = self.markers.setdefault(round_, set())
        if tag in seen or tag != header.tag:
            self.problem(f"the marker of round {round_} on tag {header.tag} came twice or "
                         f"names tag {tag}")
        seen.add(tag)
        if tag == 0:
            address, length = NEXT_REGION.unpack_from(data, HEADER.size)
            outcomes = data[HEADER.size + NEXT_REGION.size:].tobytes()
            self.accounts[round_] = (address, length, outcomes)
        self.recv_window.wake()

    def _peer_plan(self, round_: int) -> tuple[Planned, ...]:
        plan = self.peer_plans.get(round_)
        if plan is None:
            plan = self.peer_plans[round_] = plan_round(self.config, self.peer, round_)
        return plan

    async def _close_round(self, round_: int) -> None:
        """The peer's round `round_` is over: account for it and check my region."""
        plan = self._peer_plan(round_)
        address, length, outcomes = self.accounts.pop(round_)
        delivered = self.delivered.pop(round_, bytearray(len(plan)))
        for text in account(plan, outcomes, delivered, self.peer, round_):
            self.problem(text)
        self.accounted = round_
        del self.markers[round_]
        del self.peer_plans[round_]
        if length:
            self.peer_regions[round_ + 1] = (address, length)
        region = self.exposed.pop(round_, None)
        if region is not None:
            await self.world.unexpose(region)
            puts = memoryview(self.regions[round_ % 2])[:self.config.area]
            if len(outcomes) == len(plan):
                for text in check_put_area(puts, plan, outcomes, self.peer, round_):
                    self.problem(text)
        self._release_gets(round_ - 1)

    # -- watching messages -----------------------------------------------------------------

    def _schedule(self, rec: Record) -> Schedule | None:
        if rec.events is None:
            return None
        on = self._on_event
        return Schedule(completion=on, completion_data=rec, submission=on, submission_data=rec,
                        timeout=on, timeout_data=rec, failure=on, failure_data=rec)

    def _on_event(self, receipt: Receipt, rec: Record) -> None:
        """Every handler (on the loop, or in the progress thread)."""
        if rec.closed:
            self.on_loop(self._late_event, rec)
            return
        assert rec.events is not None
        rec.events.append(receipt)
        if rec.choice.observe is not Observe.HANDLERS:
            return  # its awaiter may have ended it, and the buffer be reused, before this ran
        if receipt.event is Event.SUBMISSION:
            self._scribble(rec)
        else:
            self.on_loop(self._finish, rec)

    def _late_event(self, rec: Record) -> None:
        self.problem(f"a handler of a {rec.op.value} of round {rec.round} ran after its round "
                     f"was checked")

    @staticmethod
    def _call_here(fn: Callable[[Record], None], rec: Record) -> None:
        fn(rec)

    def _call_soon(self, fn: Callable[[Record], None], rec: Record) -> None:
        self.loop.call_soon_threadsafe(fn, rec)

    def _scribble(self, rec: Record) -> None:
        """The buffer of a submitted send or put is the program's again: spoil its CRC."""
        if rec.entry is not None:
            CRC.pack_into(rec.view, 0, rec.crc ^ 0xFFFFFFFF)

    def _watch(self, rec: Record) -> None:
        msg, choice = rec.msg, rec.choice
        assert msg is not None
        self.records.append(rec)
        if choice.observe is not Observe.HANDLERS:
            rec.task = asyncio.ensure_future(self._await(rec))
        if choice.cancel is Cancel.NONE:
            return
        self.cancels += 1
        if choice.cancel is Cancel.AT_ONCE:
            msg.cancel()
        elif choice.cancel is Cancel.LATER:
            self.loop.call_later(choice.delay, msg.cancel)
        else:
            self.loop.call_later(choice.delay, self._cancel_task, rec)

    def _cancel_task(self, rec: Record) -> None:
        if rec.finished or rec.task is None:
            return
        if rec.started:
            rec.task_cancelled = True
            rec.task.cancel()
        else:  # a task cancelled before its first step never runs: cancel the message
            assert rec.msg is not None
            rec.msg.cancel()

    async def _await(self, rec: Record) -> None:
        rec.started = True
        try:
            rec.awaited = await self._outcome(rec, first=True)
        except asyncio.CancelledError:
            # Cancel.TASK: our cancellation cancelled the message; see how it ended.
            rec.awaited = await self._outcome(rec, first=False)
        self._finish(rec)

    async def _outcome(self, rec: Record, *, first: bool) -> State:
        msg = rec.msg
        assert msg is not None
        try:
            if first and rec.choice.submission:
                submitted = msg.submitted
                assert submitted is not None
                await submitted
                self._scribble(rec)
            await msg
            return State.COMPLETED
        except (MessageTimeout, MessageFailed) as exc:
            return _state_of(exc)
        except asyncio.CancelledError:
            if first and rec.task_cancelled:
                raise
            return State.CANCELLED

    def _finish(self, rec: Record) -> None:
        """A message ended (its awaiter or terminal handler saw it): do its accounting."""
        if rec.finished:
            return
        rec.finished = True
        msg = rec.msg
        assert msg is not None
        state = msg.state
        if not state.terminal:
            self.problem(f"a {rec.op.value} was seen to end in state {state.name}")
            return
        self._count_end(rec)
        op = rec.op
        if state is State.FAILED:
            self.problem(f"a {op.value} of round {rec.round} failed: {msg.error}")
        if op is Op.RECV:
            self._received(rec, state)
            return
        assert rec.entry is not None and rec.buffer is not None
        self.outcomes[rec.round][rec.entry.index] = OUTCOME_CODE[state]
        if op is Op.GET:
            self._got(rec, state)
        else:
            self.origin_buffers.give(rec.buffer)
        self.send_window.release()

    def _count_end(self, rec: Record) -> None:
        msg = rec.msg
        assert msg is not None
        self.ended[rec.op, msg.state] += 1
        if msg.state is State.COMPLETED:
            self.completed_bytes[rec.op] += msg.receipt.length

    def _got(self, rec: Record, state: State) -> None:
        assert rec.entry is not None and rec.buffer is not None
        if state is State.COMPLETED:
            header = read_payload(rec.view)
            expected = Header(Kind.SLOT, self.peer, rec.round, rec.entry.slot, rec.entry.size, 0)
            if header != expected:
                self.problem(f"get {rec.entry.index} of round {rec.round} read {header}, "
                             f"not {expected}")
            self.origin_buffers.give(rec.buffer)
        else:  # it must never write the buffer from now on: keep it, and a copy
            self.held_gets.append((rec.round, rec, rec.view.tobytes()))

    def _release_gets(self, upto: int) -> None:
        """Check the gets that ended unfinished in rounds up to `upto`, and free them."""
        kept = []
        for round_, rec, copy in self.held_gets:
            if round_ > upto:
                kept.append((round_, rec, copy))
                continue
            assert rec.entry is not None and rec.buffer is not None
            if rec.view.tobytes() != copy:
                self.problem(f"get {rec.entry.index} of round {round_} wrote its buffer after "
                             f"it ended {rec.msg.state.name if rec.msg else '?'}")
            self.origin_buffers.give(rec.buffer)
        self.held_gets = kept

    async def _check(self, records: list[Record]) -> None:
        """Check the events of a round's messages, once their handlers have run."""
        deadline = time.monotonic() + HANDLER_GRACE
        while (any(_owes_event(rec) for rec in records) and time.monotonic() < deadline):
            await asyncio.sleep(0.001)
        await asyncio.sleep(0)  # handlers queued on the loop before now (a cancelled send's
        # submission) run first
        for rec in records:
            rec.closed = True
            msg = rec.msg
            assert msg is not None
            for text in check_events(rec.op, msg.state, rec.events, rec.awaited, msg.receipt):
                self.problem(f"round {rec.round}: {text}")

    # -- the end ---------------------------------------------------------------------------

    def _sample_pins(self) -> None:
        pinned = self.world.stats().get("bytes_pinned")
        if pinned is not None:
            self.pinned_max = max(self.pinned_max, pinned)
            if self.pin_limit is not None and pinned > self.pin_limit:
                self.problem(f"the pin cache holds {pinned} bytes, over its limit "
                             f"{self.pin_limit}")

    async def _orphans_let_go(self) -> None:
        """MPI: every send it still held after a timeout or cancel (an orphan) was
        matched before the last markers (non-overtaking), so it must let go of them
        all once it tests them again (every 50 ms): none may stay for good."""
        deadline = time.monotonic() + ORPHAN_GRACE
        while self.world.stats().get("orphaned_sends") and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        left = self.world.stats().get("orphaned_sends")
        if left:
            self.problem(f"the transport still holds {left} orphaned sends "
                         f"{ORPHAN_GRACE:g} s after the last round")

    def _check_counters(self) -> None:
        """world.stats() agrees with what this program saw end."""
        stats = self.world.stats()
        if stats["outstanding"]:
            self.problem(f"{stats['outstanding']} messages still outstanding at the end")
        seen = {f"{op.value}_messages": self.ended[op, State.COMPLETED] for op in Op}
        seen.update({f"{op.value}_bytes": self.completed_bytes[op] for op in Op})
        for name, state in (("timed_out", State.TIMED_OUT), ("failed", State.FAILED),
                            ("cancelled", State.CANCELLED)):
            seen[name] = sum(self.ended[op, state] for op in Op)
        for name, value in seen.items():
            if stats.get(name) != value:
                self.problem(f"world.stats()[{name!r}] is {stats.get(name)}, the program "
                             f"saw {value}")

    def report(self) -> dict[str, Any]:
        now = resident()  # a run that stalled has no later samples: take them now
        for name in ("warm", "end"):
            self.rss.setdefault(name, now)
        return {
            "rank": self.me,
            "originated": {op.value: self.originated[op] for op in (Op.SEND, Op.PUT, Op.GET)},
            "receives": self.receives,
            "markers": self.markers_sent,
            "cancels": self.cancels,
            "ended": {f"{op.value} {state.name.lower()}": n
                      for (op, state), n in sorted(self.ended.items(),
                                                   key=lambda item: (item[0][0].value,
                                                                     item[0][1].value))},
            "traffic_s": round(self.traffic_seconds, 3),
            "rss": self.rss,
            "rss_trace": self.rss_trace,
            "pinned_max": self.pinned_max,
            "stats": self.world.stats(),
            "problem_count": self.problem_count,
            "problems": self.problems,
        }


def _state_of(exc: BaseException) -> State:
    if isinstance(exc, MessageTimeout):
        return State.TIMED_OUT
    if isinstance(exc, MessageFailed):
        return State.FAILED
    return State.CANCELLED


def _owes_event(rec: Record) -> bool:
    """Whether `rec` has a schedule and ended in a way whose handler has not run yet."""
    if rec.events is None or rec.msg is None or rec.msg.state is State.CANCELLED:
        return False
    return not any(receipt.event is not Event.SUBMISSION for receipt in rec.events)


# -- the verdict -----------------------------------------------------------------------------

FINAL_TIMEOUT = 60.0  # seconds for the final exchange between the ranks
REPORT_ROOM = 1 << 20


@attrs.frozen
class Verdict:
    lines: tuple[str, ...]
    summary: dict[str, Any]

    @property
    def verified(self) -> bool:
        return bool(self.summary["verified"])


def judge(reports: Sequence[dict[str, Any]], missing: Sequence[str], config: Config,
          setting: dict[str, Any], pin_limit: int | None) -> Verdict:
    """The verdict over the ranks' reports (`missing`: why one did not come), and the
    lines to print."""
    problems = [*missing, *(text for report in reports for text in report["problems"])]
    count = len(missing) + sum(report["problem_count"] for report in reports)
    mib = 2**20
    lines = []
    for report in reports:
        rss = report["rss"]
        growth = rss["end"] - rss["warm"]
        if growth > config.rss_bound:
            count += 1
            problems.append(f"rank {report['rank']}: the resident set grew by "
                            f"{growth / mib:.1f} MiB after the warm-up, over the bound of "
                            f"{config.rss_bound / mib:.0f} MiB")
        if pin_limit is not None and report["pinned_max"] > pin_limit:
            count += 1
            problems.append(f"rank {report['rank']}: {report['pinned_max']} bytes pinned, over "
                            f"pin_limit {pin_limit}")
        ended = report["ended"]
        states = Counter[str]()
        for key, n in ended.items():
            states[key.split(" ", 1)[1]] += n
        stats = report["stats"]
        counters = ", ".join(f"{name} {stats[name]}" for name in INTERESTING if name in stats)
        lines.append(f"rank {report['rank']}: originated {_counts(report['originated'])}; "
                     f"{report['receives']} receives; ended {states['completed']} completed, "
                     f"{states['timed_out']} timed out, {states['cancelled']} cancelled, "
                     f"{states['failed']} failed; {report['cancels']} cancels asked; "
                     f"RSS {rss['start'] / mib:.1f} -> {rss['warm'] / mib:.1f} (warm) -> "
                     f"{rss['end'] / mib:.1f} MiB, peak {rss['peak'] / mib:.1f}"
                     + (f"; {counters}" if counters else ""))
    messages = sum(sum(report["originated"].values()) for report in reports)
    seconds = max(report["traffic_s"] for report in reports)
    rate = messages / seconds if seconds else 0.0
    timed_out = sum(n for report in reports for key, n in report["ended"].items()
                    if key.endswith("timed_out"))
    cancelled = sum(n for report in reports for key, n in report["ended"].items()
                    if key.endswith("cancelled"))
    failed = sum(n for report in reports for key, n in report["ended"].items()
                 if key.endswith("failed"))
    first = reports[0]["rss"]
    growth = max(report["rss"]["end"] - report["rss"]["warm"] for report in reports)
    verified = count == 0 and messages == config.messages
    if messages != config.messages:
        problems.append(f"{messages} messages originated, not {config.messages}")
    text = (f"soak: {messages} messages in {seconds:.2f} s = {rate:.0f} messages/s; "
            f"{timed_out} timed out, {cancelled} cancelled, {failed} failed; RSS start "
            f"{first['start'] / mib:.1f} MiB, end {first['end'] / mib:.1f} MiB, growth after "
            f"warm-up {growth / mib:+.1f} MiB (bound {config.rss_bound / mib:.0f} MiB); ")
    if verified:
        text += "every message accounted for: verified"
    else:
        shown = "; ".join(problems[:3])
        more = f" (and {max(count, len(problems)) - 3} more)" if max(count,
                                                                     len(problems)) > 3 else ""
        text += f"NOT verified: {shown}{more}"
    summary = {**setting, "messages": messages, "seconds": round(seconds, 3),
               "messages_per_s": round(rate, 1), "timed_out": timed_out,
               "cancelled": cancelled, "failed": failed, "rss_bound": config.rss_bound,
               "rss_growth": growth, "pin_limit": pin_limit, "verified": verified,
               "problem_count": max(count, len(problems)), "problems": problems[:MAX_PROBLEMS],
               "ranks": list(reports)}
    return Verdict((*lines, text), summary)


INTERESTING = ("orphaned_sends", "eager_sends", "rendezvous_sends", "credit_stalls",
               "key_requests", "pin_hits", "pin_misses", "pin_evictions", "bytes_pinned",
               "rnr_retries", "direct_ops")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in counts.items())


# -- one program for both ranks --------------------------------------------------------------

def make_program(config: Config, setting: dict[str, Any], pin_limit: int | None
                 ) -> Callable[[World], Any]:
    async def program(world: World) -> Verdict | bool:
        if world.numprocs != 2:
            raise SystemExit(f"soak: runs on exactly 2 ranks, not {world.numprocs}")
        rank = Rank(world, config, pin_limit)
        try:
            report = await rank.run()
        except Stalled as exc:
            rank.problem(str(exc))
            await rank.abandon()
            report = rank.report()
        final_tag = config.tags  # no data message uses it
        if world.mypid == 1:
            told = bytearray(1)
            told_msg = world.recv(told, 0, final_tag, timeout=FINAL_TIMEOUT)
            await _quietly(world.send(json.dumps(report).encode(), 0, final_tag,
                                      timeout=FINAL_TIMEOUT))
            await _quietly(told_msg)
            return told[0] == 1
        room = bytearray(REPORT_ROOM)
        theirs = world.recv(room, 1, final_tag, timeout=FINAL_TIMEOUT)
        reports, missing = [report], []
        try:
            receipt = await theirs
            reports.append(json.loads(room[:receipt.length]))
        except (MessageTimeout, MessageFailed, ValueError) as exc:
            missing.append(f"rank 1's report did not come: {exc!r}")
        verdict = judge(reports, missing, config, setting, pin_limit)
        await _quietly(world.send(bytes([verdict.verified]), 1, final_tag,
                                  timeout=FINAL_TIMEOUT))
        return verdict

    return program


async def _quietly(msg: Message) -> None:
    with contextlib.suppress(MessageTimeout, MessageFailed):
        await msg


# -- command line ----------------------------------------------------------------------------

def byte_count(text: str) -> int:
    """An int of bytes, with K or M (binary) allowed: 64K, 1M."""
    item = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(item[-1:], 1)
    digits = item[:-1] if scale > 1 else item
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes (e.g. 4096, 1M)")
    return int(digits) * scale


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mate.soak", description=(__doc__ or "").splitlines()[0],
        epilog="docs/soak.md: what it checks, the memory bound, measured figures.")
    spmd.add_arguments(parser)
    group = parser.add_argument_group("soak")
    group.add_argument("--messages", type=positive_int, default=DEFAULTS.messages,
                       help="messages originated by the two ranks together: sends, puts and "
                            "gets (default 10**6)")
    group.add_argument("--seed", type=int, default=DEFAULTS.seed, help="random seed (default 1)")
    group.add_argument("--max-size", type=byte_count, default=DEFAULTS.max_size,
                       help="largest message, put or get in bytes (default 1M)")
    group.add_argument("--large", type=float, default=DEFAULTS.large,
                       help="fraction of sizes above 64 KiB (default 0.03)")
    group.add_argument("--window", type=positive_int, default=DEFAULTS.window,
                       help="messages outstanding per rank and direction (default 32)")
    group.add_argument("--round", type=positive_int, default=DEFAULTS.round,
                       help="messages each rank originates per round (default 500)")
    group.add_argument("--tags", type=positive_int, default=DEFAULTS.tags,
                       help="tags used, and markers per round (default 8)")
    group.add_argument("--rss-bound", type=byte_count, default=DEFAULTS.rss_bound,
                       help="largest growth of the resident set after the warm-up "
                            "(default 64M)")
    group.add_argument("--pin-limit", type=byte_count, default=None,
                       help="ibverbs: the pin cache's pin_limit (default the transport's, "
                            "256M)")
    group.add_argument("--rma", choices=("auto", "native", "emulated"), default=None,
                       help="mpi: put and get by MPI-3 RMA, by two-sided messages, or by "
                            "size (default the transport's, auto)")
    group.add_argument("--stall", type=non_negative, default=DEFAULTS.stall,
                       help="give up (NOT verified) when a round takes longer than this many "
                            "seconds (default 120)")
    group.add_argument("--json", metavar="F", default=None,
                       help="write the figures and the verdict to F as JSON")
    args = parser.parse_args(argv)
    if args.progress == "manual":
        parser.error("--progress manual: handler-watched messages would never progress")
    if args.ranks not in (None, 2):
        parser.error("the soak runs between exactly 2 ranks")
    if args.max_size < 4096:
        parser.error("--max-size must be at least 4096")
    if args.round + HEADER.size + NEXT_REGION.size > args.max_size:
        parser.error("--round must leave room for its outcomes in a marker (<= max-size - 40)")
    if not 0.0 <= args.large <= 0.5:
        parser.error("--large must be in [0, 0.5]")
    if args.stall <= 0:
        parser.error("--stall must be > 0")
    if args.tags > 1024:
        parser.error("--tags must be at most 1024")
    return args


def config_from(args: argparse.Namespace) -> Config:
    return Config(seed=args.seed, messages=args.messages, round=args.round, window=args.window,
                  max_size=args.max_size, tags=args.tags, rss_bound=args.rss_bound,
                  stall=args.stall, large=args.large)


async def main_async(args: argparse.Namespace) -> int:
    config = config_from(args)
    options = spmd.options_from(args)
    transport = spmd.chosen(args.transport)
    pin_limit: int | None = None
    if transport == "ibverbs":
        default = TRANSPORTS["ibverbs"].options["pin_limit"].default
        pin_limit = default if args.pin_limit is None else args.pin_limit
        options["pin_limit"] = pin_limit
    elif args.pin_limit is not None:
        print("soak: --pin-limit is for the ibverbs transport", file=sys.stderr)
        return 2
    if args.rma is not None:
        if transport != "mpi":
            print("soak: --rma is for the mpi transport", file=sys.stderr)
            return 2
        options["rma"] = args.rma
    setting = {"transport": transport, "progress": args.progress, "handlers": args.handlers,
               "rma": args.rma,
               "seed": config.seed, "max_size": config.max_size, "window": config.window,
               "round": config.round, "tags": config.tags, "large": config.large,
               "compiled_modules": native.compiled()}
    try:
        results = await spmd.run(make_program(config, setting, pin_limit), **options)
    except InvalidArgument as exc:  # e.g. --handlers progress without a progress thread
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    for result in results:
        if isinstance(result, Verdict):
            for line in result.lines:
                print(line, flush=True)
            if args.json:
                with open(args.json, "w") as out:
                    json.dump(result.summary, out, indent=1)
    verified = [result.verified if isinstance(result, Verdict) else result
                for result in results]
    return 0 if verified and all(verified) else 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_arguments(argv)))


if __name__ == "__main__":
    sys.exit(main())
