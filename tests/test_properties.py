"""Hypothesis over the real local transport: random programs, then the SPEC §1 invariants.

A program is a random interleaving, over 2-3 in-process ranks, of sends (sizes
around a small eager limit, so that both the eager and the rendezvous protocol
run), receives (any source or tag, wildcards included, buffers sometimes too
short so that messages are truncated), cancels (`msg.cancel()`, or cancelling
a task that awaits the message), short timeouts (`timeout=`, or UNSET with a
timeout handler and a short default), tasks that await messages (some of
them cancelled later), yields and short sleeps. Afterwards the program lets
every armed or cancelled message end (a cancel request is always answered),
drains what is left (a receive for every send not yet received), checks that
nothing else is left to receive (a receive for anything, on every rank, times
out), and shuts down. Then:

* every message ended in exactly one terminal outcome: its state, its handler
  calls and what awaiting it gives all agree; nothing ran after it;
* events came in a legal order: submission at most once, only for sends,
  before completion; a completed send always saw submission;
* a timeout never fired before its value;
* no data was lost or duplicated: every payload is unique (its id in the first
  bytes), every completed send reached exactly one receive (completed or
  TRUNCATED, with the right bytes, source and tag), every receive that got
  data got exactly one send's data, and a cancelled, timed-out or failed
  receive left its buffer untouched;
* a send that was cancelled or timed out was received by nobody. SPEC §1
  allows a timed-out send to have arrived all the same; the local transport
  is stricter (eager sends complete when they are carried out; a rendezvous
  send can be cancelled only before its match, and a cancel is answered at
  once), so the strict rule is checked here (TIMED_OUT_SEND_MAY_ARRIVE);
* a task that awaits a message (or its submission), and is not cancelled
  itself, gets the outcome that the message's state says;
* nothing raised inside the event loop's callbacks (a transport crash there
  would otherwise only be logged);
* non-overtaking: sends from one source to one destination with one tag are
  matched in posting order. The local transport carries every operation out
  in posting order, so the stronger MPI rule can be checked exactly as well:
  a match is always the oldest eligible entry, i.e. a receive never gets a
  message while an older message that it accepts waits at its rank, and a
  message never goes to a receive while an older receive that accepts it
  waits.

The order of matches is read from the order in which handlers ran: with
handlers="loop" they run in event order, and on the local transport a
receive's terminal event is reported at the moment it is matched.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import mate
from mate import ANY_SOURCE, ANY_TAG, UNSET, Event, FailureReason, Op, Receipt, Schedule, State

ANY = ANY_SOURCE
assert ANY_TAG == ANY
EAGER = 64  # eager_limit: sends up to this many bytes are eager, larger are rendezvous
DEFAULT_TIMEOUT = 0.01  # what timeout=UNSET arms (every schedule here has a timeout handler)
SEND_TAGS = (0, 1)
ID_BYTES = 4
DRAIN_SIZE = 256  # larger than any send
SENTINEL = 0xA5
PROBE_TIMEOUT = 0.002
TIMED_OUT_SEND_MAY_ARRIVE = False  # SPEC §1 allows it; the local transport never does it
SETTLE_LIMIT = 1.0  # seconds after the last deadline; far beyond what settling takes

small, near_eager, large = (st.integers(ID_BYTES, 12), st.integers(EAGER - 3, EAGER + 3),
                            st.integers(100, 160))
sizes = st.one_of(small, near_eager, large)
recv_sizes = st.one_of(small, small, near_eager, large)  # short buffers: truncation
timeouts = st.sampled_from([None, None, None, None, None, UNSET, 0.0, 0.002, 0.01, 0.02])


# A task that awaits the message ("done") or its submission ("submitted") from its post on.
watches = st.sampled_from([None, None, "done", "submitted"])


def programs(n: int) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    rank = st.integers(0, n - 1)
    receiver = st.sampled_from([1, *range(n)])  # biased towards rank 1, so that more match
    send = st.tuples(st.just("send"), rank, receiver, st.sampled_from([0, *SEND_TAGS]), sizes,
                     timeouts, watches)
    recv = st.tuples(st.just("recv"), receiver, st.sampled_from([ANY, ANY, *range(n)]),
                     st.sampled_from([ANY, 0, *SEND_TAGS]), recv_sizes, timeouts, watches)
    # A receive for a recent send (or a wildcard one that accepts it), so that many match.
    recv_for = st.tuples(st.just("recv_for"), st.integers(0, 63), st.booleans(), st.booleans(),
                         recv_sizes, timeouts, watches)
    cancel = st.tuples(st.just("cancel"), st.integers(0, 63))
    abandon = st.tuples(st.just("abandon"), st.integers(0, 63), st.integers(0, 2))
    # Start a task that awaits a message (or its submission); cancel one later.
    spawn = st.tuples(st.just("spawn"), st.integers(0, 63), st.sampled_from(["done", "submitted"]))
    kill = st.tuples(st.just("kill"), st.integers(0, 63))
    pause = st.tuples(st.just("yield"), st.integers(1, 3))
    sleep = st.tuples(st.just("sleep"), st.sampled_from([0.001, 0.004]))
    step = st.one_of(send, send, send, recv, recv, recv_for, recv_for, cancel, cancel, abandon,
                     spawn, kill, pause, pause, pause, sleep)
    return st.lists(step, min_size=4, max_size=40)


def event(name: str) -> None:
    """Count outcomes in hypothesis' statistics (pytest --hypothesis-show-statistics)."""
    if currently_in_test_context():
        hypothesis_event(name)


