"""The benchmark patterns: with mate's public API, with raw mpi4py, and the asyncio floor.

Rank 0 measures, rank 1 serves. Each size is a *phase*: rank 0 runs batches
(see `mate.bench.measure`), each announced to rank 1 by a header (iterations,
size) and acknowledged, so that the clock starts with both ranks ready; a
header with 0 iterations ends the phase. With a baseline, every size has a
mate phase followed by a raw phase, so that both see the same machine state;
with the floor, a floor phase follows them.

The floor (`FloorBench`) is the least an asyncio program pays to await MPI
requests: the same pattern with mpi4py's ``Irecv``/``Issend``, each request
awaited through a loop callback that tests it and resolves a future, as any
asyncio integration of MPI must, with no mate code involved. It runs on the
event loop the benchmark runs on (asyncio, or uvloop with ``--uvloop``), and
bounds from below what anything built on asyncio futures can reach here. For
the rate pattern, whose window holds many requests at once, one callback
tests them all with ``Testsome`` (`_Poller`), the cheapest way to await many.

Per iteration, rank 0 (rank 1 mirrors the two-sided patterns):

* pingpong: ``s = send; r = recv; await s (or its submission); await r``; rank 1
  ``await r; s = send; r = recv; await s``, so that each side's message leaves
  before the receive of the next is posted (raw MPI's order), and that receive
  is still posted before its message can come (that needs this one to arrive
  first). The figure is half the round trip. Raw: blocking ``Ssend`` + ``Recv``
  (``Send`` with ``--wait submission``).
* pingping: both ranks ``r = recv; s = send; await s (or its submission); await r``
  at once; the figure is the time per exchange. Raw: ``Irecv`` + ``Isend`` +
  ``Waitall``.
* put: ``await put`` into a region rank 1 exposed (its address came by a
  message); with ``--wait submission`` each put's submission is awaited and the
  completions at the end of the batch. Raw: ``Rput`` + ``Win_flush`` on a
  dynamic window in one ``Lock_all`` epoch (``Rput`` + ``Wait`` per put and one
  ``Win_flush`` per batch with ``--wait submission``).
* get: ``await get``. Raw: ``Rget`` + ``Wait``.
* wait: rank 1 sends one message `idle` seconds after the start; rank 0 awaits
  it, and its CPU use over that time is the figure (SPEC §7, thread mode).
  Raw: a blocking ``Recv``.
* rate (message rate, as OSU's ``osu_mbw_mr``): per iteration rank 0 posts a
  window of `window` sends and awaits each, in order; rank 1 posts a window
  of receives, awaits them, and sends one acknowledgement, which rank 0
  awaits before the next window. The figure is the time per message (so
  messages/s = 10^6 / latency). With `handler_driven`, rank 1 keeps `window`
  receives posted by reposting each from its completion handler, as the
  thesis's programs do, and acknowledges each window from the handler that
  completes it. Raw: ``Issend`` x window + ``Waitall``, ``Irecv`` x window +
  ``Waitall``, and a ``Send``/``Recv`` acknowledgement.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

import mate
from mate.bench.measure import Batch, Sample, clock

PATTERNS = ("pingpong", "pingping", "put", "get", "wait", "rate")
SUBMISSION_PATTERNS = ("pingpong", "pingping", "put")  # send and put have a submission
FLOOR_PATTERNS = ("pingpong", "pingping", "rate")  # what the asyncio floor (--floor) measures
DEFAULT_WINDOW = 64  # the rate pattern's messages per window (OSU's default)

DATA_TAG = 1
CONTROL_TAG = 2
WINDOW_TAG = 4  # the rate pattern's per-window acknowledgement
HEADER = struct.Struct("<qq")  # iterations (0 ends the phase), size
ADDRESS = struct.Struct("<Q")


class Buffers:
    """Preallocated buffers of the largest size and a view of each size, so that the
    loops slice nothing.

    A rank makes one set and every side of a comparison uses it (mate, raw MPI, the
    floor, TCP): where a buffer lies moves a large transfer by more than the targets'
    margins, for raw MPI alone (bench/buffer_placement.py: three pairs of buffers in
    one launch, raw 4 MiB pingpings taking turns, read 0.90-1.04x one another). With
    a set each, twelve launches of one build read mate's 4 MiB pingping at 0.87-0.99x
    raw; on one set, six read 0.95-0.97x.
    """

    def __init__(self, sizes: list[int]) -> None:
        largest = max(max(sizes), 1)
        self.out = bytearray(b"\x5a" * largest)
        self.into = bytearray(largest)
        self.region = bytearray(largest)  # the target of put and get (rank 1)
        out, into = memoryview(self.out), memoryview(self.into)
        self.outs = {size: out[:size] for size in sizes}
        self.intos = {size: into[:size] for size in sizes}


# -- mate --------------------------------------------------------------------------------


def divisor(pattern: str, window: int) -> int:
    """What one timed iteration is divided by: pingpong reports half the round trip,
    rate the time per message of its window."""
    return {"pingpong": 2, "rate": window}.get(pattern, 1)


class MateBench:
    """One rank's side of a pattern over mate's public API."""

    def __init__(self, world: mate.World, pattern: str, wait: str, buffers: Buffers,
                 idle: float, window: int = DEFAULT_WINDOW,
                 handler_driven: bool = False) -> None:
        self.world = world
        self.pattern = pattern
        self.window = window
        self.handler_driven = handler_driven
        self.submission = wait == "submission"
        self.idle = idle
        self.peer = 1 - world.mypid
        self.buffers = buffers
        self.header = bytearray(HEADER.size)
        self.ack = bytearray(HEADER.size)
        self.address = 0  # of rank 1's region (put, get)
        self.region: mate.Region | None = None

    async def setup(self) -> None:
        if self.pattern not in ("put", "get"):
            return
        world, word = self.world, bytearray(ADDRESS.size)
        if world.mypid == 1:
            self.region = world.expose(self.buffers.region)
            ADDRESS.pack_into(word, 0, self.region.address)
            await world.send(word, 0, CONTROL_TAG)
        else:
            await world.recv(word, 1, CONTROL_TAG)
            (self.address,) = ADDRESS.unpack(word)

    async def teardown(self) -> None:
        if self.region is not None:
            await self.world.unexpose(self.region)
            self.region = None

    # -- rank 0 ------------------------------------------------------------------------

    async def _start(self, iterations: int, size: int) -> None:
        """Announce a batch to rank 1 and wait until it is ready."""
        HEADER.pack_into(self.header, 0, iterations, size)
        ready = self.world.recv(self.ack, 1, CONTROL_TAG)
        await self.world.send(self.header, 1, CONTROL_TAG)
        await ready

    async def end_phase(self, size: int) -> None:
        HEADER.pack_into(self.header, 0, 0, size)
        await self.world.send(self.header, 1, CONTROL_TAG)

    def batch(self, size: int) -> Batch:
        """The timed loop of rank 0 at `size` bytes."""
        world, out, into = self.world, self.buffers.outs[size], self.buffers.intos[size]
        send, recv, put, get = world.send, world.recv, world.put, world.get
        address, submission, pattern = self.address, self.submission, self.pattern

        async def pingpong(n: int) -> Sample:
            await self._start(n, size)
            start = clock()
            # The ping leaves first, then the receive of its answer is posted (the
            # answer cannot come before the ping has arrived): raw MPI's order. One
            # loop per wait, so that the timed loop calls nothing of the benchmark's.
            if submission:
                for _ in range(n):
                    s = send(out, 1, DATA_TAG)
                    r = recv(into, 1, DATA_TAG)
                    await s.submitted  # type: ignore[misc]
                    await r
            else:
                for _ in range(n):
                    s = send(out, 1, DATA_TAG)
                    r = recv(into, 1, DATA_TAG)
                    await s
                    await r
            return Sample.since(n, start)

        async def pingping(n: int) -> Sample:
            await self._start(n, size)
            start = clock()
            await exchange(world, n, out, into, 1, submission)
            return Sample.since(n, start)

        async def put_(n: int) -> Sample:
            await self._start(n, size)
            start = clock()
            if submission:
                pending: list[mate.Message] = []
                for _ in range(n):
                    msg = put(out, 1, address)
                    await msg.submitted  # type: ignore[misc]
                    pending.append(msg)
                for msg in pending:
                    await msg
            else:
                for _ in range(n):
                    await put(out, 1, address)
            return Sample.since(n, start)

        async def get_(n: int) -> Sample:
            await self._start(n, size)
            start = clock()
            for _ in range(n):
                await get(into, 1, address)
            return Sample.since(n, start)

        async def wait(n: int) -> Sample:
            await self._start(n, size)
            start = clock()
            for _ in range(n):
                await recv(into, 1, DATA_TAG)
            return Sample.since(n, start)

        window, acknowledgement = self.window, self.ack

        async def rate(n: int) -> Sample:
            await self._start(n, size)
            start = clock()
            for _ in range(n):
                acknowledged = recv(acknowledgement, 1, WINDOW_TAG)
                sends = [send(out, 1, DATA_TAG) for _ in range(window)]
                for message in sends:
                    await message
                await acknowledged
            return Sample.since(n, start)

        loops = {"pingpong": pingpong, "pingping": pingping, "put": put_, "get": get_,
                 "wait": wait, "rate": rate}
        return loops[pattern]

    # -- rank 1 ------------------------------------------------------------------------

    async def serve_phase(self) -> None:
        """Serve rank 0's batches until it ends the phase."""
        world, header = self.world, self.header
        send, recv = world.send, world.recv
        submission, pattern = self.submission, self.pattern
        while True:
            await recv(header, 0, CONTROL_TAG)
            n, size = HEADER.unpack(header)
            if n == 0:
                return
            out, into = self.buffers.outs[size], self.buffers.intos[size]
            if pattern == "pingpong":
                # The answer leaves first, then the receive of the next ping is posted:
                # that ping cannot come before the answer has arrived.
                r = recv(into, 0, DATA_TAG)
                await send(self.ack, 0, CONTROL_TAG)
                for _ in range(n - 1):
                    await r
                    s = send(out, 0, DATA_TAG)
                    r = recv(into, 0, DATA_TAG)
                    await (s.submitted if submission else s)  # type: ignore[misc]
                await r
                await _reply(send, out, submission)
            elif pattern == "pingping":
                await send(self.ack, 0, CONTROL_TAG)
                await exchange(world, n, out, into, 0, submission)
            elif pattern == "wait":
                await send(self.ack, 0, CONTROL_TAG)
                for _ in range(n):
                    await asyncio.sleep(self.idle)
                    await send(out, 0, DATA_TAG)
            elif pattern == "rate":
                await send(self.ack, 0, CONTROL_TAG)
                if self.handler_driven:
                    await self._receive_by_handlers(n, into)
                else:
                    for _ in range(n):
                        receives = [recv(into, 0, DATA_TAG) for _ in range(self.window)]
                        for message in receives:
                            await message
                        await send(self.ack, 0, WINDOW_TAG)
            else:  # put, get: rank 1 only keeps its region exposed
                await send(self.ack, 0, CONTROL_TAG)


    async def _receive_by_handlers(self, windows: int, into: memoryview) -> None:
        """The rate pattern's rank 1, handler-driven: `window` receives stay posted, each
        reposted from the completion handler of the one before it; the handler that
        completes a window acknowledges it."""
        world, window, total = self.world, self.window, windows * self.window
        done = asyncio.get_running_loop().create_future()
        acknowledgements: list[mate.Message] = []
        posted = received = 0

        def completed(receipt: mate.Receipt, data: Any) -> None:
            nonlocal posted, received
            received += 1
            if posted < total:
                post()
            if received % window == 0:
                acknowledgements.append(world.send(self.ack, 0, WINDOW_TAG))
            if received == total and not done.done():
                done.set_result(None)

        def failed(receipt: mate.Receipt, data: Any) -> None:
            if not done.done():
                done.set_exception(receipt.error or RuntimeError("a receive failed"))

        schedule = mate.Schedule(completion=completed, failure=failed)

        def post() -> None:
            nonlocal posted
            posted += 1
            world.recv(into, 0, DATA_TAG, schedule=schedule, timeout=None)

        for _ in range(min(window, total)):
            post()
        await done
        for message in acknowledgements:
            await message


