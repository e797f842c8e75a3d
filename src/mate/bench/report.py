"""Results of a benchmark run: the table on stdout, the JSON of SPEC §5, the plot.

The JSON object is the contract scripts and CI read (SPEC §5)::

    {"pattern", "transport", "progress", "wait", "host",
     "rows": [{"size", "latency_us", "bandwidth_MBps", "cpu_percent",
               "baseline_latency_us", "baseline_bandwidth_MBps"}],
     "summary": {"peak_bandwidth_MBps", "n_half",
                 "baseline_peak_bandwidth_MBps", "baseline_n_half"}}

Baseline fields are null without a baseline. Extra keys (``rma``, ``date``,
``python``, ``mpi_library``, ``repetitions``, ... and per row ``iterations``,
``baseline_cpu_percent``, ``latency_ratio``, ``bandwidth_ratio``,
``messages_per_s``, ``baseline_messages_per_s``, ``floor_latency_us``,
``floor_ratio``, ``tcp_latency_us``, ``tcp_ratio``; in the summary, with ``--floor``,
``floor_peak_bandwidth_MBps`` and ``floor_n_half``) may be added but those above never
change.
``messages_per_s`` is 10^6 / ``latency_us``: for the rate pattern, whose
latency is the time per message of a window, the message rate.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mate.bench import stats
from mate.bench.measure import Measurement

ROW_KEYS = ("size", "latency_us", "bandwidth_MBps", "cpu_percent", "baseline_latency_us",
            "baseline_bandwidth_MBps")
SUMMARY_KEYS = ("peak_bandwidth_MBps", "n_half", "baseline_peak_bandwidth_MBps",
                "baseline_n_half")
TOP_KEYS = ("pattern", "transport", "progress", "wait", "host", "rows", "summary")


@dataclass(frozen=True)
class Row:
    size: int
    latency_us: float
    bandwidth_MBps: float
    cpu_percent: float
    iterations: int = 0
    baseline_latency_us: float | None = None
    baseline_bandwidth_MBps: float | None = None
    baseline_cpu_percent: float | None = None
    baseline_iterations: int | None = None
    floor_latency_us: float | None = None  # the asyncio floor (mate-bench --floor)
    tcp_latency_us: float | None = None  # asyncio TCP streams on loopback (mate-bench --tcp)

    @classmethod
    def from_measurements(cls, mate: Measurement, raw: Measurement | None = None,
                          floor: Measurement | None = None,
                          tcp: Measurement | None = None) -> Row:
        return cls(
            mate.size, mate.latency_us, mate.bandwidth_mbps, mate.cpu_percent, mate.iterations,
            baseline_latency_us=None if raw is None else raw.latency_us,
            baseline_bandwidth_MBps=None if raw is None else raw.bandwidth_mbps,
            baseline_cpu_percent=None if raw is None else raw.cpu_percent,
            baseline_iterations=None if raw is None else raw.iterations,
            floor_latency_us=None if floor is None else floor.latency_us,
            tcp_latency_us=None if tcp is None else tcp.latency_us)

    @property
    def floor_bandwidth_MBps(self) -> float | None:
        if self.floor_latency_us is None or self.floor_latency_us <= 0:
            return None
        return stats.bandwidth_mbps(self.size, self.floor_latency_us)

    @property
    def floor_ratio(self) -> float | None:
        """MATE / the asyncio floor's latency (what mate costs above the event loop)."""
        return stats.ratio(self.latency_us, self.floor_latency_us)

    @property
    def tcp_ratio(self) -> float | None:
        """MATE / asyncio TCP streams' latency (SPEC §7's peer baseline for the soft device)."""
        return stats.ratio(self.latency_us, self.tcp_latency_us)

    @property
    def latency_ratio(self) -> float | None:
        """MATE / raw latency (above 1: MATE is slower)."""
        return stats.ratio(self.latency_us, self.baseline_latency_us)

    @property
    def messages_per_s(self) -> float | None:
        return 1e6 / self.latency_us if self.latency_us > 0 else None

    @property
    def baseline_messages_per_s(self) -> float | None:
        base = self.baseline_latency_us
        return 1e6 / base if base else None

    @property
    def bandwidth_ratio(self) -> float | None:
        """MATE / raw bandwidth (below 1: MATE moves less)."""
        return stats.ratio(self.bandwidth_MBps, self.baseline_bandwidth_MBps)

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "latency_us": self.latency_us,
            "bandwidth_MBps": self.bandwidth_MBps,
            "cpu_percent": self.cpu_percent,
            "baseline_latency_us": self.baseline_latency_us,
            "baseline_bandwidth_MBps": self.baseline_bandwidth_MBps,
            "iterations": self.iterations,
            "baseline_cpu_percent": self.baseline_cpu_percent,
            "baseline_iterations": self.baseline_iterations,
            "latency_ratio": self.latency_ratio,
            "bandwidth_ratio": self.bandwidth_ratio,
            "messages_per_s": self.messages_per_s,
            "baseline_messages_per_s": self.baseline_messages_per_s,
            "floor_latency_us": self.floor_latency_us,
            "floor_ratio": self.floor_ratio,
            "tcp_latency_us": self.tcp_latency_us,
            "tcp_ratio": self.tcp_ratio,
        }


