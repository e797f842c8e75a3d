"""Where an ibverbs loop-mode half round trip goes, stamped on rank 1.

    mate-run -n 2 --transport ibverbs python bench/trace_pingpong.py [ROUNDS]

An 8 B ping-pong in which rank 0 writes the time of its `send()` call into
the payload (`time.perf_counter_ns`, one clock for both processes on one
host) and rank 1 stamps its progress passes (the channel's reader callback,
wrapped) and its task. Rank 1 prints the medians of: rank 0's send() to the
pass that takes the message, that pass, the pass's end to the task's
resumption, and the task's resumption to its reply being posted, over the
rounds in which exactly one pass ran between two receives (in the others the
message came with the pass that took the ACK before it). The wrapper adds a
little to each pass: the half round trip here is longer than mate-bench's.
"""

from __future__ import annotations

import asyncio
import statistics
import struct
import sys
import time

import mate

STAMP = struct.Struct("<q")


async def main(rounds: int) -> None:
    async with mate.startup("ibverbs", progress="loop") as world:
        loop = asyncio.get_running_loop()
        passes: list[tuple[int, int]] = []
        if world.mypid == 1:
            progress = world.transport._progress  # type: ignore[attr-defined]
            run = progress._guarded

            def stamped() -> None:
                start = time.perf_counter_ns()
                run()
                passes.append((start, time.perf_counter_ns()))

            loop.remove_reader(progress.fd)
            loop.add_reader(progress.fd, stamped)
        buf = bytearray(8)
        wire, pass_, resume, reply = [], [], [], []
        for i in range(rounds):
            if world.mypid == 0:
                answer = world.recv(buf, 1, 0)
                STAMP.pack_into(buf, 0, time.perf_counter_ns())
                await world.send(buf, 1, 0)
                await answer
                continue
            passes.clear()
            await world.recv(buf, 0, 0)
            resumed = time.perf_counter_ns()
            (sent,) = STAMP.unpack_from(buf, 0)
            taken = list(passes)
            message = world.send(buf, 0, 0)
            posted = time.perf_counter_ns()
            await message
            if i >= rounds // 10 and len(taken) == 1:  # past the warm-up
                (start, end), = taken
                wire.append(start - sent)
                pass_.append(end - start)
                resume.append(resumed - end)
                reply.append(posted - resumed)
        if world.mypid == 1:
            def us(values: list[int]) -> str:
                return f"{statistics.median(values) / 1e3:.1f} us"

            print(f"{len(wire)} of {rounds} rounds with one pass: send() -> pass "
                  f"{us(wire)}; pass {us(pass_)}; pass end -> task {us(resume)}; "
                  f"task -> reply posted {us(reply)}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000))
