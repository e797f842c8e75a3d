"""`stand_back`: the MPI progress thread's wait while the event loop runs the passes.

The C version (`mate._stand_back`, where built; .ci/run also runs this file as pure
Python) and the Python fallback share these tests. That the C one looks at the clock
without the GIL is its point, and is measured, not tested here: a thread-mode 4 MiB
pingping (bench/results/stand-back-2026-11-28.txt)."""

from __future__ import annotations

import math
import os
import threading
import time
from array import array
from collections.abc import Callable, Iterator

import pytest

from mate.transports.mpi import progress

StandBack = Callable[..., bool]  # (clock, period, fd); array is not generic at run time on 3.11

try:
    from mate._stand_back import stand_back as c_stand_back
except ImportError:  # not built, or pure Python asked for (MATE_PURE_PYTHON)
    c_stand_back = None

IMPLEMENTATIONS = [
    pytest.param(c_stand_back, id="c", marks=pytest.mark.skipif(
        c_stand_back is None, reason="mate._stand_back is not built or not wanted")),
    pytest.param(progress._stand_back_in_python, id="python"),
]


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


def clock_at(t: float) -> array[float]:
    return array("d", [t])


@pytest.mark.parametrize("stand_back", IMPLEMENTATIONS)
def test_returns_false_once_the_period_after_the_clock_has_passed(
        stand_back: StandBack, pipe: tuple[int, int]) -> None:
    assert stand_back(clock_at(-math.inf), 0.001, pipe[0]) is False  # the loop gave up
    assert stand_back(clock_at(time.monotonic() - 1.0), 0.001, pipe[0]) is False
    start = time.monotonic()
    assert stand_back(clock_at(start), 0.05, pipe[0]) is False
    assert 0.045 <= time.monotonic() - start < 1.0


@pytest.mark.parametrize("stand_back", IMPLEMENTATIONS)
def test_returns_true_when_woken_through_the_descriptor(
        stand_back: StandBack, pipe: tuple[int, int]) -> None:
    clock = clock_at(math.inf)  # a pass runs for ever: only the pipe ends the wait...
    threading.Timer(0.05, os.write, (pipe[1], b"\0")).start()
    rescue = threading.Timer(2.0, clock.__setitem__, (0, -math.inf))  # ... or a give-up
    rescue.start()
    start = time.monotonic()
    try:
        assert stand_back(clock, 0.01, pipe[0]) is True
    finally:
        rescue.cancel()
    assert 0.04 <= time.monotonic() - start < 1.0
    assert os.read(pipe[0], 16) == b"\0"  # left for the caller to take


@pytest.mark.parametrize("stand_back", IMPLEMENTATIONS)
def test_waits_as_long_as_the_clock_moves(stand_back: StandBack, pipe: tuple[int, int]) -> None:
    """The loop goes on helping for 0.2 s, marking a pass every 2 ms with a period of
    10 ms: the wait ends a period after the last mark, not a period after it began.

    A busy host can hold the helping thread back for more than a period between two
    marks; the wait may then end a period after the mark before that gap, and no
    sooner. The thread records the first such gap (over-estimated, never under)."""
    period = 0.01
    helped = 0.2
    start = time.monotonic()
    clock = clock_at(start)
    first_gap: list[float] = []  # the mark after which the thread left the clock a period

    def helping() -> None:
        mark = start
        while mark < start + helped:
            clock[0] = math.inf  # a pass runs...
            if not first_gap and time.monotonic() - mark > period:
                first_gap.append(mark)
            time.sleep(0.001)
            mark = time.monotonic()
            clock[0] = mark  # ... and ends
            time.sleep(0.001)

    loop = threading.Thread(target=helping)
    rescue = threading.Timer(2.0, os.write, (pipe[1], b"\0"))  # a wait that never ends fails
    loop.start()
    rescue.start()
    try:
        assert stand_back(clock, period, pipe[0]) is False
        ended = time.monotonic()
    finally:
        rescue.cancel()
        loop.join()
    assert ended - start < helped + 0.5
    if first_gap and first_gap[0] < ended:
        assert ended >= first_gap[0] + period
    else:
        assert ended - start >= helped


def test_thread_mode_stands_back_with_the_c_wait_where_it_is_built() -> None:
    if c_stand_back is None:
        pytest.skip("mate._stand_back is not built or not wanted")
    assert progress.stand_back is c_stand_back


def test_bad_arguments_are_refused(pipe: tuple[int, int]) -> None:
    if c_stand_back is None:
        pytest.skip("mate._stand_back is not built or not wanted")
    with pytest.raises(TypeError):
        c_stand_back(clock_at(0.0), 0.001)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="period"):
        c_stand_back(clock_at(0.0), 0.0, pipe[0])
    with pytest.raises(ValueError, match="one aligned double"):
        c_stand_back(array("f", [0.0]), 0.001, pipe[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        c_stand_back(b"12345678", 0.001, "no descriptor")  # type: ignore[arg-type]
