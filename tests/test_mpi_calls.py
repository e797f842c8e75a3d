"""The MPI calls every message makes (mate.transports.mpi.calls): mate._mpi's, from C,
answer as mpi4py's own methods do, on one rank (COMM_SELF)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from mate import native  # noqa: E402
from mate.transports.mpi import calls  # noqa: E402

BUILT = (native._PACKAGE / native.RECORD).exists()


class Calls:
    """One implementation of the calls: the three MPI calls and the status's reads."""

    def __init__(self, issend: Any, irecv: Any, testsome: Any, cancelled: Any,
                 received: Any) -> None:
        self.issend, self.irecv, self.testsome = issend, irecv, testsome
        self.cancelled, self.received = cancelled, received


MPI4PY = Calls(MPI.Comm.Issend, MPI.Comm.Irecv, MPI.Request.Testsome, MPI.Status.Is_cancelled,
               calls._received)
try:
    from mate import _mpi

    FROM_C: Calls | None = Calls(_mpi.issend, _mpi.irecv, _mpi.testsome, _mpi.cancelled,
                                 _mpi.received)
except ImportError:  # not built, or MATE_PURE_PYTHON
    FROM_C = None
IMPLEMENTATIONS = [pytest.param(MPI4PY, id="mpi4py"),
                   pytest.param(FROM_C, id="mate._mpi",
                                marks=pytest.mark.skipif(FROM_C is None,
                                                         reason="mate._mpi does not run here"))]


@pytest.fixture
def comm() -> Iterator[Any]:
    comm = MPI.COMM_SELF.Dup()  # nothing left from another test can match
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    yield comm
    comm.Free()


def finish(do: Calls, requests: list[Any], statuses: list[Any]) -> list[int]:
    """Testsome until something completes; the indices it returned."""
    for _ in range(100_000):
        done = do.testsome(requests, statuses)
        if done:
            return list(done)
    raise AssertionError("nothing completed")


def test_the_transport_calls_mpi_from_c_where_mate_is_built() -> None:
    if not BUILT or os.environ.get(native.PURE_VARIABLE):
        pytest.skip("nothing compiled here")
    assert calls.FROM_C and calls.testsome is FROM_C.testsome  # type: ignore[union-attr]


@pytest.mark.parametrize("do", IMPLEMENTATIONS)
def test_a_send_and_receive_complete_with_the_data_and_their_statuses(do: Calls,
                                                                     comm: Any) -> None:
    into = bytearray(8)
    pending = do.irecv(comm, bytearray(4), 0, 99)  # nothing is sent to it
    receive = do.irecv(comm, into, MPI.ANY_SOURCE, MPI.ANY_TAG)
    send = do.issend(comm, memoryview(b"abcdefgh"), 0, 7)
    assert all(isinstance(r, MPI.Request) for r in (pending, receive, send))
    requests = [pending, MPI.REQUEST_NULL, receive, send]
    statuses: list[Any] = []  # lengthened as needed
    received: dict[int, tuple[int, int, int]] = {}
    while len(received) < 2:
        for k, i in enumerate(finish(do, requests, statuses)):  # k-th status, i-th request
            received[i] = (statuses[k].Get_source(), statuses[k].Get_tag(),
                           statuses[k].Get_count(MPI.BYTE))
    assert sorted(received) == [2, 3]
    assert received[2] == (0, 7, 8)  # the receive's status: the wildcards filled in
    assert into == b"abcdefgh"
    assert requests[2] == MPI.REQUEST_NULL and requests[3] == MPI.REQUEST_NULL
    assert requests[0] is pending and pending != MPI.REQUEST_NULL  # still posted
    assert do.testsome(requests, statuses) == []  # one active request, not complete
    pending.Cancel()
    pending.Wait()


@pytest.mark.parametrize("do", IMPLEMENTATIONS)
def test_testsome_fills_the_statuses_in_the_order_of_its_indices(do: Calls, comm: Any) -> None:
    # More requests than mate._mpi keeps on its stack (16).
    count = 20
    intos = [bytearray(4) for _ in range(count)]
    receives = [do.irecv(comm, intos[i], 0, i) for i in range(count)]
    sends = [do.issend(comm, bytes([i]) * (i % 4 + 1), 0, i) for i in range(count)]
    statuses = [MPI.Status()]
    seen: dict[int, tuple[int, int]] = {}
    while len(seen) < count:
        for k, i in enumerate(finish(do, receives, statuses)):
            seen[i] = (statuses[k].Get_tag(), statuses[k].Get_count(MPI.BYTE))
    assert seen == {i: (i, i % 4 + 1) for i in range(count)}
    assert all(intos[i][: i % 4 + 1] == bytes([i]) * (i % 4 + 1) for i in range(count))
    MPI.Request.Waitall(sends)


def mpi4py_reads(status: Any) -> tuple[bool, int, int, int]:
    return (status.Is_cancelled(), status.Get_count(MPI.BYTE), status.Get_source(),
            status.Get_tag())


