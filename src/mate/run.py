"""mate-run: start N ranks of a program on this host.

    mate-run -n 2 python examples/pingpong.py --transport mpi

For the mpi transport this runs the `mpiexec` of the environment mate is
installed in (the one the `mpich` wheel provides, beside this Python), else the
first `mpiexec` on PATH, with MATE_TRANSPORT=mpi. A PROGRAM of ``python`` or
``python3`` means this interpreter, and a command installed beside it (such as
``mate-bench``) is taken from there, so that the ranks see the same packages.
Across hosts, call mpiexec yourself with a hostfile.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

TRANSPORTS = ("mpi",)


def find_mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise SystemExit("mate-run: no mpiexec found; pip install 'mate[mpi]' "
                         "(the mpich wheel brings one) or install an MPI library")
    return found


def command(nranks: int, program: list[str]) -> list[str]:
    """The mpiexec command line that starts `nranks` copies of `program`."""
    if program[0] in ("python", "python3"):
        program = [sys.executable, *program[1:]]
    elif "/" not in program[0] and (Path(sys.executable).parent / program[0]).exists():
        program = [str(Path(sys.executable).parent / program[0]), *program[1:]]  # mate-bench
    return [find_mpiexec(), "-n", str(nranks), *program]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mate-run", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nranks", type=int, required=True, help="number of ranks")
    parser.add_argument("--transport", default="mpi", choices=TRANSPORTS)
    parser.add_argument("program", nargs=argparse.REMAINDER, help="PROGRAM [ARGS...]")
    args = parser.parse_args(argv)
    if not args.program:
        parser.error("a PROGRAM to run is required")
    if args.nranks < 1:
        parser.error("-n must be at least 1")
    argv_run = command(args.nranks, args.program)
    os.environ["MATE_TRANSPORT"] = args.transport
    os.execv(argv_run[0], argv_run)


if __name__ == "__main__":
    main()
