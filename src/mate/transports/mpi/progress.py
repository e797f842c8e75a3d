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
thread. In manual mode a cancel (a timeout's, say) drives passes until it has
taken effect (`call_at_once`), not until the next `world.progress()`: timeouts
are the core's clock, not progress.

Sends that timed out but that MPI still holds (*orphans*, see transport.py)
are kept apart from the live requests and tested only every
`ORPHAN_INTERVAL`: a `Testsome` over 20,000 forgotten requests costs ~1.5 ms,
which no pass for live messages should pay.

Nothing that goes wrong inside a pass stops progress: every queued call,
action and end-of-pass hook runs guarded, and an exception is handed to
`on_error` with the message it concerned (the transport fails that message),
so the progress thread survives and other messages carry on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

logger = logging.getLogger("mate")

Action = Callable[[MPI.Status, "MPI.Exception | None"], None]
#: Told of an exception raised inside the progress context, with the object
#: (usually a message) that the failed call or action was about, if any.
ErrorHandler = Callable[[BaseException, Any], None]


class _Entry:
    """What the engine knows of one outstanding request."""

    __slots__ = ("action", "index", "owner", "receive", "request", "standing")

    def __init__(self, request: MPI.Request, action: Action, owner: Any, standing: bool,
                 receive: bool) -> None:
        self.request = request
        self.action = action
        self.owner = owner  # what the action is about: failed if the action raises
        self.standing = standing  # the transport's own, not a user message
        self.receive = receive  # receives are the only requests ever cancelled
        self.index = -1  # position in the live or the orphan list

MODES = ("poll", "thread", "manual")
SPIN = 0.002  # seconds of busy polling after the last progress
SLICE = 500e-6  # longest busy poll inside one loop callback
MAX_BACKOFF = 0.001  # longest pause between passes while user messages are outstanding,
LONG_IDLE = 0.05  # ... until this long without progress,
LONG_IDLE_BACKOFF = 0.004  # ... when waiting gets cheaper still (a message waited on for long)
IDLE_INTERVAL = 0.005  # pause between passes when only standing receives are outstanding
ORPHAN_INTERVAL = 0.05  # how often orphaned sends are tested (so MPI can free them)


class _Requests:
    """Requests with their entries, in two arrays for `MPI_Testsome`; O(1) removal."""

    def __init__(self) -> None:
        self.requests: list[MPI.Request] = []
        self.entries: list[_Entry] = []
        self.statuses: list[MPI.Status] = []  # scratch for Testsome, one per request

    def __len__(self) -> int:
        return len(self.requests)

    def holds(self, entry: _Entry) -> bool:
        i = entry.index
        return 0 <= i < len(self.entries) and self.entries[i] is entry

    def add(self, entry: _Entry) -> None:
        entry.index = len(self.requests)
        self.requests.append(entry.request)
        self.entries.append(entry)
        self.statuses.append(MPI.Status())

    def remove(self, entry: _Entry) -> None:
        """Take `entry` out by moving the last entry into its place."""
        i, last = entry.index, len(self.requests) - 1
        moved = self.entries[last]
        self.requests[i], self.entries[i] = moved.request, moved
        moved.index = i
        del self.requests[last], self.entries[last], self.statuses[last]

    def testsome(self) -> tuple[list[tuple[_Entry, MPI.Status]], MPI.Exception | None]:
        """The entries whose requests completed (now removed), with their statuses."""
        try:
            done = MPI.Request.Testsome(self.requests, self.statuses)
            error = None
        except MPI.Exception as exc:
            # MPI_ERR_IN_STATUS (e.g. a truncated receive): the index list is lost, but
            # the completed requests were set to MPI_REQUEST_NULL, and MPICH and Open
            # MPI both report completions in ascending index order.
            done = [i for i, r in enumerate(self.requests) if r == MPI.REQUEST_NULL]
            error = exc
        if not done:
            return [], None
        # Testsome's k-th status belongs to its k-th index, not to request k.
        finished = [(self.entries[i], MPI.Status(self.statuses[k])) for k, i in enumerate(done)]
        for i in sorted(done, reverse=True):  # highest first: moves never touch a done one
            self.remove(self.entries[i])
        return finished, error


class Engine:
    def __init__(self, loop: asyncio.AbstractEventLoop, mode: str,
                 on_error: ErrorHandler, on_pass_end: Callable[[], None]) -> None:
        self.mode = mode
        self._loop = loop
        self._on_error = on_error
        self._on_pass_end = on_pass_end  # the transport hands the pass's reports over
        self._live = _Requests()
        self._orphans = _Requests()  # abandoned sends, left for MPI to finish
        self._next_orphan_test = 0.0
        self._standing = 0  # requests that are the transport's own, always outstanding
        # Work handed to the progress context: (function, args, owner).
        self._inbox: list[tuple[Callable[..., None], tuple[Any, ...], Any]] = []
        self._after_pass: list[tuple[Callable[[], None], Any]] = []
        self._passes = 0
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

    def add(self, request: MPI.Request, action: Action, *, owner: Any = None,
            standing: bool = False, receive: bool = False) -> _Entry:
        """Test `request` from now on; run `action(status, error)` when it completes.

        The returned entry is the request's handle for `disown`.
        """
        entry = _Entry(request, action, owner, standing, receive)
        if self._thread is None:  # poll and manual: everything runs on the loop's thread
            self._add(entry)
            if self.mode == "poll":
                self._schedule(0.0)
        else:
            self.call(self._add, entry)
        return entry

    def _add(self, entry: _Entry) -> None:
        self._live.add(entry)
        if entry.standing:
            self._standing += 1
        self._last_progress = time.monotonic()
        self._backoff = 0.0

    def call(self, fn: Callable[..., None], *args: Any, owner: Any = None) -> None:
        """Run `fn(*args)` in the progress context, before the next pass."""
        with self._lock:
            self._inbox.append((fn, args, owner))
            if self._thread is not None:
                self._wake.notify()
        if self.mode == "poll":
            self._schedule(0.0)

    def call_at_once(self, fn: Callable[..., None], *args: Any, owner: Any = None) -> None:
        """`call`, and in manual mode drive passes on the loop until it has run and
        one pass more has reported what it started (a cancel: its receive, say)."""
        self.call(fn, *args, owner=owner)
        if self.mode == "manual":
            until = self._passes + 2
            self._drivers.append(lambda: self._passes >= until)
            self._schedule(0.0)

    def after_pass(self, fn: Callable[[], None], *, owner: Any = None) -> None:
        """Run `fn()` at the end of the next pass (progress context only)."""
        self._after_pass.append((fn, owner))

    @property
    def user_outstanding(self) -> int:
        return len(self._live) - self._standing

    @property
    def orphans(self) -> int:
        return len(self._orphans)

    # -- one pass ------------------------------------------------------------------------

    def test(self) -> bool:
        """Run queued calls, test every request, run the actions; True if anything moved."""
        try:
            return self._pass()
        finally:
            self._on_pass_end()

    def _pass(self) -> bool:
        self._passes += 1
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for fn, args, owner in inbox:
            self._guarded(owner, fn, *args)
        moved = bool(inbox)
        if self._live:
            finished, error = self._live.testsome()
            if finished:
                moved = True
                self._run_actions(finished, error)
        if self._orphans and time.monotonic() >= self._next_orphan_test:
            self._next_orphan_test = time.monotonic() + ORPHAN_INTERVAL
            finished, error = self._orphans.testsome()
            self._run_actions(finished, error)
        if self._after_pass:
            hooks, self._after_pass = self._after_pass, []
            for fn, owner in hooks:
                self._guarded(owner, fn)
            moved = True
        if moved:
            self._last_progress = time.monotonic()
            self._backoff = 0.0
        return moved

    def _run_actions(self, finished: list[tuple[_Entry, MPI.Status]],
                     error: MPI.Exception | None) -> None:
        for entry, status in finished:
            failed = error if error is not None and status.Get_error() != MPI.SUCCESS else None
            if entry.standing:
                self._standing -= 1
            self._guarded(entry.owner, entry.action, status, failed)

    def _guarded(self, owner: Any, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self._on_error(exc, owner)

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
        elif self._live:
            self._schedule(IDLE_INTERVAL)
        elif self._orphans:
            self._schedule(ORPHAN_INTERVAL)

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
                while not self._inbox and not self._live and not self._stopping:
                    self._wake.wait(ORPHAN_INTERVAL if self._orphans else None)
                    if self._orphans:
                        break
                if self._stopping:
                    return
            try:
                self.test()
            except Exception as exc:  # a fault in the pass itself: log it, keep progressing
                logger.exception("mate: MPI progress pass failed", exc_info=exc)
            if self._inbox:
                continue
            if self.user_outstanding or self.hot():
                pause = self._pause()
            else:
                pause = IDLE_INTERVAL if self._live else ORPHAN_INTERVAL
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
            if not self._inbox and not self._live:
                return

    def cancel_receives(self, *, standing: bool) -> None:
        """Cancel the outstanding user receives (and the standing ones if `standing`)."""
        for entry in self._live.entries:
            if entry.receive and (standing or not entry.standing):
                entry.request.Cancel()

    def disown(self, entry: _Entry) -> bool:
        """Move a live request to the orphans (tested rarely, so MPI can free it).

        False if it is not live (it completed already). Progress context only.
        """
        if not self._live.holds(entry):
            return False
        self._live.remove(entry)
        if entry.standing:
            self._standing -= 1
        self._orphans.add(entry)
        return True
