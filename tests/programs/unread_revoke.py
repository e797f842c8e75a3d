"""A REVOKE that the peer's device took but its engine never read (tests/test_ibverbs.py).

    mate-run -n 2 --transport ibverbs python tests/programs/unread_revoke.py --progress poll

Both ranks expose memory and put into each other's, so each holds the other's
key. Rank 0 unexposes, then does what a last progress pass before closing can
do: its device serves the link (taking rank 1's REVOKE off it and answering
for it) while its engine hears nothing, and it closes. Rank 1 unexposes after
that: its REVOKE's SEND completes, no REVOKE_ACK will ever come, and nothing
of rank 1's is left on the wire to fail. Its keepalive probe must find rank 0
gone, so that the unexpose ends (a lost peer counts as having acked). Rank 1
exits 1 if the unexpose is still waiting after `BOUND` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import mate
from mate.transports.ibverbs.transport import KEEPALIVE, IbverbsTransport

SERVE = 1.0  # seconds rank 0's device serves with its engine deaf
BOUND = 10 * KEEPALIVE


async def main(progress: str) -> int:
    async with mate.startup("ibverbs", progress=progress) as world:
        me, other = world.mypid, 1 - world.mypid
        memory = bytearray(8)
        region = world.expose(memory)
        address = bytearray(8)
        got = world.recv(address, other, tag=1, timeout=10)
        await world.send(region.address.to_bytes(8, "little"), other, tag=1, timeout=10)
        await got
        await world.put(b"x" * 8, other, int.from_bytes(address, "little"), timeout=10)
        token = bytearray(1)
        got = world.recv(token, other, tag=2, timeout=10)
        await world.send(b"\0", other, tag=2, timeout=10)
        await got
        if me == 0:
            await world.unexpose(region)
            transport = world.transport
            assert isinstance(transport, IbverbsTransport)
            transport._progress.stop()
            transport._keepalive_timer.cancel()
            recv_cq, send_cq = transport._cqs
            end = time.monotonic() + SERVE
            while time.monotonic() < end:  # an empty poll is a service step of the device
                send_cq.poll(64)
                await asyncio.sleep(0.001)
            unread = len(recv_cq.poll(64))
            transport._closed = True
            transport._device.close()
            print(f"rank 0: closed with {unread} frame(s) its engine never read", flush=True)
            return 0 if unread == 1 else 1
        await asyncio.sleep(SERVE / 3)  # rank 0 is deaf by now
        start = time.monotonic()
        try:
            await asyncio.wait_for(world.unexpose(region), BOUND)
        except asyncio.TimeoutError:
            print(f"rank 1: unexpose still waiting after {BOUND:g} s", flush=True)
            return 1
        print(f"rank 1: unexposed in {time.monotonic() - start:.2f} s", flush=True)
        return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--progress", choices=("loop", "poll", "thread"), default="poll")
    sys.exit(asyncio.run(main(parser.parse_args().progress)))
