"""The ibverbs protocol engine over an in-memory fabric (tests/verbs_fabric.py): no I/O.

Each test builds a few engines, posts operations as the core would, and lets
the fabric execute work requests and deliver completions in a random order
(per-QP order kept). The fabric's checker fails a test on any report the
core would refuse (two terminal reports, submission after the end, an
unrequested cancel), on negative credits, and on an RNR (a SEND that finds
the shared receive queue empty).
"""

from __future__ import annotations

import ctypes
import random
import struct
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verbs_fabric import Fabric, get, pattern, put, recv, send

from mate.constants import ANY_SOURCE, ANY_TAG
from mate.errors import FailureReason
from mate.machine import Input
from mate.schedule import Op, Region
from mate.transports.base import Operation, Report
from mate.transports.ibverbs import wire
from mate.transports.ibverbs.engine import PROBE_BASE
from mate.transports.ibverbs.verbs import Opcode, WcOpcode, WcStatus, WorkCompletion
from mate.transports.ibverbs.wire import HEADER_SIZE, Kind, ProtocolError, decode, encode

EAGER = 64
SOON = 1e18  # a deadline: the op may be abandoned by a cancel (the engine never reads clocks)


def outcome(fabric: Fabric, rank: int, op: Operation) -> Report:
    report = fabric.outcome(rank, op)
    assert report is not None, f"{op.op} on rank {rank} has not ended"
    return report


def assert_completed(fabric: Fabric, rank: int, op: Operation, length: int | None = None,
                     peer: int | None = None, tag: int | None = None) -> None:
    report = outcome(fabric, rank, op)
    assert report.input is Input.COMPLETED, report
    if length is not None:
        assert report.length == length
    if peer is not None:
        assert report.peer == peer
    if tag is not None:
        assert report.tag == tag


def assert_failed(fabric: Fabric, rank: int, op: Operation, reason: FailureReason) -> Report:
    report = outcome(fabric, rank, op)
    assert report.input is Input.FAILED, report
    assert report.error is not None and report.error.reason is reason, report
    return report


class Area(NamedTuple):
    memory: bytearray  # the region and its canaries
    view: memoryview  # the region's bytes
    region: Region


def expose(fabric: Fabric, rank: int, size: int, canary: int = 64) -> Area:
    """A region of `size` bytes with `canary` bytes of 0xEE on either side."""
    memory = bytearray(b"\xee" * (size + 2 * canary))
    view = memoryview(memory)[canary:canary + size]
    view[:] = b"\0" * size
    return Area(memory, view, fabric.engine(rank).expose(view))


def canaries_intact(memory: bytearray, size: int, canary: int = 64) -> bool:
    return memory[:canary] == b"\xee" * canary and memory[canary + size:] == b"\xee" * canary


# -- wire ------------------------------------------------------------------------------


def test_frames_round_trip() -> None:
    frame = encode(3, Kind.RTS, flags=wire.CREDIT_REQUEST, grant=7, ack=65535, tag=-5,
                   length=1 << 40, msg_id=2**64 - 1, addr=0xDEAD_BEEF_0000, rkey=2**32 - 1)
    assert len(frame) == HEADER_SIZE == 48
    h = decode(frame)
    assert h == (3, Kind.RTS, wire.CREDIT_REQUEST, 7, 65535, -5, 1 << 40, 2**64 - 1,
                 0xDEAD_BEEF_0000, 2**32 - 1)
    eager = encode(1, Kind.EAGER, tag=4, length=3, data=b"abc")
    assert decode(eager).length == 3
    for bad in (eager[:-1], eager + b"x", frame[:HEADER_SIZE - 1],
                encode(1, Kind.FIN, length=2, data=b"xy"), frame.replace(b"\x02", b"\x0c", 1),
                encode(1, Kind.FIN, flags=0x80)):
        with pytest.raises(ProtocolError):
            decode(bad)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2 * HEADER_SIZE))
def test_decode_random_bytes(frame: bytes) -> None:
    try:
        h = decode(frame)
    except ProtocolError:
        return
    assert h.kind in set(Kind) and len(frame) >= HEADER_SIZE


@settings(max_examples=300, deadline=None)
@given(kind=st.integers(0, 255), flags=st.integers(0, 255), length=st.integers(0, 80),
       extra=st.binary(max_size=80), cut=st.integers(0, 200))
def test_decode_near_valid_frames(kind: int, flags: int, length: int, extra: bytes,
                                  cut: int) -> None:
    frame = (wire.HEADER.pack(1, kind, flags, 0, 0, 0, length, 0, 0, 0) + extra)[:cut]
    try:
        h = decode(frame)
    except ProtocolError:
        return
    assert h.kind == kind and h.flags == flags
    assert len(frame) == HEADER_SIZE + (length if kind == Kind.EAGER else 0)


# -- two-sided -------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, EAGER - 1, EAGER, EAGER + 1, 5000, 70_000])
@pytest.mark.parametrize("recv_first", [False, True])
@pytest.mark.parametrize("dest", [0, 1])  # 0: loopback
def test_eager_and_rendezvous_deliver_the_bytes(size: int, recv_first: bool,
                                                dest: int) -> None:
    fabric = Fabric(2, eager_size=EAGER)
    data = pattern(size, size)
    r = recv(size + 10, 0, 9)
    if recv_first:
        fabric.post(dest, r)
    s = fabric.post(0, send(data, dest, 9))
    fabric.run(random.Random(size))
    if not recv_first:
        fabric.post(dest, r)
        fabric.run(random.Random(size + 1))
    assert_completed(fabric, dest, r, size, peer=0, tag=9)
    assert_completed(fabric, 0, s, size, peer=dest, tag=9)
    assert bytes(r.buffer[:size]) == data and bytes(r.buffer[size:]) == b"\0" * 10
    stats = fabric.engine(0).stats()
    assert stats["eager_sends" if size <= EAGER else "rendezvous_sends"] == 1
    assert fabric.engine(0).outstanding() == fabric.engine(1).outstanding() == 0


def test_eager_submission_comes_at_the_copy_and_completion_at_the_send() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    s = fabric.post(0, send(b"hello", 1))
    checker = fabric.ranks[0].checker
    assert checker.submitted[id(s)] == 1 and fabric.outcome(0, s) is None
    assert fabric.engine(0).outstanding() == 1
    fabric.run()
    assert_completed(fabric, 0, s, 5)  # in rank 1's unexpected table: it arrived


