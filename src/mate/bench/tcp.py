"""asyncio TCP streams ping-pong on loopback: the peer baseline of SPEC §7 for the
ibverbs transport's soft device ("8 B pingpong latency no worse than asyncio
TCP streams on loopback measured in the same run").

    python -m mate.bench.tcp [--sizes 1:4M] [--json F] [--plot F.png] [--uvloop]

Rank 1 is an echo server in a second process (this module with ``--serve``)
listening on 127.0.0.1 only, on a port the system picks; it serves one
connection and exits at its end. Rank 0 writes `size` bytes and reads the
echo (``readexactly``), `n` times per batch; the figure is half the round trip.
The rows have the schema of `mate-bench`, transport "tcp-loopback", no
baseline fields.

`TcpBench` is the same ping-pong as a side of a launched `mate-bench pingpong
--tcp` run, taking turns with mate a repetition each at every size, as the
baseline and the floor do: rank 1 is then the echo server, in its own event
loop (which mate leaves idle meanwhile), and rank 0 the client. A phase is one
connection: rank 0 opens it at the phase's first batch and closes it at its end,
and rank 1's phase ends when the connection does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import struct
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import mate
from mate.bench import stats
from mate.bench.measure import Batch, Sample, clock, measure
from mate.bench.report import ProgressBar, Result, Row, format_head, show_row

TRANSPORT = "tcp-loopback"
HOST = "127.0.0.1"
CHUNK = 1 << 20
START_TIMEOUT = 30.0  # seconds for the echo server to say its port
PORT = struct.Struct("<H")  # the echo server's port, rank 1 to rank 0 (TcpBench)
PORT_TAG = 6  # beside the tags of mate.bench.patterns and the driver's closing 3


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo what comes until the client closes."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def serve() -> None:
    """The echo server: one connection on 127.0.0.1, echoed until its end."""
    done = asyncio.get_running_loop().create_future()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _echo(reader, writer)
        finally:
            if not done.done():
                done.set_result(None)

    server = await asyncio.start_server(echo, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    print(port, flush=True)
    async with server:
        await done


async def _start_server(uvloop: bool) -> tuple[asyncio.subprocess.Process, int]:
    command = [sys.executable, "-m", "mate.bench.tcp", "--serve"]
    if uvloop:
        command.append("--uvloop")
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT)
        return process, int(line)
    except (TimeoutError, ValueError):
        process.kill()
        await process.wait()
        raise RuntimeError("the TCP echo server did not start") from None


async def run_tcp(sizes: Sequence[int], *, min_time: float, repetitions: int,
                  show_progress: bool = False, uvloop: bool = False) -> Result:
    """Measure the ping-pong at every size; the result has no baseline."""
    from mate.bench.driver import Options, new_result

    opts = Options("pingpong", "local", sizes=tuple(sizes), repetitions=repetitions,
                   min_time=min_time, uvloop=uvloop)
    result = new_result(opts)
    result.transport = TRANSPORT
    result.extra["note"] = ("asyncio streams over TCP on 127.0.0.1; echo server in a second "
                            "process; CPU % is the client's")
    largest = max(max(sizes), 1)
    out = memoryview(bytearray(b"\x5a" * largest))
    process, port = await _start_server(uvloop)
    bar = ProgressBar(len(sizes), f"pingpong {TRANSPORT}", show_progress)
    print(format_head(result, baseline=False), flush=True)  # then each row as measured
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            for i, size in enumerate(sizes):
                bar.update(i, f"{stats.format_size(size)} B")
                m = await measure(_batch(reader, writer, out[:size]), size,
                                  min_time=min_time, repetitions=repetitions, divisor=2)
                result.rows.append(Row.from_measurements(m))
                show_row(result.rows[-1], False, bar)
            bar.update(len(sizes), "done")
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    finally:
        bar.clear()
        try:
            await asyncio.wait_for(process.wait(), 5.0)
        except TimeoutError:
            process.kill()
            await process.wait()
    return result


def _batch(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
           out: memoryview) -> Batch:
    size = len(out)
    write, readexactly = writer.write, reader.readexactly

    async def batch(n: int) -> Sample:
        start = clock()
        for _ in range(n):
            write(out)
            await readexactly(size)
        return Sample.since(n, start)

    return batch


class TcpBench:
    """One rank's side of the TCP ping-pong in a launched mate-bench run (see the
    module's docstring): rank 0 the client, rank 1 the echo server."""

    def __init__(self, world: mate.World, sizes: Sequence[int]) -> None:
        self.world = world
        self.out = memoryview(bytearray(b"\x5a" * max(max(sizes), 1)))
        self._port = 0
        self._server: asyncio.Server | None = None
        self._ended: asyncio.Queue[None] = asyncio.Queue()  # rank 1: a connection ended
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def setup(self) -> None:
        word = bytearray(PORT.size)
        if self.world.mypid == 1:
            self._server = await asyncio.start_server(self._serve, HOST, 0)
            PORT.pack_into(word, 0, self._server.sockets[0].getsockname()[1])
            await self.world.send(word, 0, PORT_TAG)
        else:
            await self.world.recv(word, 1, PORT_TAG)
            (self._port,) = PORT.unpack(word)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _echo(reader, writer)
        finally:
            self._ended.put_nowait(None)

    def batch(self, size: int) -> Batch:
        """Rank 0: `n` round trips of `size` bytes, on the phase's connection."""
        out = self.out[:size]

        async def batch(n: int) -> Sample:
            if self._stream is None:
                self._stream = await asyncio.open_connection(HOST, self._port)
            reader, writer = self._stream
            return await _batch(reader, writer, out)(n)

        return batch

    async def end_phase(self, size: int) -> None:
        """Rank 0: close the phase's connection, which ends rank 1's phase."""
        if self._stream is not None:
            writer, self._stream = self._stream[1], None
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def serve_phase(self) -> None:
        """Rank 1: echo the phase's connection until rank 0 closes it."""
        await self._ended.get()

    async def teardown(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def main(argv: Sequence[str] | None = None) -> None:
    from mate.bench.cli import PROGRESS_ENV, add_measurement_arguments, emit

    parser = argparse.ArgumentParser(prog="python -m mate.bench.tcp",
                                     description=__doc__.splitlines()[0])
    add_measurement_arguments(parser)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    runner: Callable[[Coroutine[Any, Any, Any]], Any] = asyncio.run
    if args.uvloop:
        import uvloop

        runner = uvloop.run
    if args.serve:
        runner(serve())
        return
    show = os.environ.get(PROGRESS_ENV)
    result = runner(run_tcp(args.sizes, min_time=args.min_time, repetitions=args.repetitions,
                            show_progress=sys.stderr.isatty() if show is None else show == "1",
                            uvloop=args.uvloop))
    emit(result, args)


if __name__ == "__main__":
    main()
