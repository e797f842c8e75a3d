"""Bad input to the local transport is refused with InvalidArgument, and big groups stay cheap.

Regression tests for issue 13, defect 8: a released memoryview, a group too big
to build, and a group whose shutdown cost grew with the square of its size.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

import mate
from mate import ANY_SOURCE, FailureReason, State


def released() -> memoryview:
    view = memoryview(bytearray(8))
    view.release()
    return view


CALLS: dict[str, Callable[[mate.World, int], Any]] = {
    "send": lambda world, address: world.send(released(), 1),
    "recv": lambda world, address: world.recv(released(), 1),
    "put": lambda world, address: world.put(released(), 1, address),
    "get": lambda world, address: world.get(released(), 1, address),
    "expose": lambda world, address: world.expose(released()),
}


@pytest.mark.parametrize("call", CALLS)
async def test_a_released_memoryview_is_an_invalid_argument(call: str) -> None:
    async with mate.local.worlds(2) as (a, b):
        region = b.expose(bytearray(8))
        with pytest.raises(mate.InvalidArgument, match=r"buffer cannot be used: .*released"):
            CALLS[call](a, region.address)
        # nothing was started: the world works as before
        inbox = bytearray(2)
        got = b.recv(inbox, 0)
        await a.send(b"ok", 1)
        assert (await got).length == 2 and inbox == b"ok"


async def test_a_view_released_after_posting_does_not_stop_its_message() -> None:
    # The library keeps its own view (SPEC §2, Buffers): releasing the caller's
    # memoryview while the message is in flight must not break the transfer.
    async with mate.local.worlds(2, eager_limit=0) as (a, b):
        inbox = bytearray(4)
        view = memoryview(inbox)
        recv = b.recv(view, 0, 1)  # waits at b for a's send
        await asyncio.sleep(0)
        view.release()
        await asyncio.wait_for(asyncio.gather(a.send(b"one.", 1, 1), recv), 2)
        assert inbox == b"one."

        view = memoryview(bytearray(b"two."))
        send = a.send(view, 1, 2)  # rendezvous (eager_limit=0): parked at b, uncopied
        await asyncio.sleep(0)
        view.release()
        await asyncio.wait_for(asyncio.gather(send, b.recv(inbox, 0, 2)), 2)
        assert inbox == b"two."

        target = bytearray(4)
        view = memoryview(target)
        region = b.expose(view)
        view.release()
        view = memoryview(bytearray(b"put."))
        put = a.put(view, 1, region.address)  # carried out on the next loop pass
        view.release()
        await asyncio.wait_for(put, 2)
        assert target == b"put."


@pytest.mark.parametrize("n", [mate.local.MAX_RANKS + 1, 10**7, mate.PROC_MAX, mate.PROC_MAX + 1])
async def test_a_group_too_big_for_one_process_is_refused(n: int) -> None:
    # Before: MemoryError (or minutes of swapping first), after building part of it.
    with pytest.raises(mate.InvalidArgument, match=f"{n} ranks .* at most {mate.local.MAX_RANKS}"):
        await mate.local.open_worlds(n)
    with pytest.raises(mate.InvalidArgument, match="at most"):
        async with mate.local.worlds(n):
            pass


def post_pending(group: list[mate.World]) -> list[list[mate.Message]]:
    """On each rank: a receive from its left neighbour, a send to its right one
    (rendezvous if eager_limit=0) and a wildcard receive, none of which can match."""
    n = len(group)
    return [[w.recv(bytearray(1), (w.mypid - 1) % n, 1),
             w.send(b"x", (w.mypid + 1) % n, 2),
             w.recv(bytearray(1), ANY_SOURCE, 3)] for w in group]


async def test_shutdown_ends_what_waits_on_a_rank_that_shut_down() -> None:
    async with mate.local.worlds(4, eager_limit=0) as group:
        pending = post_pending(group)
        await asyncio.sleep(0)  # the loop carries them out: the sends park, the receives wait
    # `worlds` shut the ranks down in rank order
    for rank, (from_left, to_right, wildcard) in enumerate(pending):
        # rank 0's left neighbour (3) was still up when rank 0 shut down
        assert from_left.state is (State.CANCELLED if rank == 0 else State.FAILED)
        # rank 3's right neighbour (0) shut down with rank 3's send parked there
        assert to_right.state is (State.FAILED if rank == 3 else State.CANCELLED)
        assert wildcard.state is State.CANCELLED
        for msg in (from_left, to_right):
            if msg.state is State.FAILED:
                assert isinstance(msg.error, mate.MessageFailed)
                assert msg.error.reason is FailureReason.PEER_UNREACHABLE


async def shutdown_steps(n: int) -> int:
    """The Python steps (trace events: calls, lines, returns) that leaving
    `worlds(n)` takes with messages pending on every rank: a count of work, not
    a timing, so that a loaded machine cannot change it."""
    steps = 0

    def count(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal steps
        steps += 1
        return count

    previous = sys.gettrace()
    try:
        async with mate.local.worlds(n, eager_limit=0) as group:
            post_pending(group)
            await asyncio.sleep(0)
            sys.settrace(count)
    finally:
        sys.settrace(previous)
    return steps


async def test_shutdown_cost_grows_linearly_with_the_group() -> None:
    # Linear: 4x the ranks cost 4x the steps. Before, each rank's shutdown
    # visited every other rank: 4x the ranks cost about 15x the steps.
    small, large = await shutdown_steps(200), await shutdown_steps(800)
    assert large < 6 * small, (small, large)
