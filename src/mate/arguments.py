"""Every argument check of mate, in one place.

The API's checks raise `InvalidArgument` (SPEC §2: from the call itself, never
as an event) with a message that says what was expected: numbers of seconds,
counts, choices, ranks, tags, target addresses, buffers, schedules and
timeouts, and the four arguments of a message together (`operation`). A
buffer is any C-contiguous object with the buffer protocol whose items are
not Python object references; the library works on a flat unsigned-byte
`memoryview` of it, which also keeps the object alive until the message's
terminal outcome (SPEC §2, Buffers). The command-line tools' argparse types
(`positive_int`, `non_negative`) are here too.
"""

from __future__ import annotations

import argparse
import math
import operator
import re
from collections.abc import Collection
from typing import Any, Final

from mate.constants import ANY_SOURCE, ANY_TAG, UNSET
from mate.errors import InvalidArgument
from mate.schedule import NO_SCHEDULE, Op, Schedule

ADDRESS_LIMIT = 2**64  # one past the last byte a region can hold
# Module constants: a read through the enum class is slow on Python 3.11 (mate.message).
_SEND: Final = Op.SEND
_RECV: Final = Op.RECV
_PUT: Final = Op.PUT
_UNSET: Final = UNSET  # imported names too: Final, they are not looked up per call
_NO_SCHEDULE: Final = NO_SCHEDULE
_memoryview: Final = memoryview  # a builtin too: compiled code looked it up at every call


def seconds(value: Any, what: str) -> float:
    """A finite, non-negative number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what} must be a number of seconds, not {value!r}")
    try:
        result = float(value)
    except OverflowError:  # an int beyond every float
        result = math.inf
    if not math.isfinite(result) or result < 0:
        raise InvalidArgument(f"{what} must be finite and >= 0, not {value!r}")
    return result


def schedule(value: Any) -> Schedule:
    """A message's schedule: a `Schedule`, or None for none."""
    if value is None:
        return _NO_SCHEDULE
    if not isinstance(value, Schedule):
        raise InvalidArgument(f"schedule must be a mate.Schedule or None, not {value!r}")
    return value


def timeout(value: Any, checked: Schedule, default: float) -> float | None:
    """A message's seconds to its timeout, or None for none. Unset means the world's
    default when the schedule handles timeouts, else none."""
    if value is _UNSET:
        return default if checked.timeout is not None else None
    if value is None:
        return None
    return seconds(value, "timeout")


def probability(value: Any, what: str) -> float:
    """A number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InvalidArgument(f"{what} must be a probability in [0, 1], not {value!r}")
    return float(value)


def count(value: Any, what: str, *, minimum: int = 0, maximum: int | None = None,
          unit: str = "") -> int:
    """An int in [`minimum`, `maximum`] (bytes, messages, ranks)."""
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or (maximum is not None and value > maximum)):
        unit = f" ({unit})" if unit else ""
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise InvalidArgument(f"{what} must be an int {bound}{unit}, not {value!r}")
    return value


def choice(value: Any, what: str, allowed: Collection[str]) -> str:
    """One of `allowed`."""
    if not isinstance(value, str) or value not in allowed:
        raise InvalidArgument(f"{what} must be one of {tuple(allowed)}, not {value!r}")
    return value


def _integer(value: Any, what: str, kind: str) -> int:
    if type(value) is int:
        return value  # the common case, without operator.index's generic call
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be {kind}, not {value!r}")
    try:
        result: int = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{what} must be {kind}, not {value!r}") from None
    return result


def rank(value: Any, what: str, numprocs: int, *, wildcard: bool) -> int:
    """A rank of a world of `numprocs`, or `ANY_SOURCE` where `wildcard` allows it."""
    result = _integer(value, what, "a rank (int)")
    if wildcard and result == ANY_SOURCE:
        return result
    if not 0 <= result < numprocs:
        allowed = "mate.ANY_SOURCE or " if wildcard else ""
        raise InvalidArgument(
            f"{what}={result} is not a rank of this world: allowed are {allowed}"
            f"0..{numprocs - 1}" + ("" if wildcard else " (no wildcard here)"))
    return result


def tag(value: Any, tag_max: int, *, wildcard: bool) -> int:
    """A tag in 0..tag_max, or `ANY_TAG` where `wildcard` allows it."""
    result = _integer(value, "tag", "an int")
    if wildcard and result == ANY_TAG:
        return result
    if not 0 <= result <= tag_max:
        allowed = "mate.ANY_TAG or " if wildcard else ""
        raise InvalidArgument(
            f"tag={result} is out of range: allowed are {allowed}0..{tag_max} (world.tag_max)"
            + ("" if wildcard else "; a send cannot use a wildcard"))
    return result


def address(value: Any, length: int) -> int:
    """A target address: `[address, address + length)` must fit in 64 bits."""
    result = _integer(value, "address", "an int (region.address + offset)")
    if result < 0:
        raise InvalidArgument(f"address must be >= 0, not {result}")
    if result >= ADDRESS_LIMIT or result + length > ADDRESS_LIMIT:  # no region can hold it
        raise InvalidArgument(
            f"[{result:#x}, +{length}) ends past 2**64: no exposed region can hold it")
    return result


_NAMES = re.compile(r":[^:]*:")  # the field names of a struct format (PEP 3118)


def buffer(obj: Any, *, writable: bool, what: str) -> memoryview:
    """A flat byte view of `obj`, or InvalidArgument saying why it cannot be used."""
    try:
        # Our own view, even of a memoryview: the caller may release theirs while
        # the message is in flight, and ours keeps the memory (SPEC §2, Buffers).
        view = _memoryview(obj)
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
    if type(obj) is bytearray or type(obj) is bytes:
        return view  # flat bytes already: the layout checks below cost more than the view
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


def operation(op: Op, obj: Any, peer: Any, key: Any, numprocs: int,
              tag_max: int) -> tuple[memoryview, int, int, int]:
    """The checked buffer, peer, tag and target address of a send, recv, put or get;
    `key` is the tag of a send or receive and the target address of a put or get."""
    if op is _SEND:
        return (buffer(obj, writable=False, what="send buffer"),
                rank(peer, "dest", numprocs, wildcard=False),
                tag(key, tag_max, wildcard=False), 0)
    if op is _RECV:
        return (buffer(obj, writable=True, what="recv buffer"),
                rank(peer, "source", numprocs, wildcard=True),
                tag(key, tag_max, wildcard=True), 0)
    if op is _PUT:
        view = buffer(obj, writable=False, what="put buffer")
        return view, rank(peer, "dest", numprocs, wildcard=False), 0, address(key, len(view))
    view = buffer(obj, writable=True, what="get buffer")
    return view, rank(peer, "source", numprocs, wildcard=False), 0, address(key, len(view))


# -- argparse types for the command-line tools (mate-bench, mate.sim): text in ---------------


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def non_negative(text: str) -> float:
    """A finite number >= 0 (seconds, or the simulation's time units)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value