@pytest.mark.parametrize("seed", range(3))
def test_credit_exhaustion_never_overruns_the_receive_queue(seed: int) -> None:
    fabric = Fabric(2, eager_size=EAGER, credits=2)
    rnd = random.Random(seed)
    sends = {0: [], 1: []}
    for i in range(1000):  # both ways at once: each side owes the other while it waits
        for src in (0, 1):
            sends[src].append(fabric.post(src, send(struct.pack("<I", i), 1 - src, 5)))
        if i % 50 == 0:
            for _ in range(rnd.randrange(40)):
                fabric.step(rnd)
    fabric.run(rnd)
    for src in (0, 1):
        for s in sends[src]:
            assert_completed(fabric, src, s, 4)
        stats = fabric.engine(src).stats()
        assert stats["credit_stalls"] > 0
    receives = {dst: [fabric.post(dst, recv(8, 1 - dst, 5)) for _ in range(1000)]
                for dst in (0, 1)}
    fabric.run(rnd)
    for dst, rs in receives.items():
        got = [struct.unpack_from("<I", r.buffer)[0] for r in rs]
        assert got == list(range(1000))  # in order
        for r in rs:
            assert_completed(fabric, dst, r, 4, peer=1 - dst, tag=5)
    for r in fabric.ranks:
        assert all(0 <= c <= 2 for c in r.engine._credits)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(2, 3), credits=st.integers(2, 4),
       counts=st.lists(st.integers(0, 40), min_size=9, max_size=9),
       big=st.sets(st.integers(0, 39), max_size=5), head_start=st.integers(0, 400),
       rnd=st.randoms(use_true_random=False))
def test_credits_neither_overrun_nor_deadlock(size, credits, counts, big, head_start,
                                              rnd) -> None:
    """Every rank floods every rank (itself too) before any receive is posted.

    The fabric fails on an RNR, on a sender holding more than credits + 1 of a
    receiver's buffers, and on a second unacknowledged CREDIT; `run` fails if
    the fabric never goes quiet, and everything must end: no deadlock.
    """
    fabric = Fabric(size, eager_size=EAGER, credits=credits)
    pairs = [(a, b) for a in range(size) for b in range(size)]
    sends = []
    for (a, b), count in zip(pairs, counts, strict=False):
        for i in range(count):
            data = struct.pack("<I", i) + (b"." * 200 if i in big else b"")
            sends.append((a, fabric.post(a, send(data, b, 1))))
    for _ in range(head_start):  # the flood moves before anyone receives
        fabric.step(rnd)
    receives = []
    for (a, b), count in zip(pairs, counts, strict=False):
        receives += [(b, a, fabric.post(b, recv(300, a, 1))) for _ in range(count)]
    fabric.run(rnd)
    for rank, op in sends:
        assert_completed(fabric, rank, op)
    got: dict[tuple[int, int], list[int]] = {}
    for rank, source, op in receives:
        assert_completed(fabric, rank, op, peer=source)
        got.setdefault((source, rank), []).append(struct.unpack_from("<I", op.buffer)[0])
    for numbers in got.values():
        assert numbers == list(range(len(numbers)))


def test_explicit_credit_returns_credit_to_a_one_way_sender() -> None:
    fabric = Fabric(2, eager_size=EAGER, credits=4)
    rs = [fabric.post(1, recv(8, 0, 0)) for _ in range(100)]
    ss = [fabric.post(0, send(b"x", 1)) for _ in range(100)]
    fabric.run(random.Random(3))
    assert all(outcome(fabric, 1, r).input is Input.COMPLETED for r in rs)
    assert all(outcome(fabric, 0, s).input is Input.COMPLETED for s in ss)
    assert fabric.engine(1).stats()["credit_messages"] > 0
    assert fabric.engine(0).stats()["credit_messages"] == 0  # rank 0 received nothing


def test_idle_once_nothing_is_owed_to_the_wire() -> None:
    """A receiver whose receive has completed may still owe the sender its FIN."""
    fabric = Fabric(2, eager_size=EAGER, credits=2)
    assert all(r.engine.idle() for r in fabric.ranks)
    r = fabric.post(1, recv(1000, 0, 0))
    s = fabric.post(0, send(pattern(1000, 2), 1, 0))
    while fabric.outcome(1, r) is None:
        fabric.step()
    assert fabric.engine(1).outstanding() == 0
    assert not fabric.engine(1).idle()  # the FIN is not through yet
    fabric.run()
    assert_completed(fabric, 0, s)
    assert fabric.engine(0).idle() and fabric.engine(1).idle()
    waiting = [fabric.post(1, send(b"w", 0)) for _ in range(3)]  # the third waits for credit
    assert not fabric.engine(1).idle()
    fabric.break_link(0, 1)  # a lost peer is owed nothing, once its requests are flushed
    fabric.run()
    assert fabric.engine(1).idle()
    for op in waiting:
        assert_failed(fabric, 1, op, FailureReason.PEER_UNREACHABLE)


def test_one_send_slot_and_a_short_send_queue() -> None:
    fabric = Fabric(2, eager_size=EAGER, credits=2, send_slots=1, max_send_wr=2)
    area = expose(fabric, 1, 4096)
    rs = [fabric.post(1, recv(200, 0, ANY_TAG)) for _ in range(30)]
    ops = []
    for i in range(30):
        ops.append(fabric.post(0, send(pattern(10 + 5 * i, i), 1, i)))
        ops.append(fabric.post(0, put(pattern(100, i), 1, area.region.address + 100 * i)))
        ops.append(fabric.post(0, get(100, 1, area.region.address + 100 * i)))
    fabric.run(random.Random(0))  # the fabric fails on a send queue overflow
    for op in ops:
        assert outcome(fabric, 0, op).input is Input.COMPLETED
    for i, r in enumerate(rs):
        assert bytes(r.buffer[:10 + 5 * i]) == pattern(10 + 5 * i, i)
    assert canaries_intact(area.memory, 4096)


