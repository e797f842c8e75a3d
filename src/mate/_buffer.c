/* mate._buffer: memory by address, for mate.buffers.

   Every awaited message's receipt carries the address of its buffer, and the
   ibverbs engine takes the address of each message it sends. Python has no
   call that returns it: through ctypes it costs a ctypes object and a buffer
   export per call (3.7 k machine instructions in bench/core_instructions.py),
   here one buffer export.

   The soft verbs device copies each message's payload by address twice (out
   of the sender's registered memory, into the receiver's): ctypes.memmove
   and ctypes.string_at convert their arguments through ctypes' types, about
   6.7 k instructions a call (callgrind, the ibverbs 8 B ping-pong); here a
   call is a few hundred. They do what ctypes' functions of the same names do.

   mate.buffers falls back to ctypes when this module is not built (a
   pure-Python install) or not wanted (MATE_PURE_PYTHON). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *
address_of(PyObject *Py_UNUSED(module), PyObject *view)
{
    /* A memoryview (what mate.arguments makes) holds its buffer already: read it
       there, without the export and release of another view (the receipt of every
       awaited message asks). A released one is left to the export, which refuses it. */
    if (PyMemoryView_Check(view)
        && !(((PyMemoryViewObject *)view)->flags & _Py_MEMORYVIEW_RELEASED)) {
        return PyLong_FromVoidPtr(PyMemoryView_GET_BUFFER(view)->buf);
    }
    Py_buffer info;
    if (PyObject_GetBuffer(view, &info, PyBUF_SIMPLE) != 0) {
        return NULL;  /* not a buffer: mate.arguments made `view`, so this never happens */
    }
    void *address = info.buf;
    PyBuffer_Release(&info);
    return PyLong_FromVoidPtr(address);
}

/* Copies this large or larger run with the GIL released, as ctypes' foreign calls do. */
#define UNLOCKED_COPY (64 * 1024)

static int
arity(const char *name, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs == expected) {
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected, nargs);
    return -1;
}

static int
address_arg(PyObject *arg, char **address)
{
    *address = PyLong_AsVoidPtr(arg);
    return *address == NULL && PyErr_Occurred() ? -1 : 0;
}

static int
count_arg(PyObject *arg, Py_ssize_t *count)
{
    *count = PyLong_AsSsize_t(arg);
    if (*count == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*count < 0) {
        PyErr_SetString(PyExc_ValueError, "negative byte count");
        return -1;
    }
    return 0;
}

static PyObject *
memmove_(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    char *dst, *src;
    Py_ssize_t count;
    if (arity("memmove", nargs, 3) < 0
            || address_arg(args[0], &dst) < 0 || address_arg(args[1], &src) < 0
            || count_arg(args[2], &count) < 0) {
        return NULL;
    }
    if (count >= UNLOCKED_COPY) {
        Py_BEGIN_ALLOW_THREADS
        memmove(dst, src, (size_t)count);
        Py_END_ALLOW_THREADS
    }
    else {
        memmove(dst, src, (size_t)count);
    }
    Py_RETURN_NONE;
}

static PyObject *
string_at(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    char *address;
    Py_ssize_t count;
    if (arity("string_at", nargs, 2) < 0
            || address_arg(args[0], &address) < 0 || count_arg(args[1], &count) < 0) {
        return NULL;
    }
    return PyBytes_FromStringAndSize(address, count);
}

static PyMethodDef methods[] = {
    {"address_of", address_of, METH_O,
     "address_of(view) -> int: the virtual address of the first byte of `view`."},
    {"memmove", (PyCFunction)(void (*)(void))memmove_, METH_FASTCALL,
     "memmove(dst, src, count) -> None: copy `count` bytes between addresses."},
    {"string_at", (PyCFunction)(void (*)(void))string_at, METH_FASTCALL,
     "string_at(address, count) -> bytes: the `count` bytes at `address`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mate._buffer",
    .m_doc = "Memory by address: a buffer's, and copies (see mate.buffers).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__buffer(void)
{
    return PyModuleDef_Init(&module);
}
