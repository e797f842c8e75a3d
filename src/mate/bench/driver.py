"""Running a benchmark: two ranks on the local transport (one process), or one rank
per process on a launched transport (mpi under mpiexec; ibverbs under mate-run,
or under mpiexec when raw MPI is the baseline), the sweep over sizes, and the result.

With a baseline (raw mpi4py, `mate.bench.patterns.RawBench`) or the floor
(`FloorBench`) a size is measured on every side in turn: each side calibrates
its iteration count in a phase of its own, then the sides take turns, one
repetition each (after an untimed warm-up), so that all of them see the same
machine state, drifts included, and on the same buffers. The raw calls run on
their own communicator and window.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import socket
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import mate
from mate import native, registry
from mate.bench import stats
from mate.bench.loopback import TcpBench
from mate.bench.measure import WARMUP_ITERATIONS, Batch, Measurement, Sample, calibrate
from mate.bench.patterns import DEFAULT_WINDOW, Buffers, FloorBench, MateBench, RawBench, divisor
from mate.bench.report import ProgressBar, Result, Row, format_head, show_row

WAIT_SIZE = 8  # the wait pattern ignores --sizes
TURN_WARMUP = 10  # before its timed batch, each turn runs 1/TURN_WARMUP as many untimed


class BenchError(Exception):
    """A benchmark that cannot run as asked (reported without a traceback)."""


@dataclass(frozen=True)
class Options:
    pattern: str
    transport: str  # a name of mate.registry.TRANSPORTS
    progress: str | None = None  # None: the transport's default
    rma: str | None = None  # mpi: native (default), emulated
    wait: str = "completion"
    sizes: tuple[int, ...] = (8,)
    baseline: bool = False
    repetitions: int = 5
    min_time: float = 0.05
    idle: float = 1.0  # the wait pattern: how long rank 0 waits
    window: int = DEFAULT_WINDOW  # the rate pattern: messages per window
    handler_driven: bool = False  # the rate pattern: rank 1 reposts from handlers
    floor: bool = False  # pingpong, pingping, rate: also measure the asyncio floor (needs MPI)
    tcp: bool = False  # pingpong: also asyncio TCP streams on loopback (mate.bench.loopback)
    show_progress: bool = False
    uvloop: bool = False

    @property
    def sweep(self) -> list[int]:
        return [WAIT_SIZE] if self.pattern == "wait" else list(self.sizes)


def _metadata(opts: Options) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mate_version": mate.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "event_loop": "uvloop" if opts.uvloop else "asyncio",
        "repetitions": opts.repetitions,
        "min_time_s": opts.min_time,
        "statistic": "median of repetitions; cpu_percent over all repetitions, rank 0",
        "compiled_modules": native.compiled(),  # mypyc (mate.native); [] when pure Python
    }
    if opts.pattern == "wait":
        extra["idle_s"] = opts.idle
    if opts.floor:
        extra["floor"] = "uvloop" if opts.uvloop else "asyncio"
    if opts.tcp:
        extra["tcp"] = "asyncio streams on 127.0.0.1, rank 1 the echo server"
    if opts.pattern == "rate":
        extra["window"] = opts.window
        extra["handler_driven"] = opts.handler_driven
    extra["rma"] = (opts.rma or "auto") if opts.transport == "mpi" else None
    if opts.transport == "mpi" or opts.baseline or opts.floor:
        import mpi4py
        from mpi4py import MPI

        extra["mpi4py"] = mpi4py.__version__
        extra["mpi_library"] = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    if opts.transport == "local":
        extra["note"] = "local transport: both ranks in one process; CPU % covers both"
    return extra


def progress_of(opts: Options) -> str | None:
    """The progress mode the run uses: the one asked for, else the transport's default."""
    modes = registry.TRANSPORTS[opts.transport].progress
    return (opts.progress or modes[0]) if modes else None


def new_result(opts: Options) -> Result:
    progress = progress_of(opts)
    return Result(opts.pattern, opts.transport, progress, opts.wait, socket.gethostname(),
                  extra=_metadata(opts))


