"""Who runs the ibverbs transport's progress passes, and when (thesis §5.3.3).

A *pass* (`Transport.run_pass`) collects what the completion channel and the
completion queues hold, feeds the work completions to the protocol engine,
and hands the reports to the core at once. The three modes only differ in
who calls it:

* `LoopProgress` (``loop``): the completion channel's file descriptor is
  watched by the event loop (`loop.add_reader`). Progress is event-driven: no
  thread, no spinning; an idle rank costs nothing.
* `PollProgress` (``poll``): as ``loop``, and while user messages are
  outstanding the loop also polls the CQs from `call_soon` callbacks, busy
  for `SPIN` seconds after the last progress, then with growing pauses (up
  to `MAX_BACKOFF`); the channel's reader stays on, so a poller that backed
  off still wakes at once when something arrives. While it is busy, a task
  that awaits an operation runs passes itself first (`awaiting`), for at
  most `SLICE` since the loop last turned, until `done()` or until a pass
  gives the loop work (the core's `loop_work` moves: another task woken, a
  handler queued): a reply that comes meanwhile costs no turn of the loop,
  nor does a message that ends awaited by nobody yet.
* `ThreadProgress` (``thread``): a progress thread blocks in `select` on the
  completion channel (and an eventfd that `kick` and `stop` write); passes
  and, with ``handlers="progress"``, handlers run there.

Three calls tell a mode what the transport did. `posted()`: work was started.
Its completions will make the channel readable, so only ``poll`` acts (it
starts polling). `awaiting(done)`: a task awaits until `done()` (only
``poll`` does more than for `posted`). `kick()`: a call left reports (an
eager send's submission, a failure found at post time: the core never takes
reports from inside `post`); they are delivered soon by `deliver`, which
hands them over without touching the device (by a full pass in ``thread``
mode, where handlers run on the progress thread).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Final

logger = logging.getLogger("mate")

SPIN: Final = 0.002  # seconds of busy polling after the last progress (poll mode)
MAX_BACKOFF: Final = 0.001  # longest pause between polls while messages are outstanding
SLICE: Final = 500e-6  # longest an awaiting task's passes hold the loop since it turned

#: A pass: returns True if it moved anything.
Pass = Callable[[], bool]
_get_ident: Final = threading.get_ident


class Progress(abc.ABC):
    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, run_pass: Pass,
                 deliver: Callable[[], None]) -> None:
        self.loop = loop
        self.fd = fd
        self.run_pass = run_pass
        self.deliver = deliver

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def kick(self) -> None:
        """Reports are waiting: have them delivered soon (from any thread)."""

    def posted(self) -> None:  # noqa: B027 (most modes need do nothing)
        """Work was started; the channel will tell when it completes."""

    def awaiting(self, done: Callable[[], bool]) -> bool:
        """A task awaits until `done()` (on the loop's thread); True to have it give
        the loop one turn and ask again (`Transport.awaiting`)."""
        self.posted()
        return False

    @abc.abstractmethod
    def stop(self) -> None:
        """No pass runs after this returns (called on the loop's thread)."""

    def _guarded(self) -> bool:
        try:
            return self.run_pass()
        except Exception:  # a bug in a pass must not stop progress for good
            logger.exception("mate: ibverbs progress pass failed")
            return False


class LoopProgress(Progress):
    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, run_pass: Pass,
                 deliver: Callable[[], None]) -> None:
        super().__init__(loop, fd, run_pass, deliver)
        self._kicked = False
        self._stopped = False
        # Made on the loop's thread (the transport is opened there). Not the loop's own
        # record of it: asyncio's is private, and uvloop has none.
        self._loop_thread = _get_ident()

    def start(self) -> None:
        self.loop.add_reader(self.fd, self._guarded)

    def kick(self) -> None:
        if self._kicked or self._stopped:
            return
        self._kicked = True
        if self._on_loop_thread():
            self.loop.call_soon(self._kicked_pass)
        else:
            self.loop.call_soon_threadsafe(self._kicked_pass)

    def _on_loop_thread(self) -> bool:
        return _get_ident() == self._loop_thread

    def _kicked_pass(self) -> None:
        self._kicked = False
        if not self._stopped:
            self.deliver()

    def stop(self) -> None:
        self._stopped = True
        self.loop.remove_reader(self.fd)


class PollProgress(LoopProgress):
    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, run_pass: Pass,
                 deliver: Callable[[], None], outstanding: Callable[[], int],
                 loop_work: Callable[[], int]) -> None:
        super().__init__(loop, fd, run_pass, deliver)
        self.outstanding = outstanding
        self.loop_work = loop_work  # the core's `Sink.loop_work`
        self._polling = False
        self._last_moved = 0.0
        self._pause = 0.0
        self._soon_at: float | None = None  # when the poll was queued with call_soon, if it was

    def posted(self) -> None:
        self.kick()

    def awaiting(self, done: Callable[[], bool]) -> bool:
        self.kick()
        if self._soon_at is None:
            return False  # backing off: what the task awaits is not expected soon
        give_up = self._soon_at + SLICE
        mark = self.loop_work()
        while not done() and time.monotonic() < give_up:
            if self._guarded():
                self._last_moved, self._pause = time.monotonic(), 0.0
                if self.loop_work() != mark:
                    return False
        # Given up for the loop's turn, in which the queued poll runs: while passes
        # spin, the task yields that one turn and spins again (as the MPI transport's).
        return not done() and time.monotonic() - self._last_moved < SPIN

    def kick(self) -> None:  # a poll is a pass, which delivers the reports too
        if self._polling or self._stopped:
            return
        self._polling = True
        self._last_moved = self._soon_at = time.monotonic()
        self._pause = 0.0
        if self._on_loop_thread():
            self.loop.call_soon(self._poll)
        else:
            self.loop.call_soon_threadsafe(self._poll)

    def _poll(self) -> None:
        self._soon_at = None
        if self._stopped:
            return
        now = time.monotonic()
        if self._guarded():
            self._last_moved, self._pause = now, 0.0
        if not self.outstanding():
            self._polling = False  # idle: the channel's reader wakes the next pass
            return
        if now - self._last_moved < SPIN:
            self._soon_at = now
            self.loop.call_soon(self._poll)
        else:
            self._pause = min(MAX_BACKOFF, max(self._pause * 2, 50e-6))
            self.loop.call_later(self._pause, self._poll)


class ThreadProgress(Progress):
    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, run_pass: Pass,
                 deliver: Callable[[], None]) -> None:
        super().__init__(loop, fd, run_pass, deliver)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Held to write the eventfd and to close it: a kick racing `stop` (from another
        # thread) must not write to its number once closed, which may be reused by then.
        self._wake_lock = threading.Lock()
        self._stopping = False
        self._worker = threading.Thread(target=self._run, name="mate-ibverbs-progress",
                                        daemon=True)

    def start(self) -> None:
        self._worker.start()

    def kick(self) -> None:
        with self._wake_lock:
            if self._wake >= 0:  # -1 once stopped
                os.eventfd_write(self._wake, 1)

    def _run(self) -> None:
        wake = self._wake  # open while this thread runs (`stop` joins it, or runs on it)
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.register(wake, select.POLLIN)
        while not self._stopping:
            ready = poller.poll()
            if any(fd == wake for fd, _ in ready):
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(wake)
            if not self._stopping:
                self._guarded()

    def stop(self) -> None:
        self._stopping = True
        self.kick()
        if self._worker.is_alive() and self._worker is not threading.current_thread():
            self._worker.join()
        with self._wake_lock:
            if self._wake >= 0:
                os.close(self._wake)
                self._wake = -1
