"""mate-run: start N ranks of a program on this host.

    mate-run -n 2 python examples/pingpong.py --transport mpi

For the mpi transport this runs the `mpiexec` of the environment mate is
installed in (the one the `mpich` wheel provides, beside this Python), else the
first `mpiexec` on PATH, with MATE_TRANSPORT=mpi. A PROGRAM of ``python`` or
``python3`` means this interpreter, and a command installed beside it (such as
``mate-bench``) is taken from there, so that the ranks see the same packages.
Across hosts, call mpiexec yourself with a hostfile.

With MPICH's mpiexec (hydra, the one the wheel brings) mate-run also prefixes
each line a rank writes with ``[rank] `` (on stdout or stderr, as written),
lets the other ranks run on when one dies, names every rank that ended badly
on stderr (``mate-run: rank 1 exited with status 137 (killed by SIGKILL)``),
and returns the status of the lowest such rank (128 + N for signal N), else 0.
Any other mpiexec is run as it is.

For the ibverbs transport (``--transport ibverbs``) mate-run starts the N
processes itself, with the environment of a rendezvous it serves on loopback
(`mate.transports.ibverbs.bootstrap`: the ranks exchange their QP endpoints
there, guarded by a secret made for this job). Output is prefixed and ranks
that ended badly are reported in the same way; a rank that dies does not stop
the others, but a rank still starting a world with it is refused (its
`startup` fails: the world can never form).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, TYPE_CHECKING

from mate import registry

if TYPE_CHECKING:
    from mate.transports.ibverbs.bootstrap import Rendezvous

# hydra's options: leave the other ranks running when one dies (its default
# kills them all at once), and print each rank's wait status when all ended.
HYDRA_OPTIONS = ("-disable-auto-cleanup", "-print-all-exitcodes")
# hydra's proxy still kills every rank when one dies of a signal (SIGKILL, SIGSEGV),
# whatever the options; so each rank runs under a shell that turns a death by
# signal N into exit status 128 + N. The shell outlives the signals hydra sends
# to each rank's process group (SIGUSR1 when another rank died, SIGINT for Ctrl-C,
# SIGTERM): those are the program's to handle, and it gets them too.
RANK_SHELL = ("/bin/sh", "-c", 'trap : INT TERM USR1; "$@"; exit $?', "mate-rank")
# hydra's own closing lines, which mate-run's report replaces: the statuses
# (single host: one list, in rank order) and a summary of them OR-ed together.
EXIT_CODES = re.compile(rb"Exit codes: \[[^\]]*\] ([\d,]+)$")
HYDRA_SUMMARY = (b"YOUR APPLICATION TERMINATED", b"This typically refers",
                 b"Please see the FAQ")


def find_mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise SystemExit("mate-run: no mpiexec found; pip install 'mate-messages[mpi]' "
                         "(the mpich wheel brings one) or install an MPI library")
    return found


def is_hydra(mpiexec: str) -> bool:
    try:
        done = subprocess.run([mpiexec, "--version"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b"HYDRA" in done.stdout


def command(nranks: int, program: list[str], options: tuple[str, ...] = (),
            wrapper: tuple[str, ...] = ()) -> list[str]:
    """The mpiexec command line that starts `nranks` copies of `program`."""
    return [find_mpiexec(), *options, "-n", str(nranks), *wrapper, *program_command(program)]


def describe(status: int) -> tuple[int, str]:
    """A rank's wait status as its exit code, and in words (128 + N: signal N)."""
    return in_words(os.waitstatus_to_exitcode(status))


def in_words(code: int) -> tuple[int, str]:
    """An exit code (-N or 128 + N: killed by signal N) as 128 + N, and in words."""
    if code < 0:
        code = 128 - code
    if code > 128:
        with contextlib.suppress(ValueError):  # not a signal's number
            return code, f"{code} (killed by {signal.Signals(code - 128).name})"
    return code, str(code)


def write(out: IO[bytes], lines: list[bytes]) -> None:
    try:
        out.writelines(lines)
        out.flush()
    except BrokenPipeError:
        # Whoever read it went away (mate-run ... | head): the ranks' output goes on
        # being read, and dropped, so that mpiexec never blocks writing it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())


