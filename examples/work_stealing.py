"""Work stealing with Progressive Messages (thesis §3.4 and §4.2; seed 001 Ch. 4).

The workload counts the solutions of the n-queens problem, whose answers are
known (OEIS A000170). The search tree is cut at depth `--split`: each partial
placement of the first `split` queens is one *unit*. Every rank generates the
same list of U units, numbered in search order, and deals them unevenly
(rank r gets a share proportional to 2^(N-1-r), in contiguous blocks, so
neighbouring subtrees of very different sizes stay together). A unit's cost
ranges from nothing to thousands of nodes: the load is irregular.

Load balancing, as §4.2 writes it:

* A rank whose load (queued units) is below `--threshold` sends a REQUEST to
  a random peer and goes on computing. The request's failure or timeout
  handler sends it to another peer.
* The peer answers from a handler with a GRANT holding half its load, or
  nothing if it has fewer than twice the threshold (the thrashing check of
  §6.1: it must keep enough to do). It keeps the portion aside ("lent") and
  discards it only on the *completion* of the grant: the portion has reached
  the thief.
* The thief adds a grant's units to its load.

Faults (`--faults`, `mate.faults`) make sends fail, vanish or arrive late, and
a late grant may arrive after its send timed out. So a lent portion whose
grant timed out is neither discarded nor taken back at once: the victim asks
the thief (QUERY, repeated until an ANSWER comes) whether the grant arrived.
The thief answers "yes" if it took the grant; otherwise "no", and from then on
it refuses that grant if it turns up. Exactly one of the two ends keeps every
unit, whatever is lost, delayed or failed: completion means delivered,
failure means never delivered, and the thief's first answer decides the rest.

Termination is implicit, as seed 001 §4.4.3 proposes: every rank reports its
cumulative count of finished units to rank 0 when it runs dry (reports are
cumulative, so a lost or late one does no harm); when the counts add up to U,
rank 0 sends STOP, and every rank answers with its statistics (FINAL), sent
again until one copy completes or rank 0 answers a copy (GOT_FINAL). A copy
may arrive after its send timed out, and an answer may be lost, so a rank can
still be sending copies after rank 0 holds every FINAL. Rank 0 therefore
lingers before it leaves, as TCP's TIME_WAIT does, answering copies until none
has come for twice the longest a copy takes to be confirmed or sent again (the
timeout, plus the fault plan's delay): leaving at once would leave the sender
sending to a rank that is gone, for ever.

The check: the solutions add up to the known count, and the finished units'
numbers add up (their count, sum and sum of squares are those of 0..U-1), so no
unit was lost or done twice. Rank 0 also counts sequentially, once, for the
speed-up over one rank (not shown for the local transport, where every rank
shares one process, one event loop and one core).

`--model` picks how messages are handled (§3.4):

* progressive: handlers answer whenever the rank's loop gets control (between
  units, or at once with ``--handlers progress --progress thread``), and no
  send ever holds up the computation;
* driven (message-driven): the same handlers, but after each unit the main
  loop waits for the acknowledgement (the end) of every send it made;
* passing (message-passing): no handlers at all: the main loop looks for
  incoming messages between units, and also waits for acknowledgements.

    python examples/work_stealing.py --transport local --ranks 4 --faults drop=0.05
    mate-run -n 2 python examples/work_stealing.py --transport mpi --model driven
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import enum
import json
import random
import statistics
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

import mate
import mate.spmd
from mate.faults import FaultPlan, inject

# OEIS A000170: the number of ways to place n non-attacking queens on an n-by-n board.
KNOWN = (1, 1, 0, 0, 2, 10, 4, 40, 92, 352, 724, 2680, 14200, 73712, 365596, 2279184)

MODELS = ("progressive", "driven", "passing")


class Kind(enum.IntEnum):
    """Message kinds; each is also the message's tag."""

    START = 1  # rank 0 -> all: the sequential count is done, begin
    REQUEST = 2  # thief -> victim: <Q request id>
    GRANT = 3  # victim -> thief: <QQ request id, grant id> + units
    QUERY = 4  # victim -> thief: <Q grant id> did this grant arrive?
    ANSWER = 5  # thief -> victim: <QB grant id, arrived>
    REPORT = 6  # any -> rank 0: cumulative <QQQQQ seq, units, sum, squares, solutions>
    STOP = 7  # rank 0 -> all: every unit is done
    FINAL = 8  # any -> rank 0: this rank's statistics (JSON)
    GOT_FINAL = 9  # rank 0 -> any: your FINAL arrived (answers every copy)


