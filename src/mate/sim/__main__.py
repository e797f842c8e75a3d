"""``python -m mate.sim``: the scalability simulation of thesis §6.1 (SPEC §6).

    python -m mate.sim
    python -m mate.sim --threshold 10 --processes 1:1K --plot bench/results/sim
    python -m mate.sim --units 4096 --processes 1,4,64 --json sim.json

For each threshold and each process count it runs the three models
(message-passing, message-driven, Progressive Messages) on one workload and one
stream of random targets, prints a table of speed-ups per threshold and ends with
one summary line: ``verified`` (exit 0) when PM >= MD >= MP everywhere, otherwise
``NOT verified`` with the places (exit 1). The order is a theorem of the model
(the three models take the same balancing decisions and differ only in the time
they pay), so the check guards the implementation. The model is described in
`mate.sim`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np

from mate.arguments import non_negative, positive_int
from mate.sim import (
    DEFAULT_LATENCY,
    DEFAULT_SEED,
    DEFAULT_THRESHOLDS,
    DEFAULT_UNITS,
    MODELS,
    simulate,
    workload,
)
from mate.sim.report import (
    Row,
    check_order,
    format_table,
    plot_path,
    summary_line,
    to_json,
    write_json,
    write_plot,
)

MAX_PROCESSES = 1 << 20  # far beyond the thesis's 16K; guards against typos


def _count(text: str) -> int:
    item = text.strip().upper()
    scale = 1024 if item.endswith("K") else 1
    digits = item[:-1] if scale > 1 else item
    if not digits.isdigit():
        raise ValueError(f"{text.strip()!r} is not a process count (e.g. 64, 4K)")
    n = int(digits) * scale
    if not 1 <= n <= MAX_PROCESSES:
        raise ValueError(f"process counts must be 1 .. {MAX_PROCESSES}, not {n}")
    return n


def parse_processes(text: str) -> list[int]:
    """``LO:HI`` (powers of two from LO to HI, K = 1024) or a comma list; sorted,
    no duplicates."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 2:
            raise ValueError(f"{text!r}: a range is LO:HI, e.g. 1:16K")
        lo, hi = _count(parts[0]), _count(parts[1])
        if lo & (lo - 1) or hi & (hi - 1):
            raise ValueError(f"{text!r}: the ends of a range must be powers of two")
        if lo > hi:
            raise ValueError(f"{text!r}: the range is empty (LO > HI)")
        return [1 << i for i in range(lo.bit_length() - 1, hi.bit_length())]
    return sorted({_count(item) for item in text.split(",")})


def parse_thresholds(texts: Sequence[str]) -> list[float]:
    """Repeated ``--threshold`` options, each a number or a comma list; sorted."""
    values = set()
    for text in texts:
        for item in text.split(","):
            try:
                value = float(item)
            except ValueError:
                raise ValueError(f"{item.strip()!r} is not a threshold") from None
            if not value > 0 or value == float("inf"):
                raise ValueError(f"thresholds must be positive and finite, not {item.strip()}")
            values.add(value)
    return sorted(values)


def _processes_arg(text: str) -> list[int]:
    try:
        return parse_processes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mate.sim",
        description="Scalability simulation of thesis §6.1: speed-ups of message-passing, "
                    "message-driven and Progressive Messages work stealing.",
        epilog="The three models take the same balancing decisions and differ only in "
               "the time they pay (MP: the target handles a request only at the end of "
               "its current unit), so PM >= MD >= MP is expected. Exit status 0 when it "
               "holds at every threshold and size (the summary line says 'verified'), "
               "1 otherwise ('NOT verified').")
    parser.add_argument("--threshold", action="append", metavar="T[,T...]",
                        help="load-balancing threshold(s), repeatable or a comma list "
                             "(default: 10,100,1000)")
    parser.add_argument("--processes", type=_processes_arg, default=parse_processes("1:16K"),
                        metavar="LO:HI|N,N,...",
                        help="process counts: a range of powers of two or a comma list, "
                             "K = 1024 (default: 1:16K)")
    parser.add_argument("--latency", type=non_negative, default=DEFAULT_LATENCY,
                        help=f"network latency in work-time units (default: {DEFAULT_LATENCY})")
    parser.add_argument("--units", type=positive_int, default=DEFAULT_UNITS,
                        help=f"number of work units (default: {DEFAULT_UNITS})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"seed of the workload and the random targets "
                             f"(default: {DEFAULT_SEED})")
    parser.add_argument("--plot", metavar="DIR_OR_PREFIX",
                        help="write one PNG per threshold: DIR/sim-threshold-T.png or "
                             "PREFIX-threshold-T.png")
    parser.add_argument("--json", metavar="FILE", help="write the parameters and rows as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        thresholds = parse_thresholds(args.threshold or
                                      [",".join(f"{t:g}" for t in DEFAULT_THRESHOLDS)])
    except ValueError as exc:
        parser.error(str(exc))
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, not {args.seed}")
    processes: list[int] = args.processes
    work = workload(args.units, args.seed)
    work_stats = {"total": float(work.sum()), "median": float(np.median(work)),
                  "mean": float(work.mean()), "min": float(work.min()),
                  "max": float(work.max())}
    print(f"# mate.sim: {args.units} work units (total {work_stats['total']:.0f}, median "
          f"{work_stats['median']:g}, mean {work_stats['mean']:.2f}, max "
          f"{work_stats['max']:g}), latency {args.latency:g}, seed {args.seed}", flush=True)

    rows: list[Row] = []
    runtime = 0.0  # simulation time only (not plotting)
    for threshold in thresholds:
        t0 = time.perf_counter()
        these = []
        for p in processes:
            outcomes = {m: simulate(work, p, m, threshold, args.latency, args.seed)
                        for m in MODELS}
            these.append(Row(threshold, p, {m: o.speedup for m, o in outcomes.items()},
                             outcomes))
        elapsed = time.perf_counter() - t0
        runtime += elapsed
        rows += these
        print(format_table(threshold, these, elapsed), flush=True)
        if args.plot:
            path = plot_path(args.plot, threshold)
            write_plot(threshold, these, path, units=args.units, latency=args.latency)
            print(f"# plot: {path}", flush=True)

    violations = check_order(rows)
    if args.json:
        write_json(args.json, to_json(rows, violations, units=args.units, seed=args.seed,
                                      latency=args.latency, thresholds=thresholds,
                                      processes=processes, work_stats=work_stats,
                                      runtime_s=runtime))
        print(f"# json: {args.json}", flush=True)
    print(summary_line(rows, violations, runtime), flush=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
