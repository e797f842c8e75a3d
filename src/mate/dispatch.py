"""Where and when schedule handlers run.

Handlers run "eventually", one at a time, never inside the call that posted
their message (thesis §5.1.4). Two places are offered:

* ``handlers="loop"`` (default): each handler is queued on the event loop with
  `call_soon`, so handlers run on the loop's thread, in event order,
  serialised by the loop itself (the world applies every report on the loop's
  thread in this mode, so `dispatch` is called there).
* ``handlers="progress"``: a transport with a progress thread reports events
  from that thread (and timeouts come from the timeout thread), and handlers
  run there at once, serialised by a lock, concurrently with whatever the loop
  is doing. The application can answer a request while its loop is busy
  computing.

A handler that returns a coroutine (an ``async def`` handler) has the
coroutine run as a task on the loop; the world owns those tasks and cancels
them at shutdown. A handler that raises is logged on the ``mate`` logger and
passed to the loop's exception handler; progress and other handlers go on.
After shutdown no handler starts.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Coroutine
from typing import Any

from librt.threading import Lock

from mate.entry import EntryQueue
from mate.schedule import Handler, Receipt

logger = logging.getLogger("mate")

MODES = ("loop", "progress")


class Dispatcher:
    def __init__(self, loop: asyncio.AbstractEventLoop, mode: str, entry: EntryQueue) -> None:
        self._loop = loop
        self._entry = entry
        self._run_at_once = mode == "progress"
        self._serial = Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False

    def dispatch(self, handler: Handler, receipt: Receipt, data: Any) -> None:
        if self._run_at_once:
            with self._serial:
                self._run(handler, receipt, data)
        else:
            self._loop.call_soon(self._run, handler, receipt, data)

    def _run(self, handler: Handler, receipt: Receipt, data: Any) -> None:
        if self.closed:
            return
        try:
            result = handler(receipt, data)
        except Exception as exc:
            self._report(exc, handler, receipt)
            return
        if inspect.iscoroutine(result):
            self._entry.call_on_loop(self._start_task, result, handler, receipt)

    def _start_task(self, coro: Coroutine[Any, Any, Any], handler: Handler,
                    receipt: Receipt) -> None:
        if self.closed:
            coro.close()
            return
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(t, handler, receipt))

    def _task_done(self, task: asyncio.Task[Any], handler: Handler, receipt: Receipt) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            assert exc is not None
            self._report(exc, handler, receipt)

    def _report(self, exc: BaseException, handler: Handler, receipt: Receipt) -> None:
        name = getattr(handler, "__qualname__", repr(handler))
        text = f"mate: {receipt.event.value if receipt.event else 'event'} handler {name} raised"
        logger.error(text, exc_info=exc)
        context = {"message": text, "exception": exc, "receipt": receipt}
        self._entry.call_on_loop(self._loop.call_exception_handler, context)

    async def close(self) -> None:
        """Start no more handlers; cancel the handler tasks and wait for them.

        Handlers already queued on the loop belong to events that happened before
        shutdown (the world ended its outstanding messages without events first):
        they run now, or awaiters and handlers would disagree on those messages.
        """
        await asyncio.sleep(0)  # one loop pass runs every callback queued before it
        self.closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