@dataclass(frozen=True)
class Summary:
    peak_bandwidth_MBps: float | None
    n_half: float | None
    baseline_peak_bandwidth_MBps: float | None
    baseline_n_half: float | None
    # The asyncio floor's, measured beside mate (--floor): what no asyncio design beats.
    floor_peak_bandwidth_MBps: float | None = None
    floor_n_half: float | None = None

    @classmethod
    def of(cls, rows: list[Row]) -> Summary:
        sizes = [r.size for r in rows]
        base_peak, base_half = _peak_and_half(sizes, [r.baseline_bandwidth_MBps for r in rows])
        floor_peak, floor_half = _peak_and_half(sizes, [r.floor_bandwidth_MBps for r in rows])
        bandwidths = [r.bandwidth_MBps for r in rows]
        return cls(stats.peak(bandwidths), stats.n_half(sizes, bandwidths), base_peak,
                   base_half, floor_peak, floor_half)

    def to_json(self) -> dict[str, Any]:
        extra = (("floor_peak_bandwidth_MBps", "floor_n_half")
                 if self.floor_peak_bandwidth_MBps is not None else ())
        return {key: getattr(self, key) for key in (*SUMMARY_KEYS, *extra)}


def _peak_and_half(sizes: list[int], bandwidths: list[float | None]
                   ) -> tuple[float | None, float | None]:
    """Peak bandwidth and n½ of a column measured at every size, else (None, None)."""
    if not bandwidths or any(b is None for b in bandwidths):
        return None, None
    measured = [float(b) for b in bandwidths if b is not None]
    return stats.peak(measured), stats.n_half(sizes, measured)


@dataclass
class Result:
    pattern: str
    transport: str
    progress: str | None
    wait: str
    host: str
    rows: list[Row] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # extra top-level JSON keys

    @property
    def summary(self) -> Summary:
        if self.pattern == "wait":  # one small message after a long wait: no bandwidth
            return Summary(None, None, None, None)
        return Summary.of(self.rows)

    @property
    def has_baseline(self) -> bool:
        return any(r.baseline_latency_us is not None for r in self.rows)

    @property
    def has_floor(self) -> bool:
        return bool(self.extra.get("floor"))

    @property
    def has_tcp(self) -> bool:
        return bool(self.extra.get("tcp"))

    def title(self) -> str:
        parts = [self.pattern, self.transport]
        if self.progress:
            parts.append(f"progress={self.progress}")
        if self.extra.get("rma") and self.pattern in ("put", "get"):
            parts.append(f"rma={self.extra['rma']}")
        if self.wait != "completion":
            parts.append(f"wait={self.wait}")
        if self.extra.get("floor"):
            parts.append(f"floor={self.extra['floor']}")
        if self.extra.get("tcp"):
            parts.append("tcp=loopback")
        if self.pattern == "rate":
            parts.append(f"window={self.extra.get('window')}")
            if self.extra.get("handler_driven"):
                parts.append("handler-driven")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "pattern": self.pattern,
            "transport": self.transport,
            "progress": self.progress,
            "wait": self.wait,
            "host": self.host,
            "rows": [r.to_json() for r in self.rows],
            "summary": self.summary.to_json(),
        }
        for key, value in self.extra.items():
            obj.setdefault(key, value)
        return obj

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


