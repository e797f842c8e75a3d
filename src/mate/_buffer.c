/* mate._buffer: the address of a buffer's first byte, for mate.buffers.

   Every awaited message's receipt carries the address of its buffer, and the
   ibverbs engine takes the address of each message it sends. Python has no
   call that returns it: through ctypes it costs a ctypes object and a buffer
   export per call (3.7 k machine instructions in bench/core_instructions.py),
   here one buffer export. mate.buffers falls back to ctypes when this module
   is not built (a pure-Python install) or not wanted (MATE_PURE_PYTHON). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *
address_of(PyObject *Py_UNUSED(module), PyObject *view)
{
    Py_buffer info;
    if (PyObject_GetBuffer(view, &info, PyBUF_SIMPLE) != 0) {
        return NULL;  /* not a buffer: mate.arguments made `view`, so this never happens */
    }
    void *address = info.buf;
    PyBuffer_Release(&info);
    return PyLong_FromVoidPtr(address);
}

static PyMethodDef methods[] = {
    {"address_of", address_of, METH_O,
     "address_of(view) -> int: the virtual address of the first byte of `view`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mate._buffer",
    .m_doc = "The address of a buffer's first byte (see mate.buffers).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__buffer(void)
{
    return PyModuleDef_Init(&module);
}