def test_wildcards_resolve_source_and_tag() -> None:
    fabric = Fabric(3, eager_size=EAGER)
    any_any = fabric.post(0, recv(100))
    any_7 = fabric.post(0, recv(100, ANY_SOURCE, 7))
    from_2 = fabric.post(0, recv(1000, 2, ANY_TAG))
    fabric.post(2, send(b"a" * 500, 0, 3))  # rendezvous; only from_2... and any_any accept
    fabric.run()
    # any_any is older than from_2, but its room is 100: it is matched and truncated
    report = assert_failed(fabric, 0, any_any, FailureReason.TRUNCATED)
    assert (report.length, report.peer, report.tag) == (100, 2, 3)
    fabric.post(1, send(b"b" * 5, 0, 7))
    fabric.post(2, send(b"c" * 6, 0, 8))
    fabric.run(random.Random(1))
    assert_completed(fabric, 0, any_7, 5, peer=1, tag=7)
    assert_completed(fabric, 0, from_2, 6, peer=2, tag=8)


@pytest.mark.parametrize("size", [50, 500])
def test_truncation_delivers_a_prefix_and_the_sender_completes(size: int) -> None:
    fabric = Fabric(2, eager_size=EAGER)
    data = pattern(size, 1)
    r = fabric.post(1, recv(10, 0, 1))
    s = fabric.post(0, send(data, 1, 1))
    fabric.run(random.Random(2))
    report = assert_failed(fabric, 1, r, FailureReason.TRUNCATED)
    assert (report.length, report.peer, report.tag) == (10, 0, 1)
    assert bytes(r.buffer) == data[:10]
    assert_completed(fabric, 0, s, size)
    # a rendezvous message for an empty buffer is not read at all
    empty = fabric.post(1, recv(0, 0, 2))
    s2 = fabric.post(0, send(data, 1, 2))
    fabric.run(random.Random(3))
    assert assert_failed(fabric, 1, empty, FailureReason.TRUNCATED).length == 0
    assert_completed(fabric, 0, s2)


_message = st.tuples(st.integers(1, 2), st.integers(0, 1),  # source, tag
                     st.sampled_from([12, 40, EAGER, EAGER + 1, 300, 3000]),
                     st.booleans())  # with a deadline


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(_message, min_size=1, max_size=25),
       specs=st.lists(st.tuples(st.sampled_from([ANY_SOURCE, 1, 2]),
                                st.sampled_from([ANY_TAG, 0, 1]),
                                st.sampled_from([12, 40, 300, 4000])), max_size=25),
       cancels=st.lists(st.integers(0, 60), max_size=6),
       rnd=st.randoms(use_true_random=False), credits=st.sampled_from([2, 3, 8]))
def test_random_two_sided_traffic(messages, specs, cancels, rnd, credits) -> None:
    """Random sends from ranks 1 and 2 to rank 0, random receives, cancels and orders.

    Checked: every op ends exactly once, data is intact (a prefix when
    truncated), nothing is delivered twice, every completed send is delivered
    (after draining), and non-overtaking: among receives in posting order the
    messages of one (source, tag) come in sending order.
    """
    fabric = Fabric(3, eager_size=EAGER, credits=credits)
    seq: dict[tuple[int, int], int] = {}
    sends: list[tuple[int, Operation, bytes]] = []
    receives: list[Operation] = []
    events: list[tuple[str, int]] = [("s", i) for i in range(len(messages))]
    events += [("r", i) for i in range(len(specs))]
    rnd.shuffle(events)
    for what, i in events:
        if what == "s":
            source, tag, size, deadline = messages[i]
            n = seq.get((source, tag), 0)
            seq[source, tag] = n + 1
            data = struct.pack("<III", source, tag, n) + pattern(size - 12, hash((source, tag, n)))
            op = fabric.post(source, send(data, 0, tag, SOON if deadline else None))
            sends.append((source, op, data))
        else:
            source, tag, room = specs[i]
            receives.append(fabric.post(0, recv(room, source, tag)))
        for _ in range(rnd.randrange(8)):
            fabric.step(rnd)
        if cancels and len(sends) + len(receives) == cancels[-1] % (len(events) + 1):
            cancels.pop()
            victims = [(src, op) for src, op, _ in sends] + [(0, op) for op in receives]
            rank, victim = victims[rnd.randrange(len(victims))]
            fabric.cancel(rank, victim)
    fabric.run(rnd)
    # receives still waiting are cancelled; what is unexpected is drained
    for r in receives:
        if fabric.outcome(0, r) is None:
            fabric.cancel(0, r)
    fabric.run(rnd)
    while True:
        drain = fabric.post(0, recv(4000))
        receives.append(drain)
        fabric.run(rnd)
        if fabric.outcome(0, drain) is None:
            fabric.cancel(0, drain)
            break
    payloads = {data[:12]: data for _, _, data in sends}
    delivered: dict[bytes, int] = {}
    last: dict[tuple[int, int], int] = {}
    for r in receives:
        report = outcome(fabric, 0, r)
        if report.input is Input.CANCELLED:
            continue
        assert report.length is not None and report.length >= 12
        ident = bytes(r.buffer[:12])
        source, tag, n = struct.unpack("<III", ident)
        assert (report.peer, report.tag) == (source, tag)
        data = payloads[ident]
        assert bytes(r.buffer[:report.length]) == data[:report.length]
        if report.input is Input.FAILED:
            assert report.error is not None
            assert report.error.reason is FailureReason.TRUNCATED and len(data) > len(r.buffer)
        else:
            assert report.length == len(data)
        delivered[ident] = delivered.get(ident, 0) + 1
        assert last.get((source, tag), -1) < n, "overtaken"
        last[source, tag] = n
    assert all(count == 1 for count in delivered.values())
    for source, op, data in sends:
        report = outcome(fabric, source, op)
        if report.input is Input.COMPLETED:
            assert delivered.get(data[:12]) == 1
        else:
            assert report.input is Input.CANCELLED
    for r in fabric.ranks:
        assert r.engine.outstanding() == 0 and r.engine.idle()
        assert not r.engine._rdv and not r.engine._rdma


# -- one-sided -------------------------------------------------------------------------


