"""The ibverbs transport: the protocol engine wired to a verbs device.

Data flows like this (thesis §5.3):

    world.send -> IbverbsTransport.post -> Engine.post -> QP.post_send (SEND / RDMA)
    ... the device ...
    completion channel fd readable -> progress pass -> CQ.poll -> Engine.completion
        -> reports -> sink.report_all -> the core (handlers, awaiters)

One lock guards the engine: `post` and `cancel` come from the loop's thread
(or from a handler or the timeout thread with ``handlers="progress"``), passes
from the loop or the progress thread. Reports are taken under the lock and
handed to the sink outside it, so a handler run at once (``handlers=
"progress"``) can post again.

Resources per rank: one PD, one completion channel, a send CQ and a receive
CQ on it (§5.3: "two completion queues, one for sent data and one for
received"), one SRQ, and one RC QP per rank (itself included: a loopback QP
carries messages a rank sends to itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from librt.threading import Lock

from mate import debug
from mate.schedule import Region
from mate.transports.base import Operation, Report, Sink, Transport
from mate.transports.ibverbs.engine import Engine
from mate.transports.ibverbs.progress import (
    LoopProgress,
    PollProgress,
    Progress,
    ThreadProgress,
)
from mate.transports.ibverbs.verbs import (
    CompletionChannel,
    CompletionQueue,
    Device,
    QPState,
    QueuePair,
    RecvWR,
    SendWR,
    SharedReceiveQueue,
    WcStatus,
)

POLL_BATCH: Final = 64
KEEPALIVE: Final = 1.0  # seconds between probes of peers that operations wait on (engine.keepalive)
DRAIN_TIMEOUT: Final = 2.0  # seconds shutdown keeps progressing for what peers are owed
_SUCCESS: Final = WcStatus.SUCCESS  # read per completion (an enum read through its class is slow)


class _Wire:
    """The engine's view of the device: a QP per peer and the SRQ."""

    __slots__ = ("qps", "srq")

    def __init__(self, qps: list[QueuePair], srq: SharedReceiveQueue) -> None:
        self.qps = qps
        self.srq = srq

    def post_send(self, peer: int, wr: SendWR) -> None:
        self.qps[peer].post_send(wr)

    def post_recv(self, wr: RecvWR) -> None:
        self.srq.post_recv(wr)


