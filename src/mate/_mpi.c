/* mate._mpi: the MPI transport's per-message calls, made from C on mpi4py's objects.

   Every message of the MPI transport makes three MPI calls through mpi4py: an
   Issend or an Irecv to post it, and the MPI_Testsome of the passes that find
   it complete; then its status is read (whether it was cancelled, and a
   receive's count, source and tag). mpi4py pays for generality there: each
   Testsome allocates arrays for the requests and statuses, copies the handles
   in and out one Python call each, and builds its answer; each post parses a
   buffer specification. Measured on one host (MPICH 5.0.2, mpi4py 4.1.2), a
   Testsome over three pending requests took 0.90 us through mpi4py and
   0.27 us from C, an Irecv 1.05-1.34 us against 0.35-0.44 us; a status's four
   reads are four method calls.

   These functions make the same calls on the same objects: they take mpi4py
   Comm, Request and Status objects and return mpi4py Requests, through
   mpi4py's C API (mpi4py.h), so that everything else (cancelling, statuses,
   errors as MPI.Exception) stays mpi4py's. Like mpi4py, they release the GIL
   around each MPI call that may progress (a receive whose message came first
   is copied inside MPI_Irecv, a large one for a millisecond), and a request
   keeps a reference to its buffer until it completes.

   Compiled against MPICH's mpi.h, they run only where mpi4py runs on a
   library of MPICH's ABI: the import looks for libmpi.so.12 among the
   libraries already loaded (mpi4py loads it) and takes the functions it calls
   from it, and fails otherwise, as it does where mpi4py's objects do not have
   the layout this module was built with. mate.transports.mpi.calls then uses
   mpi4py's methods. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <limits.h>
#include <mpi.h>
#include "mpi4py/mpi4py.h"

#define LIBRARY "libmpi.so.12" /* the soname of MPICH's ABI */
#define ON_STACK 16            /* requests a Testsome handles without allocating */

static __typeof__(MPI_Issend_c) *issend_c = NULL;
static __typeof__(MPI_Irecv_c) *irecv_c = NULL;
static __typeof__(MPI_Testsome) *testsome_c = NULL;
static __typeof__(MPI_Get_count_c) *get_count_c = NULL;
static __typeof__(MPI_Test_cancelled) *test_cancelled_c = NULL;
static PyObject *mpi_exception = NULL; /* mpi4py.MPI.Exception */

/* Raise mpi4py's MPI.Exception for `ierr`, as mpi4py's own calls do. */
static PyObject *
raise_mpi(int ierr)
{
    PyObject *exc = PyObject_CallFunction(mpi_exception, "i", ierr);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* The int value of `obj`, or -1 with an exception set (an int out of range included). */
static int
as_int(PyObject *obj, int *value)
{
    long wide = PyLong_AsLong(obj);
    if (wide == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (wide < INT_MIN || wide > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a rank or tag out of the range of a C int");
        return -1;
    }
    *value = (int)wide;
    return 0;
}

/* What `request` keeps alive while MPI may use it (None once it completed), as mpi4py. */
static void
set_buffer(PyMPIRequestObject *request, PyObject *buffer)
{
    PyObject *old = request->ob_buf;
    request->ob_buf = Py_NewRef(buffer);
    Py_XDECREF(old);
}

static int
check_args(const char *name, Py_ssize_t nargs, PyObject *const *args)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "%s() takes 4 arguments (%zd given)", name, nargs);
        return -1;
    }
    if (!PyObject_TypeCheck(args[0], &PyMPIComm_Type)) {
        PyErr_Format(PyExc_TypeError, "%s(): the first argument must be an MPI.Comm", name);
        return -1;
    }
    return 0;
}

/* Post a send (MPI_Issend) or a receive (MPI_Irecv) of the bytes of `buffer`; the new
   mpi4py Request holds `buffer`. */
