"""The MPI calls every message makes: from C where `mate._mpi` runs, else mpi4py's.

A message of the MPI transport is posted with `issend` or `irecv`, found
complete by the `testsome` of a pass, and its status then read (`cancelled`,
`received`). Made through mpi4py, each of these calls cost 0.3-1.0 us more than
made from C (`bench/mpi_calls.py`), where a message of the message rate costs
mate 4-5 us in all; `mate._mpi` makes the same calls from C on the same mpi4py
objects. It is not there in a pure-Python install or run (``MATE_PURE_PYTHON``),
where it was built without MPI's headers, or where mpi4py runs on an MPI library
not of MPICH's ABI; mpi4py's own methods, called unbound, serve then, with the
same arguments and results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpi4py import MPI

Post = Callable[[Any, Any, int, int], Any]  # (comm, buffer, rank, tag) -> MPI.Request
Testsome = Callable[[list[Any], list[Any]], "list[int] | None"]


def _received(status: MPI.Status) -> tuple[int, int, int] | None:
    """None if the receive was cancelled, else its byte count, source and tag."""
    if status.Is_cancelled():
        return None
    return status.Get_count(MPI.BYTE), status.Get_source(), status.Get_tag()


try:
    from mate._mpi import cancelled, irecv, issend, received, testsome

    FROM_C = True
except ImportError:
    issend, irecv, testsome = MPI.Comm.Issend, MPI.Comm.Irecv, MPI.Request.Testsome
    cancelled, received = MPI.Status.Is_cancelled, _received
    FROM_C = False

__all__ = ["FROM_C", "Post", "Testsome", "cancelled", "irecv", "issend", "received",
           "testsome"]