@pytest.mark.parametrize("target", [1, 0])  # 0: loopback
@pytest.mark.parametrize("deadline", [None, SOON])
def test_put_and_get(target: int, deadline: float | None) -> None:
    fabric = Fabric(2, eager_size=EAGER)
    area = expose(fabric, target, 10_000)
    data = pattern(5000, 4)
    p1 = fabric.post(0, put(data, target, area.region.address + 100, deadline))
    fabric.run(random.Random(1))
    assert_completed(fabric, 0, p1, 5000, peer=target)
    assert bytes(area.view[100:5100]) == data and bytes(area.view[:100]) == b"\0" * 100
    g = fabric.post(0, get(5000, target, area.region.address + 100, deadline))
    p2 = fabric.post(0, put(b"xyz", target, area.region.address + 9997, deadline))
    fabric.run(random.Random(2))
    assert_completed(fabric, 0, g, 5000, peer=target)
    assert bytes(g.buffer) == data
    assert_completed(fabric, 0, p2, 3)
    assert bytes(area.view[9997:]) == b"xyz"
    assert canaries_intact(area.memory, 10_000)
    stats = fabric.engine(0).stats()
    assert stats["key_requests"] == 1  # the key was cached after the first


def test_key_requests_for_one_range_are_shared() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    area = expose(fabric, 1, 1000)
    ops = [fabric.post(0, put(bytes([i]) * 10, 1, area.region.address)) for i in range(5)]
    fabric.run(random.Random(5))
    assert fabric.engine(0).stats()["key_requests"] == 1
    for op in ops:
        assert_completed(fabric, 0, op, 10)


def test_refused_key_fails_remote_access_and_touches_nothing() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    area = expose(fabric, 1, 1000)
    before = bytes(area.memory)
    outside = [
        put(b"x" * 10, 1, area.region.address + 995),  # runs past the end
        put(b"x" * 10, 1, area.region.address - 5),  # starts before it
        get(10, 1, area.region.address + 1000),
        put(b"", 1, area.region.address + 1001),  # zero length, but not inside
        get(0, 1, area.region.address - 1),
    ]
    for op in outside:
        fabric.post(0, op)
    inside = [fabric.post(0, put(b"", 1, area.region.address + 1000)),  # the end is inside
              fabric.post(0, get(0, 1, area.region.address))]
    fabric.run(random.Random(6))
    for op in outside:
        assert_failed(fabric, 0, op, FailureReason.REMOTE_ACCESS)
    for op in inside:
        assert_completed(fabric, 0, op, 0)
    assert bytes(area.memory) == before
    for op in outside[2:]:
        assert bytes(op.buffer) == b"\0" * len(op.buffer)


def test_remote_access_error_completion_fails_remote_access() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    area = expose(fabric, 1, 1000)
    first = fabric.post(0, put(b"a", 1, area.region.address))
    fabric.run()
    assert_completed(fabric, 0, first)
    # The target loses the registration behind the engine's back: the key is stale.
    pd = fabric.ranks[1].pd
    mr = next(mr for mr in pd.by_lkey.values() if mr.addr == area.region.address)
    del pd.by_lkey[mr.lkey], pd.by_rkey[mr.rkey]
    bad = fabric.post(0, put(b"b" * 10, 1, area.region.address))
    other = fabric.post(0, send(b"z", 1))
    fabric.run()
    assert_failed(fabric, 0, bad, FailureReason.REMOTE_ACCESS)
    assert outcome(fabric, 0, other).input in (Input.COMPLETED, Input.FAILED)  # it ended
    assert bytes(area.view[:10]) == b"a" + b"\0" * 9


@pytest.mark.parametrize("status,reason", [
    (WcStatus.RETRY_EXC_ERR, FailureReason.PEER_UNREACHABLE),
    (WcStatus.RNR_RETRY_EXC_ERR, FailureReason.PEER_UNREACHABLE),
    (WcStatus.WR_FLUSH_ERR, FailureReason.PEER_UNREACHABLE),
    (WcStatus.REM_ACCESS_ERR, FailureReason.REMOTE_ACCESS),
    (WcStatus.GENERAL_ERR, FailureReason.TRANSPORT),
])
def test_error_completions_map_to_reasons(status: WcStatus, reason: FailureReason) -> None:
    fabric = Fabric(2, eager_size=EAGER)
    s = fabric.post(0, send(b"abc", 1))
    wr = fabric.qps[0, 1].pending.popleft()
    fabric.inject(0, WorkCompletion(wr.wr_id, status, WcOpcode.SEND, 0, 1))
    assert_failed(fabric, 0, s, reason)
    # a flushed receive buffer is ignored, another error gives the buffer back
    srq = fabric.ranks[0].srq
    n = len(srq)
    buffer = srq.popleft()
    fabric.inject(0, WorkCompletion(buffer.wr_id, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV, 0, 1))
    assert len(srq) == n - 1
    fabric.inject(0, WorkCompletion(buffer.wr_id, WcStatus.LOC_LEN_ERR, WcOpcode.RECV, 0, 1))
    assert len(srq) == n


def test_unexpose_revokes_keys() -> None:
    fabric = Fabric(3, eager_size=EAGER)
    area = expose(fabric, 1, 1000)
    granted = [fabric.post(p, put(b"k", 1, area.region.address + p)) for p in (0, 2)]
    fabric.run(random.Random(7))
    for p, op in zip((0, 2), granted, strict=True):
        assert_completed(fabric, p, op)
    # a put in flight with the cached key when the revoke comes
    late = fabric.post(0, put(b"late", 1, area.region.address + 10))
    calls: list[str] = []

    def done() -> None:
        assert fabric.outcome(0, late) is not None  # it finished before the ack
        calls.append("done")

    regs = len(fabric.ranks[1].pd.by_lkey)
    fabric.engine(1).unexpose(area.region, done)
    assert calls == []  # two peers hold the key
    fabric.run(random.Random(8))
    assert calls == ["done"]
    assert len(fabric.ranks[1].pd.by_lkey) == regs - 1  # deregistered
    assert_completed(fabric, 0, late, 4)
    after = [fabric.post(p, put(b"!", 1, area.region.address)) for p in (0, 2)]
    fabric.run()
    for p, op in zip((0, 2), after, strict=True):
        assert_failed(fabric, p, op, FailureReason.REMOTE_ACCESS)
    assert bytes(area.view[:1]) == b"k"
    assert fabric.engine(0).stats()["key_requests"] == 2