static PyObject *
post(const char *name, PyObject *const *args, Py_ssize_t nargs, int receive)
{
    if (check_args(name, nargs, args) < 0) {
        return NULL;
    }
    PyObject *buffer = args[1];
    int peer, tag;
    if (as_int(args[2], &peer) < 0 || as_int(args[3], &tag) < 0) {
        return NULL;
    }
    /* The Request first, as mpi4py does: MPI writes the handle into it, so that no
       request MPI holds is ever without its object. */
    PyObject *out = PyMPIRequest_New(MPI_REQUEST_NULL);
    if (out == NULL) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, receive ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    MPI_Comm comm = ((PyMPICommObject *)args[0])->ob_mpi;
    MPI_Request *request = &((PyMPIRequestObject *)out)->ob_mpi;
    int ierr;
    Py_BEGIN_ALLOW_THREADS
    if (receive) {
        ierr = irecv_c(view.buf, (MPI_Count)view.len, MPI_BYTE, peer, tag, comm, request);
    } else {
        ierr = issend_c(view.buf, (MPI_Count)view.len, MPI_BYTE, peer, tag, comm, request);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (ierr != MPI_SUCCESS) {
        Py_DECREF(out);
        return raise_mpi(ierr);
    }
    set_buffer((PyMPIRequestObject *)out, buffer);
    return out;
}

/* issend(comm, buffer, dest, tag) -> Request: comm.Issend(buffer, dest, tag). */
static PyObject *
issend(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    return post("issend", args, nargs, 0);
}

/* irecv(comm, buffer, source, tag) -> Request: comm.Irecv(buffer, source, tag). */
static PyObject *
irecv(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    return post("irecv", args, nargs, 1);
}

/* testsome(requests, statuses) -> list[int] | None: MPI.Request.Testsome(requests,
   statuses). `requests` is a list of Requests, each set to MPI.REQUEST_NULL as it
   completes; the k-th status of `statuses` (lengthened as needed) is that of the
   k-th index returned; None when no request is active. On an error (MPI_ERR_IN_STATUS,
   say) the requests and statuses are written back before MPI.Exception is raised. */
static PyObject *
testsome(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "testsome(requests, statuses): two lists");
        return NULL;
    }
    PyObject *requests = args[0], *statuses = args[1];
    Py_ssize_t count = PyList_GET_SIZE(requests);
    if (count > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "testsome(): too many requests");
        return NULL;
    }
    MPI_Request handles_here[ON_STACK];
    MPI_Status found_here[ON_STACK];
    int indices_here[ON_STACK];
    MPI_Request *handles = handles_here;
    MPI_Status *found = found_here;
    int *indices = indices_here;
    PyObject *out = NULL;
    int outcount = 0, ierr;
    if (count > ON_STACK) {
        handles = PyMem_Malloc(count * sizeof *handles);
        found = PyMem_Malloc(count * sizeof *found);
        indices = PyMem_Malloc(count * sizeof *indices);
        if (handles == NULL || found == NULL || indices == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *request = PyList_GET_ITEM(requests, i);
        if (!PyObject_TypeCheck(request, &PyMPIRequest_Type)) {
            PyErr_SetString(PyExc_TypeError, "testsome(): requests must be MPI.Request objects");
            goto done;
        }
        handles[i] = ((PyMPIRequestObject *)request)->ob_mpi;
    }
    Py_BEGIN_ALLOW_THREADS
    ierr = testsome_c((int)count, handles, &outcount, indices, found);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        PyMPIRequestObject *request = (PyMPIRequestObject *)PyList_GET_ITEM(requests, i);
        if (request->ob_mpi != handles[i]) { /* it completed: MPI has let go of its buffer */
            request->ob_mpi = handles[i];
            set_buffer(request, Py_None);
        }
    }
    int none_active = outcount == MPI_UNDEFINED;
    if (none_active || outcount < 0 || outcount > count) {
        outcount = 0; /* MPI_UNDEFINED, or an error other than MPI_ERR_IN_STATUS */
    }
    while (PyList_GET_SIZE(statuses) < outcount) {
        PyObject *status = PyMPIStatus_New(&found[0]);
        if (status == NULL || PyList_Append(statuses, status) < 0) {
            Py_XDECREF(status);
            goto done;
        }
        Py_DECREF(status);
    }
    for (int k = 0; k < outcount; k++) {
        PyObject *status = PyList_GET_ITEM(statuses, k);
        if (!PyObject_TypeCheck(status, &PyMPIStatus_Type)) {
            PyErr_SetString(PyExc_TypeError, "testsome(): statuses must be MPI.Status objects");
            goto done;
        }
        ((PyMPIStatusObject *)status)->ob_mpi = found[k];
    }
    if (ierr != MPI_SUCCESS) {
        raise_mpi(ierr);
        goto done;
    }
    if (none_active) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    out = PyList_New(outcount);
    for (int k = 0; out != NULL && k < outcount; k++) {
        PyObject *index = PyLong_FromLong(indices[k]);
        if (index == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, k, index);
    }
done:
    if (handles != handles_here) {
        PyMem_Free(handles);
        PyMem_Free(found);
        PyMem_Free(indices);
    }
    return out;
}

/* The status argument of `received` and `cancelled`, and whether it was cancelled:
   0, or -1 with an exception set (TypeError, or MPI's error as MPI.Exception). */
static int
read_cancelled(const char *name, PyObject *const *args, Py_ssize_t nargs,
               MPI_Status **status, int *flag)
{
    if (nargs != 1 || !PyObject_TypeCheck(args[0], &PyMPIStatus_Type)) {
        PyErr_Format(PyExc_TypeError, "%s(status): an MPI.Status", name);
        return -1;
    }
    *status = &((PyMPIStatusObject *)args[0])->ob_mpi;
    int ierr = test_cancelled_c(*status, flag);
    if (ierr != MPI_SUCCESS) {
        raise_mpi(ierr);
        return -1;
    }
    return 0;
}

