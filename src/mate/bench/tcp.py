"""asyncio TCP streams ping-pong on loopback: the peer baseline of SPEC §7 for the
ibverbs transport's soft device ("8 B pingpong latency no worse than asyncio
TCP streams on loopback measured in the same run").

    python -m mate.bench.tcp [--sizes 1:4M] [--json F] [--plot F.png] [--uvloop]

Rank 1 is an echo server in a second process (this module with ``--serve``)
listening on 127.0.0.1 only, on a port the system picks; it serves one
connection and exits at its end. Rank 0 writes `size` bytes and reads the
echo (``readexactly``), `n` times per batch; the figure is half the round trip.
The rows have the schema of `mate-bench`, transport "tcp-loopback", no
baseline fields. The echo and the timed round trips are `mate.bench.loopback`'s,
which `mate-bench pingpong --tcp` runs beside mate in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from mate.bench import stats
from mate.bench.loopback import HOST, echo, round_trips
from mate.bench.measure import measure
from mate.bench.report import ProgressBar, Result, Row, format_head, show_row

TRANSPORT = "tcp-loopback"
START_TIMEOUT = 30.0  # seconds for the echo server to say its port


async def serve() -> None:
    """The echo server: one connection on 127.0.0.1, echoed until its end."""
    done = asyncio.get_running_loop().create_future()

    async def echo_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await echo(reader, writer)
        finally:
            if not done.done():
                done.set_result(None)

    server = await asyncio.start_server(echo_once, HOST, 0)
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
                m = await measure(round_trips(reader, writer, out[:size]), size,
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
