"""A rank killed mid-stream (run by tests/test_ibverbs.py under ``mate-run -n 3``).

Rank 2 (the victim) exposes memory, takes a few of rank 0's messages, says
goodbye and SIGKILLs itself while rank 0 still has sends (eager and
rendezvous), gets and a receive outstanding to it, and rank 1 a receive.
Meanwhile ranks 0 and 1 ping-pong numbered messages across the kill. Each
survivor checks that everything it had outstanding to the victim ended within
5 s of the goodbye (completed, or failed with PEER_UNREACHABLE), that new
messages to the victim fail the same way, that every ping-pong message arrived
exactly once and in order, and that shutdown returns; then prints "survived".
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import sys
import time

import mate
from mate import FailureReason, State

VICTIM = 2
TAKEN = 4  # messages the victim receives before it dies
ROUNDS = 300  # ping-pong round trips between the survivors
BOUND = 5.0  # seconds from the victim's goodbye to the end of every message to it


async def victim(world: mate.World) -> None:
    memory = bytearray(1 << 20)
    region = world.expose(memory)
    await world.send(struct.pack("<Q", region.address), 0, tag=9)
    inbox = bytearray(1 << 20)
    for _ in range(TAKEN):
        await world.recv(inbox, 0, tag=1)
    await world.send(b"bye", 0, tag=8)
    await asyncio.sleep(0.05)  # the goodbye leaves before the process dies
    os.kill(os.getpid(), signal.SIGKILL)


async def ping_pong(world: mate.World) -> list[int]:
    """Numbered round trips between ranks 0 and 1; the numbers each saw, in order."""
    peer = 1 - world.mypid
    seen = []
    inbox = bytearray(4)
    for i in range(ROUNDS):
        if world.mypid == 0:
            await world.send(struct.pack("<I", i), peer, tag=5, timeout=10)
            await world.recv(inbox, peer, tag=6, timeout=10)
        else:
            await world.recv(inbox, peer, tag=5, timeout=10)
            await world.send(inbox, peer, tag=6, timeout=10)
        seen.append(struct.unpack("<I", inbox)[0])
        await asyncio.sleep(0.002)  # spread the exchange across the kill
    return seen


async def outstanding_to_victim(world: mate.World) -> list[mate.Message]:
    if world.mypid == 1:
        return [world.recv(bytearray(8), VICTIM, tag=3, timeout=None)]
    raw = bytearray(8)
    await world.recv(raw, VICTIM, tag=9)
    (address,) = struct.unpack("<Q", raw)
    msgs = []
    for i in range(16):  # odd: eager; even: rendezvous (above the 8 KiB eager size)
        msgs.append(world.send(bytes(64 if i % 2 else 100_000), VICTIM, tag=1, timeout=None))
    msgs += [world.get(bytearray(4096), VICTIM, address + 4096 * i, timeout=None)
             for i in range(4)]
    msgs.append(world.recv(bytearray(8), VICTIM, tag=3, timeout=None))  # never sent
    return msgs


def check_ended(msgs: list[mate.Message], what: str) -> int:
    failed = 0
    for msg in msgs:
        if msg.state is State.COMPLETED:
            continue
        error = msg.receipt.error
        assert msg.state is State.FAILED, (what, msg.state, error)
        assert isinstance(error, mate.MessageFailed), (what, error)
        assert error.reason is FailureReason.PEER_UNREACHABLE, (what, error)
        failed += 1
    return failed


async def survivor(world: mate.World) -> None:
    pinging = asyncio.ensure_future(ping_pong(world))
    msgs = await outstanding_to_victim(world)
    if world.mypid == 0:
        await world.recv(bytearray(3), VICTIM, tag=8)
    goodbye = time.monotonic()
    _done, pending = await asyncio.wait([asyncio.ensure_future(_end(m)) for m in msgs],
                                       timeout=BOUND)
    took = time.monotonic() - goodbye
    assert not pending, f"{len(pending)} of {len(msgs)} messages to the dead rank still open"
    failed = check_ended(msgs, "outstanding")
    # The victim took the first TAKEN sends; the later rendezvous sends (never read) and
    # the receives cannot have completed. (Later eager sends were delivered to its device.)
    doomed = [msgs[-1]]
    if world.mypid == 0:
        doomed += [msgs[i] for i in range(TAKEN, 16, 2)]
    assert all(m.state is State.FAILED for m in doomed), [m.state for m in msgs]
    late = [world.send(b"late", VICTIM, tag=1, timeout=None),
            world.recv(bytearray(8), VICTIM, tag=1, timeout=None)]
    await asyncio.wait([asyncio.ensure_future(_end(m)) for m in late], timeout=BOUND)
    assert check_ended(late, "posted after the death") == 2
    seen = await pinging
    assert seen == list(range(ROUNDS)), seen
    print(f"rank {world.mypid}: {failed} of {len(msgs)} messages to the dead rank failed "
          f"within {took:.2f} s", flush=True)


async def _end(msg: mate.Message) -> None:
    await asyncio.gather(msg, return_exceptions=True)


async def main(progress: str) -> None:
    world = await mate.startup(progress=progress)
    try:
        if world.mypid == VICTIM:
            await victim(world)
        else:
            await survivor(world)
    finally:
        started = time.monotonic()
        await world.shutdown()
    print(f"rank {world.mypid}: survived; shutdown took {time.monotonic() - started:.2f} s",
          flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
