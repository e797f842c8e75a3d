"""The litmus report: a table in the manner of seed 000's Table 6, and JSON.

One row per test: its ranks, the iterations run, how many outcomes the spec
allows, how many of those were observed, how many iterations gave a
forbidden outcome, and observed/allowed in percent (low percentages are not
errors: they say which allowed behaviours this transport never showed).
Forbidden outcomes are listed in full under the table. `merged` puts the
JSON of several runs (a transport each, say) side by side as one Markdown
table, the form kept in docs/litmus.md.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Mapping, Sequence
from typing import Any

from mate.litmus.runner import Result, show

HEADER = ("test", "ranks", "iterations", "allowed", "observed", "forbidden", "obs/allowed %")


def row(result: Result) -> tuple[str, ...]:
    seen = sum(1 for o in result.observed if o in result.allowed)
    forbidden = sum(result.forbidden.values())
    return (result.test.name, str(result.test.ranks), str(result.iterations),
            str(len(result.allowed)), str(seen), str(forbidden),
            f"{100 * seen / len(result.allowed):.1f}")


def line(result: Result) -> str:
    """One test's result as it finishes."""
    name, ranks, iterations, allowed, seen, forbidden, _ = row(result)
    return (f"{name}: {iterations} iterations on {ranks} ranks, {seen} of {allowed} allowed "
            f"outcomes observed, {forbidden} forbidden")


def table(results: Sequence[Result]) -> str:
    rows = [HEADER, *(row(r) for r in results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def forbidden_details(results: Sequence[Result]) -> str:
    lines = []
    for result in results:
        for outcome, count in result.forbidden.most_common():
            lines.append(f"FORBIDDEN {result.test.name} x{count}: {show(outcome)}")
        if result.forbidden:
            lines += [f"    allowed: {show(o)}" for o in sorted(result.allowed)]
    return "\n".join(lines)


def summary(results: Sequence[Result]) -> str:
    forbidden = sum(sum(r.forbidden.values()) for r in results)
    allowed = sum(len(r.allowed) for r in results)
    seen = sum(sum(1 for o in r.observed if o in r.allowed) for r in results)
    iterations = sum(r.iterations for r in results)
    verdict = "no forbidden outcome" if not forbidden else f"{forbidden} FORBIDDEN outcomes"
    return (f"{len(results)} tests, {iterations} iterations: {verdict}; "
            f"{seen} of {allowed} allowed outcomes observed "
            f"({100 * seen / max(allowed, 1):.1f}%)")


def to_json(results: Sequence[Result], **meta: Any) -> str:
    tests = []
    for result in results:
        seen = sum(1 for o in result.observed if o in result.allowed)
        tests.append({
            "name": result.test.name,
            "about": result.test.about,
            "ranks": result.test.ranks,
            "iterations": result.iterations,
            "allowed": [show(o) for o in sorted(result.allowed)],
            "observed": {show(o): n for o, n in result.observed.most_common()},
            "forbidden": {show(o): n for o, n in result.forbidden.most_common()},
            "observed_allowed": seen,
            "observed_percent": round(100 * seen / len(result.allowed), 1),
        })
    document = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
                **meta, "tests": tests}
    return json.dumps(document, indent=1)


def merged(runs: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table of several runs' JSON: per test, its allowed outcomes, then
    each run's iterations, observed/allowed and forbidden count; a run that skipped
    a test (too few ranks) shows a dash."""
    def label(run: Mapping[str, Any]) -> str:
        mode = ", ".join(str(run[k]) for k in ("progress",) if run.get(k))
        ranks = max((t["ranks"] for t in run["tests"]), default=0)
        return f"{run['transport']}" + (f" {mode}" if mode else "") + f" ({ranks} ranks)"

    by_run = [{t["name"]: t for t in run["tests"]} for run in runs]
    names: dict[str, Mapping[str, Any]] = {}
    for tests in by_run:
        for name, entry in tests.items():
            names.setdefault(name, entry)
    head = ["test", "ranks", "allowed"] + [
        f"{label(run)}: iterations, observed (%), forbidden" for run in runs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, first in names.items():
        cells = [f"`{name}`", str(first["ranks"]), str(len(first["allowed"]))]
        for tests in by_run:
            entry = tests.get(name)
            cells.append("-" if entry is None else
                         f"{entry['iterations']}, {entry['observed_allowed']} "
                         f"({entry['observed_percent']:.0f}%), {sum(entry['forbidden'].values())}")
        lines.append("| " + " | ".join(cells) + " |")
    totals = ["**all**", "", str(sum(len(e["allowed"]) for e in names.values()))]
    for tests in by_run:
        totals.append(f"{sum(e['iterations'] for e in tests.values())}, "
                      f"{sum(e['observed_allowed'] for e in tests.values())}, "
                      f"{sum(sum(e['forbidden'].values()) for e in tests.values())}")
    lines.append("| " + " | ".join(totals) + " |")
    return "\n".join(lines)
