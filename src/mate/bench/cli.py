"""mate-bench: ping tests of mate against raw MPI (SPEC §5, thesis §6.2).

    mate-bench pingpong --transport mpi --baseline --json pp.json --plot pp.png
    mate-bench put --transport mpi --progress thread --rma emulated --sizes 8,4K,1M
    mate-bench wait --transport mpi --progress thread --baseline
    mate-bench pingpong --transport local --sizes 1:64K

Started outside a launcher with ``--transport mpi`` it starts its own two
ranks (``mpiexec -n 2``); with ``--transport ibverbs`` it starts them with
``mate-run -n 2 --transport ibverbs``, or under mpiexec with ``--baseline``
(raw MPI is the baseline, so MPI must be there); under a launcher it is one
of the ranks. Only rank 0 prints and writes files.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

from mate import registry
from mate.arguments import non_negative, positive_int
from mate.bench import stats
from mate.bench.driver import BenchError, Options, run
from mate.bench.patterns import DEFAULT_WINDOW, FLOOR_PATTERNS, PATTERNS, SUBMISSION_PATTERNS
from mate.bench.report import Result, format_summary, write_plot
from mate.errors import InvalidArgument

DEFAULT_SIZES = "1:4M"
DEFAULT_MIN_TIME = 0.05
DEFAULT_REPETITIONS = 5
PROGRESS_ENV = "MATE_BENCH_PROGRESS"  # "1"/"0": show the progress bar (set for the ranks)

# A single % here: argparse %-formats an epilog only when it holds "%(prog)".
PATTERN_HELP = """\
patterns:
  pingpong  rank 0 sends, rank 1 answers; latency = half the round trip
  pingping  both ranks send and receive at once; latency = time per exchange
  put       rank 0 writes into memory rank 1 exposed (one-sided push)
  get       rank 0 reads memory rank 1 exposed (one-sided pull)
  wait      rank 0 waits --idle s (default 1) for one message: its CPU % is the figure
  rate      message rate (OSU osu_mbw_mr): rank 0 sends windows of --window messages,
            rank 1 receives each window and acknowledges it; latency = time per message

figures per size: median over --repetitions of the time per operation (µs),
bandwidth = size / latency (MB/s, MB = 10^6 bytes), CPU % = getrusage user+sys
over wall time on rank 0 (all its threads); summary: peak bandwidth and n1/2
(wait: the CPU % that waiting cost).
"""


def sizes_argument(text: str) -> list[int]:
    try:
        return stats.parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_measurement_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared with the other benchmark entry points (mate.bench.tcp)."""
    parser.add_argument("--sizes", type=sizes_argument, default=DEFAULT_SIZES,
                        metavar="SIZES",
                        help=f"powers of two LO:HI or a comma list, K/M binary "
                             f"(default {DEFAULT_SIZES}; e.g. 8,4096,1M; 0 allowed in a list)")
    parser.add_argument("--repetitions", type=positive_int, default=DEFAULT_REPETITIONS,
                        metavar="N", help=f"repetitions per size, median reported "
                                          f"(default {DEFAULT_REPETITIONS})")
    parser.add_argument("--min-time", type=non_negative, default=DEFAULT_MIN_TIME, metavar="S",
                        help="grow the iteration count until one repetition takes at least "
                             f"S seconds (default {DEFAULT_MIN_TIME})")
    parser.add_argument("--json", metavar="F", help="write the result as JSON (SPEC §5)")
    parser.add_argument("--plot", metavar="F.png",
                        help="plot latency and bandwidth against size (log-log)")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mate-bench", description=__doc__.splitlines()[0],
        epilog=PATTERN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pattern", choices=PATTERNS)
    parser.add_argument("--transport", choices=tuple(registry.TRANSPORTS),
                        help="default: $MATE_TRANSPORT, else mpi when started by mpiexec, "
                             "else local")
    parser.add_argument("--progress", choices=registry.progress_modes(),
                        help="mpi progress mode (default poll)")
    parser.add_argument("--rma", choices=("auto", "native", "emulated"),
                        help="mpi put/get: MPI-3 RMA, the two-sided protocol, or by size "
                             "(default auto)")
    parser.add_argument("--wait", choices=("submission", "completion"), default="completion",
                        help="what each send/put awaits (default completion)")
    parser.add_argument("--baseline", action="store_true",
                        help="also measure raw mpi4py in the same run (mpi only)")
    parser.add_argument("--floor", action="store_true",
                        help="pingpong, pingping, rate: also measure the asyncio (or uvloop) "
                             "floor in the same run: mpi4py requests awaited through loop "
                             "callbacks, no mate")
    parser.add_argument("--tcp", action="store_true",
                        help="pingpong: also measure asyncio TCP streams on 127.0.0.1 in the "
                             "same run, rank 1 the echo server (the soft device's baseline)")
    parser.add_argument("--idle", type=non_negative, default=1.0, metavar="S",
                        help="wait pattern: how long rank 1 waits before sending (default 1)")
    parser.add_argument("--window", type=positive_int, metavar="W",
                        help=f"rate pattern: messages per window (default {DEFAULT_WINDOW})")
    parser.add_argument("--handlers", action="store_true",
                        help="rate pattern: rank 1 reposts each receive from the completion "
                             "handler of the one before")
    add_measurement_arguments(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.transport is None:  # as mate.startup chooses
        try:
            args.transport = registry.choose(None).name
        except InvalidArgument as exc:
            parser.error(f"$MATE_TRANSPORT: {exc}")
    if args.transport == "local":
        if args.baseline or args.floor:
            parser.error("--baseline and --floor need a launched transport (both run mpi4py)")
        if args.tcp:
            parser.error("--tcp needs a launched transport (rank 1 is the echo server)")
        if args.progress is not None:
            parser.error("--progress applies to launched transports (mpi, ibverbs)")
    if args.rma is not None and args.transport != "mpi":
        parser.error("--rma applies to --transport mpi only")
    modes = registry.TRANSPORTS[args.transport].progress
    if args.progress is not None and args.progress not in modes:
        parser.error(f"--progress {args.progress}: the {args.transport} transport has "
                     f"{', '.join(modes)}")
    if args.wait == "submission" and args.pattern not in SUBMISSION_PATTERNS:
        parser.error(f"--wait submission: {args.pattern} has no submission event "
                     f"(only {', '.join(SUBMISSION_PATTERNS)} do)")
    if args.floor and args.pattern not in FLOOR_PATTERNS:
        parser.error(f"--floor applies to the {', '.join(FLOOR_PATTERNS)} patterns only")
    if args.tcp and args.pattern != "pingpong":
        parser.error("--tcp applies to the pingpong pattern only")
    if args.pattern != "rate" and (args.window is not None or args.handlers):
        parser.error("--window and --handlers apply to the rate pattern only")
    if args.rma is not None and args.pattern not in ("put", "get"):
        parser.error("--rma applies to the put and get patterns only")
    if args.uvloop:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            parser.error("--uvloop: uvloop is not installed (pip install 'mate-messages[uvloop]')")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install 'mate-messages[bench]')")
    return args


