from typing import Any

def issend(comm: Any, buffer: Any, dest: int, tag: int, /) -> Any:
    """comm.Issend(buffer, dest, tag), made from C: an mpi4py Request."""

def irecv(comm: Any, buffer: Any, source: int, tag: int, /) -> Any:
    """comm.Irecv(buffer, source, tag), made from C: an mpi4py Request."""

def testsome(requests: list[Any], statuses: list[Any], /) -> list[int] | None:
    """MPI.Request.Testsome(requests, statuses), made from C."""

def cancelled(status: Any, /) -> bool:
    """status.Is_cancelled(), made from C."""

def received(status: Any, /) -> tuple[int, int, int] | None:
    """None if the receive was cancelled, else (status.Get_count(MPI.BYTE),
    status.Get_source(), status.Get_tag()), made from C."""
