"""Fault injection: an unreliable network in front of any transport.

``mate.faults.inject(world, FaultPlan(drop=0.05, delay=0.05, fail=0.02))``
puts a `FaultyTransport` between a world and its transport. Each outgoing
message (send, put, get) then meets, at random and independently:

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

Receives are never touched: faults live on the sending side of the wire.

The fault layer is a transport that wraps the world's transport and puts
itself in as that transport's sink: what the inner transport reports about
the messages passed through goes on to the world unchanged, and a delayed
message is carried by a *carrier* of the layer's own (a copy of the message
posted to the inner transport) whose outcome the layer turns into the
original's, if the original is still live. Nothing goes back through the
public API, so handlers, locks and threads behave as without the layer.

Delayed messages form *slow links*, one per channel that SPEC §1 orders (a
destination and a tag; put and get, which are not ordered, share one per
destination): they leave in the order they were posted, and a message posted
to a channel while delayed ones wait on it queues behind them (copied, and
submitted at once), so that a wrapped world keeps non-overtaking. Operations on
different channels overtake each other, as the spec allows. Random choices come from one
seeded generator per world, so a fault plan and a seed replay the same faults
for the same sequence of posts.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from mate import arguments
from mate.errors import FailureReason, InvalidArgument
from mate.machine import Input
from mate.schedule import Op, Region
from mate.transports.base import Operation, Report, Sink, Transport, failure
from mate.world import World


def _probability(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    arguments.probability(value, attribute.name)


def _seconds(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    arguments.seconds(value, attribute.name)


@attrs.frozen
class FaultPlan:
    """How often each fault strikes an outgoing message (probabilities add up to ≤ 1)."""

    drop: float = attrs.field(default=0.0, validator=_probability)
    delay: float = attrs.field(default=0.0, validator=_probability)
    fail: float = attrs.field(default=0.0, validator=_probability)
    delay_seconds: float = attrs.field(default=0.3, validator=_seconds)
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.drop + self.delay + self.fail > 1:
            raise InvalidArgument(f"drop + delay + fail must be <= 1 in {self}")

    @classmethod
    def parse(cls, text: str, *, seed: int | None = None) -> FaultPlan:
        """``"drop=0.05,delay=0.1:0.5,fail=0.02"`` (delay=PROBABILITY[:SECONDS])."""
        fields: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in ("drop", "delay", "fail"):
                raise InvalidArgument(
                    f"bad fault {item!r}: expected drop=P, delay=P[:SECONDS] or fail=P")
            if name == "delay" and ":" in value:
                value, seconds = value.split(":", 1)
                fields["delay_seconds"] = _number(seconds, item)
            fields[name] = _number(value, item)
        return cls(seed=seed, **fields)

    def __str__(self) -> str:
        return (f"drop={self.drop:g},delay={self.delay:g}:{self.delay_seconds:g},"
                f"fail={self.fail:g}")


def _number(text: str, item: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InvalidArgument(f"bad fault {item!r}: {text!r} is not a number") from None


_Channel = tuple[int, int]  # (destination, tag); tag -1 for put and get


def _channel(msg: Operation) -> _Channel:
    return (msg.peer, msg.tag if msg.op is Op.SEND else -1)


class _Held:
    """A message that met a fault (or waits on a slow link), held by the layer until it ends."""

    __slots__ = ("data", "due", "msg")

    def __init__(self, msg: Operation, due: float) -> None:
        self.msg = msg
        self.due = due  # when it may leave (the link keeps posting order)
        # What the carrier sends, or where a get lands: the original's buffer may be
        # reused once it is submitted, or must not be written once it has ended.
        self.data = bytearray(msg.buffer) if msg.op is Op.GET else bytes(msg.buffer)


class FaultyTransport(Transport):
    """`inner` behind a wire that drops, delays and fails messages as `plan` says."""

    def __init__(self, inner: Transport, sink: Sink, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.mypid, self.numprocs, self.tag_max = inner.mypid, inner.numprocs, inner.tag_max
        self.supports_progress_handlers = inner.supports_progress_handlers
        self.injected = {"drop": 0, "delay": 0, "fail": 0}
        self._sink = sink
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._random = random.Random(None if plan.seed is None else plan.seed + inner.mypid)
        # Guarded by a lock: handlers on a progress thread post and cancel too, and the
        # inner transport may report from its progress thread. Reentrant, because the
        # inner transport is posted to under it, and a transport may answer a post at once.
        self._lock = threading.RLock()
        self._held: dict[Operation, _Held] = {}  # live messages the layer answers for
        self._carriers: dict[Operation, _Held] = {}  # carrier -> what it carries
        self._links: dict[_Channel, deque[_Held]] = {}  # messages waiting to leave, in order
        self._timers: dict[_Channel, asyncio.TimerHandle] = {}  # each link's next wake-up
        self._closed = False
        inner.bind(self)

    # -- posting --------------------------------------------------------------------------

    def post(self, msg: Operation) -> None:
        if msg.op is Op.RECV:
            self.inner.post(msg)
            return
        channel = _channel(msg)
        with self._lock:
            fault = self._draw()
            link = self._links.get(channel)
            if fault is None and not link:
                self.inner.post(msg)  # under the lock: nothing queued can overtake it
                return
            if fault is not None:
                self.injected[fault] += 1
            now = time.monotonic()
            held = self._held[msg] = _Held(msg, now + self.plan.delay_seconds
                                           if fault == "delay" else now)
            if fault is None or fault == "delay":
                self._links.setdefault(channel, deque()).append(held)
        # Events reach the world soon after the post, never from inside it.
        if fault == "fail":
            self._soon(self._fail, msg)
        elif fault != "drop":  # delayed, or queued behind delayed ones: submitted now
            self._soon(self._queued, msg)
        # A dropped message stays held until its timeout or a cancel.

    def _draw(self) -> str | None:
        plan, roll = self.plan, self._random.random()
        for fault, probability in (("drop", plan.drop), ("delay", plan.delay),
                                   ("fail", plan.fail)):
            if roll < probability:
                return fault
            roll -= probability
        return None

    def _release(self, msg: Operation) -> bool:
        """Stop answering for `msg`; False if it already ended."""
        with self._lock:
            return self._held.pop(msg, None) is not None

    def _fail(self, msg: Operation) -> None:
        if self._release(msg):
            self._sink.failed(msg, FailureReason.TRANSPORT, "injected fault")

    def _queued(self, msg: Operation) -> None:
        with self._lock:
            live = msg in self._held
        if live and msg.op is not Op.GET:
            self._sink.submitted(msg)  # the layer holds a copy
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
                held = link.popleft()
                original = held.msg
                carrier = Operation(original.op, memoryview(held.data), original.peer,
                                    original.tag, original.address)
                self._carriers[carrier] = held
                # Carried out even if the original ended meanwhile: it has left already.
                self.inner.post(carrier)
            if not link:
                self._links.pop(channel, None)
                return
            delay = max(link[0].due - time.monotonic(), 0.0)
        if not self._closed:
            self._timers[channel] = self._loop.call_later(delay, self._wake_link, channel)

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
        self.report_all((Report(Input.CANCELLED, op),))  # carriers are never cancelled

    def report_all(self, reports: Sequence[Report]) -> None:
        """Pass reports on; a carrier's outcome becomes its original's, if that still lives."""
        forwarded = []
        with self._lock:
            for report in reports:
                held = self._carriers.get(report.op)
                if held is None:
                    forwarded.append(report)
                    continue
                if report.input is Input.SUBMITTED:
                    continue  # the original was submitted when it was queued
                del self._carriers[report.op]
                original = held.msg
                if self._held.pop(original, None) is None:
                    continue  # the original timed out or was cancelled: nobody is told
                if report.input is Input.COMPLETED and original.op is Op.GET:
                    length = report.length or 0  # still live: it may be written now
                    original.buffer[:length] = held.data[:length]
                forwarded.append(report._replace(
                    op=original, tag=original.tag if report.tag is None else report.tag))
        if forwarded:
            self._sink.report_all(forwarded)

    def call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        self._sink.call_on_loop(fn, *args)

    def _soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the loop after the current call (never inside a post)."""
        if threading.get_ident() == self._loop_thread:
            self._loop.call_soon(fn, *args)
        else:
            self._sink.call_on_loop(fn, *args)

    # -- the rest of the transport ---------------------------------------------------------

    def cancel(self, msg: Operation) -> None:
        with self._lock:
            held = msg in self._held
        if not held:
            self.inner.cancel(msg)
        elif self._release(msg):
            # A queued or delayed message still leaves when its turn comes (it is
            # on the wire already); a dropped one never does.
            self._sink.cancelled(msg)

    def expose(self, buffer: memoryview) -> Region:
        return self.inner.expose(buffer)

    async def unexpose(self, region: Region) -> None:
        await self.inner.unexpose(region)

    def progress(self) -> None:
        self.inner.progress()

    def awaiting(self, op: Operation, done: Callable[[], bool]) -> None:
        self.inner.awaiting(op, done)

    def stats(self) -> dict[str, int]:
        return {**self.inner.stats(), **{f"injected_{k}": v for k, v in self.injected.items()}}

    async def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._held.clear()
            self._links.clear()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        await self.inner.shutdown()


def inject(world: World, plan: FaultPlan) -> FaultyTransport:
    """Put a fault-injecting wire between `world` and its transport; return it."""
    faulty = FaultyTransport(world.transport, world.sink, plan)
    world.interpose(faulty)
    return faulty