def payload(key: int, size: int) -> bytes:
    body = bytes((key * 37 + i) % 256 for i in range(size - ID_BYTES))
    return key.to_bytes(ID_BYTES, "big") + body


def accepts(source: int, tag: int, from_source: int, with_tag: int) -> bool:
    return source in (ANY, from_source) and tag in (ANY, with_tag)


@dataclass
class Seen:
    event: Event
    receipt: Receipt
    when: float
    position: int  # place in the global order of handler calls


@dataclass(eq=False)
class Rec:
    key: int
    op: Op
    rank: int  # the rank that posted it
    peer: int  # send: destination; recv: source filter
    tag: int  # send: tag; recv: tag filter
    timeout_arg: Any
    buffer: bytearray | bytes
    payload: bytes | None = None
    timeout: float | None = None  # what was armed
    t0: float = 0.0
    msg: mate.Message = None  # type: ignore[assignment]
    events: list[Seen] = field(default_factory=list)
    cancel_allowed: bool = False  # the user asked for a cancel (or may have)
    must_end: bool = False  # a cancel request reached the message: it must be answered
    drain: bool = False
    probe: bool = False
    watch: str | None = None

    def __repr__(self) -> str:
        where = f"{self.rank}->{self.peer}" if self.op is Op.SEND else f"{self.rank}<-{self.peer}"
        return (f"<{self.op.value} #{self.key} {where} tag={self.tag} len={len(self.buffer)} "
                f"timeout={self.timeout} {self.msg.state.name if self.msg else '?'} "
                f"{[s.event.name for s in self.events]}>")