def _mate_bench(opts: Options, world: mate.World, buffers: Buffers) -> MateBench:
    return MateBench(world, opts.pattern, opts.wait, buffers, opts.idle, opts.window,
                     opts.handler_driven)


class _Side:
    """One side of a comparison at one size: its batch, how its phase ends on rank 0
    (a coroutine for mate, a blocking call for raw MPI and the floor), its samples."""

    def __init__(self, label: str, batch: Batch,
                 end_phase: Callable[[], Coroutine[Any, Any, None] | None]) -> None:
        self.label = label
        self.batch = batch
        self._end_phase = end_phase
        self.iterations = 0
        self.samples: list[Sample] = []

    async def end_phase(self) -> None:
        await _step(self._end_phase())


class _Beside(Protocol):
    """What is measured beside mate (raw MPI, the asyncio floor, TCP on loopback): the
    same phases as mate's, each step a blocking call or a coroutine."""

    def batch(self, size: int) -> Batch: ...

    def end_phase(self, size: int) -> Coroutine[Any, Any, None] | None: ...

    def serve_phase(self) -> Coroutine[Any, Any, None] | None: ...


async def _step(step: Coroutine[Any, Any, None] | None) -> None:
    """A phase's step, done: awaited if it is a coroutine (a blocking call is done)."""
    if step is not None:
        await step


