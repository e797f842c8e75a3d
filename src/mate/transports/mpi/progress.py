"""Progress for the MPI transport: outstanding requests, tested and acted upon.

MPI has no completion callbacks, so someone must test requests (thesis §5.2).
The `Engine` keeps every outstanding request with an *action* to run when it
completes, and one `test()` pass runs `MPI_Testsome` over them all. Who calls
`test()` is the progress mode:

* ``poll``: a callback on the event loop, rescheduled with `call_soon` while
  user messages are outstanding (lowest latency); after `SPIN` seconds without
  progress it backs off to timers of growing delay (up to `MAX_BACKOFF`, and
  `LONG_IDLE_BACKOFF` once nothing moved for `LONG_IDLE`), and
  with only the transport's own standing receives left it polls every
  `IDLE_INTERVAL`, so that an idle rank does not spin but still serves peers'
  one-sided requests. A rank whose exposed memory peers use through native RMA
  is *hot* and never backs off (see `hot`).
* ``thread``: a progress thread (MPI_THREAD_MULTIPLE) runs the passes, with the
  same backoff done by sleeping, and sleeps on a condition when nothing at all
  is outstanding. Actions run in that thread.
* ``manual``: passes run only from `world.progress()` and while a task awaits a
  message (`drive_until`).

Everything that touches a request after it was posted (testing, cancelling)
happens in the progress context (`call`), because MPI forbids two threads to
use one request at once. Posting itself (Isend, Irecv, Rput) may happen on any
thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

Action = Callable[[MPI.Status, "MPI.Exception | None"], None]


class _Entry:
    """What the engine knows of one outstanding request."""

    __slots__ = ("action", "orphan", "receive", "standing")

    def __init__(self, action: Action, standing: bool, receive: bool) -> None:
        self.action = action
        self.standing = standing  # the transport's own, not a user message
        self.receive = receive  # receives are the only requests ever cancelled
        self.orphan = False  # an abandoned send, left for MPI to finish

MODES = ("poll", "thread", "manual")
SPIN = 0.002  # seconds of busy polling after the last progress
SLICE = 500e-6  # longest busy poll inside one loop callback
MAX_BACKOFF = 0.001  # longest pause between passes while user messages are outstanding,
LONG_IDLE = 0.05  # ... until this long without progress,
LONG_IDLE_BACKOFF = 0.004  # ... when waiting gets cheaper still (a message waited on for long)
IDLE_INTERVAL = 0.005  # pause between passes when only standing receives are outstanding


class Engine:
    def __init__(self, loop: asyncio.AbstractEventLoop, mode: str) -> None:
        self.mode = mode
        self._loop = loop
        self._requests: list[MPI.Request] = []
        self._entries: list[_Entry] = []
        self._statuses: list[MPI.Status] = []  # scratch for Testsome, one per request
        self._standing = 0  # requests that are the transport's own, always outstanding
        self._inbox: list[Callable[[], None]] = []  # work handed to the progress context
        self._after_pass: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._last_progress = time.monotonic()
        self._backoff = 0.0
        self._scheduled: asyncio.Handle | None = None
        self._scheduled_when = 0.0
        self._drivers: list[Callable[[], bool]] = []  # manual mode: awaited messages' done()
        # True while peers may be doing passive-target RMA on this rank: MPICH moves
        # those operations only inside this rank's MPI calls, so it must not back off.
        self.hot: Callable[[], bool] = lambda: False
        self._thread: threading.Thread | None = None
        if mode == "thread":
            self._thread = threading.Thread(target=self._run_thread, name="mate-mpi-progress",
                                            daemon=True)
            self._thread.start()

    # -- adding work (any thread) --------------------------------------------------------

    def add(self, request: MPI.Request, action: Action, *, standing: bool = False,
            receive: bool = False) -> None:
        """Test `request` from now on; run `action(status, error)` when it completes."""
        entry = _Entry(action, standing, receive)
        if self._thread is None:  # poll and manual: everything runs on the loop's thread
            self._add(request, entry)
            if self.mode == "poll":
                self._schedule(0.0)
        else:
            self.call(self._add, request, entry)

    def _add(self, request: MPI.Request, entry: _Entry) -> None:
        self._requests.append(request)
        self._entries.append(entry)
        self._statuses.append(MPI.Status())
        if entry.standing:
            self._standing += 1
        self._last_progress = time.monotonic()
        self._backoff = 0.0

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` in the progress context, before the next pass."""
        with self._lock:
            self._inbox.append(lambda: fn(*args))
            if self._thread is not None:
                self._wake.notify()
        if self.mode == "poll":
            self._schedule(0.0)

    def after_pass(self, fn: Callable[[], None]) -> None:
        """Run `fn()` at the end of the next pass (progress context only)."""
        self._after_pass.append(fn)

    @property
    def user_outstanding(self) -> int:
        return len(self._requests) - self._standing

    # -- one pass ------------------------------------------------------------------------

    def test(self) -> bool:
        """Run queued calls, test every request, run the actions; True if anything moved."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for fn in inbox:
            fn()
        moved = bool(inbox)
        if self._requests:
            try:
                done = MPI.Request.Testsome(self._requests, self._statuses)
                error = None
            except MPI.Exception as exc:
                # MPI_ERR_IN_STATUS (e.g. a truncated receive): the index list is lost, but
                # the completed requests were set to MPI_REQUEST_NULL, and MPICH and Open
                # MPI both report completions in ascending index order.
                done = [i for i, r in enumerate(self._requests) if r == MPI.REQUEST_NULL]
                error = exc
            if done:
                moved = True
                self._finish(done, error)
        if self._after_pass:
            hooks, self._after_pass = self._after_pass, []
            for fn in hooks:
                fn()
            moved = True
        if moved:
            self._last_progress = time.monotonic()
            self._backoff = 0.0
        return moved

    def _finish(self, done: list[int], error: MPI.Exception | None) -> None:
        # Testsome's k-th status belongs to its k-th index, not to request k.
        finished = [(self._entries[i], MPI.Status(self._statuses[k])) for k, i in enumerate(done)]
        # Remove the finished entries, highest index first, by moving the last entry in.
        for i in sorted(done, reverse=True):
            last = len(self._requests) - 1
            self._requests[i] = self._requests[last]
            self._entries[i] = self._entries[last]
            del self._requests[last], self._entries[last], self._statuses[last]
        for entry, status in finished:
            failed = error if error is not None and status.Get_error() != MPI.SUCCESS else None
            if entry.standing:
                self._standing -= 1
            entry.action(status, failed)

    # -- poll mode and manual awaiting: passes as loop callbacks ----------------------------

    def _schedule(self, delay: float) -> None:
        """Make sure a pass runs within `delay` seconds (sooner than any pass planned)."""
        if self._stopping:
            return
        when = time.monotonic() + delay
        if self._scheduled is not None:
            if self._scheduled_when <= when:
                return
            self._scheduled.cancel()
        self._scheduled_when = when
        if delay <= 0:
            self._scheduled = self._loop.call_soon(self._poll)
        else:
            self._scheduled = self._loop.call_later(delay, self._poll)

    def _poll(self) -> None:
        self._scheduled = None
        # Going round the event loop costs a system call; while user messages are
        # outstanding, test again for up to SLICE before yielding to other callbacks.
        if (not self.test() and self.user_outstanding
                and time.monotonic() - self._last_progress < SPIN):  # not once backing off
            give_up = time.monotonic() + SLICE
            while not self.test() and time.monotonic() < give_up:
                pass
        if self.mode == "manual":
            self._drivers = [d for d in self._drivers if not d()]
            if self._drivers:
                self._schedule(self._pause())
        elif self.user_outstanding or self._inbox or self.hot():
            self._schedule(self._pause())
        elif self._requests:
            self._schedule(IDLE_INTERVAL)

    def _pause(self) -> float:
        idle = time.monotonic() - self._last_progress
        if idle < SPIN or self.hot():
            return 0.0
        cap = MAX_BACKOFF if idle < LONG_IDLE else LONG_IDLE_BACKOFF
        self._backoff = min(cap, max(self._backoff * 2, 50e-6))
        return self._backoff

    def start(self) -> None:
        """Begin polling (poll mode); called once the standing receives are posted."""
        if self.mode == "poll":
            self._schedule(0.0)

    def drive_until(self, done: Callable[[], bool]) -> None:
        """Manual mode: poll on the loop until `done()` (a task awaits a message)."""
        if self.mode == "manual":
            self._drivers.append(done)
            self._schedule(0.0)
        elif self.mode == "poll":
            self._schedule(0.0)

    # -- thread mode ---------------------------------------------------------------------

    def _run_thread(self) -> None:
        while True:
            with self._lock:
                while not self._inbox and not self._requests and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
            self.test()
            if self._inbox:
                continue
            pause = self._pause() if self.user_outstanding or self.hot() else IDLE_INTERVAL
            if pause:
                with self._lock:
                    if not self._inbox and not self._stopping:
                        self._wake.wait(pause)
            else:
                os.sched_yield()  # let the loop's thread have the GIL (sleep(0) costs ~60 us here)

    # -- shutdown ------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop driving progress; the progress thread, if any, has ended on return."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None

    def drain(self, deadline: float) -> None:
        """After `stop`: run passes on the caller's thread until no request that can
        still finish is left (orphaned sends excepted) or the deadline passes."""
        while time.monotonic() < deadline:
            self.test()
            if not self._inbox and all(entry.orphan for entry in self._entries):
                return

    def cancel_receives(self, *, standing: bool) -> None:
        """Cancel the outstanding user receives (and the standing ones if `standing`)."""
        for request, entry in zip(self._requests, self._entries, strict=True):
            if entry.receive and (standing or not entry.standing):
                request.Cancel()

    def disown(self, request: MPI.Request) -> None:
        """Keep testing `request` (so MPI can free it) but stop counting it as user work."""
        for i, candidate in enumerate(self._requests):
            if candidate is request:
                entry = self._entries[i]
                self._standing += not entry.standing
                entry.standing = entry.orphan = True
                return