async def _reply(send: Any, out: memoryview, submission: bool) -> None:
    if submission:
        await send(out, 0, DATA_TAG).submitted
    else:
        await send(out, 0, DATA_TAG)


async def exchange(world: mate.World, n: int, out: memoryview, into: memoryview, peer: int,
                   submission: bool) -> None:
    """`n` ping-ping exchanges with `peer`: receive and send at once, both awaited."""
    send, recv = world.send, world.recv
    if submission:
        for _ in range(n):
            r = recv(into, peer, DATA_TAG)
            await send(out, peer, DATA_TAG).submitted  # type: ignore[misc]
            await r
    else:
        for _ in range(n):
            r = recv(into, peer, DATA_TAG)
            s = send(out, peer, DATA_TAG)
            await s
            await r


# -- raw mpi4py --------------------------------------------------------------------------


class _MpiPhases:
    """The phase protocol of a side that runs on raw mpi4py (the baseline, the floor):
    headers and acknowledgements by blocking calls, on a communicator of its own."""

    def __init__(self, buffers: Buffers) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.buffers = buffers
        self.header = bytearray(HEADER.size)
        self.ack = bytearray(HEADER.size)

    def _start(self, iterations: int, size: int) -> None:
        """Rank 0: announce a batch to rank 1 and wait until it is ready."""
        HEADER.pack_into(self.header, 0, iterations, size)
        self.comm.Send(self.header, 1, CONTROL_TAG)
        self.comm.Recv(self.ack, 1, CONTROL_TAG)

    def end_phase(self, size: int) -> None:
        HEADER.pack_into(self.header, 0, 0, size)
        self.comm.Send(self.header, 1, CONTROL_TAG)

    def _next_batch(self) -> tuple[int, memoryview, memoryview] | None:
        """Rank 1: the next batch's iterations and buffers, once acknowledged; None at
        the end of the phase."""
        self.comm.Recv(self.header, 0, CONTROL_TAG)
        n, size = HEADER.unpack(self.header)
        if n == 0:
            return None
        self.comm.Send(self.ack, 0, CONTROL_TAG)
        return n, self.buffers.outs[size], self.buffers.intos[size]


