"""Every standard set under bench/results/, target by target: issue 11's MPI targets.

    python bench/history.py [--results bench/results]

The top level of the results folder holds the latest set, and each folder that
has a SUMMARY.md an earlier one (`bench/run_standard.py`). For each set, in the
order they ran, this prints one row of a Markdown table, every figure computed
the same way from the set's JSON rows, whatever its SUMMARY.md said at the time:
a ratio from one run (mate against the raw MPI or the asyncio floor measured
beside it), thread-mode put and get included. A figure that misses its target is
marked ✗; a dash is a run the set did not have.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SMALL, MID, LARGE = 8, 64 * 1024, 4 * 1024 * 1024

Run = dict[str, Any]


def row_at(run: Run | None, size: int) -> dict[str, Any]:
    for row in (run or {}).get("rows", []):
        if row["size"] == size:
            return dict(row)
    return {}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else a / b


def floor_ratio(run: Run | None) -> float | None:
    row = row_at(run, SMALL)
    return ratio(row.get("latency_us"), row.get("floor_latency_us"))


def bandwidth_ratio(size: int) -> Callable[[Run | None], float | None]:
    def measure(run: Run | None) -> float | None:
        row = row_at(run, size)
        return ratio(row.get("bandwidth_MBps"), row.get("baseline_bandwidth_MBps"))
    return measure


def n_half_kib(run: Run | None) -> float | None:
    half = (run or {}).get("summary", {}).get("n_half")
    return None if half is None else half / 1024


def rate(run: Run | None) -> float | None:
    return row_at(run, SMALL).get("messages_per_s")


def rate_ratio(run: Run | None) -> float | None:
    row = row_at(run, SMALL)
    return ratio(row.get("messages_per_s"), row.get("baseline_messages_per_s"))


def wait_cpu(run: Run | None) -> float | None:
    rows = (run or {}).get("rows") or [{}]
    return rows[0].get("cpu_percent")


#: (heading, run name, measure, whether a figure meets the target, format)
COLUMNS: list[tuple[str, str, Callable[[Run | None], float | None], Callable[[float], bool],
                    str]] = [
    ("8 B /floor", "pingpong-poll", floor_ratio, lambda x: x <= 1.5, "{:.2f}"),
    ("8 B uvloop /floor", "pingpong-poll-uvloop", floor_ratio, lambda x: x <= 1.5, "{:.2f}"),
    ("8 B thread /floor", "pingpong-thread", floor_ratio, lambda x: x <= 3.0, "{:.2f}"),
    ("rate k/s", "rate-poll", lambda r: (v := rate(r)) and v / 1e3, lambda x: x >= 100,
     "{:.0f}"),
    ("rate ×raw", "rate-poll", rate_ratio, lambda x: x >= 0.3, "{:.2f}"),
    ("64 KiB ×raw", "pingpong-poll", bandwidth_ratio(MID), lambda x: x >= 0.6, "{:.2f}"),
    ("n½ KiB", "pingpong-poll", n_half_kib, lambda x: x <= 64, "{:.1f}"),
    ("4 MiB pingpong poll", "pingpong-poll", bandwidth_ratio(LARGE), lambda x: x >= 0.95,
     "{:.2f}"),
    ("pingpong thread", "pingpong-thread", bandwidth_ratio(LARGE), lambda x: x >= 0.95,
     "{:.2f}"),
    ("pingping poll", "pingping-poll", bandwidth_ratio(LARGE), lambda x: x >= 0.95, "{:.2f}"),
    ("pingping thread", "pingping-thread", bandwidth_ratio(LARGE), lambda x: x >= 0.95,
     "{:.2f}"),
    ("native put poll", "put-poll-native", bandwidth_ratio(LARGE), lambda x: x >= 0.95,
     "{:.2f}"),
    ("native put thread", "put-thread-native", bandwidth_ratio(LARGE), lambda x: x >= 0.95,
     "{:.2f}"),
    ("native get poll", "get-poll-native", bandwidth_ratio(LARGE), lambda x: x >= 0.95,
     "{:.2f}"),
    ("native get thread", "get-thread-native", bandwidth_ratio(LARGE), lambda x: x >= 0.95,
     "{:.2f}"),
    ("wait thread CPU %", "wait-thread", wait_cpu, lambda x: x <= 5, "{:.1f}"),
]


def started(folder: Path) -> str:
    """When the set began: its SUMMARY.md's time (written at the end) less its length."""
    for line in (folder / "SUMMARY.md").read_text().splitlines():
        found = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", line)
        if found:
            took = re.search(r"took (\d+) s", line)
            end = datetime.datetime.fromisoformat(found[1])
            start = end - datetime.timedelta(seconds=int(took[1]) if took else 0)
            return start.strftime("%Y-%m-%d %H:%M")
    return folder.name


def load(folder: Path) -> dict[str, Run]:
    return {path.stem: json.loads(path.read_text()) for path in folder.glob("*.json")}


def table(results: Path) -> str:
    sets = [folder for folder in results.iterdir() if (folder / "SUMMARY.md").is_file()]
    sets.append(results)
    rows = []
    for folder in sorted(sets, key=started):
        runs = load(folder)
        cells = []
        for _, name, measure, meets, form in COLUMNS:
            value = measure(runs.get(name)) if name in runs else None
            cells.append("-" if value is None else form.format(value) + ("" if meets(value)
                                                                         else " ✗"))
        label = "latest (top level)" if folder == results else folder.name
        rows.append(f"| {started(folder)} | {label} | " + " | ".join(cells) + " |")
    head = "| began | folder | " + " | ".join(column[0] for column in COLUMNS) + " |"
    rule = "|---|---|" + "--:|" * len(COLUMNS)
    return "\n".join([head, rule, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results")
    print(table(parser.parse_args().results))


if __name__ == "__main__":
    main()
