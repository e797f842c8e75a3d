"""MPI-style matching of messages to receives, for transports that match themselves.

Two tables, as in thesis §5.3.1: `PostedReceives` holds receives that wait for
a message (their source and tag may be wildcards) and `UnexpectedMessages`
holds messages that arrived before any receive wanted them (source and tag
concrete). Both are hashed by (source, tag) and keep FIFO order inside a
bucket; a global sequence number decides between buckets, so that a match is
always the oldest eligible entry. That gives MPI's non-overtaking rule: two
messages from one source with one tag match receives in the order they were
sent, and receives are satisfied in the order they were posted.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Generic, TypeVar

from mate.constants import ANY_SOURCE, ANY_TAG

T = TypeVar("T")
_Key = tuple[int, int]
_Entry = tuple[int, T]  # (sequence number, item)


class _Buckets(Generic[T]):
    def __init__(self) -> None:
        self._buckets: dict[_Key, deque[_Entry[T]]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self._buckets.values())

    def add(self, source: int, tag: int, item: T) -> None:
        key = (source, tag)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = deque()
        bucket.append((next(self._seq), item))

    def remove(self, source: int, tag: int, item: T) -> bool:
        """Take `item` out (a cancel); False if it is not there any more."""
        bucket = self._buckets.get((source, tag))
        if bucket is None:
            return False
        for i, (_, candidate) in enumerate(bucket):
            if candidate is item:
                del bucket[i]
                if not bucket:
                    del self._buckets[source, tag]
                return True
        return False

    def _pop_oldest(self, keys: list[_Key]) -> T | None:
        best: deque[_Entry[T]] | None = None
        best_key: _Key | None = None
        for key in keys:
            bucket = self._buckets.get(key)
            if bucket is not None and (best is None or bucket[0][0] < best[0][0]):
                best, best_key = bucket, key
        if best is None:
            return None
        _, item = best.popleft()
        if not best:
            del self._buckets[best_key]  # type: ignore[arg-type]
        return item

    def items(self) -> list[T]:
        return [item for bucket in self._buckets.values() for _, item in bucket]

    def clear(self) -> None:
        self._buckets.clear()


class PostedReceives(_Buckets[T]):
    """Receives waiting for a message; source and tag may be wildcards."""

    def match(self, source: int, tag: int) -> T | None:
        """Take the oldest receive that accepts a message from `source` with `tag`."""
        return self._pop_oldest(
            [(source, tag), (ANY_SOURCE, tag), (source, ANY_TAG), (ANY_SOURCE, ANY_TAG)]
        )


class UnexpectedMessages(_Buckets[T]):
    """Messages that arrived before a receive for them; source and tag are concrete."""

    def match(self, source: int, tag: int) -> T | None:
        """Take the oldest message that a receive for (`source`, `tag`) accepts."""
        if source != ANY_SOURCE and tag != ANY_TAG:
            return self._pop_oldest([(source, tag)])
        keys = [
            key
            for key in self._buckets
            if source in (ANY_SOURCE, key[0]) and tag in (ANY_TAG, key[1])
        ]
        return self._pop_oldest(keys)
