/* mate._receipt: receipts built field by field in C, for mate.message.

   Every awaited message returns a Receipt, an attrs frozen class. Built in
   Python, a frozen instance costs a call of object.__setattr__ per field (or,
   as a dict class, a dict of nine keys): 5.3 k machine instructions per
   receipt in the 8 B MPI ping-pong (callgrind), and on uvloop a tenth of
   the ping-pong's time. Receipt is slotted, so its fields are pointers at
   fixed offsets in the instance: bind() reads each field's offset from its
   slot descriptor, once; build() allocates an instance and stores the values
   there, as attrs' __init__ would (attrs' frozen classes have no validators
   or converters here to skip).

   mate.message uses the attrs constructor when this module is not built (a
   pure-Python install) or not wanted (MATE_PURE_PYTHON). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define MAX_FIELDS 16

static PyTypeObject *bound = NULL;  /* the class build() makes, and its slots' offsets */
static Py_ssize_t offsets[MAX_FIELDS];
static Py_ssize_t field_count = 0;

/* bind(cls, names): build() makes instances of `cls`, whose slots `names` it fills in
   this order. Each name must be a writable object slot of `cls`. */
static PyObject *
bind(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "bind() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *cls = args[0], *names = args[1];
    if (!PyType_Check(cls) || !PyTuple_Check(names)) {
        PyErr_SetString(PyExc_TypeError, "bind(cls, names): a class and a tuple of names");
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(names);
    if (count > MAX_FIELDS) {
        PyErr_Format(PyExc_ValueError, "bind(): at most %d fields", MAX_FIELDS);
        return NULL;
    }
    Py_ssize_t found[MAX_FIELDS];
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        PyObject *slot = PyObject_GetAttr(cls, name);
        if (slot == NULL) {
            return NULL;
        }
        int usable = Py_IS_TYPE(slot, &PyMemberDescr_Type)
            && ((PyMemberDescrObject *)slot)->d_member->type == T_OBJECT_EX
            && !(((PyMemberDescrObject *)slot)->d_member->flags & READONLY);
        if (usable) {
            found[i] = ((PyMemberDescrObject *)slot)->d_member->offset;
        }
        Py_DECREF(slot);
        if (!usable) {
            PyErr_Format(PyExc_ValueError, "bind(): %R is not a writable slot of %R", name, cls);
            return NULL;
        }
    }
    Py_XSETREF(bound, (PyTypeObject *)Py_NewRef(cls));
    memcpy(offsets, found, (size_t)count * sizeof(Py_ssize_t));
    field_count = count;
    Py_RETURN_NONE;
}

/* build(*values) -> an instance of the bound class, its slots set to `values`. */
static PyObject *
build(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (bound == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "build(): bind() was not called");
        return NULL;
    }
    if (nargs != field_count) {
        PyErr_Format(PyExc_TypeError, "build() takes %zd arguments (%zd given)",
                     field_count, nargs);
        return NULL;
    }
    PyObject *instance = bound->tp_alloc(bound, 0);
    if (instance == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject **slot = (PyObject **)((char *)instance + offsets[i]);
        Py_XSETREF(*slot, Py_NewRef(args[i]));
    }
    return instance;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(cls, names) -> None: build() makes instances of `cls`, filling the slots "
     "`names` in this order."},
    {"build", (PyCFunction)(void (*)(void))build, METH_FASTCALL,
     "build(*values) -> an instance of the bound class with its slots set to `values`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mate._receipt",
    .m_doc = "Receipts built field by field in C (see mate.message).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__receipt(void)
{
    return PyModuleDef_Init(&module);
}
