"""The benchmark's arithmetic, with no I/O: sizes, medians, latency, bandwidth,
CPU utilisation, n½ and iteration counts (thesis §6.2).

Units: latency in µs, bandwidth in MB/s with MB = 10**6 bytes (so a size in
bytes divided by a latency in µs is a bandwidth in MB/s), sizes in bytes with
K, M and G binary (1K = 1024).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
MAX_SIZE = GIB  # the largest message size --sizes accepts
MAX_ITERATIONS = 1_000_000  # the most iterations in one repetition
MAX_BYTES_PER_REPETITION = 4 * GIB  # caps the count for huge sizes

_UNITS = {"": 1, "K": KIB, "M": MIB, "G": GIB}
_SIZE = re.compile(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A size in bytes: ``4096``, ``4K``, ``1M`` (binary units), ``0``."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size: use bytes with an optional K, M or G "
                         "suffix (binary), e.g. 8, 4K, 1M")
    size = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if size > MAX_SIZE:
        raise ValueError(f"{text!r} is larger than the largest size allowed "
                         f"({format_size(MAX_SIZE)})")
    return size


def parse_sizes(text: str) -> list[int]:
    """``LO:HI`` (powers of two from LO to HI) or a comma list; sorted, no duplicates."""
    text = text.strip()
    if not text:
        raise ValueError("no sizes given: use a range such as 1:4M or a list such as 8,4096,1M")
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 2:
            raise ValueError(f"{text!r}: a range is LO:HI, e.g. 1:4M")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        for value, part in ((lo, parts[0]), (hi, parts[1])):
            if value < 1 or value & (value - 1):
                raise ValueError(f"{text!r}: the ends of a range must be powers of two >= 1, "
                                 f"not {part.strip()!r} (use a list for other sizes)")
        if lo > hi:
            raise ValueError(f"{text!r}: the range is empty (LO > HI)")
        sizes = []
        size = lo
        while size <= hi:
            sizes.append(size)
            size *= 2
        return sizes
    items = [item for item in text.split(",")]
    if any(not item.strip() for item in items):
        raise ValueError(f"{text!r}: empty item in the list of sizes")
    return sorted({parse_size(item) for item in items})


def format_size(size: float) -> str:
    """``4M``, ``64K``, ``1000`` (exact binary multiples get a suffix), ``16.3K`` for
    non-integral values such as n½."""
    if size != int(size):
        if size >= MIB:
            return f"{size / MIB:.1f}M"
        if size >= KIB:
            return f"{size / KIB:.1f}K"
        return f"{size:.1f}"
    n = int(size)
    for unit, scale in (("G", GIB), ("M", MIB), ("K", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def median(values: Sequence[float]) -> float:
    """The median (mean of the two middle values for an even count)."""
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[mid])
    return (ordered[mid - 1] + ordered[mid]) / 2


def latency_us(wall_seconds: float, iterations: int, divisor: int = 1) -> float:
    """Time per operation in µs: `wall_seconds` over `iterations`, divided by `divisor`
    (2 for a ping-pong, whose figure is half the round trip)."""
    if iterations < 1 or divisor < 1:
        raise ValueError("iterations and divisor must be >= 1")
    return wall_seconds / iterations / divisor * 1e6


def bandwidth_mbps(size: int, latency: float) -> float:
    """MB/s (10**6 bytes per second) for `size` bytes moved in `latency` µs."""
    if latency <= 0:
        raise ValueError(f"latency must be > 0 µs, not {latency!r}")
    return size / latency


def cpu_percent(cpu_seconds: float, wall_seconds: float) -> float:
    """CPU utilisation: user + system time over wall time, in % of one core (like top)."""
    if wall_seconds <= 0:
        raise ValueError(f"wall time must be > 0 s, not {wall_seconds!r}")
    return 100.0 * cpu_seconds / wall_seconds


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base, or None when either is missing or base is 0."""
    if value is None or base is None or base == 0:
        return None
    return value / base


def peak(values: Sequence[float | None]) -> float | None:
    """The largest of the values present, or None."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


def n_half(sizes: Sequence[int], bandwidths: Sequence[float]) -> float | None:
    """The half-power point n½: the message size at which half the peak bandwidth
    is first reached (thesis §6.2.1).

    Sizes are taken in ascending order. Between the two measured sizes that
    bracket half the peak, the size is interpolated linearly in log(size)
    (linearly in size when the lower one is 0). If the smallest size already
    reaches half the peak, that size is the answer. None when there is no
    data or the peak is 0.
    """
    if len(sizes) != len(bandwidths):
        raise ValueError("sizes and bandwidths differ in length")
    points = sorted(zip(sizes, bandwidths, strict=True))
    if not points:
        return None
    top = max(bw for _, bw in points)
    if top <= 0:
        return None
    half = top / 2
    if points[0][1] >= half:
        return float(points[0][0])
    for (s0, b0), (s1, b1) in itertools.pairwise(points):
        if b1 >= half:
            t = (half - b0) / (b1 - b0)  # b0 < half <= b1, so 0 < t <= 1
            if s0 <= 0:
                return s0 + t * (s1 - s0)
            return math.exp(math.log(s0) + t * (math.log(s1) - math.log(s0)))
    raise AssertionError("unreachable: the peak itself reaches half the peak")


def iteration_cap(size: int) -> int:
    """The most iterations one repetition may have at `size` bytes."""
    return max(1, min(MAX_ITERATIONS, MAX_BYTES_PER_REPETITION // max(size, 1)))


def next_iterations(iterations: int, wall_seconds: float, min_time: float, cap: int) -> int:
    """The iteration count to try after `iterations` took `wall_seconds` < `min_time`:
    aim 20 % past min_time from the measured rate, growing at least 2x and at
    most 10x per step, never above `cap`."""
    if wall_seconds <= 0:
        target = iterations * 10
    else:
        target = math.ceil(iterations * min_time * 1.2 / wall_seconds)
    return max(1, min(cap, max(2 * iterations, min(10 * iterations, target))))