@pytest.mark.parametrize("do", IMPLEMENTATIONS)
def test_a_completed_status_reads_as_mpi4py_reads_it(do: Calls, comm: Any) -> None:
    receive = do.irecv(comm, bytearray(16), MPI.ANY_SOURCE, MPI.ANY_TAG)
    send = do.issend(comm, b"0123456789", 0, 41)
    requests, statuses = [receive, send], [MPI.Status(), MPI.Status()]
    found: dict[int, Any] = {}
    while len(found) < 2:
        for k, i in enumerate(finish(do, requests, statuses)):
            found[i] = statuses[k].py2f()  # a copy: the next Testsome overwrites them
    got, sent = MPI.Status.f2py(found[0]), MPI.Status.f2py(found[1])
    assert mpi4py_reads(got) == (False, 10, 0, 41)
    assert do.received(got) == (10, 0, 41)
    assert do.cancelled(got) is False and do.cancelled(sent) is False


@pytest.mark.parametrize("do", IMPLEMENTATIONS)
def test_a_cancelled_receive_reads_as_cancelled(do: Calls, comm: Any) -> None:
    receive = do.irecv(comm, bytearray(4), 0, 77)  # nothing is sent to it
    receive.Cancel()
    statuses = [MPI.Status()]
    assert finish(do, [receive], statuses) == [0]
    assert mpi4py_reads(statuses[0])[0] is True
    assert do.cancelled(statuses[0]) is True
    assert do.received(statuses[0]) is None


@pytest.mark.parametrize("do", IMPLEMENTATIONS)
def test_testsome_over_no_active_request_answers_none(do: Calls) -> None:
    assert do.testsome([], []) is None
    assert do.testsome([MPI.REQUEST_NULL, MPI.REQUEST_NULL], []) is None


@pytest.mark.parametrize("do", IMPLEMENTATIONS)
def test_a_truncated_receive_raises_with_its_request_freed_and_its_status_filled(
        do: Calls, comm: Any) -> None:
    receive = do.irecv(comm, bytearray(4), 0, 5)
    send = do.issend(comm, b"too long", 0, 5)
    requests, statuses = [receive], [MPI.Status()]
    with pytest.raises(MPI.Exception) as raised:
        finish(do, requests, statuses)
    assert raised.value.Get_error_class() == MPI.ERR_IN_STATUS
    assert requests[0] == MPI.REQUEST_NULL  # written back before the raise
    assert MPI.Get_error_class(statuses[0].Get_error()) == MPI.ERR_TRUNCATE
    cancelled, *fields = mpi4py_reads(statuses[0])
    assert do.received(statuses[0]) == tuple(fields) and not cancelled
    send.Wait()


@pytest.mark.skipif(FROM_C is None, reason="mate._mpi does not run here")
def test_mate_mpi_refuses_bad_arguments(comm: Any) -> None:
    assert FROM_C is not None
    with pytest.raises(TypeError):
        FROM_C.irecv(object(), bytearray(1), 0, 0)  # not a communicator
    with pytest.raises(TypeError):
        FROM_C.irecv(comm, bytearray(1), 0)  # an argument short
    with pytest.raises(BufferError):
        FROM_C.irecv(comm, b"read-only", 0, 0)  # a receive writes its buffer
    with pytest.raises(TypeError):
        FROM_C.issend(comm, 17, 0, 0)  # no buffer
    with pytest.raises(OverflowError):
        FROM_C.issend(comm, b"x", 2**40, 0)
    with pytest.raises(MPI.Exception):
        FROM_C.issend(comm, b"x", 5, 0)  # no rank 5 in COMM_SELF: MPI's error, raised
    with pytest.raises(TypeError):
        FROM_C.testsome((MPI.REQUEST_NULL,), [])  # a tuple, not a list
    with pytest.raises(TypeError):
        FROM_C.testsome([object()], [])
    for read in (FROM_C.received, FROM_C.cancelled):
        with pytest.raises(TypeError):
            read(object())  # not a status
        with pytest.raises(TypeError):
            read()


@pytest.mark.parametrize("do", IMPLEMENTATIONS)
def test_a_request_keeps_its_buffer_alive(do: Calls, comm: Any) -> None:
    class Buffer(bytearray):
        pass

    buffer = Buffer(8)
    alive = weakref.ref(buffer)
    receive = do.irecv(comm, buffer, 0, 3)
    del buffer
    gc.collect()
    assert alive() is not None  # MPI may still write into it
    send = do.issend(comm, b"12345678", 0, 3)
    statuses = [MPI.Status()]
    finish(do, [receive], statuses)
    assert statuses[0].Get_count(MPI.BYTE) == 8
    assert alive() is None  # let go once complete
    send.Wait()


def test_the_calls_fall_back_to_mpi4py_where_mate_mpi_does_not_load() -> None:
    # As where it was not built or refuses the MPI library mpi4py loaded.
    probe = ("import sys; sys.modules['mate._mpi'] = None\n"
             "from mpi4py import MPI\n"
             "from mate.transports.mpi import calls\n"
             "assert not calls.FROM_C\n"
             "assert calls.testsome == MPI.Request.Testsome\n"
             "assert (calls.issend, calls.irecv) == (MPI.Comm.Issend, MPI.Comm.Irecv)\n"
             "assert calls.cancelled == MPI.Status.Is_cancelled\n"
             "assert calls.received is calls._received\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