class IbverbsTransport(Transport):
    supports_progress_handlers = True

    def __init__(self, sink: Sink, loop: asyncio.AbstractEventLoop, *, rank: int, size: int,
                 device: Device, channel: CompletionChannel, send_cq: CompletionQueue,
                 recv_cq: CompletionQueue, qps: list[QueuePair], engine: Engine,
                 progress: str) -> None:
        self.mypid = rank
        self.numprocs = size
        self.tag_max = 2**31 - 1
        self._sink = sink
        self._loop = loop
        self._hot_spot = debug.hot_spot_hook()
        self._device = device
        self._channel = channel
        self._cqs = (recv_cq, send_cq)
        self._qps = qps
        self._peer_of_qp = {qp.qp_num: peer for peer, qp in enumerate(qps)}
        self._lost: set[int] = set()
        self._engine = engine
        self._lock = Lock()
        self._pending: list[Report] = []  # reports found outside a pass, for the next one
        self._closed = False
        self._poll_all = progress == "poll"
        fd = channel.fileno()
        self._progress: Progress
        if progress == "thread":
            self._progress = ThreadProgress(loop, fd, self.run_pass, self._deliver)
        elif progress == "poll":
            self._progress = PollProgress(loop, fd, self.run_pass, self._deliver,
                                          engine.outstanding, lambda: self._sink.loop_work)
        else:
            self._progress = LoopProgress(loop, fd, self.run_pass, self._deliver)
        for cq in self._cqs:
            cq.req_notify()
        self._progress.start()
        self._keepalive_timer = loop.call_later(KEEPALIVE, self._keepalive)

    # -- the core's calls ----------------------------------------------------------------

    def post(self, op: Operation) -> None:
        if self._hot_spot is not None:
            self._hot_spot("ibverbs.post")
        with self._lock:
            if self._closed:
                return
            self._engine.post(op)
            reports = self._engine.take_reports()
            if reports:
                self._pending += reports
        if reports:
            self._progress.kick()
        else:
            self._progress.posted()

    def cancel(self, op: Operation) -> None:
        if self._hot_spot is not None:
            self._hot_spot("ibverbs.cancel")
        with self._lock:
            if self._closed:
                return
            self._engine.cancel(op)
            self._pending += self._engine.take_reports()
        self._progress.kick()

    def expose(self, buffer: memoryview) -> Region:
        with self._lock:
            return self._engine.expose(buffer)

    async def unexpose(self, region: Region) -> None:
        done = self._loop.create_future()

        def revoked() -> None:  # called by the engine under the lock, maybe on another thread
            self._sink.call_on_loop(_resolve, done)

        with self._lock:
            self._engine.unexpose(region, revoked)
            self._pending += self._engine.take_reports()
        self._progress.kick()
        await done

    def awaiting(self, op: Operation, done: Callable[[], bool]) -> bool:
        return self._progress.awaiting(done)

    def stats(self) -> dict[str, int]:
        with self._lock:
            counters = dict(self._engine.stats())
        device_stats = getattr(self._device, "stats", None)
        if device_stats is not None:
            counters.update(device_stats())
        return counters

    # -- progress ------------------------------------------------------------------------

    def _deliver(self) -> None:
        """Hand the reports that calls left to the core (no device work)."""
        with self._lock:
            reports, self._pending = self._pending, []
        if reports:
            self._sink.report_all(reports)

    def _keepalive(self) -> None:
        """Probe the peers operations wait on: a dead one is found by its failed probe."""
        with self._lock:
            if self._closed:
                return
            self._engine.keepalive()
            self._pending += self._engine.take_reports()
        self._progress.kick()
        self._keepalive_timer = self._loop.call_later(KEEPALIVE, self._keepalive)

    def run_pass(self) -> bool:
        """Drain the channel and the CQs into the engine; hand the reports to the core."""
        moved = False
        with self._lock:
            if self._closed:
                return False
            # A CQ is armed again before it is polled, so a completion that comes after
            # the poll raises a new event: one that raised none has nothing new (in poll
            # mode every CQ is polled all the same, to get ahead of the events).
            raised: list[CompletionQueue] = []
            while (cq := self._channel.get_cq_event()) is not None:
                cq.ack_events(1)
                cq.req_notify()
                raised.append(cq)
            for cq in self._cqs:
                if not (self._poll_all or cq in raised):
                    continue
                while True:
                    completions = cq.poll(POLL_BATCH)
                    if completions:
                        moved = True
                        for wc in completions:
                            peer = self._peer_of_qp.get(wc.qp_num, -1)
                            self._engine.completion(wc, peer)
                            if wc.status is not _SUCCESS:
                                self._check_peer(peer, wc.status)
                    if len(completions) < POLL_BATCH:
                        break
            reports = self._pending + self._engine.take_reports()
            self._pending = []
        if reports:
            if self._hot_spot is not None:
                self._hot_spot("ibverbs.pass")
            self._sink.report_all(reports)
            moved = True
        return moved

    def _check_peer(self, peer: int, status: WcStatus) -> None:
        """An error completion on `peer`'s QP: if that QP went to ERR, the peer is lost."""
        if peer < 0 or peer in self._lost or self._qps[peer].state is not QPState.ERR:
            return
        self._lost.add(peer)
        self._engine.peer_lost(peer, f"the connection to rank {peer} failed ({status.name})")

    # -- shutdown ------------------------------------------------------------------------

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._keepalive_timer.cancel()
        # The core has ended every operation, but this rank may still owe a peer a
        # FIN, a credit grant or a key answer that the peer's operation waits for,
        # or have work requests on the wire: keep progressing until the engine is
        # idle. Bounded, since a peer may be gone and never complete them.
        deadline = self._loop.time() + DRAIN_TIMEOUT
        while self._loop.time() < deadline:
            with self._lock:
                idle = self._engine.idle()
            if idle:
                break
            self.run_pass()
            await asyncio.sleep(0.001)
        self._progress.stop()
        with self._lock:
            self._closed = True
            self._engine.shutdown()
            self._pending.clear()
        self._device.close()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)