def test_unexpose_of_a_region_nobody_asked_for_is_immediate() -> None:
    fabric = Fabric(2)
    area = expose(fabric, 1, 100)
    calls: list[int] = []
    fabric.engine(1).unexpose(area.region, lambda: calls.append(1))
    assert calls == [1]
    fabric.engine(1).unexpose(area.region, lambda: calls.append(2))  # unknown now: at once too
    assert calls == [1, 2]
    z = bytearray()
    empty = fabric.engine(1).expose(memoryview(z))
    op = fabric.post(0, put(b"", 1, empty.address))
    fabric.run()
    assert_completed(fabric, 0, op, 0)  # zero length, inside a zero-length region
    fabric.engine(1).unexpose(empty, lambda: calls.append(3))
    fabric.run()
    assert calls == [1, 2, 3]
    again = fabric.post(0, put(b"", 1, empty.address))
    fabric.run()
    assert_failed(fabric, 0, again, FailureReason.REMOTE_ACCESS)


# -- cancel ----------------------------------------------------------------------------


def test_cancel_a_posted_receive() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    r = fabric.post(1, recv(10, 0, 0))
    fabric.cancel(1, r)
    assert outcome(fabric, 1, r).input is Input.CANCELLED
    fabric.cancel(1, r)  # after the end: nothing
    s = fabric.post(0, send(b"data", 1))
    fabric.run()
    assert bytes(r.buffer) == b"\0" * 10
    r2 = fabric.post(1, recv(10, 0, 0))  # the message was not consumed
    fabric.run()
    assert_completed(fabric, 1, r2, 4)
    assert_completed(fabric, 0, s)


def test_cancel_a_receive_being_read_lets_it_complete() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    r = fabric.post(1, recv(1000, 0, 0, deadline=SOON))
    s = fabric.post(0, send(pattern(1000, 1), 1))
    while not fabric.qps[1, 0].pending:  # until the READ is posted
        fabric.step()
    fabric.cancel(1, r)
    assert fabric.outcome(1, r) is None
    fabric.run()
    assert_completed(fabric, 1, r, 1000)
    assert bytes(r.buffer) == pattern(1000, 1)
    assert_completed(fabric, 0, s)


def test_cancel_sends_waiting_for_credit() -> None:
    fabric = Fabric(2, eager_size=EAGER, credits=2)
    ss = [fabric.post(0, send(bytes([i]), 1, 0)) for i in range(6)]
    big = fabric.post(0, send(pattern(500, 2), 1, 0))
    for op in (ss[4], big):
        fabric.cancel(0, op)
        assert outcome(fabric, 0, op).input is Input.CANCELLED
    rs = [fabric.post(1, recv(10, 0, 0)) for _ in range(6)]
    fabric.run(random.Random(9))
    got = [bytes(r.buffer[:1]) for r in rs if fabric.outcome(1, r) is not None]
    assert got == [b"\0", b"\1", b"\2", b"\3", b"\5"]


def test_cancel_an_eager_send_on_the_wire_abandons_it() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    s = fabric.post(0, send(b"gone?", 1))
    fabric.cancel(0, s)
    assert outcome(fabric, 0, s).input is Input.CANCELLED
    r = fabric.post(1, recv(10))
    fabric.run()  # the slot is freed at the completion; no second report
    assert_completed(fabric, 1, r, 5)  # it may still arrive: allowed
    assert len(fabric.engine(0)._free) == 256


def test_cancel_a_rendezvous_send_from_a_copy() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    data = bytearray(pattern(1000, 3))
    s = fabric.post(0, Operation(Op.SEND, memoryview(data), 1, 0, deadline=SOON))
    assert fabric.ranks[0].checker.submitted[id(s)] == 1  # copied at once
    data[:] = b"\0" * 1000  # the user may reuse the buffer after submission
    fabric.run()
    fabric.cancel(0, s)
    assert outcome(fabric, 0, s).input is Input.CANCELLED  # at once
    fabric.run()
    engine = fabric.engine(0)
    assert not engine._rdv and engine._scratch_kept > 0  # the copy is back in the pool
    r = fabric.post(1, recv(2000, 0, 0))
    fabric.run()
    assert fabric.outcome(1, r) is None  # the receiver dropped the RTS


def test_cancel_a_copied_rendezvous_send_that_is_being_read() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    r = fabric.post(1, recv(2000, 0, 0))
    s = fabric.post(0, send(pattern(1000, 3), 1, 0, deadline=SOON))
    while not fabric.qps[1, 0].pending:
        fabric.step()
    fabric.cancel(0, s)
    assert outcome(fabric, 0, s).input is Input.CANCELLED
    fabric.run()
    assert_completed(fabric, 1, r, 1000)  # read from the copy, which stayed intact
    assert bytes(r.buffer[:1000]) == pattern(1000, 3)
    assert not fabric.engine(0)._rdv


def test_cancel_a_zero_copy_rendezvous_send() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    s = fabric.post(0, send(pattern(1000, 4), 1, 0))
    fabric.run()  # the RTS waits in rank 1's unexpected table
    fabric.cancel(0, s)
    assert fabric.outcome(0, s) is None  # the receiver must drop it first
    fabric.run()
    assert outcome(fabric, 0, s).input is Input.CANCELLED
    r = fabric.post(1, recv(2000, 0, 0))
    fabric.run()
    assert fabric.outcome(1, r) is None
    assert fabric.ranks[0].pins.stats()["bytes_pinned"] > 0
    assert all(pin.refs == 0 for pin in fabric.ranks[0].pins._pins)  # released


def test_cancel_a_matched_zero_copy_send_completes_it() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    r = fabric.post(1, recv(2000, 0, 0))
    s = fabric.post(0, send(pattern(1000, 5), 1, 0))
    while not fabric.qps[1, 0].pending:  # the READ is on the wire
        fabric.step()
    fabric.cancel(0, s)
    fabric.run()
    assert_completed(fabric, 0, s, 1000)  # the match won
    assert_completed(fabric, 1, r, 1000)


@pytest.mark.parametrize("kind", ["put", "get"])
def test_cancel_one_sided_on_the_wire(kind: str) -> None:
    fabric = Fabric(2, eager_size=EAGER)
    area = expose(fabric, 1, 1000)
    area.view[:] = pattern(1000, 6)
    warm = fabric.post(0, get(1, 1, area.region.address))
    fabric.run()
    assert_completed(fabric, 0, warm)

    def make(deadline: float | None) -> Operation:
        if kind == "put":
            return put(b"p" * 100, 1, area.region.address, deadline)
        return get(100, 1, area.region.address, deadline)

    abandoned = fabric.post(0, make(SOON))
    kept = fabric.post(0, make(None))
    assert fabric.qps[0, 1].pending  # both on the wire (the key is cached)
    fabric.cancel(0, abandoned)
    fabric.cancel(0, kept)
    assert outcome(fabric, 0, abandoned).input is Input.CANCELLED
    assert fabric.outcome(0, kept) is None  # cannot be recalled: it completes
    fabric.run()
    assert_completed(fabric, 0, kept, 100)
    if kind == "get":
        assert bytes(abandoned.buffer) == b"\0" * 100  # never written after the cancel
        assert bytes(kept.buffer) == pattern(1000, 6)[:100]
    assert not fabric.engine(0)._rdma and not fabric.engine(0)._key_users


