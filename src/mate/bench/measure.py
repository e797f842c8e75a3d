"""How one size is measured: warm-up, adaptive iteration count, repetitions.

A pattern supplies a *batch*: ``await batch(n)`` runs `n` iterations on rank
0 (after synchronising with rank 1) and returns the `Sample` it timed, wall
time and CPU time (getrusage of the whole process, user + system: every
thread counts, so a progress thread does). `calibrate` runs a warm-up batch
and grows the count until one batch takes at least `min_time`; `measure`
then runs `repetitions` batches of that count, and the figures are their
median. Where several sides are compared (mate, raw MPI, the floor), the
driver calibrates each and then alternates their repetitions, so that a
host that drifts between a fast and a slow state during a size weighs on
every side alike.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mate.bench import stats

WARMUP_ITERATIONS = 10


def clock() -> tuple[float, float]:
    """(wall time, CPU time of this process: user + system), in seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Sample:
    """One timed batch: `iterations` operations in `wall` s, using `cpu` s of CPU."""

    iterations: int
    wall: float
    cpu: float

    @classmethod
    def since(cls, iterations: int, start: tuple[float, float]) -> Sample:
        wall, cpu = clock()
        return cls(iterations, wall - start[0], cpu - start[1])


Batch = Callable[[int], Awaitable[Sample]]


@dataclass(frozen=True)
class Measurement:
    """The repetitions at one size; `divisor` is 2 for a ping-pong (half round trip)."""

    size: int
    samples: tuple[Sample, ...]
    divisor: int = 1

    @property
    def iterations(self) -> int:
        return self.samples[0].iterations

    @property
    def latency_us(self) -> float:
        return stats.median([stats.latency_us(s.wall, s.iterations, self.divisor)
                             for s in self.samples])

    @property
    def bandwidth_mbps(self) -> float:
        return stats.bandwidth_mbps(self.size, self.latency_us)

    @property
    def cpu_percent(self) -> float:
        """CPU time over wall time of all the measured repetitions."""
        return stats.cpu_percent(sum(s.cpu for s in self.samples),
                                 sum(s.wall for s in self.samples))


async def calibrate(batch: Batch, size: int, *, min_time: float,
                    warmup: int = WARMUP_ITERATIONS, iterations: int | None = None) -> int:
    """Warm `batch` up (not if `warmup` is 0) and return the iteration count at which
    one batch takes at least `min_time`, capped by the size; a fixed `iterations`
    is returned as it is, after the warm-up."""
    cap = stats.iteration_cap(size)
    n = 1 if iterations is None else iterations
    if warmup:
        # One iteration first (connection set-up, first touch of the buffers), then a
        # longer warm-up only where it is cheap; it also gives the first rate estimate.
        sample = await batch(1)
        if warmup > 1 and sample.wall * warmup < min_time:
            sample = await batch(min(warmup, cap))
        if iterations is None and sample.wall < min_time:
            n = stats.next_iterations(sample.iterations, sample.wall, min_time, cap)
    if iterations is None:
        while n < cap:
            sample = await batch(n)
            if sample.wall >= min_time:
                break
            n = stats.next_iterations(n, sample.wall, min_time, cap)
    return n


async def measure(batch: Batch, size: int, *, min_time: float, repetitions: int,
                  divisor: int = 1, warmup: int = WARMUP_ITERATIONS,
                  iterations: int | None = None) -> Measurement:
    """Measure `batch` at `size` bytes. A fixed `iterations` skips the calibration
    (and `warmup=0` the warm-up)."""
    if repetitions < 1:
        raise ValueError("repetitions must be >= 1")
    n = await calibrate(batch, size, min_time=min_time, warmup=warmup, iterations=iterations)
    samples = [await batch(n) for _ in range(repetitions)]
    return Measurement(size, tuple(samples), divisor)
