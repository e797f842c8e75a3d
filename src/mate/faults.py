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

Receives are never touched: faults live on the sending side of the wire. The
delayed copy travels as an ordinary message of the same world ("ghost") whose
schedule relays its outcome to the original while the original is live; a
ghost itself meets no faults. Random choices come from one seeded generator
per world, so a fault plan and a seed replay the same faults for the same
sequence of posts.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

import attrs

from mate.errors import FailureReason, InvalidArgument, MessageFailed
from mate.message import Message
from mate.schedule import Op, Receipt, Region, Schedule
from mate.transports.base import Transport
from mate.world import World


def _probability(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InvalidArgument(f"{attribute.name} must be a probability in [0, 1], not {value!r}")


def _seconds(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidArgument(f"{attribute.name} must be seconds >= 0, not {value!r}")


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


_STRUCK = object()  # transport_data of a message that met a fault


class _Relay:
    """A ghost's link back to the message it carries (its schedule's data)."""

    __slots__ = ("original", "scratch")

    def __init__(self, original: Message, scratch: bytearray | None) -> None:
        self.original = original
        self.scratch = scratch  # a get lands here, and is copied over while the original lives


class FaultyTransport(Transport):
    """`inner` behind a wire that drops, delays and fails messages as `plan` says."""

    def __init__(self, inner: Transport, world: World, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.mypid, self.numprocs, self.tag_max = inner.mypid, inner.numprocs, inner.tag_max
        self.supports_progress_handlers = inner.supports_progress_handlers
        self.injected = {"drop": 0, "delay": 0, "fail": 0}
        self._world = world
        self._loop = asyncio.get_running_loop()
        self._random = random.Random(None if plan.seed is None else plan.seed + inner.mypid)
        # Held messages (struck by a fault and still live here), guarded by a lock
        # because handlers on a progress thread post and cancel too.
        self._lock = threading.Lock()
        self._held: set[Message] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._relay = Schedule(completion=self._relay_completed, failure=self._relay_failed)

    def post(self, msg: Message) -> None:
        if msg.op is Op.RECV or isinstance(msg.schedule.completion_data, _Relay):
            self.inner.post(msg)
            return
        with self._lock:
            fault = self._draw()
            if fault is None:
                self.inner.post(msg)
                return
            self.injected[fault] += 1
            msg.transport_data = _STRUCK  # never reaches `inner`: its cancels stay here
            self._held.add(msg)
        if fault == "fail":
            self._loop.call_soon_threadsafe(self._fail, msg)
        elif fault == "delay":
            copy = bytes(msg.buffer) if msg.op is not Op.GET else None
            self._loop.call_soon_threadsafe(self._delay, msg, copy)
        # A dropped message stays held until its timeout or a cancel.

    def _draw(self) -> str | None:
        plan, roll = self.plan, self._random.random()
        for fault, probability in (("drop", plan.drop), ("delay", plan.delay),
                                   ("fail", plan.fail)):
            if roll < probability:
                return fault
            roll -= probability
        return None

    def _release(self, msg: Message) -> bool:
        """Take `msg` out of the held set; False if it already ended."""
        with self._lock:
            if msg not in self._held:
                return False
            self._held.discard(msg)
            return True

    def _fail(self, msg: Message) -> None:
        if self._release(msg):
            self._world.failed(msg, FailureReason.TRANSPORT, "injected fault")

    def _delay(self, msg: Message, copy: bytes | None) -> None:
        with self._lock:
            live = msg in self._held
        if live and msg.op is not Op.GET:
            self._world.submitted(msg)
        timer = self._loop.call_later(self.plan.delay_seconds, self._send_late, msg, copy)
        self._timers.add(timer)

    def _send_late(self, msg: Message, copy: bytes | None) -> None:
        """The delay is over: carry the message out, even if it timed out meanwhile."""
        self._timers = {timer for timer in self._timers if not timer.cancelled()
                        and timer.when() > self._loop.time()}
        relay = _Relay(msg, bytearray(len(msg.buffer)) if copy is None else None)
        schedule = attrs.evolve(self._relay, completion_data=relay, failure_data=relay)
        world = self._world
        if msg.op is Op.SEND:
            world.send(copy, msg.peer, msg.tag, schedule=schedule, timeout=None)
        elif msg.op is Op.PUT:
            world.put(copy, msg.peer, msg.address, schedule=schedule, timeout=None)
        else:
            world.get(relay.scratch, msg.peer, msg.address, schedule=schedule, timeout=None)

    def _relay_completed(self, receipt: Receipt, relay: _Relay) -> None:
        msg = relay.original
        with self._lock:
            if msg not in self._held:
                return  # the original timed out or was cancelled: nobody is told
            self._held.discard(msg)
            if relay.scratch is not None:
                msg.buffer[:receipt.length] = relay.scratch[:receipt.length]
        tag = msg.tag if receipt.tag is None else receipt.tag  # put and get have no tag
        self._world.completed(msg, receipt.length, receipt.remote_pid, tag)

    def _relay_failed(self, receipt: Receipt, relay: _Relay) -> None:
        if self._release(relay.original):
            error = receipt.error
            reason = error.reason if isinstance(error, MessageFailed) else FailureReason.TRANSPORT
            self._world.failed(relay.original, reason, "the delayed message failed",
                               cause=error)

    def cancel(self, msg: Message) -> None:
        if msg.transport_data is not _STRUCK:
            self.inner.cancel(msg)
        elif self._release(msg):
            self._world.cancelled(msg)  # a delayed message still leaves when its delay ends
        # else its fault already ended it (failure, or the delayed copy's outcome).

    def expose(self, buffer: memoryview) -> Region:
        return self.inner.expose(buffer)

    async def unexpose(self, region: Region) -> None:
        await self.inner.unexpose(region)

    def progress(self) -> None:
        self.inner.progress()

    def awaiting(self, msg: Message) -> None:
        self.inner.awaiting(msg)

    async def shutdown(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        with self._lock:
            self._held.clear()
        await self.inner.shutdown()


def inject(world: World, plan: FaultPlan) -> FaultyTransport:
    """Put a fault-injecting wire between `world` and its transport; return it."""
    faulty = FaultyTransport(world.transport, world, plan)
    world.interpose(faulty)
    return faulty