async def _measure_sides(opts: Options, sides: list[_Side], size: int,
                         show: Callable[[str], None]) -> list[Measurement]:
    """Rank 0: calibrate every side at `size`, each in a phase of its own, then run
    `opts.repetitions` rounds of one repetition per side, a phase each (`_serve`
    follows the same phases on rank 1). A turn first runs a tenth of its batch
    untimed: a side that follows another starts cold (after raw MPI's busy
    polling, the ibverbs soft device's first wake-ups in loop mode took ~15 %
    longer), and its timed batch should see it as it runs on its own."""
    wait = opts.pattern == "wait"  # one long wait per repetition: no warm-up, no calibration
    for side in sides:
        show(side.label)
        side.iterations = await calibrate(side.batch, size, min_time=opts.min_time,
                                          warmup=0 if wait else WARMUP_ITERATIONS,
                                          iterations=1 if wait else None)
        await side.end_phase()
    for _ in range(opts.repetitions):
        for side in sides:
            if not wait:
                await side.batch(max(1, side.iterations // TURN_WARMUP))
            side.samples.append(await side.batch(side.iterations))
            await side.end_phase()
    per = divisor(opts.pattern, opts.window)
    return [Measurement(size, tuple(side.samples), per) for side in sides]


async def _lead(opts: Options, bench: MateBench, beside: dict[str, _Beside],
                result: Result) -> None:
    """Rank 0: the sweep, mate and then each side `beside` it ("raw" with a baseline,
    "floor" with `--floor`, "tcp" with `--tcp`) at every size, into `result`; the
    table goes to stdout as the sweep goes."""
    sizes = opts.sweep
    bar = ProgressBar(len(sizes), f"{opts.pattern} {opts.transport}", opts.show_progress)
    print(format_head(result, "raw" in beside), flush=True)
    # What rank 0's world counted while mate ran each size (world.stats(): messages,
    # bytes, and the transport's own counters such as pin-cache hits), by size. Raw
    # MPI and the floor do not go through the world, so they add nothing to it.
    counted: dict[str, dict[str, int]] = result.extra.setdefault("stats_by_size", {})
    try:
        for i, size in enumerate(sizes):
            sides = [_Side("mate", bench.batch(size), partial(bench.end_phase, size))]
            sides += [_Side(label, side.batch(size), partial(side.end_phase, size))
                      for label, side in beside.items()]

            def show(side: str, i: int = i, label: str = stats.format_size(size)) -> None:
                bar.update(i, f"{label} B {side}")

            before = bench.world.stats()
            measured = await _measure_sides(opts, sides, size, show)
            after = bench.world.stats()
            counted[str(size)] = {key: after[key] - before.get(key, 0) for key in after}
            by_side = {side.label: m for side, m in zip(sides, measured, strict=True)}
            result.rows.append(Row.from_measurements(by_side["mate"], by_side.get("raw"),
                                                     by_side.get("floor"), by_side.get("tcp")))
            show_row(result.rows[-1], "raw" in beside, bar, rate=opts.pattern == "rate")
        bar.update(len(sizes), "done")
    finally:
        bar.clear()


async def _serve(opts: Options, bench: MateBench, beside: dict[str, _Beside]) -> None:
    """Rank 1: serve every phase, in the order rank 0 runs them: at every size, the
    calibration and then each round of repetitions, side by side."""
    for _ in opts.sweep:
        for _ in range(1 + opts.repetitions):
            await bench.serve_phase()
            for side in beside.values():
                await _step(side.serve_phase())


async def run_local(opts: Options) -> Result:
    """Both ranks in this process, on the local transport."""
    if opts.baseline or opts.floor or opts.tcp:
        raise BenchError("--baseline, --floor and --tcp need a launched transport")
    result = new_result(opts)
    async with mate.local.worlds(2) as (w0, w1):
        lead = _mate_bench(opts, w0, Buffers(opts.sweep))
        serve = _mate_bench(opts, w1, Buffers(opts.sweep))
        await asyncio.gather(lead.setup(), serve.setup())
        await asyncio.gather(_lead(opts, lead, {}, result), _serve(opts, serve, {}))
        await asyncio.gather(lead.teardown(), serve.teardown())
    return result


def sides(opts: Options, world: mate.World
          ) -> tuple[MateBench, RawBench | None, FloorBench | None, TcpBench | None]:
    """This rank's side of mate and of each comparison asked for, all on one set of
    buffers (see `Buffers`)."""
    buffers = Buffers(opts.sweep)
    return (_mate_bench(opts, world, buffers),
            RawBench(opts.pattern, opts.wait, buffers, opts.idle, opts.window)
            if opts.baseline else None,
            FloorBench(opts.pattern, buffers, opts.window) if opts.floor else None,
            TcpBench(world, buffers.outs) if opts.tcp else None)


async def run_launched(opts: Options) -> Result | None:
    """This process's rank on a launched transport (mpi, ibverbs); rank 0 returns the result."""
    options: dict[str, Any] = {"progress": progress_of(opts)}
    if opts.rma is not None:
        options["rma"] = opts.rma
    async with mate.startup(opts.transport, **options) as world:
        if world.numprocs != 2:
            raise BenchError(f"mate-bench runs on exactly 2 ranks, not {world.numprocs}")
        bench, raw, floor, tcp = sides(opts, world)
        await bench.setup()
        if tcp is not None:
            await tcp.setup()
        if raw is not None:
            raw.setup()
        # In the same order on both ranks: rank 1 serves the phases rank 0 runs.
        beside: dict[str, _Beside] = {label: side for label, side in
                                      (("raw", raw), ("floor", floor), ("tcp", tcp))
                                      if side is not None}
        result: Result | None = None
        if world.mypid == 0:
            result = new_result(opts)
            await _lead(opts, bench, beside, result)
        else:
            await _serve(opts, bench, beside)
        await bench.teardown()
        if tcp is not None:
            await tcp.teardown()
        # Meet before the raw window is freed (a blocking collective): rank 1's
        # unexpose needs rank 0's mate progress until it returns.
        token = bytearray(1)
        if world.mypid == 0:
            await world.recv(token, 1, 3)
        else:
            await world.send(token, 0, 3)
        if raw is not None:
            raw.teardown()
        if floor is not None:
            floor.teardown()
    return result


def run(opts: Options) -> Result | None:
    """Run the benchmark on this process's event loop (uvloop if asked)."""
    runner: Callable[[Options], Coroutine[Any, Any, Result | None]]
    runner = run_local if opts.transport == "local" else run_launched
    if opts.uvloop:
        import uvloop

        return uvloop.run(runner(opts))
    return asyncio.run(runner(opts))


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()
