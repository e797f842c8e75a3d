"""The pin cache (thesis §5.3.2) against a fake protection domain: no memory is touched."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from verbs_fabric import FakeMR, FakePD

from mate.transports.ibverbs.pincache import PAGE, PinCache
from mate.transports.ibverbs.verbs import Access, VerbsError

RW = Access.LOCAL_WRITE
RR = Access.REMOTE_READ
BASE = 0x10_0000_0000  # made-up addresses: the fake PD never touches memory


class CappedPD(FakePD):
    """Refuses registrations beyond `cap` bytes, as a device's pinned-memory limit does."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def reg_mr(self, addr: int, length: int, access: Access) -> FakeMR:
        if sum(mr.length for mr in self.by_lkey.values()) + length > self.cap:
            raise VerbsError("cannot pin more")
        return super().reg_mr(addr, length, access)


def test_whole_pages_registered_and_reused() -> None:
    pd = FakePD()
    cache = PinCache(pd, 1 << 30)
    pin = cache.acquire(BASE + 100, 10, RR)
    assert (pin.mr.addr, pin.mr.length) == (BASE, PAGE)
    cache.release(pin)
    again = cache.acquire(BASE + 5, PAGE - 5, RR)  # other bytes of the same page
    assert again is pin and cache.hits == 1 and cache.misses == 1
    cache.release(again)
    span = cache.acquire(BASE + PAGE - 1, 2, RR)  # straddles two pages
    assert (span.mr.addr, span.mr.length) == (BASE, 2 * PAGE)
    cache.release(span)
    inside = cache.acquire(BASE + PAGE + 7, 3, RR)  # inside the two-page registration
    assert inside is span
    cache.release(inside)
    assert cache.bytes_pinned == 3 * PAGE


def test_access_must_be_covered() -> None:
    pd = FakePD()
    cache = PinCache(pd, 1 << 30)
    reader = cache.acquire(BASE, 64, RR)
    cache.release(reader)
    writer = cache.acquire(BASE, 64, RW)  # REMOTE_READ does not give LOCAL_WRITE
    assert writer is not reader and cache.misses == 2
    cache.release(writer)
    both = cache.acquire(BASE, 64, RW | RR)
    assert both.mr.access & (RW | RR) == RW | RR
    cache.release(both)
    plain = cache.acquire(BASE, 64, Access(0))  # any registration will do
    assert cache.hits == 1
    cache.release(plain)


def test_least_frequently_used_is_evicted_and_never_one_in_use() -> None:
    pd = FakePD()
    cache = PinCache(pd, 2 * PAGE)
    hot = cache.acquire(BASE, 1, RR)
    for _ in range(3):
        cache.release(hot)
        hot = cache.acquire(BASE, 1, RR)
    cache.release(hot)
    cold = cache.acquire(BASE + 10 * PAGE, 1, RR)
    cache.release(cold)
    held = cache.acquire(BASE + 20 * PAGE, 1, RR)  # third page: over the limit
    assert not cold.alive and hot.alive and held.alive
    assert cache.evictions == 1 and cache.bytes_pinned == 2 * PAGE
    big = cache.acquire(BASE + 40 * PAGE, 3 * PAGE, RR)  # over the limit by itself
    assert held.alive and big.alive  # both in use: nothing else to evict but hot
    assert not hot.alive
    cache.release(big)  # idle now, and the cache is over its limit: it goes
    assert not big.alive and cache.bytes_pinned == PAGE
    cache.release(held)
    assert held.alive and len(pd.by_lkey) == 1


def test_refused_registration_is_retried_after_evicting_idle_ones() -> None:
    pd = CappedPD(2 * PAGE)
    cache = PinCache(pd, 1 << 30)
    a = cache.acquire(BASE, 1, RR)
    b = cache.acquire(BASE + 10 * PAGE, 1, RR)
    cache.release(a)
    c = cache.acquire(BASE + 20 * PAGE, 1, RR)  # refused, a evicted, retried
    assert not a.alive and b.alive and c.alive
    with pytest.raises(VerbsError):
        cache.acquire(BASE + 30 * PAGE, 1, RR)  # b and c are in use: nothing to evict


def test_clear_deregisters_everything() -> None:
    pd = FakePD()
    cache = PinCache(pd, 1 << 30)
    used = cache.acquire(BASE, 1, RR)
    cache.release(cache.acquire(BASE + 5 * PAGE, 1, RR))
    cache.clear()
    assert not pd.by_lkey and cache.bytes_pinned == 0
    cache.release(used)  # a late release of a cleared pin is harmless
    assert not pd.by_lkey
    assert cache.stats() == {"pin_hits": 0, "pin_misses": 2, "pin_evictions": 0,
                             "bytes_pinned": 0}


_step = st.one_of(
    st.tuples(st.just("acquire"), st.integers(0, 12 * PAGE), st.integers(0, 3 * PAGE),
              st.sampled_from([Access(0), RR, RW, RW | RR])),
    st.tuples(st.just("release"), st.integers(0, 1000)),
)


@settings(max_examples=150, deadline=None)
@given(limit=st.integers(PAGE, 8 * PAGE), steps=st.lists(_step, max_size=60))
def test_random_acquire_release(limit: int, steps: list[tuple]) -> None:
    pd = FakePD()
    cache = PinCache(pd, limit)
    held = []
    for step in steps:
        if step[0] == "acquire":
            _, offset, length, access = step
            addr = BASE + offset
            hits, regs = cache.hits, pd.regs
            pin = cache.acquire(addr, length, access)
            mr = pin.mr
            assert mr.lkey in pd.by_lkey  # registered now
            assert mr.addr <= addr and addr + max(length, 1) <= mr.addr + mr.length
            assert mr.access & access == access
            assert mr.addr % PAGE == 0 and mr.length % PAGE == 0
            assert pd.regs == (regs if cache.hits > hits else regs + 1)  # a hit registers nothing
            held.append(pin)
        elif held:
            cache.release(held.pop(step[1] % len(held)))
        for pin in held:  # never evicts one in use
            assert pin.alive and pin.mr.lkey in pd.by_lkey
        registered = sum(mr.length for mr in pd.by_lkey.values())
        assert cache.bytes_pinned == registered
        idle = [pin for pin in cache._pins if pin.refs == 0]
        assert cache.bytes_pinned <= limit or not idle  # only pins in use keep it over
    for pin in held:
        cache.release(pin)
    assert cache.bytes_pinned <= limit
    assert cache.hits + cache.misses == sum(1 for step in steps if step[0] == "acquire")
