"""A rank killed mid-stream by the fault layer, on every transport (tests/test_killed_rank.py).

    python tests/programs/killed_rank.py --transport local --ranks 3       # one process
    mate-run -n 3 --transport ibverbs python tests/programs/killed_rank.py --progress loop
    mate-run -n 3 python tests/programs/killed_rank.py --progress poll     # MPI

Every rank injects the same plan, ``FaultPlan(kill_after=8, kill_rank=2)``:
rank 2 (the victim) exposes memory, takes a few of rank 0's messages, says
goodbye to both survivors and, right after posting its 8th message, dies (`mate.faults`: a
process of its own SIGKILLs itself; a local rank dies in place), while rank 0
still has sends (eager and rendezvous), gets and a receive outstanding to it,
and rank 1 a receive. Meanwhile ranks 0 and 1 ping-pong numbered messages
across the kill. Each survivor checks that everything it had outstanding to
the victim ended within 5 s of the goodbye, that new messages to the victim
end the same way, that every ping-pong message arrived exactly once and in
order, and that shutdown returns; then prints "survived".

How a message to the dead rank ends depends on the transport. local and
ibverbs report the death: the messages are posted with no timeout and must
complete (had they landed before the death) or fail with PEER_UNREACHABLE.
MPI cannot (docs/mpi.md, "When a rank dies"): they are posted with a timeout
of `MPI_TIMEOUT` seconds and must complete or time out.
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import time

import mate
from mate import FailureReason, State, spmd
from mate.faults import FaultPlan, inject

VICTIM = 2
TAKEN = 4  # messages the victim receives before it dies
KILL_AFTER = 8  # the victim's posts: the address, TAKEN receives, two goodbyes, one receive
PLAN = FaultPlan(kill_after=KILL_AFTER, kill_rank=VICTIM)
ROUNDS = 300  # ping-pong round trips between the survivors
BOUND = 5.0  # seconds from the victim's goodbye to the end of every message to it
MPI_TIMEOUT = 3.0  # seconds: how messages to the dead rank end on MPI (from their post)
MPI_SHUTDOWN_TIMEOUT = 1.0  # how long an MPI shutdown waits for the dead rank


async def victim(world: mate.World) -> None:
    memory = bytearray(1 << 20)
    region = world.expose(memory)
    await world.send(struct.pack("<Q", region.address), 0, tag=9)
    inbox = bytearray(1 << 20)
    for _ in range(TAKEN):
        await world.recv(inbox, 0, tag=1)
    for survivor_rank in (0, 1):
        await world.send(b"bye", survivor_rank, tag=8)  # completed: the survivor has it
    await world.recv(bytearray(8), 0, tag=7)  # the 8th post: the rank dies right after it


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


async def outstanding_to_victim(world: mate.World, timeout: float | None
                                ) -> tuple[list[mate.Message], int]:
    """The messages to the victim, and the address of its memory (rank 0; else 0)."""
    if world.mypid == 1:
        return [world.recv(bytearray(8), VICTIM, tag=3, timeout=timeout)], 0
    raw = bytearray(8)
    await world.recv(raw, VICTIM, tag=9)
    (address,) = struct.unpack("<Q", raw)
    msgs = []
    for i in range(16):  # odd: eager; even: rendezvous (above every transport's eager size)
        msgs.append(world.send(bytes(64 if i % 2 else 100_000), VICTIM, tag=1, timeout=timeout))
    msgs += [world.get(bytearray(4096), VICTIM, address + 4096 * i, timeout=timeout)
             for i in range(4)]
    msgs.append(world.recv(bytearray(8), VICTIM, tag=3, timeout=timeout))  # never sent
    return msgs, address


def check_ended(msgs: list[mate.Message], what: str, ending: State) -> int:
    """Every message completed or ended as `ending` says; how many did not complete."""
    ended = 0
    for msg in msgs:
        if msg.state is State.COMPLETED:
            continue
        error = msg.receipt.error
        assert msg.state is ending, (what, msg.state, error)
        if ending is State.FAILED:
            assert isinstance(error, mate.MessageFailed), (what, error)
            assert error.reason is FailureReason.PEER_UNREACHABLE, (what, error)
        ended += 1
    return ended


async def survivor(world: mate.World, detects: bool) -> None:
    # Transports that report a death need no timeout; on MPI only a timeout ends them.
    timeout, ending = (None, State.FAILED) if detects else (MPI_TIMEOUT, State.TIMED_OUT)
    pinging = asyncio.ensure_future(ping_pong(world))
    msgs, address = await outstanding_to_victim(world, timeout)
    await world.recv(bytearray(3), VICTIM, tag=8)
    goodbye = time.monotonic()
    _done, pending = await asyncio.wait([asyncio.ensure_future(_end(m)) for m in msgs],
                                       timeout=BOUND)
    took = time.monotonic() - goodbye
    assert not pending, f"{len(pending)} of {len(msgs)} messages to the dead rank still open"
    ended = check_ended(msgs, "outstanding", ending)
    # The victim took the first TAKEN sends; the later rendezvous sends (never read) and
    # the receives cannot have completed. (Later eager sends may have reached it.)
    doomed = [msgs[-1]]
    if world.mypid == 0:
        doomed += [msgs[i] for i in range(TAKEN, 16, 2)]
    assert all(m.state is ending for m in doomed), [m.state for m in msgs]
    posted = time.monotonic()
    late = [world.send(b"late", VICTIM, tag=1, timeout=timeout),
            world.recv(bytearray(8), VICTIM, tag=1, timeout=timeout)]
    if world.mypid == 0:
        late.append(world.get(bytearray(8), VICTIM, address, timeout=timeout))
    await asyncio.wait([asyncio.ensure_future(_end(m)) for m in late], timeout=BOUND)
    late_took = time.monotonic() - posted
    assert check_ended(late, "posted after the death", ending) == len(late)
    seen = await pinging
    assert seen == list(range(ROUNDS)), seen
    how = "failed (PEER_UNREACHABLE)" if detects else "timed out"
    print(f"rank {world.mypid}: {ended} of {len(msgs)} messages to the dead rank {how} "
          f"within {took:.2f} s of its goodbye, the other {len(msgs) - ended} completed; "
          f"{len(late)} of {len(late)} posted after the death {how} within {late_took:.2f} s; "
          f"{ROUNDS} of {ROUNDS} ping-pong rounds in order", flush=True)


async def _end(msg: mate.Message) -> None:
    await asyncio.gather(msg, return_exceptions=True)


async def program(world: mate.World, detects: bool) -> None:
    faulty = inject(world, PLAN)  # on every rank, before any message
    if world.mypid != VICTIM:
        try:
            await survivor(world, detects)
        finally:
            started = time.monotonic()
            await world.shutdown()
        print(f"rank {world.mypid}: survived; shutdown took {time.monotonic() - started:.2f} s",
              flush=True)
        return
    # A process of its own never gets past its 8th post; a local rank dies in place:
    # its messages end with no event (awaiting one raises CancelledError).
    try:
        await victim(world)
    except asyncio.CancelledError:
        assert faulty.killed
        print(f"rank {world.mypid}: killed in place after {KILL_AFTER} messages", flush=True)
        return
    raise AssertionError("the victim outlived its kill")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    spmd.add_arguments(parser)
    args = parser.parse_args()
    options = spmd.options_from(args)
    transport = spmd.chosen(args.transport)
    if transport == "mpi":
        options["shutdown_timeout"] = MPI_SHUTDOWN_TIMEOUT
    asyncio.run(spmd.run(lambda world: program(world, transport != "mpi"), **options))


if __name__ == "__main__":
    main()
