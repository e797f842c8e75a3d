"""Fault injection: an unreliable network in front of any transport.

``mate.faults.inject(world, FaultPlan(drop=0.05, delay=0.05, fail=0.02))``
puts a `FaultyTransport` between a world and its transport. Each outgoing
message (send, put, get) then meets, at random and independently, at most one
of:

* **drop**: the message is lost on the wire. It is never carried out and ends
  only by its timeout (or a cancel), as on a network that loses packets; so
  a program that drops messages must arm timeouts on them.
* **fail**: the transport reports failure (`FailureReason.TRANSPORT`, "injected
  fault") soon after the post; the message is never carried out.
* **delay**: the message leaves `delay_seconds` late, from a copy (a send or
  put is submitted at once). If its timeout elapses meanwhile it times out,
  and is still carried out when the delay ends: the case SPEC §1 allows ("a
  send that timed out may still have reached its destination") and real
  transports produce (MPI sends abandoned by a cancel). Programs that claim to
  survive timeouts must survive this one.
* **duplicate**: the message is carried twice across the inner transport, as
  by a network that duplicates; the receiving layer discards the second copy
  of a send before matching it (below), and a put or get is simply done twice
  inside its own window (a put's data may land any time before its
  completion, so writing the same bytes twice there changes nothing).

and, not at random:

* **kill**: the rank dies right after it has posted its `kill_after`-th
  message through the layer (`kill_rank`: only that rank; None: the rank the
  plan is injected on). A rank with a process of its own SIGKILLs itself: no
  cleanup, no goodbye, as in a crash. A rank of the local transport, whose
  ranks share one process, dies in place: its transport leaves the fabric at
  once (`LocalTransport.leave`, what a shut-down rank does, so peers see it
  as they see any rank that is gone: their messages to and from it fail with
  PEER_UNREACHABLE), nothing it had outstanding is reported any more, and its
  world shuts down, which ends those messages with no handler run (awaiting
  them raises CancelledError, and any later call raises InvalidArgument).

Receives are never faulted: faults live on the sending side of the wire.

Theory of operation
-------------------
The fault layer is a transport that wraps the world's transport and puts
itself in as that transport's sink. What the inner transport reports about
the messages passed straight through goes on to the world unchanged. A
message that meets a fault is *held*: the layer answers for it (its
`transport_data` is the layer), and carries it out with *carriers* of its own,
copies of the message posted to the inner transport, whose outcomes it turns
into the original's if that is still live: a held message ends when its last
carrier ends, completed if one copy completed (a get: with that copy's data),
else as the first copy failed. The original's submission follows its first
carrier's, unless it was submitted when it was queued. Carriers are never
cancelled: a held message that times out or is cancelled is abandoned (they
read the layer's copy, not the user's buffer). Nothing goes back through the
public API, so handlers, locks and threads behave as without the layer.

Delayed messages form *slow links*, one per channel that SPEC §1 orders (a
destination and a tag; put and get, which are not ordered, share one per
destination): they leave in the order they were posted, and a message posted
to a channel while delayed ones wait on it queues behind them (copied, and
submitted at once), so that a wrapped world keeps non-overtaking. Operations on
different channels overtake each other, as the spec allows. Random choices come from one
seeded generator per world, so a fault plan and a seed replay the same faults
for the same sequence of posts.

The duplicate protocol
----------------------
A duplicated send cannot be discarded once the inner transport has matched it
to a receive: the receive that caught it would lose its place (non-overtaking),
and no swap of data between receives repairs that when completions are
reported out of order. So a layer whose plan has ``duplicate > 0`` when it is
made is *sequenced*: it carries every send in a protocol of its own and
matches receives itself, and duplicates are dropped before matching.

* Sender: every send is held and copied. When it leaves, it gets the next
  sequence number for its destination and is carried as a fixed-size header
  (sequence, tag, length) on the layer's header tag (the inner `tag_max`),
  then its payload on the data tag (`tag_max - 1`); a duplicated send posts
  both twice, back to back. The send completes when its payloads reached the
  destination's layer (SPEC: "held there as an unexpected message").
* Receiver: a window of standing receives for headers from any source,
  handled in the order they were posted (so in each sender's order, by the
  inner transport's non-overtaking, however their completions are reported),
  and re-posted. For every header, in order, the layer posts the receive of its
  payload from that source on the data tag, so the inner transport pairs each
  payload with its header. Sequence numbers from one source then only grow,
  but for a duplicate: a header whose number is not above the last one seen
  from its source is one, and its payload is received into scratch and
  dropped. A new header is matched with `mate.matching` against the user's
  receives (the oldest eligible, wildcards included) or kept as unexpected.
  User receives are posted into the layer's table, never to the inner
  transport: one cancelled or timed out before a header matched it is taken
  out with no data lost; one that matched completes (the match wins). A
  payload longer than the receive's buffer fills it and fails TRUNCATED.

What a sequenced layer guarantees: every SPEC §1 invariant, for the wrapped
world, whatever the plan: one terminal outcome per message, non-overtaking
per (source, tag), no data lost by receives that time out or are cancelled,
truncation, wildcards, and a duplicate is never delivered.

What it asks: every rank must inject a plan with ``duplicate > 0`` (the
probabilities and seeds may differ), before it posts anything. A rank
without the protocol cannot talk with one that has it: it never reads the
headers sent to it, and its own sends wait unread in the inner transport's
unexpected table (an eager one completes all the same); those it sends on
the layer's two tags are refused by the receiving layer with an error on the
`mate` logger, which is all one rank can check.

What it costs: a copy of every send, two inner messages per send (four when
duplicated) and a loop callback per batch of headers; the receiver matches in
Python on the loop (with ``handlers="progress"`` too) and copies a message
that arrives before its receive. Its standing receives are outstanding
messages to the inner transport: MPI's poll progress never falls back to
its idle interval (it backs off to pauses of 4 ms at most), and its progress
thread never sleeps without a timeout. A receive whose header matched waits for
its payload even past its timeout (the match wins): the payload comes right
behind the header unless the sender died in between, when the payload's
receive fails on local and ibverbs and, on MPI, never ends. A receive from a
rank that died fails only if a header from it had matched it; otherwise it
ends by its timeout. A layer made with ``duplicate == 0`` has none of this:
it is the plain layer above, at the plain layer's cost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from mate import arguments
from mate.constants import ANY_SOURCE
from mate.errors import FailureReason, InvalidArgument, MessageFailed
from mate.machine import Input
from mate.matching import PostedReceives, UnexpectedMessages
from mate.schedule import Op, Region
from mate.transports.base import Operation, Report, Transport, failure
from mate.transports.local import LocalTransport
from mate.world import World

logger = logging.getLogger("mate")


def _probability(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    arguments.probability(value, attribute.name)


def _seconds(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    arguments.seconds(value, attribute.name)


def _count(minimum: int) -> Callable[[Any, attrs.Attribute[int | None], int | None], None]:
    def check(instance: Any, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None:
            arguments.count(value, attribute.name, minimum=minimum)
    return check


_RANDOM_FAULTS = ("drop", "delay", "fail", "duplicate")


@attrs.frozen
class FaultPlan:
    """How often each fault strikes an outgoing message (probabilities add up to ≤ 1),
    and whether this rank dies after its `kill_after`-th message."""

    drop: float = attrs.field(default=0.0, validator=_probability)
    delay: float = attrs.field(default=0.0, validator=_probability)
    fail: float = attrs.field(default=0.0, validator=_probability)
    delay_seconds: float = attrs.field(default=0.3, validator=_seconds)
    seed: int | None = None
    duplicate: float = attrs.field(default=0.0, validator=_probability)
    kill_after: int | None = attrs.field(default=None, validator=_count(1))
    kill_rank: int | None = attrs.field(default=None, validator=_count(0))

    def __attrs_post_init__(self) -> None:
        if self.drop + self.delay + self.fail + self.duplicate > 1:
            raise InvalidArgument(f"drop + delay + fail + duplicate must be <= 1 in {self}")
        if self.kill_rank is not None and self.kill_after is None:
            raise InvalidArgument(f"kill_rank needs kill_after in {self}")

    @classmethod
    def parse(cls, text: str, *, seed: int | None = None) -> FaultPlan:
        """``"drop=0.05,delay=0.1:0.5,fail=0.02,duplicate=0.1,kill_after=50,kill_rank=2"``
        (delay=PROBABILITY[:SECONDS]; every item optional)."""
        fields: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in (*_RANDOM_FAULTS, "kill_after", "kill_rank"):
                raise InvalidArgument(
                    f"bad fault {item!r}: expected drop=P, delay=P[:SECONDS], fail=P, "
                    f"duplicate=P, kill_after=N or kill_rank=R")
            if name in ("kill_after", "kill_rank"):
                fields[name] = _integer(value, item)
                continue
            if name == "delay" and ":" in value:
                value, seconds = value.split(":", 1)
                fields["delay_seconds"] = _number(seconds, item)
            fields[name] = _number(value, item)
        return cls(seed=seed, **fields)

    def __str__(self) -> str:
        kill = "" if self.kill_after is None else f",kill_after={self.kill_after}"
        if self.kill_rank is not None:
            kill += f",kill_rank={self.kill_rank}"
        return (f"drop={self.drop:g},delay={self.delay:g}:{self.delay_seconds:g},"
                f"fail={self.fail:g},duplicate={self.duplicate:g}{kill}")


def _number(text: str, item: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InvalidArgument(f"bad fault {item!r}: {text!r} is not a number") from None


def _integer(text: str, item: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"bad fault {item!r}: {text!r} is not an integer") from None


_Channel = tuple[int, int]  # (destination, tag); tag -1 for put and get

# The duplicate protocol's header: a constant (so that a stray message on the header tag
# is told apart), the sequence number, the user's tag, the payload's length.
HEADER = struct.Struct("<QQQQ")
MAGIC = 0x4D41544546415554  # "MATEFAUT"
WINDOW = 8  # standing receives for headers


def _channel(msg: Operation) -> _Channel:
    return (msg.peer, msg.tag if msg.op is Op.SEND else -1)


class _Held:
    """A message the layer answers for: it met a fault, waits on a slow link, or is a
    send of a sequenced layer. Its carriers are copies of it posted to the inner transport."""

    __slots__ = ("copies", "data", "due", "left", "msg", "outcome", "submitted")

    def __init__(self, msg: Operation, due: float, copies: int) -> None:
        self.msg = msg
        self.due = due  # when it may leave (the link keeps posting order)
        self.copies = copies  # carried once, or twice when duplicated
        # What the carriers send: the original's buffer may be reused once it is
        # submitted. (A get's carriers land in buffers of their own.)
        self.data = b"" if msg.op is Op.GET else bytes(msg.buffer)
        self.left = 0  # carriers not yet ended
        self.outcome: Report | None = None  # a completed carrier's report, else the first failure
        self.submitted = False


class _Arrival:
    """A message whose header reached a sequenced layer: its payload lands in `data`
    (scratch), or straight in the buffer of the receive it matched (`data` None)."""

    __slots__ = ("data", "error", "landed", "length", "recv", "source", "tag")

    def __init__(self, source: int, tag: int, length: int) -> None:
        self.source = source
        self.tag = tag
        self.length = length
        self.data: bytearray | None = None
        self.recv: Operation | None = None  # the user's receive it matched
        self.landed = False
        self.error: MessageFailed | None = None  # its payload's receive failed


class FaultyTransport(Transport):
    """`world`'s transport behind a wire that faults messages as `plan` says."""

    def __init__(self, world: World, plan: FaultPlan) -> None:
        inner = world.transport
        self.inner = inner
        self.mypid, self.numprocs, self.tag_max = inner.mypid, inner.numprocs, inner.tag_max
        self.supports_progress_handlers = inner.supports_progress_handlers
        # The protocol is chosen once: every rank's layer must speak the same.
        self.sequenced = plan.duplicate > 0
        self.plan = plan  # checked by the setter
        self.injected = dict.fromkeys(_RANDOM_FAULTS, 0)
        self.discarded = 0  # duplicates received and dropped (sequenced)
        self.killed = False
        self._world = world
        self._sink = world.sink
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._random = random.Random(None if plan.seed is None else plan.seed + inner.mypid)
        # Guarded by a lock: handlers on a progress thread post and cancel too, and the
        # inner transport may report from its progress thread. Reentrant, because the
        # inner transport is posted to under it, and a transport may answer a post at once.
        self._lock = threading.RLock()
        self._held: dict[Operation, _Held] = {}  # live messages the layer answers for
        self._carriers: dict[Operation, _Held | None] = {}  # carrier -> what it carries
        self._links: dict[_Channel, deque[_Held]] = {}  # messages waiting to leave, in order
        self._timers: dict[_Channel, asyncio.TimerHandle] = {}  # each link's next wake-up
        self._posts = 0  # messages posted through the layer (kill_after counts them)
        self._closed = False
        self._dying: asyncio.Task[None] | None = None
        # The duplicate protocol (sequenced layers only).
        self._header_tag, self._data_tag = inner.tag_max, inner.tag_max - 1
        self._next_seq: dict[int, int] = {}  # per destination: the last sequence number sent
        self._last_seq: dict[int, int] = {}  # per source: the last sequence number received
        self._posted: PostedReceives[Operation] = PostedReceives()  # the user's receives
        self._unexpected: UnexpectedMessages[_Arrival] = UnexpectedMessages()
        self._standing: deque[Operation] = deque()  # header receives, in posting order
        self._headers: dict[Operation, Report | None] = {}  # ... and their reports, once come
        self._payloads: dict[Operation, _Arrival | None] = {}  # payload receive -> its message
        self._inbox: list[Report] = []  # reports on the layer's receives, for `_drain`
        self._draining = False
        self._soon_calls = 0  # work the layer gave the loop itself (see loop_work)
        inner.bind(self)
        if self.sequenced:
            with self._lock:
                for _ in range(WINDOW):
                    self._stand()

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    @plan.setter
    def plan(self, plan: FaultPlan) -> None:
        """A new plan, from the next post on (the protocol stays what it was made with)."""
        if plan.duplicate > 0 and not self.sequenced:
            raise InvalidArgument(
                "duplicates need the layer's own protocol, chosen when it is made: "
                "inject a plan with duplicate > 0 on every rank")
        if plan.kill_rank is not None and plan.kill_rank >= self.numprocs:
            raise InvalidArgument(f"kill_rank={plan.kill_rank} is not a rank of this world "
                                  f"(0..{self.numprocs - 1})")
        self._plan = plan

    # -- posting --------------------------------------------------------------------------

    def post(self, msg: Operation) -> None:
        if self.killed:
            return  # lost with the rank: its world's shutdown ends the message
        if msg.op is not Op.RECV:
            self._post_outgoing(msg)
        elif self.sequenced:
            self._post_recv(msg)
        else:
            self.inner.post(msg)
        if self._plan.kill_after is not None and self._count_post():
            self._kill()

    def _post_outgoing(self, msg: Operation) -> None:
        channel = _channel(msg)
        with self._lock:
            fault = self._draw()
            link = self._links.get(channel)
            if fault is None and not link and not (self.sequenced and msg.op is Op.SEND):
                self.inner.post(msg)  # under the lock: nothing queued can overtake it
                return
            if fault is not None:
                self.injected[fault] += 1
            msg.transport_data = self  # the layer answers for it from now on
            now = time.monotonic()
            held = self._held[msg] = _Held(
                msg, now + self._plan.delay_seconds if fault == "delay" else now,
                2 if fault == "duplicate" else 1)
            queued = fault not in ("drop", "fail") and (fault == "delay" or bool(link))
            if queued:
                self._links.setdefault(channel, deque()).append(held)
            elif fault not in ("drop", "fail"):
                self._carry(held)  # duplicated, or a sequenced send: it leaves now
        # Events reach the world soon after the post, never from inside it.
        if fault == "fail":
            self._soon(self._fail, msg)
        elif queued:  # delayed, or queued behind delayed ones: submitted now
            self._soon(self._queued, msg)
        # A dropped message stays held until its timeout or a cancel.

    def _draw(self) -> str | None:
        plan, roll = self._plan, self._random.random()
        for fault in _RANDOM_FAULTS:
            probability: float = getattr(plan, fault)
            if roll < probability:
                return fault
            roll -= probability
        return None

    def _carry(self, held: _Held) -> None:
        """Post `held`'s carriers to the inner transport (under the lock)."""
        msg = held.msg
        held.left = held.copies
        header = None
        if self.sequenced and msg.op is Op.SEND:
            seq = self._next_seq[msg.peer] = self._next_seq.get(msg.peer, 0) + 1
            header = memoryview(HEADER.pack(MAGIC, seq, msg.tag, len(held.data)))
        for _ in range(held.copies):
            if header is not None:
                self._post_carrier(Operation(Op.SEND, header, msg.peer, self._header_tag), None)
            buffer = memoryview(bytearray(len(msg.buffer)) if msg.op is Op.GET else held.data)
            tag = msg.tag if header is None else self._data_tag
            self._post_carrier(Operation(msg.op, buffer, msg.peer, tag, msg.address), held)

    def _post_carrier(self, carrier: Operation, held: _Held | None) -> None:
        self._carriers[carrier] = held  # None: a header, whose outcome nobody needs
        self.inner.post(carrier)

    def _release(self, msg: Operation) -> bool:
        """Stop answering for `msg`; False if it already ended."""
        with self._lock:
            return self._held.pop(msg, None) is not None

    def _fail(self, msg: Operation) -> None:
        if self._release(msg):
            self._sink.failed(msg, FailureReason.TRANSPORT, "injected fault")

    def _queued(self, msg: Operation) -> None:
        with self._lock:
            held = self._held.get(msg)
            submit = held is not None and msg.op is not Op.GET and not held.submitted
            if held is not None:
                held.submitted = True  # the layer holds a copy
        if submit:
            self._sink.submitted(msg)
        self._wake_link(_channel(msg))

    # -- the slow links --------------------------------------------------------------------

    def _wake_link(self, channel: _Channel) -> None:
        """Send what is due on `channel`'s link, in order; wake again when the next is due."""
        timer = self._timers.pop(channel, None)
        if timer is not None:
            timer.cancel()
        with self._lock:
            link = self._links.get(channel)
            while link and link[0].due <= time.monotonic() and not self._closed:
                # Carried out even if the original ended meanwhile: it has left already.
                self._carry(link.popleft())
            if not link:
                self._links.pop(channel, None)
                return
            delay = max(link[0].due - time.monotonic(), 0.0)
        if not self._closed:
            self._timers[channel] = self._loop.call_later(delay, self._wake_link, channel)

    # -- the duplicate protocol's receiving side ------------------------------------------

    def _stand(self) -> None:
        """Post one more standing receive for headers (under the lock)."""
        receive = Operation(Op.RECV, memoryview(bytearray(HEADER.size)), ANY_SOURCE,
                            self._header_tag)
        self._standing.append(receive)
        self._headers[receive] = None
        self.inner.post(receive)

    def _post_recv(self, msg: Operation) -> None:
        """A user's receive, matched here against the messages whose header came."""
        msg.transport_data = self
        with self._lock:
            arrival = self._unexpected.match(msg.peer, msg.tag)
            if arrival is None:
                self._posted.add(msg.peer, msg.tag, msg)
                return
            arrival.recv = msg
            landed = arrival.landed  # if not, it is delivered when its payload lands
        if landed:
            self._soon(self._deliver_soon, arrival)

    def _deliver_soon(self, arrival: _Arrival) -> None:
        with self._lock:
            if self._closed:
                return
            report = self._deliver(arrival)
        self._sink.report_all((report,))

    def _drain(self) -> None:
        """On the loop: handle what came for the layer's receives (headers in order)."""
        out: list[Report] = []
        with self._lock:
            self._draining = False
            if self._closed:
                return
            inbox, self._inbox = self._inbox, []
            for report in inbox:
                if report.op in self._headers:
                    self._headers[report.op] = report
                else:
                    self._landed(self._payloads.pop(report.op), report, out)
            while self._standing and self._headers[self._standing[0]] is not None:
                receive = self._standing.popleft()
                header = self._headers.pop(receive)
                assert header is not None
                self._stand()
                self._take_header(header)
        if out:
            self._sink.report_all(out)

    def _take_header(self, report: Report) -> None:
        """A header came: drop it if a duplicate, else match it; receive its payload."""
        data = report.op.buffer
        length = report.length or 0
        if report.input is not Input.COMPLETED or length != HEADER.size or (
                HEADER.unpack_from(data)[0] != MAGIC):
            if report.input is not Input.CANCELLED:
                logger.error("mate.faults: something other than a header of the duplicate "
                             "protocol came on its tag from rank %s (%s): every rank must "
                             "inject a plan with duplicate > 0", report.peer, report.error or
                             f"{length} bytes")
            return
        _, seq, tag, size = HEADER.unpack_from(data)
        source = report.peer
        assert source is not None
        arrival: _Arrival | None = None
        if seq <= self._last_seq.get(source, 0):
            self.discarded += 1
            buffer = memoryview(bytearray(size))  # its payload is received, and dropped
        else:
            self._last_seq[source] = seq
            arrival = _Arrival(source, tag, size)
            recv = self._posted.match(source, tag)
            arrival.recv = recv
            if recv is not None and size <= len(recv.buffer):
                buffer = recv.buffer[:size]
            else:
                arrival.data = bytearray(size)
                buffer = memoryview(arrival.data)
                if recv is None:
                    self._unexpected.add(source, tag, arrival)
        payload = Operation(Op.RECV, buffer, source, self._data_tag)
        self._payloads[payload] = arrival
        self.inner.post(payload)

    def _landed(self, arrival: _Arrival | None, report: Report, out: list[Report]) -> None:
        """A payload's receive ended (under the lock)."""
        if arrival is None:
            return  # a duplicate's
        if report.input is Input.COMPLETED and report.length == arrival.length:
            arrival.landed = True
        else:
            arrival.error = report.error or failure(
                FailureReason.TRANSPORT,
                f"the payload of a message from rank {arrival.source} did not arrive whole")
            if arrival.recv is None:  # never delivered: forget it
                self._unexpected.remove(arrival.source, arrival.tag, arrival)
                return
        if arrival.recv is not None:
            out.append(self._deliver(arrival))

    def _deliver(self, arrival: _Arrival) -> Report:
        """The report that ends the receive `arrival` matched (under the lock)."""
        recv = arrival.recv
        assert recv is not None
        source, tag, n = arrival.source, arrival.tag, arrival.length
        if arrival.error is not None:
            return Report(Input.FAILED, recv, 0, source, tag, arrival.error)
        room = len(recv.buffer)
        if arrival.data is not None:
            k = min(n, room)
            recv.buffer[:k] = arrival.data[:k]
        if n > room:
            return Report(Input.FAILED, recv, room, source, tag, failure(
                FailureReason.TRUNCATED,
                f"a message of {n} bytes arrived for a buffer of {room} bytes"))
        return Report(Input.COMPLETED, recv, n, source, tag)

    # -- the sink of the inner transport ------------------------------------------------------

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
        """Pass reports on; a carrier's outcome becomes its original's, if that still lives;
        what comes for the layer's own receives is handled on the loop (`_drain`)."""
        forwarded: list[Report] = []
        drain = False
        with self._lock:
            if self.killed:
                return  # nothing more is heard of a dead rank's messages
            for report in reports:
                op = report.op
                if op in self._carriers:
                    self._carried(report, forwarded)
                elif op in self._headers or op in self._payloads:
                    if not self._closed:
                        self._inbox.append(report)
                else:
                    forwarded.append(report)
            if self._inbox and not self._draining:
                self._draining = drain = True
        if drain:
            self._soon(self._drain)
        if forwarded:
            self._sink.report_all(forwarded)

    def _carried(self, report: Report, forwarded: list[Report]) -> None:
        """What a carrier's report means for its original (under the lock)."""
        held = self._carriers[report.op]
        if report.input is not Input.SUBMITTED:
            del self._carriers[report.op]
        if held is None:
            return  # a header: its payload's carrier says all
        original = held.msg
        live = original in self._held
        if report.input is Input.SUBMITTED or report.input is Input.COMPLETED:
            if live and not held.submitted and original.op is not Op.GET:
                held.submitted = True
                forwarded.append(Report(Input.SUBMITTED, original))
            if report.input is Input.SUBMITTED:
                return
        held.left -= 1
        if report.input is Input.COMPLETED:
            if held.outcome is None or held.outcome.input is not Input.COMPLETED:
                held.outcome = report
        elif held.outcome is None:
            held.outcome = report
        if held.left or self._held.pop(original, None) is None:
            return  # more copies to come, or the original timed out or was cancelled
        outcome = held.outcome
        assert outcome is not None
        if outcome.input is Input.COMPLETED and original.op is Op.GET:
            length = outcome.length or 0  # still live: it may be written now
            original.buffer[:length] = outcome.op.buffer[:length]
        forwarded.append(Report(outcome.input, original, outcome.length, original.peer,
                                original.tag, outcome.error))

    def call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        self._sink.call_on_loop(fn, *args)

    @property
    def loop_work(self) -> int:
        """The world's, and the layer's own (a drain of its receives, a message let go)."""
        return self._sink.loop_work + self._soon_calls

    def _soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the loop after the current call (never inside a post)."""
        self._soon_calls += 1
        if threading.get_ident() == self._loop_thread:
            self._loop.call_soon(fn, *args)
        else:
            self._sink.call_on_loop(fn, *args)

    # -- kill ---------------------------------------------------------------------------------

    def _count_post(self) -> bool:
        """Count a post; True if it is the one this rank dies after."""
        with self._lock:
            self._posts += 1
            plan = self._plan
            return (plan.kill_after is not None and self._posts >= plan.kill_after
                    and plan.kill_rank in (None, self.mypid))

    def _kill(self) -> None:
        """Die now: SIGKILL this process, or, a rank of the local transport, die in place."""
        wire = self.inner
        while isinstance(wire, FaultyTransport):
            wire = wire.inner
        if not isinstance(wire, LocalTransport):
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing after this runs
            return
        with self._lock:
            self.killed = True
            self._close()
        wire.leave()
        # Kept, so that the task that ends this rank's messages is not collected.
        self._dying = self._loop.create_task(self._world.shutdown())

    def _close(self) -> None:
        """Stop answering for anything (under the lock)."""
        self._closed = True
        self._held.clear()
        self._links.clear()
        self._posted.clear()
        self._unexpected.clear()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    # -- the rest of the transport ---------------------------------------------------------

    def cancel(self, msg: Operation) -> None:
        if self.killed:
            return  # its world's shutdown ends it
        if msg.transport_data is not self:
            self.inner.cancel(msg)
            return
        with self._lock:
            if msg.op is Op.RECV:  # sequenced: withdrawn unless a header matched it
                withdrawn = self._posted.remove(msg.peer, msg.tag, msg)
            else:
                # A queued or delayed message still leaves when its turn comes (it is
                # on the wire already); a dropped one never does.
                withdrawn = self._held.pop(msg, None) is not None
        if withdrawn:
            self._sink.cancelled(msg)

    def expose(self, buffer: memoryview) -> Region:
        return self.inner.expose(buffer)

    async def unexpose(self, region: Region) -> None:
        await self.inner.unexpose(region)

    def progress(self) -> None:
        self.inner.progress()

    def awaiting(self, op: Operation, done: Callable[[], bool]) -> bool:
        return self.inner.awaiting(op, done)

    def stats(self) -> dict[str, int]:
        return {**self.inner.stats(), **{f"injected_{k}": v for k, v in self.injected.items()},
                "duplicates_discarded": self.discarded}

    async def shutdown(self) -> None:
        with self._lock:
            self._close()
        await self.inner.shutdown()


def inject(world: World, plan: FaultPlan) -> FaultyTransport:
    """Put a fault-injecting wire between `world` and its transport; return it.

    With ``plan.duplicate > 0`` every rank must inject a plan with duplicates
    before it posts anything (see the module's docstring).
    """
    faulty = FaultyTransport(world, plan)
    world.interpose(faulty)
    return faulty