# -- the workload ----------------------------------------------------------------------------

Unit = tuple[int, int, int, int]  # (number, columns, left diagonals, right diagonals)


def units_of(n: int, split: int) -> list[Unit]:
    """The partial placements of the first `split` queens, in search order."""
    full = (1 << n) - 1
    found: list[Unit] = []

    def place(row: int, cols: int, left: int, right: int) -> None:
        if row == split:
            found.append((len(found), cols, left, right))
            return
        free = full & ~(cols | left | right)
        while free:
            bit = free & -free
            free ^= bit
            place(row + 1, cols | bit, ((left | bit) << 1) & full, (right | bit) >> 1)

    place(0, 0, 0, 0)
    return found


def solve(n: int, row: int, cols: int, left: int, right: int) -> int:
    """Count the completions of a partial placement (bitmask backtracking)."""
    if row == n:
        return 1
    full = (1 << n) - 1
    total = 0
    free = full & ~(cols | left | right)
    while free:
        bit = free & -free
        free ^= bit
        total += solve(n, row + 1, cols | bit, ((left | bit) << 1) & full, (right | bit) >> 1)
    return total


def deal(units: list[Unit], rank: int, size: int) -> list[Unit]:
    """Rank `rank`'s initial share: proportional to 2^(size-1-rank), contiguous."""
    weights = [2 ** (size - 1 - r) for r in range(size)]
    bounds = [len(units) * sum(weights[:r]) // sum(weights) for r in range(size + 1)]
    return units[bounds[rank]:bounds[rank + 1]]


def pack_units(units: list[Unit]) -> bytes:
    return array.array("Q", [field for unit in units for field in unit]).tobytes()


def unpack_units(data: bytes) -> list[Unit]:
    flat = array.array("Q", data)
    return [(flat[i], flat[i + 1], flat[i + 2], flat[i + 3]) for i in range(0, len(flat), 4)]


# -- one rank ------------------------------------------------------------------------------


@attrs.define
class Stats:
    """What one rank did (sent to rank 0 at the end)."""

    rank: int
    units: int = 0  # units finished here
    number_sum: int = 0  # sum of their numbers
    number_squares: int = 0  # sum of their squares
    solutions: int = 0
    leftover: int = 0  # units still queued at STOP (must be 0)
    steals: int = 0  # grants with units taken in
    given: int = 0  # grants with units sent out and known delivered
    requests: int = 0
    retries: int = 0  # requests re-sent after a failure, timeout or lost grant
    queries: int = 0  # grants whose timeout needed a QUERY
    taken_back: int = 0  # lent units taken back (failed or unreceived grants)
    refused: int = 0  # grants that arrived after this rank answered "no"
    duplicates: int = 0  # a grant received twice (must be 0)
    busy: float = 0.0  # seconds spent computing units
    injected: dict[str, int] = attrs.Factory(dict)  # faults mate.faults injected here
    latencies: list[float] = attrs.Factory(list)  # request -> grant, seconds


@attrs.frozen
class Config:
    n: int
    split: int
    threshold: int
    model: str
    timeout: float  # on every send
    grant_wait: float  # after a delivered request, how long to wait for its grant
    faults: FaultPlan | None
    seed: int


Outcome = Callable[[mate.State], None]

_END_STATE = {mate.Event.COMPLETION: mate.State.COMPLETED, mate.Event.FAILURE: mate.State.FAILED,
              mate.Event.TIMEOUT: mate.State.TIMED_OUT}


class Stealer:
    """One rank: its load, the units it lent, and the protocol above."""

    def __init__(self, world: mate.World, config: Config, units: list[Unit],
                 injected: dict[str, int]) -> None:
        self.world, self.config = world, config
        self.injected = injected  # live counts of the faults injected at this rank
        self.me, self.size = world.mypid, world.numprocs
        self.total = len(units)
        self.load: deque[Unit] = deque(deal(units, self.me, self.size))
        self.stats = Stats(self.me)
        self.handlers = config.model != "passing"
        self.random = random.Random(config.seed * 7919 + self.me)
        self.loop = asyncio.get_running_loop()
        # Handlers may run on a progress thread (handlers="progress"): one lock for all state.
        self.lock = threading.RLock()
        self.wake = asyncio.Event()
        self.timers: set[asyncio.TimerHandle] = set()
        self.unacked: deque[tuple[mate.Message, Outcome | None]] = deque()
        self.inbox = bytearray(16 + 32 * self.total)
        self.receive: mate.Message | None = None
        self.stopped = False  # no more work anywhere (rank 0 decided)
        self.finished = False  # this rank is leaving: handlers and timers do nothing
        self.final_delivered = False
        # thief side
        self.request: tuple[int, float] | None = None  # (request id, sent at)
        self.request_ids = 0
        self.empty_grants = 0  # consecutive empty answers: back off before asking again
        self.received: set[tuple[int, int]] = set()  # (victim, grant id) taken in
        self.refused: set[tuple[int, int]] = set()  # (victim, grant id) answered "no"
        # victim side
        self.grant_ids = 0
        self.lent: dict[int, tuple[int, list[Unit]]] = {}  # grant id -> (thief, units)
        self.querying: set[int] = set()
        # termination: rank 0 keeps everyone's latest cumulative counts
        self.report_seq = 0
        self.reporting = False
        self.reported: tuple[int, ...] = ()
        self.reports: dict[int, tuple[int, ...]] = {}
        self.finals: dict[int, dict[str, Any]] = {}
        self.last_final = 0.0  # loop time of the latest FINAL copy (rank 0)

    # -- the main loop ----------------------------------------------------------------------

    async def run(self) -> None:
        with self.lock:
            self.post_receive()
            self.ask()
            self.report()
        while True:
            self.wake.clear()
            with self.lock:
                if self.leaving():
                    break
                unit = self.load.pop() if self.load and not self.stopped else None
                self.ask()  # before computing, so that the answer overlaps the unit
            if unit is not None:
                self.compute(unit)
            # mate_progress between units (a no-op with a progress thread): a transport
            # polled from the loop may back off while the rank computes, and a request
            # should wait for one unit at most.
            self.world.progress()
            await asyncio.sleep(0)  # the loop's turn: handlers run
            if not self.handlers:
                self.poll()
            await self.wait_for_acks()
            if unit is None:
                await self.idle()

    def compute(self, unit: Unit) -> None:
        number, cols, left, right = unit
        start = time.perf_counter()
        solutions = solve(self.config.n, self.config.split, cols, left, right)
        with self.lock:
            s = self.stats
            s.busy += time.perf_counter() - start
            s.units += 1
            s.number_sum += number
            s.number_squares += number * number
            s.solutions += solutions
            if not self.load:
                self.report()
            elif self.me == 0:
                self.check_done()

    async def wait_for_acks(self) -> None:
        """Message-driven and message-passing: wait until every send made so far ended."""
        # Only the sends made so far: handlers keep adding sends while this waits, and
        # waiting for those too could go on for ever.
        pending = list(self.unacked)
        self.unacked.clear()
        for msg, outcome in pending:
            with contextlib.suppress(mate.MessageTimeout, mate.MessageFailed):
                await msg
            if outcome is not None and not self.handlers:  # message passing: no handlers
                with self.lock:
                    if not self.finished:
                        outcome(msg.state)

    async def idle(self) -> None:
        if self.handlers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), 0.05)
        else:
            await asyncio.sleep(0.0005)  # message passing polls

    async def linger(self) -> None:
        """Rank 0, once it holds every FINAL: answer late copies until none has come for a while."""
        delay = self.config.faults.delay_seconds if self.config.faults else 0.0
        quiet = 2 * (self.config.timeout + delay)
        while self.loop.time() < self.last_final + quiet:
            self.world.progress()
            await asyncio.sleep(0.005)
            if not self.handlers:
                self.poll()

    def leaving(self) -> bool:
        if not self.stopped:
            return False
        if self.me == 0:
            return len(self.finals) == self.size - 1
        return self.final_delivered

    def close(self) -> None:
        with self.lock:
            self.finished = True
            for timer in self.timers:
                timer.cancel()
            if self.receive is not None:
                self.receive.cancel()

    # -- sending ----------------------------------------------------------------------------

    def send(self, kind: Kind, dest: int, payload: bytes, outcome: Outcome | None = None) -> None:
        """Send; `outcome` gets the message's end (COMPLETED, FAILED or TIMED_OUT)."""
        schedule = None
        if self.handlers and outcome is not None:
            def ended(receipt: mate.Receipt, data: None) -> None:
                assert receipt.event is not None  # a handler's receipt names its event
                with self.lock:
                    if not self.finished:
                        outcome(_END_STATE[receipt.event])

            schedule = mate.Schedule(completion=ended, failure=ended, timeout=ended)
        msg = self.world.send(payload, dest, int(kind), schedule=schedule,
                              timeout=self.config.timeout)
        if self.config.model != "progressive":
            self.unacked.append((msg, outcome))

    def send_reliably(self, kind: Kind, dest: int, payload: bytes,
                      delivered: Callable[[], None] | None = None) -> None:
        """Send until one copy completes (only for idempotent messages: STOP, FINAL)."""
        def ended(state: mate.State) -> None:
            if state is not mate.State.COMPLETED:
                self.send(kind, dest, payload, ended)
            elif delivered is not None:
                delivered()

        self.send(kind, dest, payload, ended)

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        """Run `fn` under the lock after `delay` seconds, unless the rank has left."""
        def fire() -> None:
            with self.lock:
                if not self.finished:
                    fn()

        def arm() -> None:
            if not self.finished:
                self.timers.add(self.loop.call_later(delay, fire))

        self.loop.call_soon_threadsafe(arm)

    def notify(self) -> None:
        self.loop.call_soon_threadsafe(self.wake.set)

    # -- receiving --------------------------------------------------------------------------

    def post_receive(self) -> None:
        schedule = mate.Schedule(completion=self.arrived) if self.handlers else None
        self.receive = self.world.recv(self.inbox, mate.ANY_SOURCE, mate.ANY_TAG,
                                       schedule=schedule, timeout=None)

    def poll(self) -> None:
        """Message passing: handle what arrived since the last look."""
        while self.receive is not None and self.receive.done():
            receipt = self.receive.receipt
            if receipt.event is mate.Event.COMPLETION:
                self.arrived(receipt)
            else:
                with self.lock:
                    self.post_receive()

    def arrived(self, receipt: mate.Receipt, data: None = None) -> None:
        payload = bytes(self.inbox[:receipt.length])
        with self.lock:
            if self.finished:
                return
            self.post_receive()
            assert receipt.tag is not None  # a completed receive knows its tag
            source, kind = receipt.remote_pid, Kind(receipt.tag)
            if kind is Kind.REQUEST:
                self.on_request(source, payload)
            elif kind is Kind.GRANT:
                self.on_grant(source, payload)
            elif kind is Kind.QUERY:
                self.on_query(source, payload)
            elif kind is Kind.ANSWER:
                self.on_answer(payload)
            elif kind is Kind.REPORT:
                self.on_report(source, payload)
            elif kind is Kind.STOP:
                self.on_stop()
            elif kind is Kind.FINAL:
                self.finals[source] = json.loads(payload)
                self.last_final = self.loop.time()
                self.send(Kind.GOT_FINAL, source, b"")
                self.notify()
            elif kind is Kind.GOT_FINAL:
                self.final_delivered = True
                self.notify()

    # -- thief ------------------------------------------------------------------------------

    def ask(self, avoid: int | None = None) -> None:
        """Below the threshold: ask a random peer (other than `avoid`, if there is a choice)."""
        if (self.stopped or self.request is not None or self.size == 1
                or len(self.load) >= self.config.threshold):
            return
        peers = [p for p in range(self.size) if p not in (self.me, avoid)] or [
            p for p in range(self.size) if p != self.me]
        victim = self.random.choice(peers)
        self.request_ids += 1
        rid = self.request_ids
        self.request = (rid, time.perf_counter())
        self.stats.requests += 1
        self.send(Kind.REQUEST, victim, struct.pack("<Q", rid),
                  lambda state: self.request_ended(rid, victim, state))

    def request_ended(self, rid: int, victim: int, state: mate.State) -> None:
        if self.request is None or self.request[0] != rid:
            return
        if state is mate.State.COMPLETED:  # delivered: wait a while for the grant
            self.after(self.config.grant_wait, lambda: self.give_up(rid, victim))
        else:  # §4.2: "upon receipt of request failure: ... send a request to another node"
            self.give_up(rid, victim)

    def give_up(self, rid: int, victim: int) -> None:
        if self.request is not None and self.request[0] == rid:
            self.request = None
            self.stats.retries += 1
            self.ask(avoid=victim)

    def on_grant(self, victim: int, data: bytes) -> None:
        rid, gid = struct.unpack_from("<QQ", data)
        units = unpack_units(data[16:])
        key = (victim, gid)
        if key in self.refused:
            self.stats.refused += 1  # the victim took these units back on our "no"
        elif key in self.received:
            self.stats.duplicates += 1
        else:
            self.received.add(key)
            self.load.extend(units)
            self.stats.steals += bool(units)
        if self.request is not None and self.request[0] == rid:
            self.stats.latencies.append(time.perf_counter() - self.request[1])
            self.request = None
            if units:
                self.empty_grants = 0
                self.ask()
            else:  # nothing there: ask again, backing off while everyone is short of work
                self.empty_grants += 1
                self.after(min(0.0005 * 2 ** self.empty_grants, 0.02), self.ask)
        self.notify()

    def on_query(self, victim: int, data: bytes) -> None:
        (gid,) = struct.unpack("<Q", data)
        key = (victim, gid)
        arrived = key in self.received
        if not arrived:
            self.refused.add(key)  # if it turns up later, it is refused: the victim keeps it
        self.send(Kind.ANSWER, victim, struct.pack("<QB", gid, arrived))

    # -- victim -----------------------------------------------------------------------------

    def on_request(self, thief: int, data: bytes) -> None:
        (rid,) = struct.unpack("<Q", data)
        # Half the load, if this rank keeps at least its threshold (else victim and thief
        # would pass the last units back and forth, as §6.1's thrashing check prevents).
        share = len(self.load) // 2 if len(self.load) >= 2 * self.config.threshold else 0
        portion = [self.load.popleft() for _ in range(share)]
        self.grant_ids += 1
        gid = self.grant_ids
        if portion:
            self.lent[gid] = (thief, portion)
        self.send(Kind.GRANT, thief, struct.pack("<QQ", rid, gid) + pack_units(portion),
                  lambda state: self.grant_ended(gid, state))

    def grant_ended(self, gid: int, state: mate.State) -> None:
        if gid not in self.lent:
            return
        if state is mate.State.COMPLETED:  # §4.2: "upon receipt of response ack: discard"
            del self.lent[gid]
            self.stats.given += 1
        elif state is mate.State.FAILED:  # known never to arrive
            self.take_back(gid)
        else:  # timed out: it may still arrive, so the thief's answer decides
            self.stats.queries += 1
            self.querying.add(gid)
            self.query(gid)

    def query(self, gid: int) -> None:
        if gid in self.querying:
            self.send(Kind.QUERY, self.lent[gid][0], struct.pack("<Q", gid))
            self.after(self.config.timeout, lambda: self.query(gid))

    def on_answer(self, data: bytes) -> None:
        gid, arrived = struct.unpack("<QB", data)
        if gid not in self.querying:
            return  # the answer to a repeated query
        self.querying.discard(gid)
        if arrived:
            del self.lent[gid]
            self.stats.given += 1
        else:
            self.take_back(gid)

    def take_back(self, gid: int) -> None:
        _, units = self.lent.pop(gid)
        self.load.extendleft(reversed(units))
        self.stats.taken_back += len(units)
        self.notify()

    # -- termination ------------------------------------------------------------------------

    def counts(self) -> tuple[int, ...]:
        s = self.stats
        return (s.units, s.number_sum, s.number_squares, s.solutions)

    def report(self) -> None:
        """Out of work: make sure rank 0 has this rank's cumulative counts."""
        if self.me == 0:
            self.check_done()
        elif not (self.reporting or self.stopped) and self.counts() != self.reported:
            self.reporting = True
            self.report_seq += 1
            counts = self.counts()
            self.send(Kind.REPORT, 0, struct.pack("<5Q", self.report_seq, *counts),
                      lambda state: self.report_ended(counts, state))

    def report_ended(self, counts: tuple[int, ...], state: mate.State) -> None:
        self.reporting = False
        if state is mate.State.COMPLETED:
            self.reported = counts
        if not self.load:
            self.report()  # counts changed meanwhile, or this report was lost

    def on_report(self, source: int, data: bytes) -> None:
        seq, *counts = struct.unpack("<5Q", data)
        if seq > self.reports.get(source, (0,))[0]:
            self.reports[source] = (seq, *counts)
        self.check_done()

    def check_done(self) -> None:
        done = self.stats.units + sum(report[1] for report in self.reports.values())
        if done >= self.total and not self.stopped:
            self.stopped = True
            for rank in range(1, self.size):
                self.send_reliably(Kind.STOP, rank, b"")
            self.notify()

    def on_stop(self) -> None:
        if self.stopped:
            return  # a repeated STOP
        self.stopped = True
        self.stats.leftover = len(self.load)
        self.stats.injected = dict(self.injected)

        def delivered() -> None:
            self.final_delivered = True
            self.notify()

        self.send_reliably(Kind.FINAL, 0, json.dumps(attrs.asdict(self.stats)).encode(),
                           delivered)
        self.notify()