def test_cancel_one_sided_waiting_for_a_key() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    area = expose(fabric, 1, 1000)
    p = fabric.post(0, put(b"x" * 10, 1, area.region.address))
    g = fabric.post(0, get(10, 1, area.region.address, SOON))
    fabric.cancel(0, p)
    fabric.cancel(0, g)
    assert outcome(fabric, 0, p).input is Input.CANCELLED
    assert outcome(fabric, 0, g).input is Input.CANCELLED
    fabric.run()
    assert bytes(area.view[:10]) == b"\0" * 10
    assert fabric.engine(0).outstanding() == 0


# -- faults ----------------------------------------------------------------------------


def test_peer_lost_fails_its_operations_and_spares_the_others() -> None:
    fabric = Fabric(3, eager_size=EAGER)
    area = expose(fabric, 1, 1000)
    mine = expose(fabric, 0, 1000)  # kept alive: rank 1 writes into it
    key_holder = fabric.post(1, put(b"k", 0, mine.region.address))
    fabric.run()
    assert_completed(fabric, 1, key_holder)
    to_1 = fabric.post(0, send(pattern(1000, 1), 1, 0))  # rendezvous, unmatched
    from_1 = fabric.post(0, recv(10, 1, 0))
    any_source = fabric.post(0, recv(10))
    to_2 = fabric.post(0, send(b"to 2", 2, 0))
    from_2 = fabric.post(0, recv(10, 2, 1))
    fabric.run()
    one_sided = fabric.post(0, put(b"x", 1, area.region.address))  # waits for its key
    calls: list[int] = []
    fabric.engine(0).unexpose(mine.region, lambda: calls.append(1))  # rank 1 holds the key
    unacked = fabric.post(0, send(b"lost", 1, 9))
    fabric.break_link(0, 1)
    assert calls == [1]  # a lost peer counts as having acked
    for op in (to_1, from_1, one_sided, unacked):
        assert_failed(fabric, 0, op, FailureReason.PEER_UNREACHABLE)
    assert fabric.outcome(0, any_source) is None
    fabric.engine(0).peer_lost(1, "again")  # idempotent
    fabric.ranks[0].collect()
    after = fabric.post(0, send(b"late", 1))
    assert_failed(fabric, 0, after, FailureReason.PEER_UNREACHABLE)
    after_recv = fabric.post(0, recv(10, 1, 0))
    assert_failed(fabric, 0, after_recv, FailureReason.PEER_UNREACHABLE)
    fabric.post(2, send(b"any", 0, 3))  # first: any_source is older than from_2
    fabric.post(2, send(b"from 2", 0, 1))
    fabric.run(random.Random(10))
    assert_completed(fabric, 0, to_2)
    assert_completed(fabric, 0, from_2, 6, peer=2)
    assert_completed(fabric, 0, any_source, 3, peer=2, tag=3)
    assert fabric.engine(0).outstanding() == 0
    assert all(pin.refs == 0 for pin in fabric.ranks[0].pins._pins)


def test_peer_lost_while_reading_waits_for_the_flush() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    r = fabric.post(1, recv(1000, 0, 0))
    fabric.post(0, send(pattern(1000, 7), 1, 0))
    while not fabric.qps[1, 0].pending:
        fabric.step()
    fabric.break_link(0, 1)
    assert_failed(fabric, 1, r, FailureReason.PEER_UNREACHABLE)
    pins = fabric.ranks[1].pins._pins
    assert any(pin.refs for pin in pins)  # the READ may still write: pinned until its flush
    fabric.run()
    assert all(pin.refs == 0 for pin in pins)
    assert fabric.engine(0).outstanding() == fabric.engine(1).outstanding() == 0


def test_keepalive_probes_the_peers_waited_on_with_nothing_on_the_wire() -> None:
    fabric = Fabric(4, eager_size=EAGER)
    from_1 = fabric.post(0, recv(10, 1, 0))
    fabric.post(0, send(pattern(1000, 3), 2, 0))  # rendezvous: waits for rank 2's FIN
    fabric.post(0, send(b"x", 3, 0))  # eager: its SEND is on the wire
    engine = fabric.engine(0)
    engine.keepalive()
    probes = {peer: [wr for wr in fabric.qps[0, peer].pending if wr.wr_id >= PROBE_BASE]
              for peer in range(1, 4)}
    assert [len(probes[p]) for p in (1, 2, 3)] == [1, 0, 0]  # 2 and 3: their RTS/SEND is out
    (probe,) = probes[1]
    assert (probe.opcode, probe.sge, probe.signaled) == (Opcode.RDMA_READ, None, True)
    engine.keepalive()  # the first probe is still out: it will tell
    assert len(fabric.qps[0, 1].pending) == 1
    fabric.run()
    assert fabric.outcome(0, from_1) is None  # an answered probe changes nothing
    engine.keepalive()  # rank 2's FIN is awaited, nothing is on the wire any more
    assert [wr.wr_id for wr in fabric.qps[0, 2].pending] == [PROBE_BASE + 2]
    assert engine.stats()["probes"] == 3
    fabric.run()
    assert engine.idle()


def test_an_unexpose_whose_ack_never_comes_probes_the_peer_and_ends() -> None:
    """The peer's device took the REVOKE, then the peer closed before its engine saw it:
    no work request is left on the wire, so only a probe can find the peer gone."""
    fabric = Fabric(2, eager_size=EAGER)
    area = expose(fabric, 0, 100)
    op = fabric.post(1, put(b"k", 0, area.region.address))
    fabric.run()
    assert_completed(fabric, 1, op, 1)
    calls: list[str] = []
    engine = fabric.engine(0)
    engine.unexpose(area.region, lambda: calls.append("done"))
    while not fabric.rcq[1, 0]:  # the REVOKE lands in rank 1's receive queue ...
        fabric.step()
    fabric.rcq[1, 0].clear()  # ... and rank 1 is gone before its engine reads it
    fabric.dead.add(1)
    fabric.run()
    assert calls == [] and engine.idle()  # the REVOKE's SEND completed: nothing is out
    engine.keepalive()
    assert [wr.wr_id for wr in fabric.qps[0, 1].pending] == [PROBE_BASE + 1]
    fabric.run()
    assert calls == ["done"]  # a lost peer counts as having acked


