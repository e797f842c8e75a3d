"""An order manager written the Progressive Messages way (thesis §3.5 and §4.2).

Roles (any number of ranks >= 2):

* rank 0 is the **exchange**;
* the **market-data** source is the last rank (with 2 ranks: rank 0 as well);
* the ranks in between (with 2 ranks: rank 1) are **traders**.

The market-data source streams ``--prices`` ticks of a seeded random walk to
every trader, one every ``--tick`` seconds, then an END marker. A trader has
no polling loop; its logic lives in handlers, as in §4.2:

    upon price:                       incorporate it; if ready, send an order
    upon acknowledgment or execution: clear the outstanding order
    upon timeout of outstanding order: cancel the order and handle error

A trader takes prices in with a standing receive whose completion handler
incorporates the price and re-posts the receive. "Ready to send an order"
means: it has orders left (``--orders`` per trader) and fewer than
``--max-outstanding`` outstanding; the side follows the price against its
running mean. For each order it posts a receive for the exchange's answer on
the order's own tag, with a timeout of ``--order-timeout`` seconds, then sends
the order. Completion of that receive ends the order. Its timeout handler
sends CANCEL to the exchange and posts a second receive on the same tag,
without a timeout, for the exchange's final word. A receive that times out
never consumes a message (SPEC §1), so nothing falls between the two receives.

The exchange serves orders and cancels from a standing receive. For each order
it decides (seeded) to fill it (EXECUTED) or to acknowledge it (ACKED). With
``--drop-acks P`` it holds back, for good, the report of a fraction P of the
orders; with ``--delay-acks P[:SECONDS]`` it sends the report of a fraction P
after a delay (by default twice the order timeout, so the trader times out
first). **The exchange sends exactly one final message per order**, on the
order's tag: its report, or, when a CANCEL arrives while the report is still
held back, a CANCELLED confirmation (and the held report is never sent). A
CANCEL that comes after the report changes nothing: the trader's second
receive gets that report. So every order ends exactly once, on the arrival of
that one message, as ACKED, EXECUTED or CANCELLED, at both ends.

Messages and tags:

=============  ======================  ==========================================
tag            from -> to              payload
=============  ======================  ==========================================
1  PRICE       market -> trader        ``<Id`` (sequence, price); END: 0 bytes
2  REQUEST     trader -> exchange      ORDER ``<BIBdI`` (kind, id, side, price,
                                       quantity), CANCEL ``<BI`` (kind, id), and
                                       last the trader's LEDGER (kind + JSON)
3  VERDICT     exchange -> every rank  1 byte: 1 verified, 0 not
16 + id        exchange -> trader      REPORT ``<BI`` (final state, id)
=============  ======================  ==========================================

Orders, cancels and the ledger share one tag, so non-overtaking delivers the
ledger after every CANCEL its trader sent. At the end each trader sends its
ledger (order id -> final state); the exchange compares it with its own,
tells every rank the verdict, and rank 0 prints one summary line, last. The
exit code is 0 only when the check holds.

    python examples/order_manager.py --ranks 3 --drop-acks 0.1 --delay-acks 0.1
    mate-run -n 2 python examples/order_manager.py --transport mpi --drop-acks 0.1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import mate
import mate.spmd

# -- messages ------------------------------------------------------------------------------

TAG_PRICE = 1
TAG_REQUEST = 2
TAG_VERDICT = 3
TAG_REPORT_BASE = 16  # the report of order `id` travels on tag TAG_REPORT_BASE + id
MAX_ORDERS = 32767 - TAG_REPORT_BASE + 1  # every world has tag_max >= 32767

PRICE = struct.Struct("<Id")  # sequence number, price
ORDER = struct.Struct("<BIBdI")  # kind, order id, side, limit price, quantity
CANCEL = struct.Struct("<BI")  # kind, order id
REPORT = struct.Struct("<BI")  # final state, order id

KIND_ORDER, KIND_CANCEL, KIND_LEDGER = ord("O"), ord("X"), ord("L")
BUY, SELL = 0, 1

# Final states of an order (the same letters at both ends and in the ledgers).
ACKED, EXECUTED, CANCELLED = "A", "E", "C"
FINAL_STATES = (ACKED, EXECUTED, CANCELLED)
FAILED = "F"  # the trader's receive for the report failed: never a valid ending

LEDGER_SLACK = 1024  # room in the exchange's request buffer for the ledger's JSON


# -- the check (pure: no I/O, so that it can be tested on its own) ---------------------------

@dataclass
class TraderReport:
    """What a trader tells the exchange at the end."""

    rank: int
    ledger: dict[int, str]  # order id -> final state
    sent: int  # orders sent (ids 0 .. sent-1)
    prices: int = 0  # price ticks received
    timeouts: int = 0
    second_endings: int = 0  # an order that ended again: must be 0
    failures: int = 0  # failed messages, malformed reports
    median_latency_ms: float | None = None  # order sent -> report, orders that did not time out

    def pack(self) -> bytes:
        text = "".join(self.ledger.get(i, "-") for i in range(self.sent))
        fields = {"rank": self.rank, "ledger": text, "sent": self.sent, "prices": self.prices,
                  "timeouts": self.timeouts, "second": self.second_endings,
                  "failures": self.failures, "latency": self.median_latency_ms}
        return bytes([KIND_LEDGER]) + json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def unpack(cls, data: bytes) -> TraderReport:
        fields = json.loads(data[1:].decode())
        ledger = {i: state for i, state in enumerate(fields["ledger"]) if state != "-"}
        return cls(rank=int(fields["rank"]), ledger=ledger, sent=int(fields["sent"]),
                   prices=int(fields["prices"]), timeouts=int(fields["timeouts"]),
                   second_endings=int(fields["second"]), failures=int(fields["failures"]),
                   median_latency_ms=fields["latency"])


@dataclass
class ExchangeBook:
    """What the exchange knows of the orders, by trader."""

    received: dict[int, set[int]] = field(default_factory=dict)  # trader -> order ids
    ledgers: dict[int, dict[int, str]] = field(default_factory=dict)  # -> id -> final sent
    finals: Counter[tuple[int, int]] = field(default_factory=Counter)  # final messages sent
    dropped: set[tuple[int, int]] = field(default_factory=set)  # reports held back for good
    delayed: set[tuple[int, int]] = field(default_factory=set)
    cancels: int = 0  # CANCELs received
    late_cancels: int = 0  # CANCELs that came after the report had been sent
    unknown_cancels: int = 0  # CANCELs of orders never received
    duplicate_orders: int = 0
    failures: int = 0  # failed messages, malformed requests


@dataclass
class Verdict:
    orders: int = 0
    acked: int = 0
    executed: int = 0
    cancelled: int = 0
    dropped: int = 0
    delayed: int = 0
    timeouts: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        counts = (f"order manager: {self.orders} orders = {self.acked} acknowledged + "
                  f"{self.executed} executed + {self.cancelled} cancelled "
                  f"({self.dropped} acks dropped, {self.delayed} delayed; "
                  f"{self.timeouts} timeouts)")
        if self.verified:
            return counts + "; trader and exchange ledgers agree: verified"
        shown = "; ".join(self.problems[:3])
        more = f" (and {len(self.problems) - 3} more)" if len(self.problems) > 3 else ""
        return f"{counts}; NOT verified: {shown}{more}"


def verify(book: ExchangeBook, reports: dict[int, TraderReport], traders: list[int],
           prices: int) -> Verdict:
    """Compare the traders' ledgers with the exchange's, and count.

    Verified when: every trader reported; every order a trader sent ended
    exactly once there, in one of the final states, and the exchange received
    it and sent exactly one final message for it, with the same state; the
    counts add up; every dropped report gave a cancellation; every trader got
    every price; and no message failed.
    """
    v = Verdict(dropped=len(book.dropped), delayed=len(book.delayed))
    problems = v.problems
    for trader in traders:
        report = reports.get(trader)
        if report is None:
            problems.append(f"trader {trader} sent no ledger")
            continue
        ids = set(range(report.sent))
        v.orders += report.sent
        v.timeouts += report.timeouts
        for state in report.ledger.values():
            v.acked += state == ACKED
            v.executed += state == EXECUTED
            v.cancelled += state == CANCELLED
        if report.second_endings:
            problems.append(f"trader {trader}: {report.second_endings} orders ended twice")
        if report.failures:
            problems.append(f"trader {trader}: {report.failures} failed messages")
        if report.prices != prices:
            problems.append(f"trader {trader} got {report.prices} of {prices} prices")
        if set(report.ledger) != ids:
            problems.append(f"trader {trader}: {len(ids - set(report.ledger))} of its "
                            f"{report.sent} orders never ended")
        invalid = sorted(i for i, s in report.ledger.items() if s not in FINAL_STATES)
        if invalid:
            problems.append(f"trader {trader}: {len(invalid)} orders ended in no final state "
                            f"(order {invalid[0]}: {report.ledger[invalid[0]]!r})")
        received = book.received.get(trader, set())
        if received != ids:
            problems.append(f"the exchange received {len(received)} orders from trader "
                            f"{trader}, which sent {report.sent}")
        theirs = book.ledgers.get(trader, {})
        differ = sorted(i for i in ids | set(theirs) if report.ledger.get(i) != theirs.get(i))
        if differ:
            i = differ[0]
            problems.append(f"trader {trader}: {len(differ)} orders whose final states "
                            f"disagree (order {i}: trader {report.ledger.get(i)}, "
                            f"exchange {theirs.get(i)})")
    for rank in sorted(set(reports) - set(traders)):
        problems.append(f"rank {rank} sent a ledger but is no trader")
    if v.acked + v.executed + v.cancelled != v.orders:
        problems.append(f"{v.acked} + {v.executed} + {v.cancelled} != {v.orders} orders sent")
    extra = sorted(key for key, n in book.finals.items() if n != 1)
    if extra:
        problems.append(f"{len(extra)} orders got more than one final message (e.g. {extra[0]})")
    uncancelled = sorted(key for key in book.dropped
                         if book.ledgers.get(key[0], {}).get(key[1]) != CANCELLED
                         or (key[0] in reports
                             and reports[key[0]].ledger.get(key[1]) != CANCELLED))
    if uncancelled:
        problems.append(f"{len(uncancelled)} dropped acks gave no cancellation "
                        f"(e.g. trader {uncancelled[0][0]} order {uncancelled[0][1]})")
    if book.unknown_cancels:
        problems.append(f"{book.unknown_cancels} cancels of unknown orders")
    if book.duplicate_orders:
        problems.append(f"{book.duplicate_orders} orders received twice")
    if book.failures:
        problems.append(f"the exchange saw {book.failures} failed or malformed messages")
    return v


# -- the roles -----------------------------------------------------------------------------

@dataclass
class Order:
    oid: int
    side: int
    price: float
    quantity: int
    sent: float  # time.monotonic() when sent
    timed_out: bool = False


class Trader:
    """Handlers only: prices come in, orders go out, reports and timeouts end them."""

    def __init__(self, world: mate.World, args: argparse.Namespace, exchange: int,
                 market: int) -> None:
        self.world, self.exchange, self.market = world, exchange, market
        self.max_orders = args.orders
        self.max_outstanding = args.max_outstanding
        self.order_timeout: float = args.order_timeout
        self.rng = random.Random(args.seed * 1_000_003 + world.mypid)
        self.loop = asyncio.get_running_loop()
        self.finished = asyncio.Event()  # the stream ended and every order ended
        self.lock = threading.Lock()  # handlers may run on a progress thread
        self.ledger: dict[int, str] = {}
        self.next_id = 0
        self.outstanding = 0
        self.stream_ended = False
        self.mean: float | None = None
        self.prices = self.timeouts = self.second_endings = self.failures = 0
        self.latencies: list[float] = []
        self.sends: list[mate.Message] = []
        self.price_buffer = bytearray(PRICE.size)
        self.price_schedule = mate.Schedule(completion=self.on_price,
                                            failure=self.on_price_failed)

    async def run(self) -> TraderReport:
        self.world.recv(self.price_buffer, self.market, TAG_PRICE, schedule=self.price_schedule)
        await self.finished.wait()
        # Every order and cancel was matched before the ledger, which follows them on
        # the same tag; collect their outcomes so that none is left for shutdown.
        with self.lock:
            sends = list(self.sends)
        outcomes = await asyncio.gather(*sends, return_exceptions=True)
        with self.lock:
            self.failures += sum(isinstance(o, BaseException) for o in outcomes)
            return TraderReport(
                rank=self.world.mypid, ledger=dict(self.ledger), sent=self.next_id,
                prices=self.prices, timeouts=self.timeouts,
                second_endings=self.second_endings, failures=self.failures,
                median_latency_ms=(round(statistics.median(self.latencies) * 1e3, 3)
                                   if self.latencies else None))

    # upon price: incorporate the new datum; if ready, send an order
    def on_price(self, receipt: mate.Receipt, data: None) -> None:
        if receipt.length == 0:  # END of the stream: no re-post
            with self.lock:
                self.stream_ended = True
            self.check_finished()
            return
        if receipt.length != PRICE.size:
            with self.lock:
                self.failures += 1
            price = None
        else:
            _, price = PRICE.unpack(self.price_buffer)
        self.world.recv(self.price_buffer, self.market, TAG_PRICE, schedule=self.price_schedule)
        if price is None:
            return
        order = None
        with self.lock:
            self.prices += 1
            mean = price if self.mean is None else self.mean
            self.mean = 0.9 * mean + 0.1 * price
            if self.next_id < self.max_orders and self.outstanding < self.max_outstanding:
                order = Order(self.next_id, BUY if price <= mean else SELL, price,
                              self.rng.randint(1, 100), time.monotonic())
                self.next_id += 1
                self.outstanding += 1
        if order is not None:
            self.place(order)

    def on_price_failed(self, receipt: mate.Receipt, data: None) -> None:
        with self.lock:
            self.failures += 1
            self.stream_ended = True
        self.check_finished()

    def place(self, order: Order) -> None:
        """Post the receive for the order's report (with a timeout), then send the order."""
        buffer = bytearray(REPORT.size)
        self.world.recv(buffer, self.exchange, TAG_REPORT_BASE + order.oid,
                        timeout=self.order_timeout,
                        schedule=mate.Schedule(completion=self.on_report,
                                               completion_data=(order, buffer),
                                               timeout=self.on_latent, timeout_data=order,
                                               failure=self.on_report_failed,
                                               failure_data=order))
        packet = ORDER.pack(KIND_ORDER, order.oid, order.side, order.price, order.quantity)
        self.keep(self.world.send(packet, self.exchange, TAG_REQUEST))

    # upon acknowledgment, execution report or cancellation: clear the outstanding order
    def on_report(self, receipt: mate.Receipt, data: tuple[Order, bytearray]) -> None:
        order, buffer = data
        arrived = time.monotonic()
        state, oid = REPORT.unpack(buffer) if receipt.length == REPORT.size else (0, -1)
        with self.lock:
            if oid != order.oid or chr(state) not in FINAL_STATES:
                self.failures += 1
            if order.oid in self.ledger:
                self.second_endings += 1
                return
            self.ledger[order.oid] = chr(state) if state else FAILED
            self.outstanding -= 1
            if not order.timed_out:
                self.latencies.append(arrived - order.sent)
        self.check_finished()

    # upon timeout of outstanding order: cancel the order and handle error
    def on_latent(self, receipt: mate.Receipt, order: Order) -> None:
        with self.lock:
            self.timeouts += 1
            order.timed_out = True
        buffer = bytearray(REPORT.size)
        self.world.recv(buffer, self.exchange, TAG_REPORT_BASE + order.oid, timeout=None,
                        schedule=mate.Schedule(completion=self.on_report,
                                               completion_data=(order, buffer),
                                               failure=self.on_report_failed,
                                               failure_data=order))
        self.keep(self.world.send(CANCEL.pack(KIND_CANCEL, order.oid), self.exchange,
                                  TAG_REQUEST))

    def on_report_failed(self, receipt: mate.Receipt, order: Order) -> None:
        with self.lock:
            self.failures += 1
            if order.oid in self.ledger:
                self.second_endings += 1
                return
            self.ledger[order.oid] = FAILED
            self.outstanding -= 1
        self.check_finished()

    def keep(self, msg: mate.Message) -> None:
        with self.lock:
            self.sends.append(msg)

    def check_finished(self) -> None:
        with self.lock:
            done = self.stream_ended and self.outstanding == 0
        if done:
            self.loop.call_soon_threadsafe(self.finished.set)