class Run:
    def __init__(self, n: int, program: list[tuple[Any, ...]]) -> None:
        self.n = n
        self.program = program
        self.recs: list[Rec] = []
        self.log: list[tuple[Rec, Event]] = []
        self.problems: list[str] = []
        self.posting = False
        self.awaiters: list[Awaiter] = []
        self.live_at_shutdown: set[int] = set()
        self.keys = itertools.count(1)
        self.schedule_handlers = {e: self._handler(e) for e in Event}

    def _handler(self, ev: Event) -> Any:
        def on(receipt: Receipt, rec: Rec) -> None:
            # Handler exceptions are only logged by mate, so problems are collected.
            if self.posting:
                self.problems.append(f"{ev.name} handler of {rec} ran inside a posting call")
            if receipt.event is not ev:
                self.problems.append(f"{ev.name} handler of {rec} got a {receipt.event} receipt")
            rec.events.append(Seen(ev, receipt, time.monotonic(), len(self.log)))
            self.log.append((rec, ev))
        return on

    def schedule(self, rec: Rec) -> Schedule:
        h = self.schedule_handlers
        return Schedule(completion=h[Event.COMPLETION], completion_data=rec,
                        submission=h[Event.SUBMISSION], submission_data=rec,
                        timeout=h[Event.TIMEOUT], timeout_data=rec,
                        failure=h[Event.FAILURE], failure_data=rec)

    def post(self, worlds: list[mate.World], rec: Rec) -> None:
        world = worlds[rec.rank]
        if rec.timeout_arg is UNSET:
            rec.timeout = DEFAULT_TIMEOUT
        else:
            rec.timeout = rec.timeout_arg
        rec.t0 = time.monotonic()
        self.posting = True
        try:
            if rec.op is Op.SEND:
                rec.msg = world.send(rec.buffer, rec.peer, rec.tag, schedule=self.schedule(rec),
                                     timeout=rec.timeout_arg)
            else:
                rec.msg = world.recv(rec.buffer, rec.peer, rec.tag, schedule=self.schedule(rec),
                                     timeout=rec.timeout_arg)
        finally:
            self.posting = False
        self.recs.append(rec)
        if rec.watch is not None:
            self.spawn(rec, rec.watch)

    def spawn(self, rec: Rec, kind: str) -> Awaiter:
        """A task that awaits `rec`'s message, or its submission (sends only)."""
        awaiter = Awaiter(rec, "submitted" if kind == "submitted" and rec.op is Op.SEND
                          else "done")
        awaiter.task = asyncio.create_task(awaiter.wait())
        self.awaiters.append(awaiter)
        return awaiter

    @staticmethod
    def kill(awaiter: Awaiter) -> None:
        """Cancel the task; once it awaits, that cancels the message (the asyncio rule)."""
        rec = awaiter.rec
        rec.cancel_allowed = True
        if awaiter.started and not awaiter.task.done():
            rec.must_end = True  # a cancel request reaches the message: it must be answered
        awaiter.killed = True
        awaiter.task.cancel()

    def send(self, worlds: list[mate.World], src: int, dst: int, tag: int, size: int,
             timeout: Any, watch: str | None = None, *, drain: bool = False) -> Rec:
        key = next(self.keys)
        data = payload(key, size)
        rec = Rec(key, Op.SEND, src, dst, tag, timeout, data, payload=data, drain=drain,
                  watch=watch)
        self.post(worlds, rec)
        return rec

    def recv(self, worlds: list[mate.World], rank: int, source: int, tag: int, size: int,
             timeout: Any, watch: str | None = None, *, drain: bool = False,
             probe: bool = False) -> Rec:
        rec = Rec(next(self.keys), Op.RECV, rank, source, tag, timeout,
                  bytearray([SENTINEL]) * size, drain=drain, probe=probe, watch=watch)
        self.post(worlds, rec)
        return rec

    async def wait_until(self, what: str, condition: Any) -> None:
        last = max((r.t0 + r.timeout for r in self.recs if r.timeout is not None), default=0.0)
        deadline = max(time.monotonic(), last) + SETTLE_LIMIT
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not happen in time: "
                                     f"{[r for r in self.recs if not r.msg.done()]}")
            await asyncio.sleep(0.001)

    def loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.problems.append(f"raised in the event loop: {context.get('message')} "
                             f"{context.get('exception')!r}")

    async def main(self) -> None:
        asyncio.get_running_loop().set_exception_handler(self.loop_exception)
        async with mate.local.worlds(self.n, eager_limit=EAGER,
                                     default_timeout=DEFAULT_TIMEOUT) as worlds:
            for step in self.program:
                await self.step(worlds, step)
            # Every armed timeout and every cancel request must get its answer.
            await self.wait_until("the end of every timed or cancelled message", lambda: all(
                r.msg.done() for r in self.recs if r.timeout is not None or r.must_end))
            await flush()
            self.drain(worlds)
            await self.wait_until("the drain", lambda: all(
                r.msg.done() for r in self.recs if r.drain or r.op is Op.SEND))
            await flush()
            # Nothing else may be left to receive (no duplicate, no phantom): a
            # receive for anything, on every rank, finds nothing and times out.
            probes = [self.recv(worlds, rank, ANY, ANY, DRAIN_SIZE, PROBE_TIMEOUT, probe=True)
                      for rank in range(self.n)]
            await self.wait_until("the probes", lambda: all(p.msg.done() for p in probes))
            await flush()
            for probe in probes:
                if probe.msg.state is not State.TIMED_OUT:
                    self.problems.append(f"{probe} found a message after the drain")
            self.live_at_shutdown = {r.key for r in self.recs if not r.msg.done()}
        seen = len(self.log)  # handlers of events before shutdown ran during it
        await flush()
        if len(self.log) != seen:
            self.problems.append(f"handlers ran after shutdown: {self.log[seen:]}")
        for rec in self.recs:
            await self.check_outcome(rec)
        for awaiter in self.awaiters:
            await self.check_awaiter(awaiter)

    async def step(self, worlds: list[mate.World], step: tuple[Any, ...]) -> None:
        kind = step[0]
        if kind == "send":
            self.send(worlds, *step[1:])
        elif kind == "recv":
            self.recv(worlds, *step[1:])
        elif kind == "recv_for":
            sends = [r for r in self.recs if r.op is Op.SEND]
            if sends:
                _, i, any_source, any_tag, size, timeout, watch = step
                send = sends[-1 - i % len(sends)]
                self.recv(worlds, send.peer, ANY if any_source else send.rank,
                          ANY if any_tag else send.tag, size, timeout, watch)
        elif kind == "cancel" and self.recs:
            rec = self.recs[-1 - step[1] % len(self.recs)]
            was_done = rec.msg.done()
            rec.cancel_allowed = rec.must_end = True
            if rec.msg.cancel() != (not was_done):
                self.problems.append(f"cancel() of {rec} returned the wrong answer")
        elif kind == "abandon" and self.recs:
            awaiter = self.spawn(self.recs[-1 - step[1] % len(self.recs)], "done")
            for _ in range(step[2]):
                await asyncio.sleep(0)
            self.kill(awaiter)
        elif kind == "spawn" and self.recs:
            self.spawn(self.recs[-1 - step[1] % len(self.recs)], step[2])
        elif kind == "kill":
            alive = [a for a in self.awaiters if not a.killed]
            if alive:
                self.kill(alive[-1 - step[1] % len(alive)])
        elif kind == "yield":
            for _ in range(step[1]):
                await asyncio.sleep(0)
        elif kind == "sleep":
            await asyncio.sleep(step[1])

    def drain(self, worlds: list[mate.World]) -> None:
        """Post a receive for every send that is not received yet (and may still be)."""
        received = {self.received_key(r) for r in self.recs if r.op is Op.RECV}
        for rec in list(self.recs):
            if rec.op is Op.SEND and rec.key not in received and rec.msg.state in (
                    State.POSTED, State.SUBMITTED, State.COMPLETED):
                self.recv(worlds, rec.peer, rec.rank, rec.tag, DRAIN_SIZE, None, drain=True)

    @staticmethod
    def received_key(rec: Rec) -> int | None:
        """The id of the payload a receive got, or None if it got none."""
        return int.from_bytes(rec.buffer[:ID_BYTES], "big") if got_data(rec) else None

    async def check_outcome(self, rec: Rec) -> None:
        """What awaiting the message (and its submission) gives agrees with its state."""
        state = rec.msg.state
        try:
            receipt = await rec.msg
        except mate.MessageTimeout:
            got = State.TIMED_OUT
        except mate.MessageFailed:
            got = State.FAILED
        except asyncio.CancelledError:
            got = State.CANCELLED
        else:
            got = State.COMPLETED
            if receipt != rec.msg.receipt or receipt.event is not Event.COMPLETION:
                self.problems.append(f"await {rec} returned {receipt}")
        if got is not state:
            self.problems.append(f"await {rec} gave {got.name}")
        if rec.op is Op.SEND:
            submitted = rec.msg.submitted
            assert submitted is not None
            try:
                sub = await submitted
            except (mate.MessageTimeout, mate.MessageFailed, asyncio.CancelledError):
                if rec.msg.submitted_seen:
                    self.problems.append(f"await submitted of {rec} raised after submission")
            else:
                if sub.event is not Event.SUBMISSION or not rec.msg.submitted_seen:
                    self.problems.append(f"await submitted of {rec} returned {sub}")
        elif rec.msg.submitted is not None:
            self.problems.append(f"{rec}.submitted is not None")

    async def check_awaiter(self, awaiter: Awaiter) -> None:
        rec, kind, task = awaiter.rec, awaiter.kind, awaiter.task
        if not task.done():
            self.problems.append(f"the task awaiting {kind} of {rec} never woke up")
            task.cancel()
            return
        state = rec.msg.state
        if kind == "submitted" and rec.msg.submitted_seen:
            expected: type[BaseException] | None = None  # the submission receipt
        else:
            expected = {State.COMPLETED: None, State.TIMED_OUT: mate.MessageTimeout,
                        State.FAILED: mate.MessageFailed,
                        State.CANCELLED: asyncio.CancelledError}[state]
        try:
            receipt = await task
        except (mate.MessageTimeout, mate.MessageFailed, asyncio.CancelledError) as exc:
            if awaiter.killed and isinstance(exc, asyncio.CancelledError):
                return  # its own cancellation, whatever the message did
            if expected is None or not isinstance(exc, expected):
                self.problems.append(f"the task awaiting {kind} of {rec} raised {exc!r}"
                                     f"{' (it was cancelled)' if awaiter.killed else ''}")
        else:
            want = Event.SUBMISSION if kind == "submitted" else Event.COMPLETION
            if expected is not None or receipt.event is not want:
                self.problems.append(f"the task awaiting {kind} of {rec} returned {receipt}")


