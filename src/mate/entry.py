"""The one way into the event loop from other threads (in the manner of trio's entry queue).

A progress thread or a timeout thread that has work for the loop's thread
(reports to apply, awaiters to wake) queues it here. Everything queued before
the loop gets to it runs in one loop callback: one lock to queue a batch and
one `call_soon_threadsafe` per batch, however many items it holds. Each item
runs guarded: an exception is logged (logger ``mate``) and passed to the
loop's exception handler, and the rest of the batch still runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Final

from librt.threading import Lock

logger = logging.getLogger("mate")

_Item = tuple[Callable[..., None], tuple[Any, ...]]
# Bound once: every report asks which thread it is on, and a compiled lookup on the
# module costs more than the call.
_get_ident: Final = threading.get_ident


class EntryQueue:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loop_thread = _get_ident()  # made on the loop's thread
        self._lock = Lock()
        self._items: list[_Item] = []

    def on_loop_thread(self) -> bool:
        return _get_ident() == self._loop_thread

    def run_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the loop's thread soon (from any thread)."""
        with self._lock:
            self._items.append((fn, args))
            first = len(self._items) == 1
        if first:
            self._hop()

    def run_each_soon(self, fn: Callable[[Any], None], arguments: Iterable[Any]) -> None:
        """`run_soon(fn, a)` for each `a`, in order, under one lock."""
        with self._lock:
            first = not self._items
            self._items.extend((fn, (argument,)) for argument in arguments)
            first = first and bool(self._items)
        if first:
            self._hop()

    def call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` now if on the loop's thread, else soon."""
        if self.on_loop_thread():
            fn(*args)
        else:
            self.run_soon(fn, *args)

    def _hop(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is left to run them
            with self._lock:
                self._items.clear()

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for fn, args in items:
            try:
                fn(*args)
            except Exception as exc:
                logger.error("mate: %r failed on the loop", fn, exc_info=exc)
                self._loop.call_exception_handler(
                    {"message": f"mate: {fn!r} failed on the loop", "exception": exc})