@dataclass
class _Entry:
    """The exchange's state of one order."""

    report: str  # ACKED or EXECUTED: what the exchange decided
    final: str | None = None  # the one final message, once sent


class Exchange:
    """Serves orders and cancels from a standing receive; one final message per order."""

    def __init__(self, world: mate.World, args: argparse.Namespace, traders: list[int]) -> None:
        self.world, self.traders = world, traders
        self.rng = random.Random(args.seed)
        self.fill_rate: float = args.fill_rate
        self.drop: float = args.drop_acks
        self.delay_rate, self.delay = args.delay_acks
        if self.delay is None:
            self.delay = 2 * args.order_timeout
        self.loop = asyncio.get_running_loop()
        self.lock = threading.Lock()
        self.book = ExchangeBook()
        self.entries: dict[tuple[int, int], _Entry] = {}
        self.reports: dict[int, TraderReport] = {}
        self.all_in = asyncio.Event()  # every trader's ledger arrived
        self.sends: list[mate.Message] = []
        self.buffer = bytearray(1 + args.orders + LEDGER_SLACK)
        self.schedule = mate.Schedule(completion=self.on_request, failure=self.on_request_failed)

    async def run(self) -> None:
        self.world.recv(self.buffer, mate.ANY_SOURCE, TAG_REQUEST, schedule=self.schedule)
        await self.all_in.wait()
        with self.lock:
            sends = list(self.sends)
        outcomes = await asyncio.gather(*sends, return_exceptions=True)
        with self.lock:
            self.book.failures += sum(isinstance(o, BaseException) for o in outcomes)

    def on_request(self, receipt: mate.Receipt, data: None) -> None:
        packet, source = bytes(self.buffer[:receipt.length]), receipt.remote_pid
        kind = packet[0] if packet else None
        if kind == KIND_LEDGER:
            try:
                report = TraderReport.unpack(packet)
            except (ValueError, KeyError, TypeError):
                report = TraderReport(rank=source, ledger={}, sent=0, failures=1)
            with self.lock:
                self.reports[source] = report
                everyone = len(self.reports) >= len(self.traders)
        else:
            everyone = False
        if everyone:
            self.loop.call_soon_threadsafe(self.all_in.set)
        else:  # the request is copied: the buffer may take the next one
            self.world.recv(self.buffer, mate.ANY_SOURCE, TAG_REQUEST, schedule=self.schedule)
        if kind == KIND_ORDER and len(packet) == ORDER.size:
            self.on_order(source, ORDER.unpack(packet)[1])
        elif kind == KIND_CANCEL and len(packet) == CANCEL.size:
            self.on_cancel(source, CANCEL.unpack(packet)[1])
        elif kind != KIND_LEDGER:
            with self.lock:
                self.book.failures += 1

    def on_request_failed(self, receipt: mate.Receipt, data: None) -> None:
        with self.lock:
            self.book.failures += 1
        self.world.recv(self.buffer, mate.ANY_SOURCE, TAG_REQUEST, schedule=self.schedule)

    def on_order(self, trader: int, oid: int) -> None:
        key = (trader, oid)
        send_now = delayed = False
        with self.lock:
            if key in self.entries:
                self.book.duplicate_orders += 1
                return
            entry = self.entries[key] = _Entry(
                EXECUTED if self.rng.random() < self.fill_rate else ACKED)
            self.book.received.setdefault(trader, set()).add(oid)
            fate = self.rng.random()
            if fate < self.drop:
                self.book.dropped.add(key)  # held back for good: only a CANCEL ends it
            elif fate < self.drop + self.delay_rate:
                self.book.delayed.add(key)
                delayed = True
            else:
                send_now = self.decide(key, entry.report)
        if send_now:
            self.send_final(key, entry.report)
        elif delayed:  # call_later belongs to the loop's thread; handlers may not be there
            self.loop.call_soon_threadsafe(self.loop.call_later, self.delay, self.release, key)

    def release(self, key: tuple[int, int]) -> None:
        """A delayed report is due: send it, unless a CANCEL ended the order first."""
        with self.lock:
            entry = self.entries[key]
            due = self.decide(key, entry.report)
        if due:
            self.send_final(key, entry.report)

    def on_cancel(self, trader: int, oid: int) -> None:
        key = (trader, oid)
        with self.lock:
            self.book.cancels += 1
            if key not in self.entries:
                self.book.unknown_cancels += 1
                return
            confirm = self.decide(key, CANCELLED)
            if not confirm:
                self.book.late_cancels += 1  # the report went first: it is the final word
        if confirm:
            self.send_final(key, CANCELLED)

    def decide(self, key: tuple[int, int], state: str) -> bool:
        """With the lock held: make `state` the order's final message, unless one was sent."""
        entry = self.entries[key]
        if entry.final is not None:
            return False
        entry.final = state
        self.book.ledgers.setdefault(key[0], {})[key[1]] = state
        self.book.finals[key] += 1
        return True

    def send_final(self, key: tuple[int, int], state: str) -> None:
        trader, oid = key
        msg = self.world.send(REPORT.pack(ord(state), oid), trader, TAG_REPORT_BASE + oid)
        with self.lock:
            self.sends.append(msg)

    def figures(self) -> list[str]:
        book = self.book
        lines = []
        for trader in self.traders:
            report = self.reports.get(trader)
            if report is None:
                continue
            latency = ("-" if report.median_latency_ms is None
                       else f"{report.median_latency_ms:.2f} ms")
            lines.append(f"trader {trader}: {report.prices} prices, {report.sent} orders, "
                         f"{report.timeouts} timeouts, {report.second_endings} ended twice, "
                         f"median ack latency {latency}")
        received = sum(len(ids) for ids in book.received.values())
        lines.append(f"exchange: {received} orders received, {len(self.sends)} final messages "
                     f"sent, {book.cancels} cancels ({book.late_cancels} after the report)")
        return lines


