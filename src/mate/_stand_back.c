/* mate._stand_back: a progress thread's wait while the event loop runs the passes.

   In the MPI transport's thread mode the loop's thread runs the passes while a
   task awaits, and the progress thread stands back: it must take over if the
   loop stops (a callback that computes), so it looks now and then at when the
   loop last ran passes. A look written in Python needs the GIL, which the loop
   holds while it polls -- mpi4py keeps it even across an MPI_Testsome that
   copies 4 MiB for a millisecond -- so each look forced a GIL switch on the
   loop's thread, and looks every 1 ms made a thread-mode 4 MiB pingping take
   1.7-2.0x as long as looks every 100 ms (bench/results/stand-back-2026-11-28.txt).

   stand_back() looks without the GIL: it sleeps in poll() on the thread's wake
   descriptor until `period` seconds after the time that `clock` (a buffer of
   one C double, the loop's CLOCK_MONOTONIC time, which is time.monotonic()'s)
   holds, reads the clock again, and returns only when that time has passed
   without a newer one (False), or when the descriptor is readable (True). The
   loop's thread writes the clock with plain stores of aligned doubles: a look
   reads the old time or the new one, and either is safe (an old one costs one
   more look). +inf in the clock means "the loop is running passes now", and a
   look then comes a period later; the poll() timeout is rounded up to whole
   milliseconds, so a look may come up to 1 ms late.

   progress.py falls back to a Python loop over select() when this module is
   not built or not wanted (MATE_PURE_PYTHON). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <time.h>

static double
monotonic(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

static PyObject *
stand_back(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "stand_back() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    double period = PyFloat_AsDouble(args[1]);
    if (period == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(args[2]);
    if (fd < 0) {
        return NULL;
    }
    if (!(period > 0.0)) {
        PyErr_SetString(PyExc_ValueError, "stand_back(): the period must be positive");
        return NULL;
    }
    Py_buffer clock;
    if (PyObject_GetBuffer(args[0], &clock, PyBUF_SIMPLE) != 0) {
        return NULL;
    }
    if (clock.len < (Py_ssize_t)sizeof(double) || (Py_uintptr_t)clock.buf % sizeof(double)) {
        PyBuffer_Release(&clock);
        PyErr_SetString(PyExc_ValueError, "stand_back(): the clock must be one aligned double");
        return NULL;
    }
    const volatile double *helped = (const volatile double *)clock.buf;
    int woken = 0, failed = 0;

    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        double left = *helped + period - monotonic();
        if (!(left > 0.0)) {
            break;  /* the loop last ran passes `period` ago or more (-inf, NaN too) */
        }
        if (left > period) {
            left = period;  /* +inf: passes are running; look again a period later */
        }
        struct pollfd wake = {.fd = fd, .events = POLLIN, .revents = 0};
        int ready = poll(&wake, 1, (int)(left * 1e3) + 1);  /* whole ms, rounded up */
        if (ready > 0) {
            woken = 1;
            break;
        }
        if (ready < 0 && errno != EINTR) {
            failed = errno;
            break;
        }
    }
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&clock);
    if (failed) {
        errno = failed;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(woken);
}

static PyMethodDef methods[] = {
    {"stand_back", (PyCFunction)(void (*)(void))stand_back, METH_FASTCALL,
     "stand_back(clock, period, fd) -> bool: wait, without the GIL, until `period` s "
     "after the time in `clock` (re-read) has passed (False) or `fd` is readable (True)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mate._stand_back",
    .m_doc = "A progress thread's wait that looks at the loop's clock without the GIL.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__stand_back(void)
{
    return PyModuleDef_Init(&module);
}
