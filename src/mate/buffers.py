"""Turning user buffers into byte views, and knowing where they live.

Any C-contiguous object with the buffer protocol is accepted, but one whose
items are Python object references. The library works on a flat
unsigned-byte `memoryview` of it, which also keeps the object alive until
the message's terminal outcome (SPEC §2, Buffers).
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

from mate.errors import InvalidArgument


def byte_view(obj: Any, *, writable: bool, what: str) -> memoryview:
    """A flat byte view of `obj`, or InvalidArgument saying why it cannot be used."""
    try:
        # Our own view, even of a memoryview: the caller may release theirs while
        # the message is in flight, and ours keeps the memory (SPEC §2, Buffers).
        view = memoryview(obj)
    except TypeError:
        raise InvalidArgument(
            f"{what} must support the buffer protocol (bytes, bytearray, memoryview, "
            f"NumPy array), not {type(obj).__name__}"
        ) from None
    except (ValueError, BufferError) as exc:
        # e.g. a released memoryview, or an exporter that refuses a view of itself
        raise InvalidArgument(f"{what} cannot be used: {exc}") from exc
    if writable and view.readonly:
        raise InvalidArgument(
            f"{what} is read-only; this call writes into it, so pass a writable "
            "buffer (bytearray, writable memoryview, NumPy array)"
        )
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if "O" in _NAMES.sub("", view.format):
        # Items that are references to Python objects (a NumPy object array): their
        # bytes mean nothing elsewhere, and bytes written over them crash the process.
        raise InvalidArgument(f"{what} holds Python objects ({view.format!r}), not data")
    if view.nbytes == 0:
        # Nothing to lay out: cast() refuses shapes with a zero in them (np.zeros((0, 3))),
        # and CPython calls an empty strided view non-contiguous. Any empty byte view of
        # the same writability stands for it (zero length is allowed).
        return memoryview(b"" if view.readonly else bytearray())
    if not view.c_contiguous:
        raise InvalidArgument(f"{what} must be C-contiguous; copy it first (e.g. bytes(...))")
    return view.cast("B")


_NAMES = re.compile(r":[^:]*:")  # the field names of a struct format (PEP 3118)


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


def address_of(view: memoryview) -> int:
    """The virtual address of the first byte of `view` (read-only views included)."""
    if not view.readonly and view.nbytes:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))  # the fast way, 4x cheaper
    info = _PyBuffer()
    if _get_buffer(view, ctypes.byref(info), 0) != 0:  # PyBUF_SIMPLE
        raise InvalidArgument("cannot take the address of this buffer")
    try:
        return info.buf or 0
    finally:
        _release_buffer(ctypes.byref(info))