async def market_data(world: mate.World, traders: list[int], prices: int, tick: float,
                      seed: int) -> None:
    """Stream a seeded random walk to every trader, then END (an empty message)."""
    rng = random.Random(seed ^ 0x5EED)
    price = 100.0
    sends: list[mate.Message] = []
    for seq in range(prices):
        price = max(0.01, price + rng.gauss(0.0, 0.05))
        packet = PRICE.pack(seq, price)
        sends.extend(world.send(packet, trader, TAG_PRICE) for trader in traders)
        if tick:
            await asyncio.sleep(tick)
    sends.extend(world.send(b"", trader, TAG_PRICE) for trader in traders)
    await asyncio.gather(*sends, return_exceptions=True)  # traders count what they got


# -- one program for every rank --------------------------------------------------------------

@dataclass
class Outcome:
    rank: int
    verified: bool
    lines: list[str] = field(default_factory=list)  # what to print (rank 0 only)


def layout(numprocs: int) -> tuple[int, int, list[int]]:
    """(exchange, market data, traders) for `numprocs` ranks."""
    if numprocs == 2:
        return 0, 0, [1]
    return 0, numprocs - 1, list(range(1, numprocs - 1))


def make_program(args: argparse.Namespace, here: list[int], live: dict[int, Exchange]
                 ) -> Callable[[mate.World], Awaitable[Outcome]]:
    """The SPMD program; it notes the ranks it runs as in `here`, the exchange in `live`."""

    async def program(world: mate.World) -> Outcome:
        here.append(world.mypid)
        if world.numprocs < 2:
            raise SystemExit("order manager: needs at least 2 ranks (--ranks or mate-run -n)")
        if TAG_REPORT_BASE + args.orders - 1 > world.tag_max:
            raise SystemExit(f"order manager: --orders {args.orders} exceeds tag_max")
        exchange, market, traders = layout(world.numprocs)
        me = world.mypid
        verdict_buffer = bytearray(1)
        if me == exchange:
            desk = live[me] = Exchange(world, args, traders)
            stream = (asyncio.ensure_future(market_data(world, traders, args.prices, args.tick,
                                                        args.seed))
                      if market == me else None)
            await desk.run()
            if stream is not None:
                await stream
            with desk.lock:
                verdict = verify(desk.book, desk.reports, traders, args.prices)
            verdicts = [world.send(bytes([verdict.verified]), rank, TAG_VERDICT)
                        for rank in range(world.numprocs) if rank != me]
            await asyncio.gather(*verdicts)
            return Outcome(me, verdict.verified, [*desk.figures(), verdict.summary()])
        told = world.recv(verdict_buffer, exchange, TAG_VERDICT, timeout=None)
        if me == market:
            await market_data(world, traders, args.prices, args.tick, args.seed)
        else:
            report = await Trader(world, args, exchange, market).run()
            await world.send(report.pack(), exchange, TAG_REQUEST)
        await told
        return Outcome(me, verdict_buffer[0] == 1)

    return program


