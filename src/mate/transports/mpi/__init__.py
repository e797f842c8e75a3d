"""The MPI transport (SPEC §3 "mpi"): `transport.py` for two-sided messages,
`rma.py` for put and get, `progress.py` for the three progress modes,
`finalize.py` so that MPI_Finalize never waits for a rank that died.

Options to `mate.startup("mpi", ...)`:

* ``progress``: "poll" (default), "thread" or "manual";
* ``rma``: "native" (default, MPI-3 RMA) or "emulated" (two-sided protocol);
* ``eager_size``: sends up to this many bytes go from an internal copy and are
  submitted at once (default 4096);
* ``orphan_limit``: how many sends that timed out unreceived ("orphans", still
  held by MPI) are kept per destination before new sends to it fail with
  RESOURCES (default 4096);
* ``shutdown_timeout``: how long shutdown waits for the other ranks (default 5 s;
  docs/mpi.md says what a rank gets when another one died).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from mate.errors import InvalidArgument
from mate.transports.base import Sink, Transport

PROGRESS_MODES = ("poll", "thread", "manual")
RMA_MODES = ("native", "emulated")

# Environment variables that MPI launchers set in the processes they start.
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")


def launched_by_mpiexec() -> bool:
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def open_transport(sink: Sink, loop: asyncio.AbstractEventLoop, *, handlers: str,
                   progress: Any = None, rma: Any = "native", eager_size: Any = 4096,
                   orphan_limit: Any = 4096, shutdown_timeout: Any = 5.0,
                   **unknown: Any) -> Transport:
    if unknown:
        raise InvalidArgument(
            f"unknown option(s) {sorted(unknown)} for the mpi transport; it accepts "
            "default_timeout, handlers, progress, rma, eager_size, orphan_limit, "
            "shutdown_timeout")
    progress = "poll" if progress is None else progress
    if progress not in PROGRESS_MODES:
        raise InvalidArgument(f"progress must be one of {PROGRESS_MODES}, not {progress!r}")
    if rma not in RMA_MODES:
        raise InvalidArgument(f"rma must be one of {RMA_MODES}, not {rma!r}")
    if isinstance(eager_size, bool) or not isinstance(eager_size, int) or eager_size < 0:
        raise InvalidArgument(f"eager_size must be an int >= 0 (bytes), not {eager_size!r}")
    if isinstance(orphan_limit, bool) or not isinstance(orphan_limit, int) or orphan_limit < 1:
        raise InvalidArgument(f"orphan_limit must be an int >= 1, not {orphan_limit!r}")
    if (isinstance(shutdown_timeout, bool) or not isinstance(shutdown_timeout, (int, float))
            or not shutdown_timeout >= 0):
        raise InvalidArgument(f"shutdown_timeout must be seconds >= 0, not {shutdown_timeout!r}")
    if handlers == "progress" and progress != "thread":
        raise InvalidArgument('handlers="progress" needs progress="thread" on the mpi transport')
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise InvalidArgument(
            "the mpi transport needs mpi4py: pip install 'mate[mpi]'") from exc
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    if progress == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise InvalidArgument(
            'progress="thread" needs MPI_THREAD_MULTIPLE, which this MPI library did not grant')
    from mate.transports.mpi.transport import MpiTransport

    return MpiTransport(sink, loop, progress=progress, handlers=handlers, rma=rma,
                        eager_size=eager_size, orphan_limit=orphan_limit,
                        shutdown_timeout=float(shutdown_timeout))
