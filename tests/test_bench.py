"""Tests of mate-bench's own arithmetic and output, on synthetic inputs.

No timing assertions: the figures are computed from made-up samples. One
smoke run of the command on the local transport checks the JSON schema of
SPEC §5 end to end.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from launch import load_script, run_bounded

import mate
from mate.bench import cli, driver, stats
from mate.bench.measure import Measurement, Sample, measure
from mate.bench.report import (
    ROW_KEYS,
    SUMMARY_KEYS,
    TOP_KEYS,
    ProgressBar,
    Result,
    Row,
    format_head,
    format_row,
    format_summary,
    write_plot,
)

K, M = 1024, 1024 * 1024

# -- sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "size"), [
    ("0", 0), ("8", 8), ("4K", 4096), ("4k", 4096), ("1M", M), ("1m", M), ("1G", 1 << 30),
    (" 64K ", 64 * K), ("4KiB", 4096), ("2KB", 2048), ("16B", 16),
])
def test_parse_size(text: str, size: int) -> None:
    assert stats.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "K", "abc", "-1", "1.5K", "4T", "2G", "1 K B x"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        stats.parse_size(text)


def test_parse_sizes_range() -> None:
    sizes = stats.parse_sizes("1:4M")
    assert sizes[0] == 1 and sizes[-1] == 4 * M and len(sizes) == 23
    assert all(b == 2 * a for a, b in itertools.pairwise(sizes))
    assert stats.parse_sizes("8:8") == [8]
    assert stats.parse_sizes("1K:4K") == [1024, 2048, 4096]


def test_parse_sizes_list() -> None:
    assert stats.parse_sizes("8,4096,1M") == [8, 4096, M]
    assert stats.parse_sizes("1M, 8,8 ,0") == [0, 8, M]  # sorted, no duplicates, 0 allowed


@pytest.mark.parametrize(("text", "why"), [
    ("", "no sizes"),
    ("3:8", "powers of two"),
    ("0:4", "powers of two"),
    ("8:4", "empty"),
    ("1:2:4", "LO:HI"),
    ("8,,16", "empty item"),
    ("8,x", "not a size"),
    ("1:2G", "larger"),
])
def test_parse_sizes_rejects(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        stats.parse_sizes(text)


def test_bad_sizes_are_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["pingpong", "--transport", "local", "--sizes", "3:7"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--sizes" in err and "powers of two" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["pingpong", "--transport", "local", "--baseline"], "--baseline and --floor need a launched"),
    (["pingpong", "--transport", "local", "--progress", "thread"], "launched transports"),
    (["put", "--transport", "ibverbs", "--rma", "native"], "--transport mpi only"),
    (["pingpong", "--transport", "ibverbs", "--progress", "manual"], "loop, poll, thread"),
    (["pingpong", "--transport", "mpi", "--progress", "loop"], "poll, thread, manual"),
    (["get", "--transport", "mpi", "--wait", "submission"], "no submission"),
    (["pingpong", "--transport", "mpi", "--rma", "native"], "put and get"),
    (["pingpong", "--repetitions", "0"], "must be >= 1"),
    (["pingpong", "--min-time", "-1"], ">= 0"),
    (["pingpong", "--window", "8"], "rate pattern only"),
    (["pingping", "--handlers"], "rate pattern only"),
    (["rate", "--window", "0"], "must be >= 1"),
    (["rate", "--wait", "submission"], "no submission"),
    (["put", "--transport", "mpi", "--floor"], "pingpong, pingping, rate patterns only"),
    (["pingpong", "--transport", "local", "--floor"], "need a launched transport"),
    (["pingpong", "--transport", "local", "--tcp"], "--tcp needs a launched transport"),
    (["rate", "--transport", "ibverbs", "--tcp"], "pingpong pattern only"),
])
def test_bad_combinations(argv: list[str], message: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert message in capsys.readouterr().err


def test_default_transport_outside_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    args = cli.parse_args(["put"])
    assert args.transport == "local" and args.sizes == stats.parse_sizes(cli.DEFAULT_SIZES)
    monkeypatch.setenv("PMI_RANK", "0")
    assert cli.parse_args(["put"]).transport == "mpi"


def test_format_size() -> None:
    assert [stats.format_size(s) for s in (0, 8, 1000, 1024, 4 * M, 3 * K)] == \
        ["0", "8", "1000", "1K", "4M", "3K"]
    assert stats.format_size(1536.0 + 0.5) == "1.5K"


# -- arithmetic -------------------------------------------------------------------------------


def test_median() -> None:
    assert stats.median([3.0]) == 3.0
    assert stats.median([5.0, 1.0, 3.0]) == 3.0
    assert stats.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError):
        stats.median([])


def test_latency() -> None:
    assert stats.latency_us(1.0, 1_000_000) == pytest.approx(1.0)
    assert stats.latency_us(1.0, 1_000_000, divisor=2) == pytest.approx(0.5)  # pingpong
    with pytest.raises(ValueError):
        stats.latency_us(1.0, 0)


def test_bandwidth() -> None:
    # MB = 10**6 bytes: one byte per µs is one MB/s.
    assert stats.bandwidth_mbps(1_000_000, 1_000_000.0) == pytest.approx(1.0)
    assert stats.bandwidth_mbps(4 * M, 1000.0) == pytest.approx(4194.304)
    assert stats.bandwidth_mbps(0, 5.0) == 0.0
    with pytest.raises(ValueError):
        stats.bandwidth_mbps(8, 0.0)


def test_cpu_percent() -> None:
    assert stats.cpu_percent(0.5, 1.0) == pytest.approx(50.0)
    assert stats.cpu_percent(0.0, 2.0) == 0.0
    assert stats.cpu_percent(2.0, 1.0) == pytest.approx(200.0)  # two busy threads
    with pytest.raises(ValueError):
        stats.cpu_percent(1.0, 0.0)


def test_ratio_and_peak() -> None:
    assert stats.ratio(3.0, 2.0) == 1.5
    assert stats.ratio(None, 2.0) is None and stats.ratio(1.0, None) is None
    assert stats.ratio(1.0, 0.0) is None
    assert stats.peak([1.0, None, 3.0]) == 3.0 and stats.peak([None]) is None


def test_n_half_interpolates_in_log_size() -> None:
    # half the peak (2) lies half-way between 1 and 3, at 1K and 4K: 2K in log size
    assert stats.n_half([1024, 4096, 16384], [1.0, 3.0, 4.0]) == pytest.approx(2048.0)
    # a quarter of the way: 1K * 4 ** 0.25
    assert stats.n_half([1024, 4096, 16384], [1.0, 9.0, 4.0 * 3]) == pytest.approx(
        1024 * 4 ** (((12 / 2) - 1) / (9 - 1)))


def test_n_half_exactly_at_a_measured_size() -> None:
    assert stats.n_half([1, 2, 4, 8], [1.0, 2.0, 4.0, 8.0]) == pytest.approx(4.0)


def test_n_half_smallest_size_already_above_half() -> None:
    assert stats.n_half([8, 16, 32], [10.0, 12.0, 14.0]) == 8.0
    assert stats.n_half([64], [5.0]) == 64.0


def test_n_half_sorts_and_takes_the_first_crossing() -> None:
    sizes, bws = [4096, 1024, 16384, 2048], [9.0, 1.0, 10.0, 3.0]
    assert stats.n_half(sizes, bws) == pytest.approx(
        math.exp(math.log(2048) + (5 - 3) / (9 - 3) * (math.log(4096) - math.log(2048))))
    # a dip after the first crossing does not move it
    assert stats.n_half([1, 2, 4, 8], [1.0, 6.0, 2.0, 10.0]) == pytest.approx(
        math.exp((5 - 1) / (6 - 1) * math.log(2)))


def test_n_half_from_size_zero_is_linear() -> None:
    assert stats.n_half([0, 8], [0.0, 10.0]) == pytest.approx(4.0)


def test_n_half_without_data() -> None:
    assert stats.n_half([], []) is None
    assert stats.n_half([0, 8], [0.0, 0.0]) is None
    with pytest.raises(ValueError):
        stats.n_half([1, 2], [1.0])


def test_iteration_counts() -> None:
    assert stats.next_iterations(10, 0.001, 0.05, 10**6) == 100  # at most 10x per step
    assert stats.next_iterations(10, 0.04, 0.05, 10**6) == 20  # at least 2x
    assert stats.next_iterations(100, 0.01, 0.05, 10**6) == 600  # 20 % past min_time
    assert stats.next_iterations(10, 0.0, 0.05, 10**6) == 100
    assert stats.next_iterations(10, 0.001, 0.05, 15) == 15  # capped
    assert stats.iteration_cap(8) == stats.MAX_ITERATIONS
    assert stats.iteration_cap(stats.GIB) == 4
    assert stats.iteration_cap(0) == stats.MAX_ITERATIONS


# -- measurement with a synthetic batch --------------------------------------------------------


class FakeBatch:
    """Each iteration 'takes' `per_iteration` s of wall time and half of it in CPU."""

    def __init__(self, per_iteration: float) -> None:
        self.per_iteration = per_iteration
        self.calls: list[int] = []

    async def __call__(self, n: int) -> Sample:
        self.calls.append(n)
        return Sample(n, n * self.per_iteration, n * self.per_iteration / 2)


def test_measure_calibrates_and_takes_the_median() -> None:
    batch = FakeBatch(100e-6)
    m = asyncio.run(measure(batch, 64, min_time=0.01, repetitions=5, divisor=2))
    assert batch.calls[0] == 1  # warm-up starts with one iteration
    assert m.iterations * 100e-6 >= 0.01  # one repetition reaches min_time
    assert batch.calls[-5:] == [m.iterations] * 5
    assert m.latency_us == pytest.approx(50.0)  # half of 100 µs
    assert m.bandwidth_mbps == pytest.approx(64 / 50.0)
    assert m.cpu_percent == pytest.approx(50.0)


def test_measure_with_fixed_iterations_and_no_warmup() -> None:
    batch = FakeBatch(1.0)
    m = asyncio.run(measure(batch, 8, min_time=0.05, repetitions=3, warmup=0, iterations=1))
    assert batch.calls == [1, 1, 1]
    assert m.latency_us == pytest.approx(1e6)


def test_measure_respects_the_cap_for_huge_sizes() -> None:
    batch = FakeBatch(1e-9)
    m = asyncio.run(measure(batch, stats.GIB, min_time=10.0, repetitions=1))
    assert max(batch.calls) <= stats.iteration_cap(stats.GIB) == m.iterations


def test_sides_calibrate_apart_then_take_turns_one_repetition_each() -> None:
    """mate, raw, the floor and TCP each calibrate in a phase of their own, then alternate a
    repetition at a time, so that a drifting host weighs on every side alike; each turn
    warms its side up again (untimed) before the timed batch; rank 1 serves exactly the
    phases that rank 0 ends, in the same order."""
    opts = driver.Options("pingpong", "mpi", repetitions=3, min_time=0.01)
    events: list[tuple[str, str]] = []

    class Recorder(FakeBatch):
        def __init__(self, label: str, per_iteration: float) -> None:
            super().__init__(per_iteration)
            self.label = label

        async def __call__(self, n: int) -> Sample:
            events.append((self.label, "batch"))
            return await super().__call__(n)

        def end_phase(self) -> None:
            events.append((self.label, "end"))

    batches = [Recorder(label, t) for label, t in
               (("mate", 200e-6), ("raw", 50e-6), ("floor", 100e-6), ("tcp", 300e-6))]
    sides = [driver._Side(b.label, b, b.end_phase) for b in batches]
    shown: list[str] = []
    mine, raw, floor, tcp = asyncio.run(driver._measure_sides(opts, sides, 64, shown.append))
    assert shown == ["mate", "raw", "floor", "tcp"]
    phases: list[list[str]] = []  # the sides each phase ran, in order
    current: list[str] = []
    for label, what in events:
        current.append(label)
        if what == "end":
            phases.append(current)
            current = []
    assert current == []
    calibration, rounds = phases[:4], phases[4:]
    assert [set(p) for p in calibration] == [{"mate"}, {"raw"}, {"floor"}, {"tcp"}]
    assert [p[-1] for p in rounds] == ["mate", "raw", "floor", "tcp"] * opts.repetitions
    assert all(len(p) == 3 for p in rounds)  # warm-up, timed batch, end of the phase
    for measurement, batch in zip((mine, raw, floor, tcp), batches, strict=True):
        n = measurement.iterations
        assert len(measurement.samples) == opts.repetitions
        assert n * batch.per_iteration >= opts.min_time
        turns = batch.calls[-2 * opts.repetitions:]
        assert turns == [max(1, n // driver.TURN_WARMUP), n] * opts.repetitions
    assert mine.latency_us == pytest.approx(100.0) and raw.latency_us == pytest.approx(25.0)

    served: list[str] = []

    class Server:
        def __init__(self, label: str) -> None:
            self.label = label

        def serve_phase(self) -> None:
            served.append(self.label)

    class MateServer(Server):
        async def serve_phase(self) -> None:  # type: ignore[override]
            served.append(self.label)

    beside = {"raw": Server("raw"), "floor": MateServer("floor"), "tcp": MateServer("tcp")}
    asyncio.run(driver._serve(opts, MateServer("mate"), beside))  # type: ignore[arg-type]
    assert served == [p[-1] for p in phases] * len(opts.sweep)


def test_measurement_median_and_cpu_over_all_repetitions() -> None:
    m = Measurement(1000, (Sample(10, 0.001, 0.001), Sample(10, 0.003, 0.0),
                           Sample(10, 0.002, 0.002)))
    assert m.latency_us == pytest.approx(200.0)  # median of 100, 300, 200 µs
    assert m.bandwidth_mbps == pytest.approx(5.0)
    assert m.cpu_percent == pytest.approx(50.0)  # 0.003 s over 0.006 s


# -- results: JSON, table, plot ------------------------------------------------------------------


def synthetic_result(baseline: bool) -> Result:
    rows = []
    for size in (0, 8, 1024, 65536, 4 * M):
        latency = 5.0 + size / 1000.0
        mate = Measurement(size, (Sample(100, latency * 100e-6, latency * 50e-6),))
        raw = Measurement(size, (Sample(100, latency * 50e-6, latency * 50e-6),))
        rows.append(Row.from_measurements(mate, raw if baseline else None))
    return Result("pingpong", "mpi", "poll", "completion", "testhost", rows,
                  extra={"rma": "native", "repetitions": 1, "pattern": "overridden?"})


def check_schema(obj: dict[str, object], *, baseline: bool) -> None:
    """SPEC §5: the keys, their types, and null baseline fields without a baseline."""
    for key in TOP_KEYS:
        assert key in obj, key
    for key in ("pattern", "transport", "wait", "host"):
        assert isinstance(obj[key], str), key
    assert obj["progress"] is None or isinstance(obj["progress"], str)
    rows = obj["rows"]
    assert isinstance(rows, list) and rows
    for row in rows:
        for key in ROW_KEYS:
            assert key in row, key
        assert isinstance(row["size"], int)
        for key in ("latency_us", "bandwidth_MBps", "cpu_percent"):
            assert isinstance(row[key], float), key
        for key in ("baseline_latency_us", "baseline_bandwidth_MBps"):
            assert (isinstance(row[key], float) if baseline else row[key] is None), key
    summary = obj["summary"]
    assert isinstance(summary, dict)
    assert set(SUMMARY_KEYS) <= set(summary)
    assert isinstance(summary["peak_bandwidth_MBps"], float)
    assert isinstance(summary["n_half"], float)
    for key in ("baseline_peak_bandwidth_MBps", "baseline_n_half"):
        assert (isinstance(summary[key], float) if baseline else summary[key] is None), key


@pytest.mark.parametrize("baseline", [False, True])
def test_json_schema(baseline: bool, tmp_path: Path) -> None:
    result = synthetic_result(baseline)
    path = tmp_path / "r.json"
    result.write_json(path)
    obj = json.loads(path.read_text())
    check_schema(obj, baseline=baseline)
    assert obj["pattern"] == "pingpong"  # extra keys never override the contract's
    assert obj["rma"] == "native"
    assert [row["size"] for row in obj["rows"]] == [0, 8, 1024, 65536, 4 * M]
    assert obj["summary"]["peak_bandwidth_MBps"] == pytest.approx(max(
        row["bandwidth_MBps"] for row in obj["rows"]))
    if baseline:
        assert obj["rows"][1]["latency_ratio"] == pytest.approx(2.0)
        assert obj["rows"][1]["bandwidth_ratio"] == pytest.approx(0.5)


def format_table(result: Result) -> str:
    """The table as mate-bench prints it, row by row, then the summary."""
    rows = [format_row(row, result.has_baseline) for row in result.rows]
    return "\n".join([format_head(result, result.has_baseline), *rows, format_summary(result)])


def test_table(baseline: bool = True) -> None:
    text = format_table(synthetic_result(baseline))
    lines = text.splitlines()
    assert lines[0].startswith("# mate-bench pingpong mpi progress=poll")
    assert "raw us" in lines[1] and "lat ratio" in lines[1]
    assert lines[-1].startswith("summary: peak bandwidth") and "baseline" in lines[-1]
    assert any(line.split()[0] == "4M" for line in lines[2:-1])
    plain = format_table(synthetic_result(False))
    assert "raw us" not in plain and "baseline" not in plain.splitlines()[-1]


@pytest.mark.parametrize("baseline", [False, True])
def test_plot_writes_a_png(baseline: bool, tmp_path: Path) -> None:
    path = tmp_path / "plot.png"
    write_plot(synthetic_result(baseline), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_bar() -> None:
    off = io.StringIO()
    bar = ProgressBar(3, "x", enabled=False, stream=off)
    bar.update(1)
    bar.clear()
    assert off.getvalue() == ""
    on = io.StringIO()
    bar = ProgressBar(4, "pingpong", enabled=True, stream=on)
    bar.update(2, "64K")
    bar.clear()
    assert on.getvalue().startswith("\rpingpong [") and "2/4 64K" in on.getvalue()
    assert "\n" not in on.getvalue()


async def test_every_side_of_a_comparison_uses_the_ranks_one_set_of_buffers() -> None:
    """Mate, raw MPI, the floor and TCP send from and receive into the same memory:
    where a buffer lies moves a 4 MiB transfer by more than the targets' margins
    (`bench/buffer_placement.py`), which is a cost of neither side."""
    pytest.importorskip("mpi4py.MPI")
    opts = driver.Options("put", "mpi", sizes=(8, 4096), baseline=True, floor=True, tcp=True)
    async with mate.local.worlds(2) as (world, _):
        bench, raw, floor, tcp = driver.sides(opts, world)
        assert raw is not None and floor is not None and tcp is not None
        try:
            assert raw.buffers is bench.buffers and floor.buffers is bench.buffers
            assert tcp.outs is bench.buffers.outs
            assert len(bench.buffers.outs[4096]) == 4096
        finally:
            raw.teardown()
            floor.teardown()


# -- one smoke run of the command --------------------------------------------------------------


def test_smoke_run_local(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "mate-bench"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mate.bench"]
    path = tmp_path / "pp.json"
    env = {k: v for k, v in os.environ.items() if k != cli.PROGRESS_ENV}
    done = subprocess.run(
        [*command, "pingpong", "--transport", "local", "--sizes", "8,1024",
         "--min-time", "0.001", "--repetitions", "1", "--json", str(path)],
        capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    obj = json.loads(path.read_text())
    check_schema(obj, baseline=False)
    assert obj["pattern"] == "pingpong" and obj["transport"] == "local"
    assert obj["wait"] == "completion"
    assert [row["size"] for row in obj["rows"]] == [8, 1024]
    assert "summary: peak bandwidth" in done.stdout
    assert done.stderr == ""  # no progress bar when stderr is not a terminal


# -- issue 13: friction seen as a new user -------------------------------------------------------


def bench_env() -> dict[str, str]:
    """The environment of a user's shell: no progress bar forced, no unbuffered stdout."""
    return {k: v for k, v in os.environ.items() if k not in (cli.PROGRESS_ENV, "PYTHONUNBUFFERED")}


