"""The ibverbs progress modes without a device: which loop call carries a kick, and
the passes an awaiting task runs itself in poll mode."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

import mate.transports.ibverbs.progress as progress_module
from mate.transports.ibverbs.progress import (
    SLICE,
    LoopProgress,
    PollProgress,
    Progress,
    ThreadProgress,
)


class _RecordingLoop(asyncio.AbstractEventLoop):
    """Records how callbacks are scheduled. Like uvloop's loop, it has no `_thread_id`."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def call_soon(self, callback: Callable[..., object], *args: Any,
                  context: Any = None) -> Any:
        self.calls.append("call_soon")
        self.queued = callback

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any,
                             context: Any = None) -> Any:
        self.calls.append("call_soon_threadsafe")


def _make(mode: str, loop: asyncio.AbstractEventLoop) -> Progress:
    if mode == "loop":
        return LoopProgress(loop, -1, lambda: False, lambda: None)
    return PollProgress(loop, -1, lambda: False, lambda: None, lambda: 1, lambda: 0)


@pytest.mark.parametrize("mode", ["loop", "poll"])
def test_a_kick_on_the_loop_thread_is_a_plain_call_soon(mode: str) -> None:
    """The loop's thread is the one that opened the transport, whatever the loop
    records of itself: a kick there never pays the self-pipe of call_soon_threadsafe."""
    loop = _RecordingLoop()
    progress = _make(mode, loop)
    progress.kick()
    progress.kick()  # already kicked: nothing more until the first one has run
    assert loop.calls == ["call_soon"]


@pytest.mark.parametrize("mode", ["loop", "poll"])
def test_a_kick_from_another_thread_wakes_the_loop(mode: str) -> None:
    loop = _RecordingLoop()
    progress = _make(mode, loop)
    other = threading.Thread(target=progress.kick)
    other.start()
    other.join()
    assert loop.calls == ["call_soon_threadsafe"]


class _Passes:
    """A pass that moves at the `moves_at`-th call and then makes `done()` true if
    `completes`, and gives the loop work (`loop_work`) if `wakes`; counts its calls."""

    def __init__(self, moves_at: int, completes: bool = True, wakes: bool = False) -> None:
        self.calls, self.moves_at, self.completes, self.finished = 0, moves_at, completes, False
        self.wakes, self.loop_work = wakes, 0

    def __call__(self) -> bool:
        self.calls += 1
        if self.calls == self.moves_at:
            self.finished = self.completes
            self.loop_work += self.wakes
            return True
        return False

    def done(self) -> bool:
        return self.finished


def _poller(passes: _Passes) -> tuple[PollProgress, _RecordingLoop]:
    loop = _RecordingLoop()
    return PollProgress(loop, -1, passes, lambda: None, lambda: 1, lambda: passes.loop_work), loop


def test_an_awaiting_task_runs_passes_until_what_it_awaits_is_done() -> None:
    passes = _Passes(moves_at=5)
    progress, loop = _poller(passes)
    progress.awaiting(passes.done)
    assert passes.done() and passes.calls == 5
    assert loop.calls == ["call_soon"]  # the poll it queued runs when the loop turns


def test_an_awaiting_task_stops_at_a_pass_that_gave_the_loop_work() -> None:
    """A pass that woke another task or queued a handler: the loop turns at once."""
    passes = _Passes(moves_at=3, completes=False, wakes=True)
    progress, _ = _poller(passes)
    progress.awaiting(passes.done)
    assert not passes.done() and passes.calls == 3


def test_an_awaiting_task_goes_on_past_a_pass_that_gave_the_loop_nothing() -> None:
    """A pass that ended what nobody awaits yet (the receive beside an awaited send)
    leaves the loop nothing to do: the task's passes go on, until the slice is over."""
    passes = _Passes(moves_at=3, completes=False)
    progress, _ = _poller(passes)
    progress.awaiting(passes.done)
    assert not passes.done() and passes.calls > 3


def test_an_awaiting_task_holds_the_loop_at_most_a_slice_since_it_turned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]

    def tick() -> float:
        clock[0] += SLICE / 10
        return clock[0]

    monkeypatch.setattr(progress_module.time, "monotonic", tick)
    passes = _Passes(moves_at=10**6)
    progress, _ = _poller(passes)
    progress.awaiting(passes.done)  # queues the poll at one tick, gives up a slice later
    assert 5 <= passes.calls <= 10
    calls = passes.calls
    progress.awaiting(passes.done)  # the loop has not turned since: no more passes
    assert passes.calls == calls


def test_an_awaiting_task_does_not_spin_while_polling_backs_off() -> None:
    """Once a poll found nothing for SPIN, the next one is a timer: what the task awaits
    is not expected soon, and the task leaves waiting to the loop."""
    passes = _Passes(moves_at=10**6)
    progress, loop = _poller(passes)
    loop.call_later = lambda delay, callback, *args: None  # type: ignore[method-assign]
    progress.kick()
    progress._last_moved -= 1.0  # nothing moved for a second
    loop.queued()  # the queued poll runs, finds nothing, and backs off
    calls = passes.calls
    progress.awaiting(passes.done)
    assert passes.calls == calls


def test_a_kick_after_stop_writes_to_no_descriptor() -> None:
    """Thread mode wakes its thread through an eventfd, which `stop` closes. A kick
    that comes later (a call from another thread racing the shutdown) must not
    write to that descriptor's number, which the process may have given to a file
    of its own meanwhile: in one CI run a pipe opened later read a stray write."""
    channel_r, channel_w = os.pipe()  # stands for the completion channel
    progress = ThreadProgress(asyncio.new_event_loop(), channel_r, lambda: False,
                              lambda: None)
    progress.start()
    wake = progress._wake
    progress.stop()
    reused = os.eventfd(0, os.EFD_NONBLOCK)  # the lowest free number: the wake's
    try:
        assert reused == wake
        progress.kick()
        with pytest.raises(BlockingIOError):  # nothing written
            os.eventfd_read(reused)
    finally:
        for fd in (reused, channel_r, channel_w):
            os.close(fd)