def test_a_probe_that_goes_unanswered_loses_the_peer() -> None:
    fabric = Fabric(3, eager_size=EAGER)
    from_1 = fabric.post(0, recv(10, 1, 0))
    from_2 = fabric.post(0, recv(10, 2, 0))
    fabric.dead.add(1)  # killed: rank 0's QP to it is still in RTS, and nothing is posted
    fabric.run()
    assert fabric.outcome(0, from_1) is None
    fabric.engine(0).keepalive()
    fabric.run()
    report = assert_failed(fabric, 0, from_1, FailureReason.PEER_UNREACHABLE)
    assert "did not answer a probe (RETRY_EXC_ERR)" in str(report.error)
    assert fabric.outcome(0, from_2) is None  # rank 2 is alive
    fabric.post(2, send(b"alive", 0))
    fabric.run()
    assert_completed(fabric, 0, from_2, 5)


def test_a_post_the_device_refuses_loses_the_peer() -> None:
    fabric = Fabric(3, eager_size=EAGER)
    waiting = fabric.post(0, recv(10, 1, 0))
    fabric.qps[0, 1].error = True  # the driver has not noticed yet
    s = fabric.post(0, send(b"x", 1))
    assert_failed(fabric, 0, s, FailureReason.PEER_UNREACHABLE)
    assert_failed(fabric, 0, waiting, FailureReason.PEER_UNREACHABLE)
    other = fabric.post(0, send(b"y", 2))
    fabric.run()
    assert_completed(fabric, 0, other)


def land_frame(fabric: Fabric, rank: int, frame: bytes, peer: int) -> None:
    """`frame` lands in one of `rank`'s receive buffers, through its QP to `peer`."""
    buffer = fabric.ranks[rank].srq.popleft()
    ctypes.memmove(buffer.sge.addr, frame, len(frame))
    fabric.inject(rank, WorkCompletion(buffer.wr_id, WcStatus.SUCCESS, WcOpcode.RECV,
                                       len(frame), rank * 1000 + peer))


def test_malformed_frame_loses_its_sender() -> None:
    fabric = Fabric(3, eager_size=EAGER)
    r1 = fabric.post(0, recv(10, 1, 0))
    r2 = fabric.post(0, recv(10, 2, 0))
    srq = fabric.ranks[0].srq
    for frame in (struct.pack("<I", 1) + b"\xff" * 60, struct.pack("<I", 99) + b"\0" * 60,
                  b"\1"):
        land_frame(fabric, 0, frame, 1)
    assert_failed(fabric, 0, r1, FailureReason.PEER_UNREACHABLE)
    assert fabric.outcome(0, r2) is None
    assert fabric.engine(0).stats()["protocol_errors"] == 3
    assert len(srq) == 3 * 33  # every buffer is back
    fabric.post(2, send(b"ok", 0))
    fabric.run()
    assert_completed(fabric, 0, r2, 2)


def test_a_frame_speaks_only_for_the_peer_whose_qp_it_came_on() -> None:
    # Rank 2 forges an EAGER frame that names rank 1 as its source: it must not
    # complete a receive from rank 1, and it breaks rank 2, not rank 1.
    fabric = Fabric(3, eager_size=EAGER)
    r1 = fabric.post(0, recv(10, 1, 5))
    r2 = fabric.post(0, recv(10, 2, 5))
    land_frame(fabric, 0, encode(1, Kind.EAGER, tag=5, length=6, data=b"forged"), 2)
    assert_failed(fabric, 0, r2, FailureReason.PEER_UNREACHABLE)
    assert fabric.outcome(0, r1) is None
    assert fabric.engine(0).stats()["protocol_errors"] == 1
    fabric.post(1, send(b"real", 0, 5))
    fabric.run()
    assert_completed(fabric, 0, r1, 4)
    assert bytes(r1.buffer[:4]) == b"real"


def test_registration_failures_fail_with_resources() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    fabric.ranks[0].pd.fail = 1
    s = fabric.post(0, send(pattern(1000, 8), 1, 0))
    fabric.run()
    assert_failed(fabric, 0, s, FailureReason.RESOURCES)
    fabric.ranks[0].pd.fail = 1
    copy = fabric.post(0, send(pattern(1000, 8), 1, 0, deadline=SOON))
    assert_failed(fabric, 0, copy, FailureReason.RESOURCES)
    # the receiver cannot register its buffer: it fails, and so does the sender
    r = fabric.post(1, recv(1000, 0, 1))
    s2 = fabric.post(0, send(pattern(1000, 9), 1, 1))
    fabric.ranks[1].pd.fail = 1
    fabric.run()
    assert_failed(fabric, 1, r, FailureReason.RESOURCES)
    assert_failed(fabric, 0, s2, FailureReason.TRANSPORT)
    # the same when the receive is posted after the RTS arrived
    s3 = fabric.post(0, send(pattern(1000, 9), 1, 2))
    fabric.run()
    fabric.ranks[1].pd.fail = 1
    r3 = fabric.post(1, recv(1000, 0, 2))
    assert_failed(fabric, 1, r3, FailureReason.RESOURCES)
    fabric.run()
    assert_failed(fabric, 0, s3, FailureReason.TRANSPORT)


def test_shutdown_deregisters_everything() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    area = expose(fabric, 1, 1000)
    fabric.post(1, recv(2000, 0, 0))
    fabric.post(0, send(pattern(1000, 1), 1, 0))
    fabric.post(0, put(pattern(500, 1), 1, area.region.address, SOON))
    fabric.post(0, get(500, 1, area.region.address))
    fabric.run()
    fabric.post(0, send(pattern(1000, 1), 1, 0, SOON))  # left unmatched, holding a copy
    fabric.run()
    stats = fabric.engine(0).stats()
    assert set(stats) >= {"eager_sends", "rendezvous_sends", "credit_stalls",
                          "credit_messages", "key_requests", "pin_hits", "pin_misses",
                          "pin_evictions", "bytes_pinned", "probes"}
    for rank in fabric.ranks:
        rank.engine.shutdown()
        assert not rank.pd.by_lkey
        assert rank.engine.outstanding() == 0 and rank.engine.take_reports() == []


