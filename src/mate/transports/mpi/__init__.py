"""The MPI transport (SPEC §3 "mpi"): `transport.py` for two-sided messages,
`rma.py` with `rma_native.py`, `rma_emulated.py` and `rma_auto.py` for put
and get over the control channel of `control.py`, `progress.py` for the
three progress modes, `reports.py` for what a pass tells the core, and
`finalize.py` so that MPI_Finalize never waits for a rank that died.

Options to `mate.startup("mpi", ...)`, declared with their checks in
`mate.registry`:

* ``progress``: "poll" (default), "thread" or "manual";
* ``rma``: "auto" (default: MPI-3 RMA below ``rma_threshold`` bytes, the
  two-sided protocol from it on), "native" (MPI-3 RMA) or "emulated";
* ``rma_threshold``: where "auto" changes side (default 65536);
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

from mate.errors import InvalidArgument
from mate.transports.base import Sink, Transport


async def open_transport(sink: Sink, loop: asyncio.AbstractEventLoop, *, handlers: str,
                         progress: str, rma: str, rma_threshold: int, eager_size: int,
                         orphan_limit: int, shutdown_timeout: float) -> Transport:
    """The MPI transport of this rank; the registry checked the options."""
    from mpi4py import MPI

    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    if progress == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise InvalidArgument(
            'progress="thread" needs MPI_THREAD_MULTIPLE, which this MPI library did not grant')
    from mate.transports.mpi.transport import MpiTransport

    return MpiTransport(sink, loop, progress=progress, handlers=handlers, rma=rma,
                        rma_threshold=rma_threshold, eager_size=eager_size,
                        orphan_limit=orphan_limit,
                        shutdown_timeout=shutdown_timeout)