class RawBench(_MpiPhases):
    """One rank's side of a pattern in raw mpi4py: blocking or request-based calls on
    a communicator (and for put/get a dynamic window) of its own."""

    def __init__(self, pattern: str, wait: str, buffers: Buffers, idle: float,
                 window: int = DEFAULT_WINDOW) -> None:
        super().__init__(buffers)
        self.pattern = pattern
        self.window = window
        self.submission = wait == "submission"
        self.idle = idle
        self.rank = self.comm.Get_rank()
        self.win: Any = None
        self.address = 0

    def setup(self) -> None:
        if self.pattern not in ("put", "get"):
            return
        MPI = self.MPI
        self.win = MPI.Win.Create_dynamic(MPI.INFO_NULL, self.comm)
        word = bytearray(ADDRESS.size)
        if self.rank == 1:
            self.win.Attach(self.buffers.region)
            ADDRESS.pack_into(word, 0, MPI.Get_address(self.buffers.region))
            self.comm.Send(word, 0, CONTROL_TAG)
        else:
            self.comm.Recv(word, 1, CONTROL_TAG)
            (self.address,) = ADDRESS.unpack(word)
            self.win.Lock_all(MPI.MODE_NOCHECK)

    def teardown(self) -> None:
        if self.win is not None:
            if self.rank == 0:
                self.win.Unlock_all()
            else:
                self.win.Detach(self.buffers.region)
            self.win.Free()
            self.win = None
        self.comm.Free()

    # -- rank 0 ------------------------------------------------------------------------

    def batch(self, size: int) -> Batch:
        MPI, comm, win = self.MPI, self.comm, self.win
        out, into = self.buffers.outs[size], self.buffers.intos[size]
        target = (self.address, size, MPI.BYTE)
        send = comm.Send if self.submission else comm.Ssend
        pattern, submission = self.pattern, self.submission

        def loop(n: int) -> None:
            if pattern == "pingpong":
                recv = comm.Recv
                for _ in range(n):
                    send(out, 1, DATA_TAG)
                    recv(into, 1, DATA_TAG)
            elif pattern == "pingping":
                raw_exchange(MPI, comm, n, out, into, 1)
            elif pattern == "put":
                rput, flush = win.Rput, win.Flush
                if submission:
                    for _ in range(n):
                        rput(out, 1, target).Wait()
                    flush(1)
                else:
                    for _ in range(n):
                        request = rput(out, 1, target)
                        flush(1)
                        request.Wait()
            elif pattern == "get":
                rget = win.Rget
                for _ in range(n):
                    rget(into, 1, target).Wait()
            elif pattern == "rate":
                issend, irecv, waitall = comm.Issend, comm.Irecv, MPI.Request.Waitall
                window, acknowledgement = self.window, self.ack
                for _ in range(n):
                    acknowledged = irecv(acknowledgement, 1, WINDOW_TAG)
                    waitall([issend(out, 1, DATA_TAG) for _ in range(window)])
                    acknowledged.Wait()
            else:  # wait
                for _ in range(n):
                    comm.Recv(into, 1, DATA_TAG)

        async def timed(n: int) -> Sample:
            self._start(n, size)
            start = clock()
            loop(n)
            return Sample.since(n, start)

        return timed

    # -- rank 1 ------------------------------------------------------------------------

    def serve_phase(self) -> None:
        comm, MPI = self.comm, self.MPI
        send = comm.Send if self.submission else comm.Ssend
        while (batch := self._next_batch()) is not None:
            n, out, into = batch
            if self.pattern == "pingpong":
                recv = comm.Recv
                for _ in range(n):
                    recv(into, 0, DATA_TAG)
                    send(out, 0, DATA_TAG)
            elif self.pattern == "pingping":
                raw_exchange(MPI, comm, n, out, into, 0)
            elif self.pattern == "wait":
                for _ in range(n):
                    time.sleep(self.idle)
                    comm.Ssend(out, 0, DATA_TAG)
            elif self.pattern == "rate":
                irecv, waitall = comm.Irecv, MPI.Request.Waitall
                for _ in range(n):
                    waitall([irecv(into, 0, DATA_TAG) for _ in range(self.window)])
                    comm.Send(self.ack, 0, WINDOW_TAG)
            # put, get: the next blocking Recv of a header keeps MPI progressing