@dataclass(eq=False)
class Awaiter:
    """A task awaiting a message; unless killed, it must get exactly the message's outcome."""

    rec: Rec
    kind: str  # "done" (await msg) or "submitted" (await msg.submitted)
    task: asyncio.Task[Receipt] = None  # type: ignore[assignment]
    started: bool = False
    killed: bool = False

    async def wait(self) -> Receipt:
        self.started = True
        if self.kind == "done":
            return await self.rec.msg
        submitted = self.rec.msg.submitted
        assert submitted is not None
        return await submitted


def got_data(rec: Rec) -> bool:
    """A receive got a message: it completed, or failed because it was too short."""
    state = rec.msg.state
    if state is State.FAILED:
        error = rec.msg.receipt.error
        return isinstance(error, mate.MessageFailed) and error.reason is FailureReason.TRUNCATED
    return state is State.COMPLETED


async def flush() -> None:
    for _ in range(6):
        await asyncio.sleep(0)


TERMINAL_EVENT = {State.COMPLETED: Event.COMPLETION, State.TIMED_OUT: Event.TIMEOUT,
                  State.FAILED: Event.FAILURE, State.CANCELLED: None}


def check_events(run: Run) -> None:
    for rec in run.recs:
        state = rec.msg.state
        kinds = [s.event for s in rec.events]
        assert state.terminal, rec
        if rec.key in run.live_at_shutdown:
            check_shutdown(rec)
            continue
        # Submission: at most once, only for sends, first.
        if rec.op is Op.RECV:
            assert Event.SUBMISSION not in kinds, rec
        else:
            assert kinds.count(Event.SUBMISSION) <= 1, rec
            if Event.SUBMISSION in kinds:
                assert kinds[0] is Event.SUBMISSION, rec
        # Exactly one terminal outcome, matching the state; nothing after it.
        ends = [k for k in kinds if k is not Event.SUBMISSION]
        expected = TERMINAL_EVENT[state]
        assert ends == ([expected] if expected else []), rec
        if ends:
            assert kinds[-1] is ends[0], rec
        if rec.op is Op.SEND and state is State.COMPLETED:
            assert kinds == [Event.SUBMISSION, Event.COMPLETION], rec
        # Why it ended that way.
        if state is State.CANCELLED:
            assert rec.cancel_allowed, rec
        if state is State.TIMED_OUT:
            assert rec.timeout is not None, rec
            (seen,) = [s for s in rec.events if s.event is Event.TIMEOUT]
            assert seen.when >= rec.t0 + rec.timeout, f"{rec} timed out early"
        if state is State.FAILED:
            # No rank went away during the program: only a too-short receive fails.
            assert rec.op is Op.RECV, rec
            error = rec.msg.receipt.error
            assert isinstance(error, mate.MessageFailed), rec
            assert error.reason is FailureReason.TRUNCATED, rec
        for seen in rec.events:
            r = seen.receipt
            assert (r.op, r.local_pid) == (rec.op, rec.rank), (rec, r)
            if seen.event is Event.TIMEOUT:
                assert isinstance(r.error, mate.MessageTimeout), (rec, r)
            elif seen.event is Event.FAILURE:
                assert isinstance(r.error, mate.MessageFailed), (rec, r)
            else:
                assert r.error is None, (rec, r)
            if rec.op is Op.SEND and seen.event is Event.COMPLETION:
                assert rec.payload is not None
                assert (r.length, r.remote_pid, r.tag) == (len(rec.payload), rec.peer, rec.tag)
        if state is State.COMPLETED:
            event("send completed" if rec.op is Op.SEND else "recv completed")
        else:
            event(f"{rec.op.value} {state.name}")


