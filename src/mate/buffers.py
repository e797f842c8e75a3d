"""Memory by address: where a buffer lives, and copies between addresses.

`address_of` gives the address of a byte view's first byte. The views are
the flat byte `memoryview`s that `mate.arguments.buffer` makes of user
buffers. Python itself has no call for it: the compiled `mate._buffer` takes
it with one buffer export (a receipt needs it for every awaited message).

`memmove` and `string_at` are ctypes' functions of those names; the soft
verbs device copies every payload with them, so `mate._buffer` has cheaper
ones.

ctypes does all three where `mate._buffer` is not built or not wanted
(`mate.native`), which is why this module stays interpreted.
"""

from __future__ import annotations

import ctypes

from mate.errors import InvalidArgument


class _PyBuffer(ctypes.Structure):
    # CPython's Py_buffer, as PEP 3118 defines it; only `buf` is read.
    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_release_buffer.restype = None
# Bound once: looking them up on the ctypes module and type costs a sixth of a call.
_char_at = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def _address_of(view: memoryview) -> int:
    """The virtual address of the first byte of `view` (read-only views included)."""
    if not view.readonly and view.nbytes:
        return _addressof(_char_at(view))  # the fast way, 4x cheaper
    info = _PyBuffer()
    if _get_buffer(view, ctypes.byref(info), 0) != 0:  # PyBUF_SIMPLE
        raise InvalidArgument("cannot take the address of this buffer")
    try:
        return info.buf or 0
    finally:
        _release_buffer(ctypes.byref(info))


def _memmove(dst: int, src: int, count: int) -> None:
    ctypes.memmove(dst, src, count)


try:
    from mate._buffer import address_of as address_of
    from mate._buffer import memmove as memmove
    from mate._buffer import string_at as string_at
except ImportError:  # not built, or refused by mate.native (pure Python asked for, or stale)
    address_of = _address_of
    memmove = _memmove
    string_at = ctypes.string_at