def test_shutdown_ends_an_unexpose_that_waits_for_a_peers_ack() -> None:
    fabric = Fabric(2, eager_size=EAGER)
    area = expose(fabric, 1, 1000)
    op = fabric.post(0, put(b"k", 1, area.region.address))
    fabric.run(random.Random(1))
    assert_completed(fabric, 0, op)
    calls: list[str] = []
    fabric.engine(1).unexpose(area.region, lambda: calls.append("done"))
    assert calls == []  # rank 0 holds the key: its REVOKE_ACK is due, and never read now
    fabric.engine(1).shutdown()
    assert calls == ["done"] and not fabric.ranks[1].pd.by_lkey


_one_sided = st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 9),  # slot
                       st.sampled_from([0, 1, 30, 100, 700]), st.booleans(),  # deadline
                       st.integers(0, 2))  # origin


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_one_sided, min_size=1, max_size=20),
       cancels=st.lists(st.integers(0, 19), max_size=5),
       rnd=st.randoms(use_true_random=False))
def test_random_one_sided_traffic(ops, cancels, rnd) -> None:
    """Puts to private slots and gets of a constant area, with cancels, on rank 1."""
    fabric = Fabric(3, eager_size=EAGER, credits=2)
    slot = 700
    area = expose(fabric, 1, 11 * slot)
    constant = pattern(slot, 99)
    area.view[10 * slot:] = constant  # gets read here; puts write slots 0..9
    posted: list[tuple[int, Operation, int]] = []
    used: set[int] = set()
    for i, (kind, index, size, deadline, origin) in enumerate(ops):
        if kind == "put":
            if index in used:
                continue
            used.add(index)
            op = put(pattern(size, index), 1, area.region.address + index * slot,
                     SOON if deadline else None)
        else:
            op = get(size, 1, area.region.address + 10 * slot, SOON if deadline else None)
        posted.append((origin, fabric.post(origin, op), index))
        for _ in range(rnd.randrange(6)):
            fabric.step(rnd)
        if i in cancels:
            victim = posted[rnd.randrange(len(posted))]
            fabric.cancel(victim[0], victim[1])
    fabric.run(rnd)
    assert canaries_intact(area.memory, 11 * slot)
    assert bytes(area.view[10 * slot:]) == constant
    for origin, op, index in posted:
        report = outcome(fabric, origin, op)
        n = len(op.buffer)
        landed = bytes(area.view[index * slot:index * slot + n])
        if op.op is Op.PUT:
            if report.input is Input.COMPLETED:
                assert landed == bytes(op.buffer)
            else:  # cancelled: all or nothing of it landed
                assert report.input is Input.CANCELLED
                assert landed in (bytes(op.buffer), b"\0" * n)
        elif report.input is Input.COMPLETED:
            assert bytes(op.buffer) == constant[:n]
        else:
            assert report.input is Input.CANCELLED
            if op.deadline is not None:
                assert bytes(op.buffer) == b"\0" * n
    for r in fabric.ranks:
        assert r.engine.outstanding() == 0 and not r.engine._key_users
    calls: list[int] = []
    fabric.engine(1).unexpose(area.region, lambda: calls.append(1))
    fabric.run(rnd)
    assert calls == [1]
    late = fabric.post(0, put(b"late", 1, area.region.address))
    fabric.run(rnd)
    assert_failed(fabric, 0, late, FailureReason.REMOTE_ACCESS)
    assert bytes(area.view[10 * slot:]) == constant and canaries_intact(area.memory, 11 * slot)


_traffic = st.tuples(st.sampled_from(["send", "recv", "put", "get", "cancel"]),
                     st.integers(0, 2), st.integers(0, 2),  # rank, peer
                     st.sampled_from([0, 10, EAGER + 1, 500]), st.booleans())  # deadline


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_traffic, min_size=1, max_size=30), when=st.integers(0, 30),
       link=st.sampled_from([(0, 1), (1, 2), (0, 0)]), rnd=st.randoms(use_true_random=False))
def test_random_traffic_with_a_lost_peer(ops, when, link, rnd) -> None:
    """Any mix of operations, a link broken at some point: everything still ends once.

    (0, 0) breaks rank 0's loopback QP. Afterwards nothing is left behind:
    no pinned memory, no requests on the wire, no key in use.
    """
    fabric = Fabric(3, eager_size=EAGER, credits=2)
    areas = [expose(fabric, rank, 1000) for rank in range(3)]
    posted: list[tuple[int, Operation]] = []
    for i, (kind, rank, peer, size, deadline) in enumerate(ops):
        if i == when:
            fabric.break_link(*link)
        due = SOON if deadline else None
        if kind == "send":
            op = send(pattern(size, i), peer, 0, due)
        elif kind == "recv":
            op = recv(size, peer if deadline else ANY_SOURCE, ANY_TAG, due)
        elif kind == "put":
            op = put(pattern(size, i), peer, areas[peer].region.address, due)
        elif kind == "get":
            op = get(size, peer, areas[peer].region.address, due)
        else:
            if posted:
                fabric.cancel(*posted[rnd.randrange(len(posted))])
            continue
        posted.append((rank, fabric.post(rank, op)))
        for _ in range(rnd.randrange(10)):
            fabric.step(rnd)
    fabric.run(rnd)
    for rank, op in posted:  # what still waits (receives, unmatched sends) is cancelled
        if fabric.outcome(rank, op) is None:
            fabric.cancel(rank, op)
    fabric.run(rnd)
    for rank, op in posted:
        report = outcome(fabric, rank, op)
        if report.input is Input.FAILED:
            assert report.error is not None
            assert report.error.reason in (FailureReason.PEER_UNREACHABLE,
                                           FailureReason.TRUNCATED)
    for r in fabric.ranks:
        engine = r.engine
        assert engine.outstanding() == 0 and engine.idle()
        assert not engine._rdma and not engine._rdv and not engine._key_users
        assert all(pin.refs == 0 for pin in r.pins._pins)
        assert len(engine._free) == 256
    for area in areas:
        assert canaries_intact(area.memory, 1000)