def check_shutdown(rec: Rec) -> None:
    """A message still outstanding when the group was shut down.

    Every send was drained before, so only receives are left. Shutdown cancels
    them silently. `worlds()` shuts the ranks down one after the other, though,
    so a receive from a lower rank first fails with PEER_UNREACHABLE when that
    rank goes: a real event, whose handler runs before this rank's own
    shutdown closes its dispatcher (handlers and awaiters agree).
    """
    assert rec.op is Op.RECV, rec
    kinds = [s.event for s in rec.events]
    if rec.msg.state is State.CANCELLED:
        assert kinds == [], rec
    else:
        assert rec.msg.state is State.FAILED, rec
        error = rec.msg.receipt.error
        assert isinstance(error, mate.MessageFailed), rec
        assert error.reason is FailureReason.PEER_UNREACHABLE, rec
        assert 0 <= rec.peer < rec.rank, rec
        assert kinds == [Event.FAILURE], rec
        event("recv failed at group shutdown")


def check_data(run: Run) -> None:
    sends = {r.key: r for r in run.recs if r.op is Op.SEND}
    delivered: dict[int, list[Rec]] = defaultdict(list)
    for rec in run.recs:
        if rec.op is not Op.RECV:
            continue
        state, buf = rec.msg.state, rec.buffer
        if not got_data(rec):
            # No data loss: a cancelled, timed-out or failed receive consumed nothing.
            assert buf == bytearray([SENTINEL]) * len(buf), f"{rec} was written into"
            continue
        receipt = rec.msg.receipt
        key = int.from_bytes(buf[:ID_BYTES], "big")
        assert key in sends, f"{rec} holds no send's payload: {bytes(buf)!r}"
        send = sends[key]
        assert send.payload is not None
        length, full = receipt.length, len(send.payload)
        if state is State.COMPLETED:
            assert length == full <= len(buf), (rec, send)
        else:
            assert full > len(buf) == length, f"{rec} truncated {send} wrongly"
            event("truncated")
        assert buf[:length] == send.payload[:length], (rec, send)
        assert buf[length:] == bytearray([SENTINEL]) * (len(buf) - length), (rec, send)
        assert send.peer == rec.rank, (rec, send)
        assert accepts(rec.peer, rec.tag, send.rank, send.tag), (rec, send)
        assert (receipt.remote_pid, receipt.tag) == (send.rank, send.tag), (rec, send, receipt)
        delivered[key].append(rec)

    for key, send in sends.items():
        got = delivered[key]
        state = send.msg.state
        if state is State.COMPLETED:
            assert len(got) == 1, f"completed {send} was received by {got}"
            event("rendezvous send delivered" if len(send.buffer) > EAGER
                  else "eager send delivered")
        elif state is State.TIMED_OUT and TIMED_OUT_SEND_MAY_ARRIVE:
            assert len(got) <= 1, f"{send} was received by {got}"
        else:
            assert got == [], f"{state.name} {send} was received by {got}"


