"""Deadlines: the one owner of every armed timeout (SPEC §2 "Timeouts", thesis §5.3.4).

A message with a timeout gets a deadline on `time.monotonic()` when it is
posted. `Deadlines` keeps them on a heap (O(log n) a message, no scan of the
outstanding messages) and calls `expire(msg)` once a deadline has passed and
the message is still live; that feeds TIMEOUT to its state machine.

Where the clock runs:

* `LoopDeadlines`: on the event loop, one loop timer for the earliest
  deadline. Loops may keep a cached or coarse clock (uvloop), so a timer is
  only a wake-up: the heap is checked against `time.monotonic()` and a
  deadline not yet due is waited for again. A timeout never fires early.
* `ThreadDeadlines`: on a timeout thread of its own, for worlds whose handlers
  run in the progress thread (``handlers="progress"``): the timeout fires, and
  its handler runs, while the loop's thread computes. Started at the first
  deadline, stopped by `close`.

A message that ends before its deadline leaves a stale entry behind, dropped
when it comes up (or in a compaction, once stale entries are the majority),
so ending a message costs nothing here.
"""

from __future__ import annotations

import abc
import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mate.message import Message

logger = logging.getLogger("mate")

_COMPACT_AT = 1024  # heap size from which stale entries are swept out


class Deadlines(abc.ABC):
    def __init__(self, expire: Callable[[Message], None]) -> None:
        self._expire = expire
        self._heap: list[tuple[float, int, Message]] = []
        self._order = itertools.count()  # ties in posting order; messages do not compare
        self._stale = 0

    @abc.abstractmethod
    def arm(self, msg: Message, deadline: float) -> None:
        """Expire `msg` at `deadline` (monotonic seconds) unless it has ended by then."""

    def ended(self) -> None:
        """A message with a deadline ended: its entry is stale now."""
        self._stale += 1
        if self._stale > _COMPACT_AT and self._stale * 2 > len(self._heap):
            self._compact()

    def _compact(self) -> None:
        self._heap = [entry for entry in self._heap if not entry[2].done()]
        heapq.heapify(self._heap)
        self._stale = 0

    def _due(self, now: float) -> list[Message]:
        """Pop the entries due at `now`; the live messages among them."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            msg = heapq.heappop(self._heap)[2]
            if msg.done():
                self._stale = max(self._stale - 1, 0)
            else:
                due.append(msg)
        return due

    def _fire_guarded(self, msg: Message) -> None:
        try:
            self._expire(msg)
        except Exception as exc:  # a bug must not stop the clock for every other message
            logger.error("mate: expiring %r failed", msg, exc_info=exc)

    @abc.abstractmethod
    def close(self) -> None:
        """Fire nothing more; stop the timer or the thread."""


class LoopDeadlines(Deadlines):
    """Deadlines on the event loop (handlers on the loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, expire: Callable[[Message], None]) -> None:
        super().__init__(expire)
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")  # the monotonic time the timer was set for
        self._closed = False

    def arm(self, msg: Message, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), msg))
        if deadline < self._timer_at:
            self._set_timer(deadline)

    def _set_timer(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = self._loop.call_later(max(deadline - time.monotonic(), 0.0), self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        if self._closed:
            return
        for msg in self._due(time.monotonic()):
            self._fire_guarded(msg)
        if self._heap:  # the next deadline, or one the loop's clock woke us early for
            self._set_timer(self._heap[0][0])

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()


class ThreadDeadlines(Deadlines):
    """Deadlines on a timeout thread (handlers in the progress thread, §5.3.4)."""

    def __init__(self, expire: Callable[[Message], None]) -> None:
        super().__init__(expire)
        self._wake = threading.Condition(threading.Lock())
        self._timer_thread: threading.Thread | None = None
        self._closed = False

    def arm(self, msg: Message, deadline: float) -> None:
        with self._wake:
            if self._closed:
                return
            heapq.heappush(self._heap, (deadline, next(self._order), msg))
            if self._timer_thread is None:
                self._timer_thread = threading.Thread(target=self._run, name="mate-timeouts",
                                                daemon=True)
                self._timer_thread.start()
            elif self._heap[0][2] is msg:  # a new earliest deadline: wait less
                self._wake.notify()

    def ended(self) -> None:
        with self._wake:
            super().ended()

    def _run(self) -> None:
        with self._wake:
            while not self._closed:
                now = time.monotonic()
                due = self._due(now)
                if due:
                    self._wake.release()  # expire without the lock: it may post and arm
                    try:
                        for msg in due:
                            self._fire_guarded(msg)
                    finally:
                        self._wake.acquire()
                elif self._heap:
                    # Capped: a longer wait raises (threading.TIMEOUT_MAX) and would kill
                    # the clock of every message; after the cap it simply waits again.
                    self._wake.wait(min(self._heap[0][0] - now, threading.TIMEOUT_MAX))
                else:
                    self._wake.wait()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._heap.clear()
            self._wake.notify()
            thread = self._timer_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