class Relay:
    """Each rank's stdout and stderr, read from FIFOs of their own and written out
    here one whole line at a time with the rank in front; and mpiexec's own
    lines, passed on, but for the closing ones that mate-run's report replaces.

    hydra's -prepend-rank prefixes each chunk it happens to read, so a line
    written in two pieces (by an unbuffered Python, say) comes out broken in two.
    Its -outfile-pattern and -errfile-pattern instead have mpiexec itself write
    each rank's output, unchanged, to a file named by rank: here, a FIFO.
    """

    def __init__(self, directory: Path, nranks: int) -> None:
        self.patterns = (str(directory / "out.%r"), str(directory / "err.%r"))
        self.selector = selectors.DefaultSelector()
        self.partial: dict[int, bytes] = {}  # the unfinished line read from each fd
        self.statuses: list[int] = []  # the ranks' wait statuses, once mpiexec told them
        for rank in range(nranks):
            for pattern, out in zip(self.patterns, (sys.stdout.buffer, sys.stderr.buffer),
                                    strict=True):
                path = pattern.replace("%r", str(rank))
                os.mkfifo(path)
                # Opened for reading and writing, this end alone keeps the FIFO open:
                # reads find no end of file before mpiexec opens it, or if it never does.
                fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
                self.selector.register(fd, selectors.EVENT_READ, (rank, out))
                self.partial[fd] = b""

    def run(self, hydra: IO[bytes]) -> None:
        """Relay until mpiexec closes its stdout (`hydra`), then what is left."""
        self.selector.register(hydra, selectors.EVENT_READ)
        self.partial[hydra.fileno()] = b""
        while hydra.fileno() in self.selector.get_map():
            for key, _ in self.selector.select():
                if key.data is None:
                    self._from_hydra(hydra)
                else:
                    self._from_rank(key)
        # mpiexec has ended: what the FIFOs hold now is all there is.
        for key in list(self.selector.get_map().values()):
            while self._from_rank(key):
                pass
            rank, out = key.data
            if self.partial[key.fd]:
                write(out, [b"[%d] %s\n" % (rank, self.partial[key.fd])])
            self.selector.unregister(key.fd)
            os.close(key.fd)

    def _read(self, fd: int) -> list[bytes] | None:
        """The lines `fd` completes now; None if it had nothing (or was at its end)."""
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            data = b""
        if not data:
            return None
        *lines, self.partial[fd] = (self.partial[fd] + data).split(b"\n")
        return lines

    def _from_rank(self, key: selectors.SelectorKey) -> bool:
        """Relay the lines a rank's FIFO completes; False if it had nothing."""
        lines = self._read(key.fd)
        if lines is None:
            return False
        rank, out = key.data
        write(out, [b"[%d] %s\n" % (rank, line) for line in lines])
        return True

    def _from_hydra(self, hydra: IO[bytes]) -> None:
        lines = self._read(hydra.fileno())
        if lines is None:  # mpiexec closed its stdout: it is ending
            self.selector.unregister(hydra)
            return
        for line in lines:
            found = EXIT_CODES.search(line)
            if found:
                self.statuses = [int(status) for status in found[1].split(b",")]
            elif not line.startswith(HYDRA_SUMMARY):
                write(sys.stdout.buffer, [line + b"\n"])


def supervise(nranks: int, program: list[str]) -> int:
    """Run hydra's mpiexec, relay the ranks' output, report the ranks that failed."""
    with tempfile.TemporaryDirectory(prefix="mate-run-") as directory:
        relay = Relay(Path(directory), nranks)
        out, err = relay.patterns
        options = (*HYDRA_OPTIONS, "-outfile-pattern", out, "-errfile-pattern", err)
        mpiexec = subprocess.Popen(command(nranks, program, options, RANK_SHELL),
                                   stdout=subprocess.PIPE)
        assert mpiexec.stdout is not None
        # Ctrl-C reaches mpiexec from the terminal too (same process group): mate-run
        # relays until mpiexec has ended. A SIGTERM sent to mate-run alone is passed on.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda signum, frame: mpiexec.terminate())
        relay.run(mpiexec.stdout)
        returncode = mpiexec.wait()
    if not relay.statuses:  # mpiexec failed before the ranks ended
        return 128 - returncode if returncode < 0 else returncode
    return report([describe(status) for status in relay.statuses])