# -- the table ------------------------------------------------------------------------------


def _num(value: float | None, width: int, digits: int = 2) -> str:
    if value is None:
        return "-".rjust(width)
    if abs(value) >= 10 ** (width - digits - 2):
        return f"{value:{width}.0f}"
    return f"{value:{width}.{digits}f}"


def format_head(result: Result, baseline: bool) -> str:
    """The title and column heads of the table (with the raw columns if `baseline`)."""
    head = f"{'size':>8} {'latency us':>11} {'MB/s':>10} {'CPU %':>7} {'iters':>8}"
    if baseline:
        head += (f"  {'raw us':>10} {'raw MB/s':>10} {'raw CPU%':>8}"
                 f"  {'lat ratio':>9} {'bw ratio':>8}")
    if result.pattern == "rate":
        head += f"  {'msg/s':>10}" + (f" {'raw msg/s':>10}" if baseline else "")
    if result.has_floor:
        head += f"  {'floor us':>9} {'/floor':>7}"
    if result.has_tcp:
        head += f"  {'tcp us':>9} {'/tcp':>7}"
    return f"# mate-bench {result.title()}  host={result.host}\n{head}"


def format_row(row: Row, baseline: bool, *, rate: bool = False) -> str:
    """One line of the table, under `format_head` (`rate`: with the message rates)."""
    line = (f"{stats.format_size(row.size):>8} {_num(row.latency_us, 11)} "
            f"{_num(row.bandwidth_MBps, 10)} {_num(row.cpu_percent, 7, 1)} "
            f"{row.iterations:>8}")
    if baseline:
        line += (f"  {_num(row.baseline_latency_us, 10)} "
                 f"{_num(row.baseline_bandwidth_MBps, 10)} "
                 f"{_num(row.baseline_cpu_percent, 8, 1)}"
                 f"  {_num(row.latency_ratio, 9)} {_num(row.bandwidth_ratio, 8)}")
    if rate:
        line += f"  {_num(row.messages_per_s, 10, 0)}"
        if baseline:
            line += f" {_num(row.baseline_messages_per_s, 10, 0)}"
    if row.floor_latency_us is not None:
        line += f"  {_num(row.floor_latency_us, 9)} {_num(row.floor_ratio, 7)}"
    if row.tcp_latency_us is not None:
        line += f"  {_num(row.tcp_latency_us, 9)} {_num(row.tcp_ratio, 7)}"
    return line


def show_row(row: Row, baseline: bool, bar: ProgressBar, *, rate: bool = False) -> None:
    """Print a row as soon as it is measured: flushed, since piped stdout would hold every
    row until the end of the sweep, and on a line of its own rather than after the bar."""
    bar.clear()
    print(format_row(row, baseline, rate=rate), flush=True)