def match_position(rec: Rec) -> int:
    (seen,) = [s for s in rec.events if s.event in (Event.COMPLETION, Event.FAILURE)]
    return seen.position


def check_order(run: Run) -> None:
    recvs = [r for r in run.recs if r.op is Op.RECV and got_data(r)]  # in posting order
    sends = {r.key: r for r in run.recs if r.op is Op.SEND}
    sender_of = {r.key: sends[Run.received_key(r) or 0] for r in recvs}
    recv_of = {sender_of[r.key].key: r for r in recvs}
    delivered = [s for s in sends.values() if s.key in recv_of]  # in posting order

    # Non-overtaking (SPEC §1): one source, one destination, one tag.
    streams: dict[tuple[int, int, int], list[Rec]] = defaultdict(list)
    for send in delivered:
        streams[send.rank, send.peer, send.tag].append(send)
    for stream, group in streams.items():
        positions = [match_position(recv_of[s.key]) for s in group]
        assert positions == sorted(positions), f"overtaking in {stream}: {group}"

    # Oldest eligible (exact on the local transport, which carries operations
    # out in posting order). A message older than m that r accepts, and that
    # was still waiting when r got m, should have gone to r first:
    for j, later in enumerate(delivered):
        r = recv_of[later.key]
        for earlier in delivered[:j]:
            if earlier.peer == later.peer and accepts(r.peer, r.tag, earlier.rank, earlier.tag):
                assert match_position(recv_of[earlier.key]) < match_position(r), (
                    f"{r} got {later} while the older {earlier} waited")
    # ... and a receive older than r that accepts m, and still waited, should have got m.
    for j, r in enumerate(recvs):
        m = sender_of[r.key]
        for older in recvs[:j]:
            if older.rank == r.rank and accepts(older.peer, older.tag, m.rank, m.tag):
                assert match_position(older) < match_position(r), (
                    f"{m} went to {r} while the older {older} waited")


