"""The ibverbs progress modes' kicks, without a device: which loop call carries them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from mate.transports.ibverbs.progress import LoopProgress, PollProgress, Progress


class _RecordingLoop(asyncio.AbstractEventLoop):
    """Records how callbacks are scheduled. Like uvloop's loop, it has no `_thread_id`."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def call_soon(self, callback: Callable[..., object], *args: Any,
                  context: Any = None) -> Any:
        self.calls.append("call_soon")

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any,
                             context: Any = None) -> Any:
        self.calls.append("call_soon_threadsafe")


def _make(mode: str, loop: asyncio.AbstractEventLoop) -> Progress:
    if mode == "loop":
        return LoopProgress(loop, -1, lambda: False, lambda: None)
    return PollProgress(loop, -1, lambda: False, lambda: None, lambda: 1)


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