def _plain(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _size_or_dash(value: float | None) -> str:
    return "-" if value is None else f"{stats.format_size(value)} ({value:.0f} B)"


def format_summary(result: Result) -> str:
    """The summary line under the table."""
    if result.pattern == "wait":
        return _wait_summary(result)
    s = result.summary
    line = (f"summary: peak bandwidth {_plain(s.peak_bandwidth_MBps)} MB/s, "
            f"n1/2 {_size_or_dash(s.n_half)}")
    if result.has_baseline:
        line += (f"; baseline: peak bandwidth {_plain(s.baseline_peak_bandwidth_MBps)} MB/s, "
                 f"n1/2 {_size_or_dash(s.baseline_n_half)}")
        peak_ratio = stats.ratio(s.peak_bandwidth_MBps, s.baseline_peak_bandwidth_MBps)
        half_ratio = stats.ratio(s.n_half, s.baseline_n_half)
        line += f"; MATE/raw: peak {_plain(peak_ratio, 2)}, n1/2 {_plain(half_ratio, 2)}"
    if s.floor_peak_bandwidth_MBps is not None:
        line += (f"; floor: peak bandwidth {_plain(s.floor_peak_bandwidth_MBps)} MB/s, "
                 f"n1/2 {_size_or_dash(s.floor_n_half)}")
    return line


def _wait_summary(result: Result) -> str:
    """The wait pattern's figure is the CPU that waiting costs, not a bandwidth."""
    (row,) = result.rows  # the pattern has a single size
    line = (f"summary: waiting {row.latency_us / 1e6:.2f} s for one message used "
            f"{row.cpu_percent:.1f} % of a core")
    if row.baseline_cpu_percent is not None:
        line += f"; raw mpi4py (blocking Recv): {row.baseline_cpu_percent:.1f} %"
    return line


# -- progress on stderr ------------------------------------------------------------------------


class ProgressBar:
    """A one-line progress display on stderr (plain carriage returns); silent when off."""

    def __init__(self, total: int, label: str, enabled: bool, stream: TextIO | None = None):
        self.total = total
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._width = 0

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        filled = 20 * done // max(self.total, 1)
        text = f"{self.label} [{'#' * filled}{'.' * (20 - filled)}] {done}/{self.total} {note}"
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def clear(self) -> None:
        """Erase the bar, e.g. before a line goes to stdout; `update` draws it again."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


# -- the plot -----------------------------------------------------------------------------------


SIZE_MARGIN = 2 ** 0.25  # room left and right of the sizes on the size axis, as a factor


def _size_tick(value: float, _position: float) -> str:
    """Whole bytes only, K and M binary: no label between them (a tick at 0.5 B)."""
    return stats.format_size(value) if value >= 1 and value == int(value) else ""


def write_plot(result: Result, path: str | Path) -> None:
    """Latency and bandwidth against size, log-log, MATE and the baseline on the same
    axes (in the manner of the thesis's Figs 6.8-6.17)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows = [r for r in result.rows if r.size > 0]  # log axes: size 0 cannot be shown
    fig, (lat_ax, bw_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    label = "MATE" if result.transport in ("mpi", "local") else result.transport
    sizes = [r.size for r in rows]
    lat_ax.plot(sizes, [r.latency_us for r in rows], "o-", label=label)
    bw_ax.plot(sizes, [r.bandwidth_MBps for r in rows], "o-", label=label)
    base = [r for r in rows if r.baseline_latency_us is not None]
    if base:
        base_sizes = [r.size for r in base]
        lat_ax.plot(base_sizes, [r.baseline_latency_us for r in base], "s--",
                    label="raw mpi4py")
        bw_ax.plot(base_sizes, [r.baseline_bandwidth_MBps for r in base], "s--",
                   label="raw mpi4py")
    summary = result.summary
    if summary.n_half is not None and summary.peak_bandwidth_MBps:
        bw_ax.axvline(summary.n_half, color="C0", linestyle=":", linewidth=1,
                      label=f"n1/2 {stats.format_size(summary.n_half)}")
    if base and summary.baseline_n_half is not None:
        bw_ax.axvline(summary.baseline_n_half, color="C1", linestyle=":", linewidth=1,
                      label=f"raw n1/2 {stats.format_size(summary.baseline_n_half)}")
    for ax, ylabel, what in ((lat_ax, "latency (µs)", "latency"),
                             (bw_ax, "bandwidth (MB/s)", "bandwidth")):
        if rows:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            # Matplotlib's margins go below 1 B (a tick at 0.5): keep to the sizes.
            ax.set_xlim(min(sizes) / SIZE_MARGIN, max(sizes) * SIZE_MARGIN)
            ax.xaxis.set_major_formatter(FuncFormatter(_size_tick))
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.set_title(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(f"mate-bench {result.title()} ({result.host})")
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)