def run_program(n: int, program: list[tuple[Any, ...]]) -> Run:
    run = Run(n, program)
    asyncio.run(run.main())
    assert run.problems == []
    check_events(run)
    check_data(run)
    check_order(run)
    return run


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(2, 3).flatmap(lambda n: st.tuples(st.just(n), programs(n))))
def test_local_transport_keeps_the_contract(case: tuple[int, list[tuple[Any, ...]]]) -> None:
    run_program(*case)


# Fixed programs: the protocols' corners run on every test run, whatever
# hypothesis draws. Each goes through the same checks as the property.


def states(run: Run) -> list[State]:
    return [r.msg.state for r in run.recs if not (r.drain or r.probe)]


def test_fixed_eager_rendezvous_truncation_and_wildcards() -> None:
    run = run_program(2, [
        ("recv", 1, ANY, ANY, 200, None, "done"),  # posted first: takes the first send
        ("send", 0, 1, 0, 10, None, "submitted"),  # eager, matches the posted receive
        ("send", 0, 1, 0, 100, None, "submitted"),  # rendezvous, parked
        ("send", 0, 1, 1, 30, None, None),  # eager, unexpected
        ("yield", 2),
        ("recv", 1, 0, 1, 8, None, "done"),  # truncates the tag-1 message
        ("recv", 1, ANY, 0, 50, None, None),  # truncates the rendezvous one
        ("send", 1, 1, 0, 5, None, None),  # to itself
    ])
    assert states(run)[:6] == [State.COMPLETED] * 4 + [State.FAILED] * 2


def test_fixed_cancels_and_timeouts() -> None:
    run = run_program(3, [
        ("send", 0, 1, 0, 100, 0.0, "done"),  # rendezvous: times out before any receive
        ("send", 0, 2, 0, 100, None, "submitted"),
        ("cancel", 0),  # cancels the previous send (still queued)
        ("recv", 2, 0, ANY, 8, 0.002, "done"),  # times out
        ("recv", 1, 2, 1, 8, None, None),
        ("abandon", 0, 1),  # the receive is cancelled through its awaiting task
        ("sleep", 0.004),
    ])
    assert states(run)[:4] == [State.TIMED_OUT, State.CANCELLED, State.TIMED_OUT,
                               State.CANCELLED]