/* cancelled(status) -> bool: status.Is_cancelled(). */
static PyObject *
cancelled(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    MPI_Status *status;
    int flag = 0;
    if (read_cancelled("cancelled", args, nargs, &status, &flag) < 0) {
        return NULL;
    }
    return PyBool_FromLong(flag);
}

/* received(status) -> tuple[int, int, int] | None: None if the receive was cancelled,
   else (status.Get_count(MPI.BYTE), status.Get_source(), status.Get_tag()). One call
   where mpi4py's methods make four (1.2 k machine instructions a receive, callgrind). */
static PyObject *
received(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    MPI_Status *status;
    int flag = 0;
    if (read_cancelled("received", args, nargs, &status, &flag) < 0) {
        return NULL;
    }
    if (flag) {
        Py_RETURN_NONE;
    }
    MPI_Count count = 0;
    int ierr = get_count_c(status, MPI_BYTE, &count);
    if (ierr != MPI_SUCCESS) {
        return raise_mpi(ierr);
    }
    return Py_BuildValue("(Lii)", (long long)count, status->MPI_SOURCE, status->MPI_TAG);
}

static PyMethodDef methods[] = {
    {"issend", (PyCFunction)(void (*)(void))issend, METH_FASTCALL,
     "issend(comm, buffer, dest, tag, /) -> MPI.Request: comm.Issend(buffer, dest, tag)"},
    {"irecv", (PyCFunction)(void (*)(void))irecv, METH_FASTCALL,
     "irecv(comm, buffer, source, tag, /) -> MPI.Request: comm.Irecv(buffer, source, tag)"},
    {"testsome", (PyCFunction)(void (*)(void))testsome, METH_FASTCALL,
     "testsome(requests, statuses, /) -> list[int] | None: MPI.Request.Testsome"},
    {"cancelled", (PyCFunction)(void (*)(void))cancelled, METH_FASTCALL,
     "cancelled(status, /) -> bool: status.Is_cancelled()"},
    {"received", (PyCFunction)(void (*)(void))received, METH_FASTCALL,
     "received(status, /) -> tuple[int, int, int] | None: None if cancelled, else the "
     "status's byte count, source and tag"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mate._mpi",
    .m_doc = "The MPI transport's per-message MPI calls, from C.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__mpi(void)
{
    if (import_mpi4py() < 0) {
        return NULL;
    }
    if (PyMPIRequest_Type.tp_basicsize != sizeof(PyMPIRequestObject)
        || PyMPIStatus_Type.tp_basicsize != sizeof(PyMPIStatusObject)
        || PyMPIComm_Type.tp_basicsize != sizeof(PyMPICommObject)) {
        PyErr_SetString(PyExc_ImportError,
                        "mate._mpi: mpi4py's objects differ from the MPICH ABI it was built for");
        return NULL;
    }
    void *library = dlopen(LIBRARY, RTLD_LAZY | RTLD_NOLOAD);
    if (library == NULL) {
        PyErr_SetString(PyExc_ImportError,
                        "mate._mpi: mpi4py did not load " LIBRARY " (an MPI of MPICH's ABI)");
        return NULL;
    }
    issend_c = (__typeof__(MPI_Issend_c) *)dlsym(library, "MPI_Issend_c");
    irecv_c = (__typeof__(MPI_Irecv_c) *)dlsym(library, "MPI_Irecv_c");
    testsome_c = (__typeof__(MPI_Testsome) *)dlsym(library, "MPI_Testsome");
    get_count_c = (__typeof__(MPI_Get_count_c) *)dlsym(library, "MPI_Get_count_c");
    test_cancelled_c = (__typeof__(MPI_Test_cancelled) *)dlsym(library, "MPI_Test_cancelled");
    dlclose(library); /* mpi4py keeps it loaded */
    if (issend_c == NULL || irecv_c == NULL || testsome_c == NULL || get_count_c == NULL
        || test_cancelled_c == NULL) {
        PyErr_SetString(PyExc_ImportError,
                        "mate._mpi: " LIBRARY " lacks MPI_Issend_c, MPI_Irecv_c, MPI_Testsome, "
                        "MPI_Get_count_c or MPI_Test_cancelled");
        return NULL;
    }
    PyObject *mpi = PyImport_ImportModule("mpi4py.MPI");
    if (mpi == NULL) {
        return NULL;
    }
    mpi_exception = PyObject_GetAttrString(mpi, "Exception");
    Py_DECREF(mpi);
    if (mpi_exception == NULL) {
        return NULL;
    }
    return PyModule_Create(&module_def);
}
