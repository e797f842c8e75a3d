"""Every argument check of mate, in one place.

The API's checks raise `InvalidArgument` (SPEC §2: from the call itself,
never as an event) with a message that says what was expected: numbers of
seconds, counts, choices, ranks, tags and target addresses. The command-line
tools' argparse types (`positive_int`, `non_negative`) are here too.
"""

from __future__ import annotations

import argparse
import math
import operator
from collections.abc import Collection
from typing import Any

from mate.constants import ANY_SOURCE, ANY_TAG
from mate.errors import InvalidArgument

ADDRESS_LIMIT = 2**64  # one past the last byte a region can hold


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