@pytest.mark.parametrize("how", ["cancel", "abandon", "timeout"])
@pytest.mark.parametrize("source", [0, ANY])
def test_fixed_withdrawn_recv_gets_nothing(how: str, source: int) -> None:
    # A receive that waits in the posted table is withdrawn; a matching send
    # that comes afterwards must go to the next receive, not into its buffer.
    ending = {"cancel": [("cancel", 0)], "abandon": [("abandon", 0, 1), ("yield", 2)],
              "timeout": [("sleep", 0.004)]}[how]
    run = run_program(2, [
        ("recv", 1, source, 0, 8, 0.002 if how == "timeout" else None, None),
        ("yield", 1),  # carried out: now in the posted table
        *ending,
        ("send", 0, 1, 0, 6, None, None),
        ("yield", 2),
        ("recv", 1, 0, 0, 8, None, "done"),
    ])
    expected = State.TIMED_OUT if how == "timeout" else State.CANCELLED
    assert states(run) == [expected, State.COMPLETED, State.COMPLETED]


@pytest.mark.parametrize("how", ["cancel", "abandon", "timeout"])
def test_fixed_withdrawn_rendezvous_send_is_not_delivered(how: str) -> None:
    ending = {"cancel": [("cancel", 0)], "abandon": [("abandon", 0, 1), ("yield", 2)],
              "timeout": [("sleep", 0.004)]}[how]
    run = run_program(2, [
        ("send", 0, 1, 0, 100, 0.002 if how == "timeout" else None, None),
        ("yield", 1),  # carried out: parked at rank 1, uncopied
        *ending,
        ("send", 0, 1, 0, 100, None, None),
        ("recv", 1, ANY, ANY, 200, None, "done"),
    ])
    expected = State.TIMED_OUT if how == "timeout" else State.CANCELLED
    assert states(run) == [expected, State.COMPLETED, State.COMPLETED]


def test_fixed_oldest_eligible_across_buckets() -> None:
    run = run_program(3, [
        ("send", 2, 1, 1, 10, None, None),
        ("send", 0, 1, 0, 100, None, None),
        ("send", 0, 1, 1, 10, None, None),
        ("yield", 1),  # all three wait at rank 1, in three buckets
        ("recv", 1, ANY, 1, 16, None, None),  # the oldest with tag 1: #1, not #3
        ("recv", 1, 0, ANY, 200, None, None),  # the oldest from rank 0: #2, not #3
        ("recv", 1, ANY, ANY, 16, None, None),  # what is left: #3
        ("recv", 1, 1, ANY, 16, None, None),  # waits
        ("recv", 1, ANY, 0, 16, None, None),  # waits too, in another bucket
        ("send", 1, 1, 0, 10, None, None),  # #9: both accept it; the older one gets it
    ])
    assert states(run) == [State.COMPLETED] * 7 + [State.CANCELLED, State.COMPLETED]
    got = [Run.received_key(r) for r in run.recs if r.op is Op.RECV and not r.probe]
    assert got == [1, 2, 3, 9, None]


def test_fixed_cancelling_one_awaiter_leaves_the_others_alone() -> None:
    # Two tasks await one receive; one of them is cancelled just as a send
    # matches it. The match wins (no data loss): the receive completes, and
    # the task that nobody cancelled must get the receipt.
    run = run_program(2, [
        ("recv", 1, 0, 0, 8, None, "done"),  # awaited by task W
        ("spawn", 0, "done"),  # and by task A
        ("yield", 1),  # both await it now
        ("send", 0, 1, 0, 6, None, None),  # queued: matches on the next loop pass
        ("kill", 0),  # cancel A (the cancel request reaches the receive after the match)
    ])
    assert states(run) == [State.COMPLETED, State.COMPLETED]