def options(args: argparse.Namespace) -> Options:
    show = os.environ.get(PROGRESS_ENV)
    return Options(
        pattern=args.pattern, transport=args.transport, progress=args.progress, rma=args.rma,
        wait=args.wait, sizes=tuple(args.sizes), baseline=args.baseline,
        repetitions=args.repetitions, min_time=args.min_time, idle=args.idle,
        window=args.window or DEFAULT_WINDOW, handler_driven=args.handlers, floor=args.floor,
        tcp=args.tcp,
        show_progress=sys.stderr.isatty() if show is None else show == "1",
        uvloop=args.uvloop)


def emit(result: Result, args: argparse.Namespace) -> None:
    """Print the summary under the rows already printed, and write the files asked for,
    saying where (rank 0 only)."""
    print(format_summary(result), flush=True)
    if args.json:
        result.write_json(args.json)
        print(f"wrote {args.json}", flush=True)
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}", flush=True)


def launch(argv: Sequence[str], transport: str, with_mpi: bool) -> int:
    """Run this benchmark again as two ranks (mpiexec, or mate-run for a transport of
    its own launcher when no raw MPI runs beside it); return the launcher's exit code."""
    from mate.run import find_mpiexec

    if registry.TRANSPORTS[transport].launcher == "mpiexec" or with_mpi:
        launcher = [find_mpiexec(), "-n", "2"]
    else:
        launcher = [sys.executable, "-m", "mate.run", "-n", "2", "--transport", transport]
    command = [*launcher, sys.executable, "-m", "mate.bench", *argv]
    env = dict(os.environ)
    env.setdefault(PROGRESS_ENV, "1" if sys.stderr.isatty() else "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        return subprocess.call(command, env=env)
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    entry = registry.TRANSPORTS[args.transport]
    if entry.launcher is not None and not (registry.launched_by_mpiexec() or entry.detect()):
        sys.exit(launch([*argv, "--transport", args.transport], args.transport,
                        args.baseline or args.floor))
    try:
        result = run(options(args))
    except BenchError as exc:
        print(f"mate-bench: {exc}", file=sys.stderr)
        _abort_mpi(2)
        sys.exit(2)
    except BaseException:
        if registry.launched_by_mpiexec():
            import traceback

            traceback.print_exc()
            _abort_mpi(1)
        raise
    if result is not None:
        emit(result, args)


def _abort_mpi(code: int) -> None:
    """One rank failed: end the whole MPI job rather than leave the other one waiting."""
    if not registry.launched_by_mpiexec() or "mpi4py.MPI" not in sys.modules:
        return
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(code)