# -- command line ----------------------------------------------------------------------------

def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in [0, 1]")
    return value


def fraction_and_delay(text: str) -> tuple[float, float | None]:
    rate, _, seconds = text.partition(":")
    delay = float(seconds) if seconds else None
    if delay is not None and delay < 0:
        raise argparse.ArgumentTypeError(f"the delay {seconds} must be >= 0 seconds")
    return fraction(rate), delay


def order_count(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_ORDERS:
        raise argparse.ArgumentTypeError(f"--orders must be in 0..{MAX_ORDERS} "
                                         f"(order ids become tags {TAG_REPORT_BASE}..32767)")
    return value


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="Roles: rank 0 is the exchange, the last rank the market-data source "
               "(rank 0 with 2 ranks), the others traders.")
    mate.spmd.add_arguments(parser)
    demo = parser.add_argument_group("order manager")
    demo.add_argument("--orders", type=order_count, default=100,
                      help="orders each trader sends at most (default 100)")
    demo.add_argument("--prices", type=int, default=1000,
                      help="price ticks streamed to every trader (default 1000)")
    demo.add_argument("--tick", type=float, default=0.001,
                      help="seconds between price ticks (default 0.001)")
    demo.add_argument("--max-outstanding", type=int, default=8,
                      help="a trader orders only with fewer outstanding orders (default 8)")
    demo.add_argument("--fill-rate", type=fraction, default=0.25,
                      help="fraction of orders the exchange executes; the rest it "
                           "acknowledges (default 0.25)")
    demo.add_argument("--drop-acks", type=fraction, default=0.0, metavar="P",
                      help="fraction of orders whose report the exchange never sends")
    demo.add_argument("--delay-acks", type=fraction_and_delay, default=(0.0, None),
                      metavar="P[:SECONDS]",
                      help="fraction of orders whose report the exchange sends late, after "
                           "SECONDS (default: twice --order-timeout)")
    demo.add_argument("--order-timeout", type=float, default=0.2,
                      help="seconds a trader waits for a report before cancelling (default 0.2)")
    demo.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    demo.add_argument("--deadline", type=float, default=60.0,
                      help="give up (NOT verified, exit 1) after this many seconds (default 60)")
    args = parser.parse_args(argv)
    if args.drop_acks + args.delay_acks[0] > 1.0:
        parser.error("--drop-acks and --delay-acks add up to more than 1")
    if args.order_timeout <= 0 or args.deadline <= 0 or args.tick < 0 or args.prices < 0:
        parser.error("--order-timeout and --deadline must be > 0, --tick and --prices >= 0")
    if args.progress == "manual":
        parser.error("--progress manual: this demo has no loop to call world.progress() in; "
                     "its ranks wait on events that handlers set (use poll or thread)")
    if args.max_outstanding < 1:
        parser.error("--max-outstanding must be at least 1")
    return args


