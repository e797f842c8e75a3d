"""mate on uvloop: the loop whose clock is coarse and cached (the timeout code's hard case)."""

from __future__ import annotations

import asyncio
import time

import pytest

import mate

uvloop = pytest.importorskip("uvloop")


def test_messages_timeouts_and_cancellation_on_uvloop() -> None:
    async def main() -> None:
        assert "uvloop" in type(asyncio.get_running_loop()).__module__
        async with mate.local.worlds(2) as (a, b):
            buf = bytearray(5)
            r = b.recv(buf, 0, tag=1)
            assert (await a.send(b"hello", 1, tag=1)).length == 5
            assert (await r).remote_pid == 0 and buf == b"hello"
            for seconds in (0.01, 0.05, 0.2):
                start = time.monotonic()
                with pytest.raises(mate.MessageTimeout):
                    await b.recv(bytearray(1), 0, tag=2, timeout=seconds)
                elapsed = time.monotonic() - start
                assert seconds <= elapsed <= seconds + 0.1 + 0.1 * seconds, (seconds, elapsed)
            pending = b.recv(bytearray(1), 0, tag=3)
            assert pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            late = a.send(b"x", 1, tag=3)  # not swallowed by the cancelled receive
            got = bytearray(1)
            await b.recv(got, 0, tag=3)
            await late
            assert got == b"x"

    uvloop.run(main())