def program_command(program: list[str]) -> list[str]:
    """`program` with ``python`` as this interpreter and commands beside it found there."""
    if program[0] in ("python", "python3"):
        return [sys.executable, *program[1:]]
    if "/" not in program[0] and (Path(sys.executable).parent / program[0]).exists():
        return [str(Path(sys.executable).parent / program[0]), *program[1:]]  # mate-bench
    return program


async def _relay_lines(stream: asyncio.StreamReader, rank: int, out: IO[bytes]) -> None:
    partial = b""
    while True:
        data = await stream.read(65536)
        if not data:
            break
        *lines, partial = (partial + data).split(b"\n")
        write(out, [b"[%d] %s\n" % (rank, line) for line in lines])
    if partial:
        write(out, [b"[%d] %s\n" % (rank, partial)])


async def _tell_end(process: asyncio.subprocess.Process, rank: int,
                    rendezvous: Rendezvous) -> None:
    """Tell the rendezvous when `rank` ends: the worlds still forming never can."""
    rendezvous.ended(rank, in_words(await process.wait())[1])


async def _run_local(nranks: int, program: list[str], transport: str) -> list[int]:
    from mate.transports.ibverbs.bootstrap import Rendezvous

    rendezvous = Rendezvous(nranks)
    await rendezvous.start()
    argv = program_command(program)
    processes = []
    try:
        for rank in range(nranks):
            env = {**os.environ, "MATE_TRANSPORT": transport, **rendezvous.environment(rank)}
            processes.append(await asyncio.create_subprocess_exec(
                *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
        relays = [_relay_lines(stream, rank, out)
                  for rank, process in enumerate(processes)
                  for stream, out in ((process.stdout, sys.stdout.buffer),
                                      (process.stderr, sys.stderr.buffer))
                  if stream is not None]
        ends = [_tell_end(process, rank, rendezvous) for rank, process in enumerate(processes)]
        await asyncio.gather(*relays, *ends)
        return [await process.wait() for process in processes]
    finally:
        for process in processes:
            if process.returncode is None:
                process.terminate()
                await process.wait()
        await rendezvous.close()


def supervise_local(nranks: int, program: list[str], transport: str) -> int:
    """Start the ranks here, serve their rendezvous, report the ranks that failed."""
    try:
        codes = asyncio.run(_run_local(nranks, program, transport))
    except KeyboardInterrupt:
        return 130
    except FileNotFoundError as exc:
        print(f"mate-run: {exc}", file=sys.stderr)
        return 127
    return report([in_words(code) for code in codes])


def report(ended: list[tuple[int, str]]) -> int:
    """Name each rank that ended badly; the exit code of the lowest one, else 0."""
    first = 0
    for rank, (code, words) in enumerate(ended):
        if code:
            print(f"mate-run: rank {rank} exited with status {words}", file=sys.stderr)
            first = first or code
    return first


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mate-run", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nranks", type=int, required=True, help="number of ranks")
    parser.add_argument("--transport", default="mpi", choices=registry.launched())
    parser.add_argument("program", nargs=argparse.REMAINDER, help="PROGRAM [ARGS...]")
    args = parser.parse_args(argv)
    if not args.program:
        parser.error("a PROGRAM to run is required")
    if args.nranks < 1:
        parser.error("-n must be at least 1")
    if registry.TRANSPORTS[args.transport].launcher == "rendezvous":
        sys.exit(supervise_local(args.nranks, args.program, args.transport))
    os.environ["MATE_TRANSPORT"] = args.transport
    if is_hydra(find_mpiexec()):
        sys.exit(supervise(args.nranks, args.program))
    argv_run = command(args.nranks, args.program)
    os.execv(argv_run[0], argv_run)


if __name__ == "__main__":
    main()
