"""Keep MPI_Finalize from waiting for ranks that are gone (issue 13).

mpi4py calls MPI_Finalize at the very end of the interpreter's exit (a
Py_AtExit hook, after every Python atexit handler), and MPICH's MPI_Finalize
begins with a barrier of all ranks through the process manager (PMI), so a
rank whose peer died waits there for ever. Other ways out were worse:

* bounding the call: mpi4py makes it holding the GIL, once the interpreter no
  longer runs Python code; calling it earlier, from an atexit handler, in a
  thread with a deadline, leaves only os._exit when it does not return, and
  CPython never tells atexit handlers the status `sys.exit` asked for, so the
  rank's exit status would be lost;
* not finalizing (mpi4py.rc.finalize, which counts only before mpi4py is
  imported): hydra takes a rank that exits without MPI_Finalize for a failed
  one and, unless started with -disable-auto-cleanup, kills all the others.

MPICH has a control variable for this, MPIR_CVAR_NO_COLLECTIVE_FINALIZE: with
it, MPI_Finalize skips the barrier and releases only this rank's resources.
MPICH reads it when MPI_Finalize runs, so it can be set late: `finalize_locally`
sets it through the MPI tool interface (MPI_T), which mpi4py does not wrap, by
ctypes into the MPI library that mpi4py loaded. The barrier is there so that
no rank disconnects while others may still send to it; mate needs none of that
once its transport has shut down (every message ended, and the ranks met if
they could). The process then ends as it would have, with its own exit status.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from mpi4py import MPI

CVAR = b"MPIR_CVAR_NO_COLLECTIVE_FINALIZE"


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library mpi4py uses, or None if it cannot be found.

    mpi4py loads it with RTLD_LOCAL, so its symbols are not global: find its
    path among the mapped files (Linux) and open it again, which returns the
    library already loaded.
    """
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith(("libmpi.", "libmpich.")):
            return ctypes.CDLL(fields[5])
    return None


def finalize_locally() -> bool:
    """Make MPI_Finalize skip its barrier of all ranks; False if this MPI cannot."""
    lib = _libmpi()
    if lib is None or not hasattr(lib, "MPI_T_cvar_write"):
        return False
    provided, index, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if lib.MPI_T_init_thread(MPI.Query_thread(), ctypes.byref(provided)) != MPI.SUCCESS:
        return False
    try:
        if lib.MPI_T_cvar_get_index(CVAR, ctypes.byref(index)) != MPI.SUCCESS:
            return False  # not MPICH
        handle = ctypes.c_void_p()
        if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle),
                                       ctypes.byref(count)) != MPI.SUCCESS:
            return False
        written: bool = lib.MPI_T_cvar_write(handle, ctypes.byref(ctypes.c_int(1))) == MPI.SUCCESS
        lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
        return written
    finally:
        lib.MPI_T_finalize()