def raw_exchange(MPI: Any, comm: Any, n: int, out: memoryview, into: memoryview,
                 peer: int) -> None:
    """`n` ping-ping exchanges in raw MPI: Irecv + Isend + Waitall."""
    requests: list[Any] = [None, None]
    irecv, isend, waitall = comm.Irecv, comm.Isend, MPI.Request.Waitall
    for _ in range(n):
        requests[0] = irecv(into, peer, DATA_TAG)
        requests[1] = isend(out, peer, DATA_TAG)
        waitall(requests)


# -- the asyncio floor -----------------------------------------------------------------------


async def await_request(request: Any) -> None:
    """Await an MPI request the cheapest way an event loop can: test it from a loop
    callback until it completes."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def test() -> None:
        if request.Test():
            future.set_result(None)
        else:
            loop.call_soon(test)

    loop.call_soon(test)
    await future


class _Poller:
    """Await many MPI requests through one loop callback, testing them as mate's engine
    does: ``Testsome`` over the oldest `FRONT` outstanding, over all of them when
    those did not move; again while a call completes some (MPICH takes in one message
    per call), after a bare progress call for each of the oldest `FRONT` but one;
    and back on the next turn of the loop while any are left."""

    def __init__(self, MPI: Any) -> None:
        from mate.transports.mpi.progress import FRONT  # the engine's (it needs mpi4py)

        self.front = FRONT
        self.testsome = MPI.Request.Testsome
        self.loop = asyncio.get_running_loop()
        self.requests: list[Any] = []  # in posting order, completed ones included ...
        self.futures: list[asyncio.Future[None]] = []
        self.oldest = 0  # ... until every one before this has completed
        self.moved = False  # the last call completed some: messages flow

    def wait(self, request: Any) -> asyncio.Future[None]:
        future = self.loop.create_future()
        if not self.requests:
            self.loop.call_soon(self._test)
        self.requests.append(request)
        self.futures.append(future)
        return future

    def _test(self) -> None:
        requests, futures, testsome, front = self.requests, self.futures, self.testsome, self.front
        while self.oldest < len(requests):
            oldest = self.oldest
            if self.moved:  # the newest request: the one least likely complete
                progress = requests[-1].Get_status
                for _ in range(min(front, len(requests) - oldest) - 1):
                    progress()
            done = testsome(requests[oldest:oldest + front]) or testsome(requests[oldest:])
            self.moved = bool(done)
            if not done:
                break
            for index in done:
                futures[oldest + index].set_result(None)
            while self.oldest < len(futures) and futures[self.oldest].done():
                self.oldest += 1
        if self.oldest < len(requests):
            self.loop.call_soon(self._test)
        else:
            requests.clear()
            futures.clear()
            self.oldest = 0


class FloorBench(_MpiPhases):
    """One rank's side of the floor ping-pong, ping-ping or rate, on a communicator of
    its own: the pattern mate's runs, in the same order (a ping or an answer sent
    before the next receive is posted; in a ping-ping, the receive posted first),
    each request awaited through loop callbacks."""

    def __init__(self, pattern: str, buffers: Buffers, window: int = DEFAULT_WINDOW) -> None:
        super().__init__(buffers)
        self.pattern = pattern
        self.window = window

    def teardown(self) -> None:
        self.comm.Free()

    def batch(self, size: int) -> Batch:
        comm, out, into = self.comm, self.buffers.outs[size], self.buffers.intos[size]
        window, acknowledgement = self.window, self.ack

        exchange = _floor_ping if self.pattern == "pingpong" else _floor_exchange

        async def timed(n: int) -> Sample:
            self._start(n, size)
            start = clock()
            for _ in range(n):
                await exchange(comm, out, into, 1)
            return Sample.since(n, start)

        async def rate(n: int) -> Sample:
            poller = _Poller(self.MPI)
            issend, irecv, wait = comm.Issend, comm.Irecv, poller.wait
            self._start(n, size)
            start = clock()
            for _ in range(n):
                acknowledged = wait(irecv(acknowledgement, 1, WINDOW_TAG))
                sends = [wait(issend(out, 1, DATA_TAG)) for _ in range(window)]
                for future in sends:
                    await future
                await acknowledged
            return Sample.since(n, start)

        return rate if self.pattern == "rate" else timed

    async def serve_phase(self) -> None:
        comm = self.comm
        poller = _Poller(self.MPI)
        while (batch := self._next_batch()) is not None:
            n, out, into = batch
            if self.pattern == "pingpong":
                await _floor_answer(comm, n, out, into)
                continue
            for _ in range(n):
                if self.pattern == "pingping":  # rank 0's loop, mirrored
                    await _floor_exchange(comm, out, into, 0)
                else:  # rate
                    receives = [poller.wait(comm.Irecv(into, 0, DATA_TAG))
                                for _ in range(self.window)]
                    for future in receives:
                        await future
                    await poller.wait(comm.Issend(self.ack, 0, WINDOW_TAG))


async def _floor_ping(comm: Any, out: memoryview, into: memoryview, peer: int) -> None:
    """Send the ping, post the receive of its answer, await both: mate's ping-pong."""
    sent = comm.Issend(out, peer, DATA_TAG)
    incoming = comm.Irecv(into, peer, DATA_TAG)
    await await_request(sent)
    await await_request(incoming)


async def _floor_answer(comm: Any, n: int, out: memoryview, into: memoryview) -> None:
    """Rank 1's `n` answers, as mate's: each sent, then the next ping's receive posted."""
    incoming = comm.Irecv(into, 0, DATA_TAG)
    for i in range(n):
        await await_request(incoming)
        sent = comm.Issend(out, 0, DATA_TAG)
        if i < n - 1:
            incoming = comm.Irecv(into, 0, DATA_TAG)
        await await_request(sent)


async def _floor_exchange(comm: Any, out: memoryview, into: memoryview, peer: int) -> None:
    """Post the receive, await the send, then the receive: mate's ping-ping."""
    incoming = comm.Irecv(into, peer, DATA_TAG)
    await await_request(comm.Issend(out, peer, DATA_TAG))
    await await_request(incoming)
