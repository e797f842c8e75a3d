"""Registrations of user memory, cached (thesis §5.3.2).

Registering memory (`ibv_reg_mr`) pins its pages and costs far more than
the transfer of a small message, so the engine asks this cache instead of
the protection domain. A miss registers the whole pages containing the
buffer; a later request for any range inside those pages, needing no more
access than was registered, is a hit and costs a dictionary lookup.

Entries are kept sorted by start address. A lookup checks the entry with
exactly the same pages first (the common case: a buffer used again), then
scans back from the requested address over entries that could reach it (no
farther than the longest entry).

A `Pin` is in use between `acquire` and `release`; one in use is never
evicted. When more bytes are registered than `limit`, registrations not in
use are evicted least-frequently-used first (ties: the one released
longest ago), through a heap with lazy deletion. A registration that fails
(the device's pinned-memory limit) is retried once after evicting
everything not in use.

Stale memory: a registration names pages, not a Python object. If the
object were freed and the address reused by a new object, a cached
registration would name the old pages (on hardware without on-demand
paging). `acquire` therefore takes the object that owns the memory and
keeps it alive while the registration is cached; the registration pins its
pages anyway, so this costs no more memory.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import mmap
from typing import Final

from mate.transports.ibverbs.verbs import Access, MemoryRegion, ProtectionDomain, VerbsError

PAGE: Final = mmap.PAGESIZE


class Pin:
    """One cached registration of whole pages [start, end); `mr` holds its keys."""

    __slots__ = ("access", "alive", "end", "mr", "owner", "refs", "start", "uses", "version")

    def __init__(self, mr: MemoryRegion, start: int, end: int, access: Access,
                 owner: object) -> None:
        self.mr = mr
        self.start = start
        self.end = end
        self.access = access
        self.owner = owner  # keeps the memory alive while it is registered
        self.refs = 0  # acquires not yet released
        self.uses = 0  # acquires ever: the "frequency" of LFU
        self.version = 0  # which heap entry for this pin is current
        self.alive = True  # False once deregistered (evicted or cleared)


class PinCache:
    def __init__(self, pd: ProtectionDomain, limit: int) -> None:
        self._pd = pd
        self.limit = limit
        self._starts: list[int] = []  # sorted; parallel to _pins
        self._pins: list[Pin] = []
        self._exact: dict[tuple[int, int], list[Pin]] = {}
        self._longest = 0
        # (uses, tick, version, pin) of pins not in use; stale entries are skipped
        self._idle: list[tuple[int, int, int, Pin]] = []
        self._tick = itertools.count()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.bytes_pinned = 0

    def acquire(self, addr: int, length: int, access: Access, owner: object = None) -> Pin:
        """A registration covering [addr, addr + length) with at least `access`.

        `owner` (the object whose memory it is) is kept alive while the
        registration stays cached. Raises `VerbsError` if the device refuses.
        """
        start = addr - addr % PAGE
        end = -(-(addr + max(length, 1)) // PAGE) * PAGE
        pin = self._lookup(start, end, access)
        if pin is not None:
            self.hits += 1
        else:
            self.misses += 1
            pin = self._register(start, end, access, owner)
        pin.refs += 1
        pin.uses += 1
        return pin

    def release(self, pin: Pin) -> None:
        """End one `acquire` of `pin`; it stays cached while the limit allows."""
        pin.refs -= 1
        if pin.refs or not pin.alive:  # still in use, or cleared meanwhile
            return
        pin.version += 1
        heapq.heappush(self._idle, (pin.uses, next(self._tick), pin.version, pin))
        if self.bytes_pinned > self.limit:
            self._trim(self.limit)

    def clear(self) -> None:
        """Deregister everything, in use or not (shutdown)."""
        pins = self._pins
        self._pins, self._starts, self._idle = [], [], []
        self._exact.clear()
        self._longest = 0
        self.bytes_pinned = 0
        for pin in pins:
            self._drop(pin)

    def stats(self) -> dict[str, int]:
        return {"pin_hits": self.hits, "pin_misses": self.misses,
                "pin_evictions": self.evictions, "bytes_pinned": self.bytes_pinned}

    # -- inside --------------------------------------------------------------------------

    def _lookup(self, start: int, end: int, access: Access) -> Pin | None:
        for pin in self._exact.get((start, end), ()):
            if pin.access & access == access:
                return pin
        starts, pins = self._starts, self._pins
        reach = start - self._longest
        i = bisect.bisect_right(starts, start) - 1
        while i >= 0 and starts[i] >= reach:
            pin = pins[i]
            if pin.end >= end and pin.access & access == access:
                return pin
            i -= 1
        return None

    def _register(self, start: int, end: int, access: Access, owner: object) -> Pin:
        try:
            mr = self._pd.reg_mr(start, end - start, access)
        except VerbsError:
            if not self._trim(0):
                raise
            mr = self._pd.reg_mr(start, end - start, access)
        pin = Pin(mr, start, end, access, owner)
        i = bisect.bisect_right(self._starts, start)
        self._starts.insert(i, start)
        self._pins.insert(i, pin)
        self._exact.setdefault((start, end), []).append(pin)
        self._longest = max(self._longest, end - start)
        self.bytes_pinned += end - start
        if self.bytes_pinned > self.limit:
            self._trim(self.limit)
        return pin

    def _trim(self, target: int) -> bool:
        """Evict idle pins, least used first, until at most `target` bytes; any evicted?"""
        evicted = False
        idle = self._idle
        while self.bytes_pinned > target and idle:
            _, _, version, pin = heapq.heappop(idle)
            if pin.version != version or pin.refs or not pin.alive:
                continue  # stale: used again since, or already gone
            self._evict(pin)
            evicted = True
        return evicted

    def _evict(self, pin: Pin) -> None:
        i = bisect.bisect_left(self._starts, pin.start)
        while self._pins[i] is not pin:
            i += 1
        del self._starts[i], self._pins[i]
        same = self._exact[pin.start, pin.end]
        same.remove(pin)
        if not same:
            del self._exact[pin.start, pin.end]
        self.bytes_pinned -= pin.end - pin.start
        self.evictions += 1
        self._drop(pin)

    @staticmethod
    def _drop(pin: Pin) -> None:
        pin.alive = False
        pin.owner = None
        pin.mr.dereg()