def test_piped_output_comes_as_it_is_measured() -> None:
    """Piped, mate-bench used to print nothing until the end: the head must arrive before
    the measurement, not with the rows after it."""
    script = Path(sys.executable).parent / "mate-bench"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mate.bench"]
    idle = 1.0
    with subprocess.Popen([*command, "wait", "--transport", "local", "--idle", str(idle),
                           "--repetitions", "1"], stdout=subprocess.PIPE, text=True,
                          env=bench_env()) as process:
        assert process.stdout is not None
        head = process.stdout.readline()
        head_time = time.monotonic()
        rest = process.stdout.read()
        rest_time = time.monotonic()
    assert process.returncode == 0
    assert head.startswith("# mate-bench wait local")
    assert rest_time - head_time >= idle / 2, "the head came only with the rows"
    assert rest.splitlines()[1].split()[0] == "8"


def test_rows_are_printed_as_they_are_measured(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The head is printed before the first size is measured, each row before the next."""
    monkeypatch.delenv(cli.PROGRESS_ENV, raising=False)
    printed = ""
    before: dict[int, str] = {}
    measure_sides = driver._measure_sides

    async def spy(opts: driver.Options, sides: Any, size: int,
                  show: Any) -> list[Measurement]:
        nonlocal printed
        printed += capsys.readouterr().out
        before[size] = printed
        return await measure_sides(opts, sides, size, show)

    monkeypatch.setattr(driver, "_measure_sides", spy)
    cli.main(["pingpong", "--transport", "local", "--sizes", "8,16", "--min-time", "0",
              "--repetitions", "1"])
    printed += capsys.readouterr().out
    assert before[8].startswith("# mate-bench pingpong local")
    assert "latency us" in before[8] and "summary" not in before[8]
    assert [line.split()[0] for line in before[16].splitlines()[2:]] == ["8"]
    assert printed.splitlines()[-1].startswith("summary: peak bandwidth")


def test_help_shows_a_single_percent_sign() -> None:
    """The epilog is not %-formatted by argparse: '%%' came out literally."""
    text = cli.build_parser().format_help()
    assert "CPU %" in text and "%%" not in text


def wait_result(baseline: bool) -> Result:
    mate = Measurement(8, (Sample(1, 1.0, 0.03),))
    raw = Measurement(8, (Sample(1, 1.0, 1.0),))
    return Result("wait", "mpi", "thread", "completion", "testhost",
                  [Row.from_measurements(mate, raw if baseline else None)])


@pytest.mark.parametrize("baseline", [False, True])
def test_wait_summary_is_the_cpu_used_while_waiting(baseline: bool) -> None:
    """The wait pattern measures CPU, not bandwidth: its summary said 'peak bandwidth 0.0
    MB/s, n1/2 8'."""
    result = wait_result(baseline)
    line = format_summary(result)
    assert line.startswith("summary:") and "3.0 % of a core" in line
    assert "bandwidth" not in line and "n1/2" not in line
    assert ("100.0 %" in line) == baseline
    summary = result.to_json()["summary"]
    assert set(summary) == set(SUMMARY_KEYS)  # the schema stays, with nulls
    assert all(value is None for value in summary.values())


def test_plot_size_axis_ticks_whole_bytes_within_the_sizes(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """From 1 B, the log axis had a tick at 0.5 (bytes) left of the data."""
    from matplotlib.figure import Figure

    figures: list[Figure] = []
    savefig = Figure.savefig

    def keep(self: Figure, *args: Any, **kwargs: Any) -> None:
        figures.append(self)
        savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    rows = [Row(size, 5.0 + size / 1e3, size / (5.0 + size / 1e3), 10.0)
            for size in stats.parse_sizes("1:4M")]
    write_plot(Result("pingpong", "local", None, "completion", "testhost", rows),
               tmp_path / "plot.png")
    (figure,) = figures
    for ax in figure.axes:
        lo, hi = ax.get_xlim()
        assert 0.5 < lo <= 1 and 4 * M <= hi < 8 * M
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        formatter = ax.xaxis.get_major_formatter()
        labels = [formatter(t, i) for i, t in enumerate(ticks)]
        assert ticks and all(t >= 1 and t == int(t) for t in ticks), ticks
        assert all(re.fullmatch(r"\d+[KM]?", label) for label in labels), labels
        assert formatter(0.5, 0) == "" and formatter(1536.5, 0) == ""  # whole bytes only


def test_written_files_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--json and --plot wrote their files without a word."""
    monkeypatch.delenv(cli.PROGRESS_ENV, raising=False)
    json_path, plot_path = tmp_path / "r.json", tmp_path / "r.png"
    cli.main(["pingpong", "--transport", "local", "--sizes", "8", "--min-time", "0",
              "--repetitions", "1", "--json", str(json_path), "--plot", str(plot_path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == [f"wrote {json_path}", f"wrote {plot_path}"]
    assert json_path.exists() and plot_path.exists()


# -- the rate pattern (message rate, osu_mbw_mr style) ---------------------------------------------


def test_rate_rows_carry_messages_per_second() -> None:
    """The rate pattern's latency is the time per message, so messages/s is 10^6 / latency;
    the table shows both rates and the title the window."""
    mate = Measurement(8, (Sample(10, 0.001, 0.01),), divisor=64)  # 10 windows of 64 in 1 ms
    raw = Measurement(8, (Sample(10, 0.0001, 0.001),), divisor=64)
    result = Result("rate", "mpi", "poll", "completion", "testhost",
                    [Row.from_measurements(mate, raw)], extra={"window": 64})
    row = result.to_json()["rows"][0]
    assert row["messages_per_s"] == pytest.approx(640_000)
    assert row["baseline_messages_per_s"] == pytest.approx(6_400_000)
    assert row["latency_us"] == pytest.approx(1e6 / 640_000)
    head = format_head(result, True)
    assert "window=64" in head.splitlines()[0] and head.split()[-2:] == ["raw", "msg/s"]
    assert format_row(result.rows[0], True, rate=True).split()[-2:] == ["640000", "6400000"]
    assert "msg/s" not in format_head(synthetic_result(True), True)


@pytest.mark.parametrize("handlers", [False, True])
def test_rate_runs_locally(handlers: bool, tmp_path: Path) -> None:
    path = tmp_path / "rate.json"
    env = {k: v for k, v in os.environ.items() if k != cli.PROGRESS_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "mate.bench", "rate", "--transport", "local", "--sizes", "8,4K",
         "--window", "8", "--min-time", "0.001", "--repetitions", "2", "--json", str(path),
         *(["--handlers"] if handlers else [])],
        capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    obj = json.loads(path.read_text())
    check_schema(obj, baseline=False)
    assert (obj["pattern"], obj["window"], obj["handler_driven"]) == ("rate", 8, handlers)
    for row in obj["rows"]:
        assert row["messages_per_s"] == pytest.approx(1e6 / row["latency_us"])
        assert row["baseline_messages_per_s"] is None
    assert ("handler-driven" in done.stdout) == handlers


@pytest.mark.parametrize(("transport", "handlers"), [("mpi", False), ("ibverbs", True)])
def test_rate_against_raw_windows_on_two_ranks(transport: str, handlers: bool,
                                               tmp_path: Path) -> None:
    """Two launched ranks, beside raw Issend/Irecv windows in the same run."""
    path = tmp_path / "rate.json"
    env = {k: v for k, v in os.environ.items() if k != cli.PROGRESS_ENV}
    done = run_bounded(
        [sys.executable, "-m", "mate.bench", "rate", "--transport", transport, "--baseline",
         "--sizes", "8,64K", "--window", "16", "--min-time", "0.001", "--repetitions", "2",
         "--json", str(path), *(["--handlers"] if handlers else [])], 300, "mate-bench rate", env)
    assert done.returncode == 0, done.stdout + done.stderr
    obj = json.loads(path.read_text())
    check_schema(obj, baseline=True)
    assert obj["transport"] == transport and obj["window"] == 16
    for row in obj["rows"]:
        assert row["messages_per_s"] > 0 and row["baseline_messages_per_s"] > 0


# -- the asyncio floor beside mate (mate-bench pingpong --floor) ----------------------------------


async def test_the_rate_floor_poller_resolves_each_future_when_its_request_completes() -> None:
    """`_Poller` (the rate floor's one Testsome callback) under a made-up MPI whose
    requests complete in random order: each future resolves once, at its own request's
    completion, whether the front or the whole list found it."""
    from mate.bench.patterns import _Poller

    rng = random.Random(7)

    class Request:
        def __init__(self) -> None:
            self.done = self.reported = False

        def Get_status(self) -> bool:  # a bare progress call: this MPI progresses in Testsome
            return self.done

    class MPI:
        class Request:
            @staticmethod
            def Testsome(requests: list[Request]) -> list[int] | None:
                active = [i for i, r in enumerate(requests) if not r.reported]
                if not active:
                    return None  # MPI_UNDEFINED: no active request
                for i in active:  # a few complete in every call
                    requests[i].done = requests[i].done or rng.random() < 0.3
                done = [i for i in active if requests[i].done]
                for i in done:  # as in MPI, a completed request is inactive from then on
                    requests[i].reported = True
                rng.shuffle(done)
                return done

    poller = _Poller(MPI)
    requests = [Request() for _ in range(40)]
    futures = [poller.wait(r) for r in requests]
    resolved: list[tuple[int, bool]] = []  # (request, whether it had completed)
    for i, future in enumerate(futures):
        future.add_done_callback(lambda f, i=i: resolved.append((i, requests[i].done)))
        assert not future.done()
    await asyncio.wait_for(asyncio.gather(*futures), 5)
    assert sorted(resolved) == [(i, True) for i in range(40)]
    assert all(r.done for r in requests) and poller.requests == poller.futures == []
    assert poller.oldest == 0


def test_floor_columns_and_ratio() -> None:
    mate = Measurement(8, (Sample(100, 0.003, 0.01),), divisor=2)  # 15 us
    floor = Measurement(8, (Sample(100, 0.001, 0.01),), divisor=2)  # 5 us
    result = Result("pingpong", "mpi", "poll", "completion", "testhost",
                    [Row.from_measurements(mate, None, floor)], extra={"floor": "asyncio"})
    row = result.to_json()["rows"][0]
    assert row["floor_latency_us"] == pytest.approx(5.0)
    assert row["floor_ratio"] == pytest.approx(3.0)
    assert row["baseline_latency_us"] is None
    head = format_head(result, False)
    assert "floor=asyncio" in head.splitlines()[0] and head.split()[-2:] == ["us", "/floor"]
    assert format_row(result.rows[0], False).split()[-2:] == ["5.00", "3.00"]
    assert synthetic_result(True).to_json()["rows"][0]["floor_ratio"] is None


def test_tcp_columns_and_ratio() -> None:
    mate = Measurement(8, (Sample(100, 0.003, 0.01),), divisor=2)  # 15 us
    tcp = Measurement(8, (Sample(100, 0.006, 0.01),), divisor=2)  # 30 us
    result = Result("pingpong", "ibverbs", "poll", "completion", "testhost",
                    [Row.from_measurements(mate, None, None, tcp)], extra={"tcp": "loopback"})
    row = result.to_json()["rows"][0]
    assert row["tcp_latency_us"] == pytest.approx(30.0)
    assert row["tcp_ratio"] == pytest.approx(0.5)
    assert row["floor_latency_us"] is None and row["baseline_latency_us"] is None
    head = format_head(result, False)
    assert "tcp=loopback" in head.splitlines()[0] and head.split()[-2:] == ["us", "/tcp"]
    assert format_row(result.rows[0], False).split()[-2:] == ["30.00", "0.50"]
    assert synthetic_result(True).to_json()["rows"][0]["tcp_ratio"] is None


def test_floor_peak_and_n_half_in_the_summary() -> None:
    """The floor's bandwidth curve gets its own peak and n½, from its latencies alone."""
    rows = []
    for size, mate_us, floor_us in ((1024, 20.0, 10.0), (65536, 40.0, 20.0),
                                    (1048576, 200.0, 160.0)):
        mate = Measurement(size, (Sample(100, mate_us * 200e-6, 0.01),), divisor=2)
        floor = Measurement(size, (Sample(100, floor_us * 200e-6, 0.01),), divisor=2)
        rows.append(Row.from_measurements(mate, None, floor))
    result = Result("pingpong", "mpi", "poll", "completion", "testhost", rows,
                    extra={"floor": "asyncio"})
    summary = result.to_json()["summary"]
    assert summary["floor_peak_bandwidth_MBps"] == pytest.approx(1048576 / 160.0)
    # Half the floor's peak (3277 MB/s) lies between 64 KiB (3277 MB/s) and 1 MiB.
    assert summary["floor_n_half"] == pytest.approx(65536, rel=0.01)
    assert summary["n_half"] > summary["floor_n_half"]
    assert "floor: peak bandwidth 6553.6 MB/s, n1/2 64.0K (65536 B)" in format_summary(result)
    no_floor = synthetic_result(True).to_json()["summary"]
    assert "floor_n_half" not in no_floor and "floor_peak_bandwidth_MBps" not in no_floor


@pytest.mark.parametrize("pattern", ["pingpong", "pingping", "rate"])
def test_floor_measured_in_the_same_run_on_two_ranks(tmp_path: Path, pattern: str) -> None:
    path = tmp_path / "pp.json"
    env = {k: v for k, v in os.environ.items() if k != cli.PROGRESS_ENV}
    done = run_bounded(
        [sys.executable, "-m", "mate.bench", pattern, "--transport", "mpi", "--baseline",
         "--floor", "--sizes", "8,4K", "--min-time", "0.001", "--repetitions", "2",
         "--json", str(path)], 300, f"mate-bench {pattern} --floor", env)
    assert done.returncode == 0, done.stdout + done.stderr
    obj = json.loads(path.read_text())
    check_schema(obj, baseline=True)
    assert obj["floor"] == "asyncio" and obj["pattern"] == pattern
    for row in obj["rows"]:
        assert row["floor_latency_us"] > 0
        assert row["floor_ratio"] == pytest.approx(row["latency_us"] / row["floor_latency_us"])
    assert obj["summary"]["floor_peak_bandwidth_MBps"] == pytest.approx(
        max(row["size"] / row["floor_latency_us"] for row in obj["rows"]))


@pytest.mark.parametrize("transport", ["ibverbs", "mpi"])
def test_tcp_measured_in_the_same_run_on_two_ranks(tmp_path: Path, transport: str) -> None:
    """`--tcp`: the TCP ping-pong takes turns with mate at every size, rank 1 serving
    each phase's connection in its own event loop (`mate.bench.loopback.TcpBench`)."""
    path = tmp_path / "pp.json"
    env = {k: v for k, v in os.environ.items() if k != cli.PROGRESS_ENV}
    done = run_bounded(
        [sys.executable, "-m", "mate.bench", "pingpong", "--transport", transport, "--tcp",
         "--sizes", "8,64K", "--min-time", "0.001", "--repetitions", "2",
         "--json", str(path)], 300, f"mate-bench pingpong --transport {transport} --tcp", env)
    assert done.returncode == 0, done.stdout + done.stderr
    obj = json.loads(path.read_text())
    check_schema(obj, baseline=False)
    assert obj["tcp"] and obj["transport"] == transport
    assert [row["size"] for row in obj["rows"]] == [8, 65536]
    for row in obj["rows"]:
        assert row["tcp_latency_us"] > 0
        assert row["tcp_ratio"] == pytest.approx(row["latency_us"] / row["tcp_latency_us"])


# -- the standard set's summary (bench/run_standard.py) ------------------------------------


def _put_run(mate_mbps: float, raw_mbps: float) -> dict[str, Any]:
    size = 4 * 1024 * 1024
    return {"rows": [{"size": size, "bandwidth_MBps": mate_mbps,
                      "baseline_bandwidth_MBps": raw_mbps,
                      "baseline_latency_us": size / raw_mbps}]}


def test_every_put_and_get_is_held_to_the_raw_of_its_own_run() -> None:
    """SPEC §7: each ratio from one run, thread mode's too (its raw no longer runs beside
    a progress thread that polls for good: rma_native.py, leases)."""
    rs = load_script(Path(__file__).parent.parent / "bench" / "run_standard.py")
    runs = {"put-poll-native": _put_run(5000, 6000), "put-thread-native": _put_run(5000, 5200)}
    assert rs.bandwidth_targets(runs) == [
        "- mpi put poll native, 4 MiB bandwidth ≥ 0.95x raw: 0.83x → NOT met",
        "- mpi put thread native, 4 MiB bandwidth ≥ 0.95x raw: 0.96x → met"]

def test_the_history_of_sets_computes_every_set_alike_in_the_order_they_ran(
        tmp_path: Path) -> None:
    """bench/history.py: one row per set (the top level the latest), oldest first by
    start (the summary's time less the set's length), each figure from the set's JSON
    rows, ✗ where it misses its target, a dash where the set lacks the run."""
    history = load_script(Path(__file__).parent.parent / "bench" / "history.py")

    def write_set(folder: Path, written: str, took: int, mate_4m: float, half: float) -> None:
        folder.mkdir(exist_ok=True)
        (folder / "SUMMARY.md").write_text(
            f"# mate-bench standard set\n\n{written}+00:00, host `vm`; the whole set took "
            f"{took} s.\n")
        rows = [{"size": 8, "latency_us": 5.0, "floor_latency_us": 10.0},
                {"size": 64 * 1024, "bandwidth_MBps": 7.0, "baseline_bandwidth_MBps": 10.0},
                {"size": 4 * 1024 * 1024, "bandwidth_MBps": mate_4m,
                 "baseline_bandwidth_MBps": 100.0}]
        (folder / "pingpong-poll.json").write_text(json.dumps(
            {"rows": rows, "summary": {"n_half": half * 1024}}))

    write_set(tmp_path, "2026-12-01T10:10:00", 600, 96.0, 60.0)  # the latest
    write_set(tmp_path / "later-named", "2026-11-30T09:00:00", 60, 90.0, 70.0)
    write_set(tmp_path / "2026-12-01-0900", "2026-12-01T09:05:00", 300, 99.0, 50.0)
    lines = history.table(tmp_path).splitlines()
    assert lines[0].startswith("| began | folder | 8 B /floor |") and len(lines) == 5
    assert [line.split(" | ")[:2] for line in lines[2:]] == [
        ["| 2026-11-30 08:59", "later-named"], ["| 2026-12-01 09:00", "2026-12-01-0900"],
        ["| 2026-12-01 10:00", "latest (top level)"]]
    cells = lines[2].split(" | ")
    assert cells[2] == "0.50" and cells[7] == "0.70" and cells[8] == "70.0 ✗"
    assert cells[9] == "0.90 ✗" and cells[10] == "-"
    assert lines[4].split(" | ")[9] == "0.96"


# -- where a large ping-ping's time goes (bench/exchange_phases.py) --------------------------


def _perf_script(copies: dict[int, list[tuple[float, float]]], size: int) -> str:
    """`perf script -F pid,time,event,trace` text of `copies` (us), with 16 B reads of
    MPICH's own (which are not copies of `size`) between them."""
    lines = []
    for pid, made in copies.items():
        for start, end in made:
            for at, kind, trace in ((start - 2, "enter", "pid: 0x1"), (start - 1, "exit", "0x10"),
                                    (start, "enter", "pid: 0x1"), (end, "exit", hex(size))):
                lines.append(f"{pid:>7} {at / 1e6:.6f}: syscalls:sys_{kind}_process_vm_readv: "
                             f"{trace}")
    return "\n".join(lines)


def test_a_ping_pings_phases_are_read_off_the_two_ranks_copies() -> None:
    """Each side's exchanges are paired across the ranks by their order: the copy and
    the skews of the pair, the gap from the later end to the next pair's first start,
    the exchange from start to start; the warm-up round and each block's last exchange
    (its next copies are the next side's) are left out."""
    phases = load_script(Path(__file__).parent.parent / "bench" / "exchange_phases.py")
    size, per_side = 4 << 20, {"mate": 40.0, "floor": 30.0, "raw": 10.0}  # gaps
    a: list[tuple[float, float]] = []
    b: list[tuple[float, float]] = []
    now = 0.0
    for _ in range(phases.ROUNDS):
        for side in phases.SIDES:
            for _ in range(phases.EXCHANGES):
                a.append((now, now + 300.0))
                b.append((now + 2.0, now + 320.0))  # starts 2 us later, ends 20 us later
                now += 320.0 + per_side[side]
            now += 1000.0  # the barrier before the next side
    copies = phases.parse_copies(_perf_script({101: a, 202: b}, size), size)
    assert sorted(copies) == [101, 202]
    assert [t for pair in copies[202] for t in pair] == pytest.approx(
        [t for pair in b for t in pair])
    medians = phases.phases(copies)
    for side, gap in per_side.items():
        assert medians[side] == {"copy": pytest.approx(309.0), "start skew": pytest.approx(2.0),
                                 "end skew": pytest.approx(20.0), "gap": pytest.approx(gap),
                                 "exchange": pytest.approx(320.0 + gap)}
    with pytest.raises(ValueError, match="expected two processes"):
        phases.phases({101: a, 202: b[:-1]})