# -- the program ---------------------------------------------------------------------------


@attrs.frozen
class Result:
    """Rank 0's account of the run."""

    config: Config
    size: int
    units: int
    sequential: float
    elapsed: float
    stats: list[dict[str, Any]]

    def problems(self) -> list[str]:
        """Everything that is wrong with the run; empty means verified."""
        total = self.units
        found = []
        solutions = sum(s["solutions"] for s in self.stats)
        if solutions != KNOWN[self.config.n]:
            found.append(f"{solutions} solutions, not {KNOWN[self.config.n]}")
        done = sum(s["units"] for s in self.stats)
        sums = (sum(s["number_sum"] for s in self.stats),
                sum(s["number_squares"] for s in self.stats))
        expected = (total * (total - 1) // 2, (total - 1) * total * (2 * total - 1) // 6)
        if done != total or sums != expected:
            found.append(f"{done} units done of {total}, or some twice (number sums {sums}, "
                         f"expected {expected})")
        for key in ("leftover", "duplicates"):
            if any(s[key] for s in self.stats):
                found.append(f"{key}: {[s[key] for s in self.stats]}")
        return found


async def program(world: mate.World, config: Config) -> Result | None:
    units = units_of(config.n, config.split)
    sequential = 0.0
    if world.mypid == 0:
        # One rank alone, for the speed-up; also a second count of the answer.
        start = time.perf_counter()
        alone = sum(solve(config.n, config.split, c, left, r) for _, c, left, r in units)
        sequential = time.perf_counter() - start
        if alone != KNOWN[config.n]:
            raise SystemExit(f"the sequential count gives {alone}, not {KNOWN[config.n]}")
        for rank in range(1, world.numprocs):
            await world.send(b"", rank, Kind.START, timeout=None)
    else:
        await world.recv(bytearray(0), 0, Kind.START, timeout=None)
    injected = inject(world, config.faults).injected if config.faults else {}
    stealer = Stealer(world, config, units, injected)
    start = time.perf_counter()
    await stealer.run()
    elapsed = time.perf_counter() - start
    if world.mypid == 0:
        await stealer.linger()
    stealer.close()
    if world.mypid != 0:
        return None
    stealer.stats.injected = dict(injected)
    finals = [attrs.asdict(stealer.stats)] + [stealer.finals[r] for r in sorted(stealer.finals)]
    return Result(config, world.numprocs, len(units), sequential, elapsed, finals)


def speedup(result: Result, transport: str) -> float | None:
    """The speed-up over one rank alone, or None on the local transport: there all ranks
    share one process, one event loop and one core, so the ratio is no speed-up."""
    return None if transport == "local" else result.sequential / result.elapsed


def as_json(result: Result, transport: str) -> dict[str, Any]:
    """The run's figures, for scripts (bench/work_stealing.py)."""
    latencies = [t for s in result.stats for t in s["latencies"]]
    config = result.config
    return {
        "model": config.model, "transport": transport, "ranks": result.size,
        "queens": config.n, "split": config.split, "threshold": config.threshold,
        "faults": str(config.faults) if config.faults else None, "units": result.units,
        "elapsed_s": result.elapsed, "sequential_s": result.sequential,
        "speedup": speedup(result, transport),
        "steals": sum(s["steals"] for s in result.stats),
        "answer_latency_median_ms": statistics.median(latencies) * 1e3 if latencies else None,
        "busy_s": [s["busy"] for s in result.stats],
        "verified": not result.problems(),
    }


def show(result: Result, transport: str) -> int:
    """Print the per-rank table and the summary line; return the exit code."""
    print(f"{'rank':>4} {'units':>6} {'solutions':>9} {'busy s':>7} {'steals':>6} "
          f"{'given':>5} {'requests':>8} {'retries':>7} {'queries':>7} {'taken back':>10}")
    for s in result.stats:
        print(f"{s['rank']:>4} {s['units']:>6} {s['solutions']:>9} {s['busy']:>7.3f} "
              f"{s['steals']:>6} {s['given']:>5} {s['requests']:>8} {s['retries']:>7} "
              f"{s['queries']:>7} {s['taken_back']:>10}")
    latencies = [t for s in result.stats for t in s["latencies"]]
    if latencies:
        ms = sorted(t * 1e3 for t in latencies)
        print(f"answer latency (request sent -> grant received): median {statistics.median(ms):.3f}"
              f" ms, 90th percentile {ms[int(0.9 * (len(ms) - 1))]:.3f} ms, {len(ms)} answers")
    if result.config.faults:
        injected = {k: sum(s["injected"].get(k, 0) for s in result.stats)
                    for k in ("drop", "delay", "fail")}
        print("faults injected: " + ", ".join(f"{k} {v}" for k, v in injected.items())
              + f"; grants refused after a 'no': {sum(s['refused'] for s in result.stats)}")
    config = result.config
    gain = speedup(result, transport)
    over_one = "" if gain is None else f", {gain:.2f}x over one rank ({result.sequential:.3f} s)"
    steals = sum(s["steals"] for s in result.stats)
    what = (f"work stealing ({config.model}, {transport}, {result.size} ranks"
            f"{', faults ' + str(config.faults) if config.faults else ''}): "
            f"{sum(s['solutions'] for s in result.stats)} solutions of {config.n}-queens in "
            f"{result.elapsed:.3f} s{over_one}; {result.units} units, {steals} steals")
    problems = result.problems()
    if problems:
        print(f"{what}: NOT verified: {'; '.join(problems)}")
        return 1
    print(f"{what}; every unit done once: verified")
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Work stealing with Progressive Messages: count n-queens solutions.",
        epilog=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--model", choices=MODELS, default="progressive")
    parser.add_argument("--queens", "-n", type=int, default=10,
                        help=f"board size, 4..{len(KNOWN) - 1} (default 10)")
    parser.add_argument("--split", type=int, default=3,
                        help="depth at which the search tree is cut into units (default 3)")
    parser.add_argument("--threshold", type=int, default=4,
                        help="ask for work when fewer units than this are queued (default 4)")
    parser.add_argument("--timeout", type=float, default=0.25,
                        help="timeout of every send, seconds (default 0.25)")
    parser.add_argument("--grant-wait", type=float, default=1.0,
                        help="after a delivered request, wait this long for its grant")
    parser.add_argument("--faults", default="",
                        help="e.g. drop=0.05,delay=0.05:0.3,fail=0.02 (see mate.faults)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="FILE", help="also write the run's figures here")
    parser.add_argument("--deadline", type=float, default=120.0,
                        help="give up (NOT verified, exit 1) after this many seconds")
    mate.spmd.add_arguments(parser)
    args = parser.parse_args(argv)
    if not 4 <= args.queens < len(KNOWN) or not 0 <= args.split <= args.queens:
        parser.error("need 4 <= --queens <= 15 and 0 <= --split <= --queens")
    if args.threshold < 1 or args.timeout <= 0 or args.grant_wait <= 0:
        parser.error("--threshold, --timeout and --grant-wait must be positive")
    return args


async def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    faults = FaultPlan.parse(args.faults, seed=args.seed) if args.faults else None
    config = Config(n=args.queens, split=args.split, threshold=args.threshold,
                    model=args.model, timeout=args.timeout, grant_wait=args.grant_wait,
                    faults=faults, seed=args.seed)
    if args.handlers == "progress":
        # The progress thread must get the GIL while a unit computes: 0.5 ms, not 5 ms.
        sys.setswitchinterval(0.0005)
    options = mate.spmd.options_from(args)
    transport = mate.spmd.chosen(args.transport)
    try:
        results = await asyncio.wait_for(
            mate.spmd.run(lambda world: program(world, config), **options), args.deadline)
    except mate.InvalidArgument as exc:
        print(f"work_stealing.py: {exc}", file=sys.stderr)
        return 2
    except TimeoutError:
        print(f"work stealing ({args.model}, {transport}): no result within "
              f"{args.deadline} s: NOT verified")
        return 1
    for result in results:
        if result is not None:
            if args.json:
                with open(args.json, "w") as out:
                    json.dump(as_json(result, transport), out, indent=1)
            return show(result, transport)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