async def main_async(args: argparse.Namespace) -> int:
    here: list[int] = []
    live: dict[int, Exchange] = {}
    program = make_program(args, here, live)
    try:
        outcomes = await asyncio.wait_for(mate.spmd.run(program, **mate.spmd.options_from(args)),
                                          args.deadline)
    except mate.InvalidArgument as exc:  # e.g. --handlers progress on the local transport
        print(f"order manager: {exc}", file=sys.stderr)
        return 2
    except asyncio.TimeoutError:
        # Rank 0 says so (and, if the ranks never started, every process does).
        desk = live.get(0)
        if 0 in here or not here:
            where = ""
            if desk is not None:
                with desk.lock:
                    received = sum(len(ids) for ids in desk.book.received.values())
                    ended = sum(len(states) for states in desk.book.ledgers.values())
                    where = (f" ({received} orders received, {ended} ended, "
                             f"{len(desk.reports)} of {len(desk.traders)} ledgers in)")
            print(f"order manager: the deadline of {args.deadline:g} s passed{where}: "
                  f"NOT verified", flush=True)
        return 1
    for outcome in outcomes:
        for line in outcome.lines:
            print(line, flush=True)
    return 0 if all(outcome.verified for outcome in outcomes) else 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_arguments(argv)))


if __name__ == "__main__":
    sys.exit(main())
