"""Fuzzing the ibverbs wire: a lying peer against the protocol engine and the soft device.

Theory of operation
-------------------
Engine (no I/O). Three engines share the in-memory verbs fabric of the
engine tests (tests/verbs_fabric.py): rank 0 is the victim, rank 1 an honest
peer, rank 2 the adversary. The adversary runs a real engine, so its frames
are plausible, but the wire under it mutates the frames it sends the victim
as hypothesis planned (a header field set to anything: kind, flags, grant,
ack, tag, length, message id, address, rkey, source; a byte flipped; the
frame cut short or run long) and forges the keys and addresses of its RDMA
requests; besides, forged frames (junk, or headers with any field drawn
from pools of live ids, keys and addresses, or from anywhere) and replays
of the adversary's earlier frames are put straight into the victim's
receive queue. Meanwhile all three ranks post every kind of operation to
each other, with and without deadlines, cancel some, and the fabric runs
in a random order. At the end every operation still going is cancelled,
the adversary's links are broken (a peer that merely goes quiet can hold a
zero-copy send for ever, as an MPI receiver can hold an Issend), and then:

* no engine raised out of an entry point (post, cancel, completion,
  peer_lost, keepalive, unexpose): anything raised fails the test;
* every operation of the victim and the honest rank ended exactly once
  (the fabric's checker refuses a second terminal report, a late
  submission, an unrequested cancel), an unexpose finished once, and
  nothing is left pinned, queued or on the wire;
* credits never went negative (checked at every step), and the victim kept
  every credit promise towards the honest rank (the fabric checks those
  between trusted ranks);
* the victim and the honest rank still talk correctly: between them, a
  completed receive holds exactly one send's bytes, no message twice, a
  completed rendezvous send was received, puts and gets move the right
  bytes; the adversary can fail only what it takes part in;
* no byte outside a registered region was written: every user buffer and
  every exposed region sits between canaries, checked at the end.

Soft device. A fake peer speaks the soft device's link protocol on a raw
socket, after a proper handshake: random bytes, frames with any fields,
requests (SEND, RDMA WRITE, RDMA READ) with forged rkeys, addresses inside,
across and outside the regions, lengths past the end, regions without the
access asked, payloads cut short, answers to requests never made. A small
model of the responder (sequence numbers, receive buffers, keys, bounds,
access) says what each byte stream must do; the device must do exactly
that: the QP in ERR where the model says so, accepted writes and SENDs
landed, refused ones touching nothing, READ responses only for allowed
reads, never an exception out of the device, canaries intact. Before a
handshake, junk on the device's listening socket (garbage, bad lengths,
hellos that are not JSON, not objects, nested too deep, of the wrong types,
naming the wrong QP or PSN) must leave a connecting QP waiting or refused
with `VerbsError`, and a real peer must still connect afterwards. mate-run's
rendezvous refuses a process without the secret (wrong, missing, malformed
proofs, junk lines) and goes on.

Example counts are modest; ``MATE_FUZZ_EXAMPLES=N`` sets the number per
test (docs/fuzzing.md has the long run).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_soft_device import ALL, Buf, Side
from verbs_fabric import Checker, Fabric

from mate.constants import ANY_SOURCE, ANY_TAG
from mate.errors import FailureReason, InvalidArgument
from mate.machine import Input
from mate.schedule import Op
from mate.transports.base import Operation, Report
from mate.transports.ibverbs import bootstrap, soft, soft_link, wire
from mate.transports.ibverbs.soft_link import close_quietly
from mate.transports.ibverbs.soft_sys import host_identity
from mate.transports.ibverbs.verbs import (
    SGE,
    Access,
    Endpoint,
    Opcode,
    QPState,
    RecvWR,
    SendWR,
    WcOpcode,
    WcStatus,
    WorkCompletion,
)
from mate.transports.ibverbs.wire import HEADER, HEADER_SIZE, Kind

EXAMPLES = int(os.environ.get("MATE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

VICTIM, HONEST, ADVERSARY = 0, 1, 2
EAGER = 64
CREDITS = 4
SOON = 1e18  # a deadline: an operation that a cancel may abandon (engines read no clock)
CANARY = 64
AREA = 2048  # bytes each rank exposes to everyone; the honest rank exposes a private one too
SLOT = 128  # the victim's puts to the honest rank's private area: one slot each
SIZES = [0, 3, 4, 40, EAGER, EAGER + 1, 300, 5000]


def mostly(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any],
           odds: int = 4) -> st.SearchStrategy[Any]:
    """`common`, but once in `odds + 1` draws `rare` (one_of would weigh them alike)."""
    return st.integers(0, odds).flatmap(lambda i: rare if i == 0 else common)


# -- memory with canaries --------------------------------------------------------------------

class Memory:
    """Every buffer of a run, each between two canaries that nothing may write."""

    def __init__(self) -> None:
        self.blocks: list[bytearray] = []

    def alloc(self, data: bytes | int) -> memoryview:
        n = data if isinstance(data, int) else len(data)
        block = bytearray(b"\xee" * CANARY) + bytearray(n) + bytearray(b"\xee" * CANARY)
        self.blocks.append(block)
        view = memoryview(block)[CANARY:CANARY + n]
        if not isinstance(data, int):
            view[:] = data
        return view

    def intact(self) -> bool:
        return all(block[:CANARY] == block[-CANARY:] == b"\xee" * CANARY for block in self.blocks)


class Ordered(Checker):
    """The checker of an honest rank, which also notes the order in which operations end
    (in a list shared by the ranks)."""

    def __init__(self, ended: list[int]) -> None:
        super().__init__()
        self.ended = ended

    def feed(self, report: Report) -> None:
        super().feed(report)
        if report.input is not Input.SUBMITTED:
            self.ended.append(id(report.op))


class Lenient(Checker):
    """The adversary's own reports: kept, never judged (its frames were mutated)."""

    def feed(self, report: Report) -> None:
        if report.input is not Input.SUBMITTED:
            self.final.setdefault(id(report.op), report)


# -- the adversary's wire --------------------------------------------------------------------

HEADER_FIELDS = ("source", "kind", "flags", "grant", "ack", "tag", "length", "msg_id", "addr",
                 "rkey")
_FIELD_LIMITS = {"source": 2**32 - 1, "kind": 255, "flags": 255, "grant": 2**16 - 1,
                 "ack": 2**16 - 1, "tag": 2**32 - 1, "length": 2**64 - 1,
                 "msg_id": 2**64 - 1, "addr": 2**64 - 1, "rkey": 2**32 - 1}


@attrs.frozen
class Mutation:
    """What the adversary's wire does to one frame it sends the victim."""

    how: str  # "field", "flip", "cut", "grow"
    field: str = ""
    value: int = 0

    def apply(self, wr: SendWR) -> SendWR:
        assert wr.sge is not None
        addr, n = wr.sge.addr, wr.sge.length
        memory = memoryview((ctypes.c_char * n).from_address(addr)).cast("B")
        if self.how == "field" and n >= HEADER_SIZE:
            fields = list(HEADER.unpack_from(memory))
            i = HEADER_FIELDS.index(self.field)
            value = self.value % (_FIELD_LIMITS[self.field] + 1)
            if self.field == "tag":  # an i32
                value = value - 2**32 if value >= 2**31 else value
            elif self.field == "source":  # no rank: the engine believes a source it is given
                value = max(value, 3)
            fields[i] = value
            HEADER.pack_into(memory, 0, *fields)
        elif self.how == "flip" and n:
            memory[self.value % n] ^= 0xFF
        elif self.how == "cut":
            return wr._replace(sge=wr.sge._replace(length=self.value % (n + 1)))
        elif self.how == "grow":
            return wr._replace(sge=wr.sge._replace(length=n + 1 + self.value % 96))
        return wr


mutations = st.one_of(
    st.builds(Mutation, st.just("field"), st.sampled_from(HEADER_FIELDS),
              st.one_of(st.integers(0, 8), st.integers(0, 2**16), st.integers(0, 2**64 - 1))),
    st.builds(Mutation, st.sampled_from(["flip", "cut", "grow"]), st.just(""),
              st.integers(0, 200)))


@attrs.frozen
class Forgery:
    """What the adversary's wire does to one RDMA request it sends the victim."""

    rkey: int | None
    shift: int

    def apply(self, wr: SendWR, rkeys: list[int]) -> SendWR:
        rkey = wr.rkey if self.rkey is None else (rkeys[self.rkey % len(rkeys)]
                                                  if self.rkey < 1000 else self.rkey)
        return wr._replace(rkey=rkey, remote_addr=max(wr.remote_addr + self.shift, 0))


forgeries = st.builds(Forgery, st.one_of(st.none(), st.integers(0, 10), st.integers(0, 2**32 - 1)),
                      st.sampled_from([0, 1, -1, 8, AREA, -AREA, 1 << 20, -(1 << 40)]))


class AdversaryWire:
    """Rank 2's wire: its frames and RDMA requests to the victim altered as planned, and
    recorded for replays."""

    def __init__(self, inner: Any, pool: memoryview, victim_rkeys: Callable[[], list[int]],
                 frames: dict[int, Mutation], rdma: dict[int, Forgery]) -> None:
        self.inner = inner
        self.pool_end = ctypes.addressof(ctypes.c_char.from_buffer(pool)) + len(pool)
        self.victim_rkeys = victim_rkeys
        self.frames = frames
        self.rdma = rdma
        self.sent_frames = 0
        self.sent_rdma = 0
        self.recorded: list[bytes] = []

    def post_send(self, peer: int, wr: SendWR) -> None:
        if peer == VICTIM and wr.sge is not None and wr.opcode is Opcode.SEND:
            mutation = self.frames.get(self.sent_frames)
            self.sent_frames += 1
            if mutation is not None:
                wr = mutation.apply(wr)
                assert wr.sge is not None
                room = self.pool_end - wr.sge.addr  # a frame run long stays in the send pool
                wr = wr._replace(sge=wr.sge._replace(length=min(wr.sge.length, room)))
            self.recorded.append(ctypes.string_at(wr.sge.addr, wr.sge.length))
        elif peer == VICTIM and wr.opcode is not Opcode.SEND:
            forgery = self.rdma.get(self.sent_rdma)
            self.sent_rdma += 1
            if forgery is not None:
                wr = forgery.apply(wr, self.victim_rkeys() or [0])
        self.inner.post_send(peer, wr)

    def post_recv(self, wr: RecvWR) -> None:
        self.inner.post_recv(wr)


# -- the run ---------------------------------------------------------------------------------

@attrs.define
class Posted:
    rank: int
    op: Operation
    ident: int  # the send's id in its first 4 bytes (-1: none, or not a send)


class Run:
    """One fuzzed run: three ranks, what they posted, the adversary's frames."""

    def __init__(self, frames: dict[int, Mutation], rdma: dict[int, Forgery]) -> None:
        self.fabric = Fabric(3, eager_size=EAGER, credits=CREDITS, adversary=ADVERSARY)
        self.memory = Memory()
        self.ended: list[int] = []  # id() of the honest ranks' operations, as they end
        for rank in (VICTIM, HONEST):
            self.fabric.ranks[rank].checker = Ordered(self.ended)
        self.fabric.ranks[ADVERSARY].checker = Lenient()
        adversary = self.fabric.engine(ADVERSARY)
        self.wire = AdversaryWire(adversary._wire, adversary._sview, self.victim_rkeys, frames,
                                  rdma)
        adversary._wire = self.wire
        # Everyone exposes an area to everyone; the honest rank also a private one that
        # only the victim is told of (its slots take the victim's puts, its end is constant).
        self.areas = [self.expose(rank, AREA) for rank in range(3)]
        self.private = self.expose(HONEST, 11 * SLOT)
        self.constant = random.Random(7).randbytes(SLOT)
        self.private[1][10 * SLOT:] = self.constant
        self.posted: list[Posted] = []
        self.ids = 0
        self.used_slots: set[int] = set()
        self.unexposed: list[int] | None = None  # done() calls, once the victim unexposes

    def expose(self, rank: int, n: int) -> tuple[int, memoryview]:
        view = self.memory.alloc(n)
        return self.fabric.engine(rank).expose(view).address, view

    def rkeys(self, rank: int) -> list[int]:
        """The keys of `rank`'s exposed regions and pools (not of its pins, which come
        and go with where buffers happen to lie: a replayed example must draw alike)."""
        engine = self.fabric.engine(rank)
        mrs = [x.mr for x in engine._exposed.values() if x.mr is not None]
        return [mr.rkey for mr in mrs + engine._pool_mrs]

    def victim_rkeys(self) -> list[int]:
        return self.rkeys(VICTIM)

    def post(self, rank: int, op: Operation, ident: int = -1) -> None:
        self.posted.append(Posted(rank, op, ident))
        self.fabric.post(rank, op)

    def payload(self, n: int) -> tuple[bytes, int]:
        self.ids += 1
        body = random.Random(self.ids).randbytes(n)
        if n < 4:
            return body, -1
        return self.ids.to_bytes(4, "little") + body[4:], self.ids

    def outcome(self, p: Posted) -> Report | None:
        return self.fabric.outcome(p.rank, p.op)

    # -- what the victim receives straight from the adversary's QP ---------------------

    def inject(self, frame: bytes) -> None:
        """Put `frame` into the victim's oldest receive buffer, as arriving from rank 2."""
        srq = self.fabric.ranks[VICTIM].srq
        if not srq or self.fabric.qps[VICTIM, ADVERSARY].error:
            return  # no buffer (the device would answer RNR), or the link is down
        buffer = srq.popleft()
        frame = frame[:buffer.sge.length]
        ctypes.memmove(buffer.sge.addr, frame, len(frame))
        self.fabric.inject(VICTIM, WorkCompletion(buffer.wr_id, WcStatus.SUCCESS, WcOpcode.RECV,
                                                  len(frame), VICTIM * 1000 + ADVERSARY))

    def pools(self) -> tuple[list[int], list[int], list[int]]:
        """Live addresses, keys and message ids a forger may name (or a random one)."""
        addrs = [a for a, view in (*self.areas, self.private) for a in (a, a + 1, a + len(view))]
        addrs += [ctypes.addressof(ctypes.c_char.from_buffer(p.op.buffer)) for p in self.posted
                  if len(p.op.buffer) and not p.op.buffer.readonly]
        rkeys = self.rkeys(VICTIM) + self.rkeys(ADVERSARY)
        victim = self.fabric.engine(VICTIM)
        ids = sorted(victim._rdv) + sorted(victim._key_requests)
        return addrs or [0], rkeys or [0], ids or [0]


@st.composite
def forged_frames(draw: st.DrawFn, run: Run) -> bytes:
    """A frame from 'rank 2' that no engine sent: junk, an answer to something of the
    victim's that is going on, or a header with any fields."""
    # Mostly plausible: a frame the victim rejects ends the adversary's run (it is lost).
    shape = draw(mostly(st.sampled_from(["header", "answer", "answer"]), st.just("junk")))
    if shape == "junk":  # named after the adversary, or after no rank at all
        source = draw(st.sampled_from([ADVERSARY, 3, 2**32 - 1]))
        return struct.pack("<I", source) + draw(st.binary(max_size=2 * HEADER_SIZE))
    addrs, rkeys, ids = run.pools()
    if shape == "answer":  # for a live message id, whoever it concerns
        return wire.encode(
            ADVERSARY, draw(st.sampled_from([Kind.FIN, Kind.CANCEL_ACK, Kind.KEY_REPLY,
                                             Kind.KEY_REFUSED])),
            flags=draw(st.sampled_from([0, wire.TRUNCATED, wire.FAILED])),
            msg_id=ids[draw(st.integers(0, 63)) % len(ids)],
            addr=addrs[draw(st.integers(0, 63)) % len(addrs)], length=draw(st.integers(0, AREA)),
            rkey=rkeys[draw(st.integers(0, 63)) % len(rkeys)])
    victim = run.fabric.engine(VICTIM)
    kind = draw(mostly(st.sampled_from(list(Kind)), st.integers(0, 255)))
    header = HEADER.pack(
        ADVERSARY, kind,
        draw(mostly(st.sampled_from([0, 1, 2, 4, 6, 7]), st.integers(0, 255))),
        draw(st.one_of(st.just(0), st.integers(0, 8), st.integers(0, 2**16 - 1))),  # grant
        draw(st.one_of(st.just(victim._ctrl_sent[ADVERSARY]), st.integers(0, 2**16 - 1))),
        draw(st.one_of(st.integers(-2, 3), st.integers(-(2**31), 2**31 - 1))),  # tag / xid
        draw(st.one_of(st.integers(0, EAGER + 8), st.integers(0, 2**64 - 1))),  # length
        draw(st.one_of(st.integers(0, 63).map(lambda i: ids[i % len(ids)]),  # msg_id
                       st.integers(0, 40), st.integers(0, 2**64 - 1))),
        # (pools are indexed modulo their size, which varies with where buffers lie)
        draw(st.one_of(st.integers(0, 63).map(lambda i: addrs[i % len(addrs)]),
                       st.integers(0, 2**64 - 1))),
        draw(st.one_of(st.integers(0, 63).map(lambda i: rkeys[i % len(rkeys)]),
                       st.integers(0, 2**32 - 1))))
    body = draw(st.binary(max_size=EAGER + 8)) if kind == Kind.EAGER else b""
    frame = header + body
    cut = draw(mostly(st.none(), st.integers(0, len(frame))))
    return frame if cut is None else frame[:cut]


@st.composite
def operations(draw: st.DrawFn, run: Run) -> tuple[int, Operation, int]:
    """An operation of any kind between any two ranks (the adversary's included)."""
    kind = draw(st.sampled_from(["send", "send", "recv", "recv", "put", "get"]))
    # Mostly between the victim and the others, both ways; now and then anything.
    rank, peer = draw(st.one_of(
        st.sampled_from([(ADVERSARY, VICTIM), (VICTIM, ADVERSARY), (VICTIM, HONEST),
                         (HONEST, VICTIM)]),
        st.tuples(st.integers(0, 2), st.integers(0, 2))))
    size = draw(st.sampled_from(SIZES))
    deadline = SOON if draw(st.booleans()) else None
    if kind == "send":
        data, ident = run.payload(size)
        return rank, Operation(Op.SEND, run.memory.alloc(data).toreadonly(), peer,
                               draw(st.integers(0, 1)), 0, deadline), ident
    if kind == "recv":
        source = draw(st.sampled_from([peer, ANY_SOURCE]))
        tag = draw(st.sampled_from([0, 1, ANY_TAG]))
        return rank, Operation(Op.RECV, run.memory.alloc(size), source, tag, 0, deadline), -1
    private = draw(st.booleans()) and rank == VICTIM and peer == HONEST
    slot = draw(st.integers(0, 9))
    if private:  # exact data: a slot of its own, or the constant end
        address = run.private[0]
        if kind == "put":
            if slot in run.used_slots:
                private = False
            else:
                run.used_slots.add(slot)
                address += slot * SLOT
                size = min(size, SLOT)
        else:
            address += 10 * SLOT
            size = min(size, SLOT)
    if not private:
        base = run.areas[peer][0]
        address = base + draw(st.sampled_from([0, 10, AREA - size, AREA - size + 1, -1, AREA]))
    address = max(address, 0)
    if kind == "put":
        data, _ = run.payload(size)
        return rank, Operation(Op.PUT, run.memory.alloc(data).toreadonly(), peer, 0, address,
                               deadline), -1
    return rank, Operation(Op.GET, run.memory.alloc(size), peer, 0, address, deadline), -1


@FUZZ
@given(frames=st.dictionaries(st.integers(0, 15), mutations, max_size=3),
       rdma=st.dictionaries(st.integers(0, 10), forgeries, max_size=3),
       data=st.data(), rnd=st.randoms(use_true_random=False))
def test_a_lying_peer_cannot_break_the_engine(frames: dict[int, Mutation],
                                             rdma: dict[int, Forgery], data: st.DataObject,
                                             rnd: random.Random) -> None:
    run = Run(frames, rdma)
    fabric = run.fabric
    for _ in range(data.draw(st.integers(1, 60), "steps")):
        action = data.draw(st.sampled_from(["post", "post", "post", "run", "run", "forge",
                                            "replay", "cancel", "keepalive", "unexpose"]))
        if action == "post":
            rank, op, ident = data.draw(operations(run))
            run.post(rank, op, ident)
        elif action == "run":
            for _ in range(data.draw(st.integers(1, 30))):
                fabric.step(rnd)
        elif action == "forge":
            run.inject(data.draw(forged_frames(run)))
        elif action == "replay":  # (drawn whatever happened: draws never depend on it)
            index = data.draw(st.integers(0, 255))
            if run.wire.recorded:
                run.inject(run.wire.recorded[index % len(run.wire.recorded)])
        elif action == "cancel":
            index = data.draw(st.integers(0, 255))
            if run.posted:
                victim = run.posted[index % len(run.posted)]
                fabric.cancel(victim.rank, victim.op)
        elif action == "keepalive":
            fabric.engine(VICTIM).keepalive()
            fabric.ranks[VICTIM].collect()
        elif action == "unexpose" and run.unexposed is None:
            engine = fabric.engine(VICTIM)
            region = next(x.region for x in engine._exposed.values()
                          if x.region.address == run.areas[VICTIM][0])
            run.unexposed = []
            engine.unexpose(region, functools.partial(run.unexposed.append, 1))
            fabric.ranks[VICTIM].collect()
    fabric.run(rnd)
    victim = fabric.engine(VICTIM)
    event(f"the victim lost the adversary: {victim._lost[ADVERSARY]}")
    event(f"protocol errors at the victim: {min(victim.stats()['protocol_errors'], 3)}")
    event(f"frames the adversary sent: {min(run.wire.sent_frames // 10 * 10, 50)}+")
    finish(run, rnd)
    check(run)


def finish(run: Run, rnd: random.Random) -> None:
    """Cancel whatever still goes on, then cut the adversary off, and let it all end."""
    fabric = run.fabric
    fabric.run(rnd)
    for p in run.posted:
        if fabric.outcome(p.rank, p.op) is None:
            fabric.cancel(p.rank, p.op)
    fabric.run(rnd)
    for peer in (VICTIM, HONEST):
        fabric.break_link(peer, ADVERSARY)
    fabric.run(rnd)


def check(run: Run) -> None:
    fabric = run.fabric
    assert run.memory.intact(), "a byte outside every buffer and region was written"
    for rank in (VICTIM, HONEST):
        engine = fabric.engine(rank)
        assert engine.outstanding() == 0 and engine.idle()
        assert not engine._rdma and not engine._rdv and not engine._key_users
        assert all(pin.refs == 0 for pin in fabric.ranks[rank].pins._pins)
        assert len(engine._free) == 256
        assert all(0 <= c <= CREDITS for p, c in enumerate(engine._credits) if p != ADVERSARY)
    if run.unexposed is not None:
        assert run.unexposed == [1], "an unexpose finished more than once, or never"
    honest = [p for p in run.posted if p.rank != ADVERSARY]
    for p in honest:
        assert run.outcome(p) is not None, f"{p} never ended"
    between = [p for p in honest if p.op.peer in (VICTIM, HONEST)]
    for p in between:  # the adversary can fail only what it takes part in
        report = run.outcome(p)
        assert report is not None
        if report.input is Input.FAILED:
            assert report.error is not None
            assert report.error.reason in (FailureReason.TRUNCATED,
                                           FailureReason.REMOTE_ACCESS), (p, report)
    received: dict[int, int] = {}  # send id -> receives that got it
    readers: dict[int, Operation] = {}  # send id -> the receive that got it
    short: set[tuple[int, int]] = set()  # (source, tag) of receives too short for an id
    for p in honest:
        report = run.outcome(p)
        assert report is not None
        if p.op.op is not Op.RECV or report.input is Input.CANCELLED or report.peer not in (
                VICTIM, HONEST):
            continue
        if report.length < 4:
            short.add((report.peer, report.tag))
        else:
            ident = int.from_bytes(p.op.buffer[:4], "little")
            sent = next((s for s in run.posted if s.ident == ident), None)
            assert sent is not None and sent.rank == report.peer, (p, report)
            n = report.length
            assert bytes(p.op.buffer[:n]) == bytes(sent.op.buffer[:n]), (p, report)
            received[ident] = received.get(ident, 0) + 1
            readers[ident] = p.op
    assert all(count == 1 for count in received.values()), "a message received twice"
    order = {key: i for i, key in enumerate(run.ended)}
    for p in between:  # a rendezvous send completes only once it was received
        report = run.outcome(p)
        if (p.op.op is Op.SEND and len(p.op.buffer) > EAGER and report is not None
                and report.input is Input.COMPLETED):
            assert received.get(p.ident) == 1 or (p.rank, p.op.tag) in short, (
                f"{p} completed, never received")
            receive = readers.get(p.ident)
            assert receive is None or order[id(receive)] < order[id(p.op)], (
                f"{p} completed before its receive")
    base, view = run.private
    for p in honest:
        report = run.outcome(p)
        if p.op.op in (Op.PUT, Op.GET) and report is not None and report.input is Input.COMPLETED:
            offset = p.op.address - base
            if p.op.peer == HONEST and 0 <= offset < len(view):
                n = len(p.op.buffer)
                assert bytes(view[offset:offset + n]) == bytes(p.op.buffer), p
    assert bytes(view[10 * SLOT:]) == run.constant


# -- fixed cases: the defects the fuzzing found ------------------------------------------------
# -- the soft device: a fake peer on the link ----------------------------------------------------

MASK = 0xFFFFFFFF
FAKE_ADDRESS = "unix:@a-mate-fuzz"  # below every device's address: the device waits for our dial
FAKE_QP = 0x5A5A5A
FAKE_PSN = MASK - 2  # sequence numbers wrap around during a run
F_SEND, F_WRITE, F_READ, F_ACK, F_NAK, F_RNR, F_READ_RESP = 1, 2, 3, 16, 17, 18, 19
NAK_STATUSES = {int(WcStatus.REM_ACCESS_ERR), int(WcStatus.REM_INV_REQ_ERR),
                int(WcStatus.REM_OP_ERR)}
GAP = 256  # bytes of each buffer outside its memory region (and canaries beyond those)
MAX_MSG = (1 << 31) - 1


def seq_diff(a: int, b: int) -> int:
    return ((a - b + 0x80000000) & MASK) - 0x80000000


@attrs.define
class Area:
    """Victim memory: `size` bytes between canaries, its MR on [GAP, size - GAP)."""

    buf: Any  # test_soft_device.Buf
    mr: Any  # SoftMR
    pd: int
    access: int
    valid: bool = True

    @property
    def start(self) -> int:
        return self.mr.addr

    def covers(self, addr: int, length: int, need: int, pd: int) -> bool:
        return (self.valid and self.pd == pd and self.access & need == need
                and self.mr.addr <= addr and addr + length <= self.mr.addr + self.mr.length)


@attrs.define
class Request:
    """One of the victim's own requests to the fake peer, as the model sees it."""

    wr_id: int
    op: int  # F_SEND, F_WRITE, F_READ
    length: int
    offset: int  # in the victim's "local" area: where it reads from, or a READ lands
    seq: int = 0


class LinkModel:
    """What the soft device must do with a byte stream from its peer: the responder
    (sequence numbers, receive buffers, keys, bounds, access) and the requester (answers
    to its own requests), as soft.py's docstring states them."""

    def __init__(self, areas: dict[str, Area], wqes: list[tuple[int, str, int, int, bool]],
                 requests: list[Request], psn: int, pd: int) -> None:
        self.areas = areas
        self.memory = {name: bytearray(area.buf.read()) for name, area in areas.items()}
        self.srq = list(wqes)  # (wr_id, area, offset, length, valid lkey)
        self.pd = pd
        self.state = "RTS"
        self.expected = FAKE_PSN
        self.rnr_drop = False
        self.stream = bytearray()
        self.need = 0  # payload bytes the current frame still has
        self.dst: tuple[str, int] | None = None  # where they go (None: dropped)
        self.kind = 0
        self.rx: tuple[int, int, int] = (0, 0, 0)  # (seq, wr_id, length) of a SEND
        self.recv_wcs: list[tuple[int, int, int]] = []  # (wr_id, status, byte_len)
        self.send_wcs: list[tuple[int, int]] = []  # (wr_id, status)
        self.responses: list[tuple[int, int, int, bytes]] = []  # non-ACK: kind, status, seq
        self.executed: set[int] = set()  # sequence numbers an ACK may name
        self.unacked = list(requests)
        self.waiting: list[Request] = []
        self.next_seq = psn
        for req in requests:
            req.seq = self.next_seq
            self.next_seq = (self.next_seq + 1) & MASK
        self.link_closed = False

    # -- helpers -----------------------------------------------------------------------------

    def area_of(self, rkey: int) -> Area | None:
        return next((a for a in self.areas.values() if a.mr.rkey == rkey), None)

    def offset(self, name: str, addr: int) -> int:
        return addr - self.areas[name].buf.addr

    def error(self, first: int | None = None) -> None:
        if self.state == "ERR":
            return
        self.state = "ERR"
        reqs = [*self.unacked, *self.waiting]
        self.unacked, self.waiting = [], []
        for i, req in enumerate(reqs):
            status = first if first is not None and i == 0 else int(WcStatus.WR_FLUSH_ERR)
            self.send_wcs.append((req.wr_id, status))
        self.need = 0

    def malformed(self) -> None:
        """The peer broke the protocol: a lost link (the oldest request timed out)."""
        self.error(int(WcStatus.RETRY_EXC_ERR) if self.unacked else None)
        self.link_closed = True

    def fatal(self, seq: int, status: WcStatus) -> None:
        self.responses.append((F_NAK, int(status), seq, b""))
        self.error()

    def expect(self, length: int, dst: tuple[str, int] | None, kind: int) -> None:
        self.kind, self.dst, self.need = kind, dst, length
        if not length:
            self.frame_done()

    # -- requester ---------------------------------------------------------------------------

    def retire(self, seq: int, inclusive: bool) -> bool:
        if seq_diff(seq, self.next_seq) >= 0:
            self.malformed()
            return False
        last = seq if inclusive else (seq - 1) & MASK
        while self.unacked:
            req = self.unacked[0]
            if (last - req.seq) & MASK >= 0x80000000:
                break
            if req.op == F_READ:
                self.malformed()
                return False
            self.unacked.pop(0)
            self.send_wcs.append((req.wr_id, int(WcStatus.SUCCESS)))
        return True

    def head(self, seq: int) -> Request | None:
        if not self.retire(seq, False):
            return None
        if not self.unacked or self.unacked[0].seq != seq:
            self.malformed()
            return None
        return self.unacked[0]

    # -- responder ---------------------------------------------------------------------------

    def take_seq(self, seq: int) -> bool:
        if seq == self.expected:
            self.rnr_drop = False
            return True
        if not self.rnr_drop:
            self.malformed()
        return False

    def executed_seq(self, seq: int) -> None:
        self.expected = (seq + 1) & MASK
        self.executed.add(seq)

    def begin(self, kind: int, status: int, seq: int, length: int, rkey: int,
              addr: int) -> None:
        if kind in (F_SEND, F_WRITE):
            if length > MAX_MSG:
                self.malformed()
            elif not self.take_seq(seq):
                if self.state != "ERR":
                    self.expect(length, None, 0)
            elif kind == F_SEND:
                self.begin_send(seq, length)
            elif length and not ((area := self.area_of(rkey)) is not None and area.covers(
                    addr, length, int(Access.REMOTE_WRITE), self.pd)):
                self.fatal(seq, WcStatus.REM_ACCESS_ERR)
            else:
                self.rx = (seq, 0, length)
                self.expect(length, self.place(addr) if length else None, F_WRITE)
        elif kind == F_READ:
            if length > MAX_MSG:
                self.malformed()
            elif self.take_seq(seq):
                payload = b""
                if length:
                    area = self.area_of(rkey)
                    if area is None or not area.covers(addr, length, int(Access.REMOTE_READ),
                                                       self.pd):
                        self.fatal(seq, WcStatus.REM_ACCESS_ERR)
                        return
                    name, offset = self.place(addr)
                    payload = bytes(self.memory[name][offset:offset + length])
                self.expected = (seq + 1) & MASK
                self.responses.append((F_READ_RESP, 0, seq, payload))
        elif kind == F_READ_RESP:
            req = self.head(seq)
            if req is None:
                return
            if req.op != F_READ or length != req.length:
                self.malformed()
                return
            self.expect(length, ("local", req.offset), F_READ_RESP)
        elif kind == F_NAK:
            req = self.head(seq)
            if req is None:
                return
            if status not in NAK_STATUSES:
                self.malformed()
                return
            self.unacked.pop(0)
            self.send_wcs.append((req.wr_id, status))
            self.error()
        elif kind == F_RNR:
            if self.head(seq) is None:
                return
            self.waiting = self.unacked + self.waiting  # sent again when the timer expires
            self.unacked = []
        else:
            self.malformed()

    def place(self, addr: int) -> tuple[str, int]:
        """The area and offset of an address that a check found inside an MR."""
        for name, area in self.areas.items():
            if area.buf.addr <= addr < area.buf.addr + area.buf.size:
                return name, addr - area.buf.addr
        raise AssertionError(f"{addr:#x} is in no area")

    def begin_send(self, seq: int, length: int) -> None:
        if not self.srq:
            self.responses.append((F_RNR, 0, seq, b""))
            self.rnr_drop = True
            self.expect(length, None, 0)
            return
        wr_id, name, offset, room, valid = self.srq.pop(0)
        if length > room:
            self.recv_wcs.append((wr_id, int(WcStatus.LOC_LEN_ERR), 0))
            self.fatal(seq, WcStatus.REM_INV_REQ_ERR)
            return
        if length and not valid:
            self.recv_wcs.append((wr_id, int(WcStatus.LOC_PROT_ERR), 0))
            self.fatal(seq, WcStatus.REM_OP_ERR)
            return
        self.rx = (seq, wr_id, length)
        self.expect(length, (name, offset), F_SEND)

    def frame_done(self) -> None:
        seq, wr_id, length = self.rx
        if self.kind == F_SEND:
            self.recv_wcs.append((wr_id, int(WcStatus.SUCCESS), length))
            self.executed_seq(seq)
        elif self.kind == F_WRITE:
            self.executed_seq(seq)
        elif self.kind == F_READ_RESP:
            req = self.unacked.pop(0)
            self.send_wcs.append((req.wr_id, int(WcStatus.SUCCESS)))
        self.kind = 0

    def feed(self, data: bytes) -> None:
        """Parse `data` after what came before, as the device's responder does."""
        if self.state == "ERR":
            return
        self.stream += data
        while self.state != "ERR":
            if self.need:
                n = min(self.need, len(self.stream))
                if not n:
                    return
                if self.dst is not None:
                    name, offset = self.dst
                    self.memory[name][offset:offset + n] = self.stream[:n]
                    self.dst = (name, offset + n)
                del self.stream[:n]
                self.need -= n
                if not self.need:
                    self.frame_done()
                continue
            if len(self.stream) < 24:
                return
            kind, status, _, seq, length, rkey, addr = struct.unpack_from("<BBHIIIQ",
                                                                          self.stream)
            del self.stream[:24]
            if kind == F_ACK:
                self.retire(seq, True)
            else:
                self.begin(kind, status, seq, length, rkey, addr)
        self.stream.clear()


class Victim:
    """A soft device whose one QP is connected to a fake peer: this test, on a raw socket."""

    def __init__(self) -> None:
        # Served one-sided access (frames, checked here); an RNR'd request waits an hour.
        self.dev = soft.open_device(link="unix", one_sided="served", rnr_timer=3600.0)
        try:
            self.side = Side.open(self.dev)
            self.other_pd = self.dev.alloc_pd()
            pd = self.side.pd
            rw = Access.LOCAL_WRITE
            self.areas = {
                "all": self.area(pd, 4 * GAP + 70_000, ALL),
                "read": self.area(pd, 3 * GAP, rw | Access.REMOTE_READ),
                "write": self.area(pd, 3 * GAP, rw | Access.REMOTE_WRITE),
                "local": self.area(pd, 2 * GAP + 300, rw),  # the victim's requests' memory
                "other-pd": self.area(self.other_pd, 3 * GAP, ALL),
                "gone": self.area(pd, 3 * GAP, ALL),
                "inbox": self.area(pd, 2 * GAP + 200 * 5, rw),  # receive buffers, 200 B apart
            }
            gone = self.areas["gone"]
            gone.mr.dereg()
            gone.valid = False
            self.sock = self.handshake()
        except BaseException:
            self.dev.close()
            raise

    @staticmethod
    def area(pd: Any, size: int, access: Access) -> Area:
        buf = Buf(size, bytes(range(251)))
        mr = pd.reg_mr(buf.addr + GAP, size - 2 * GAP, access)
        return Area(buf, mr, pd.pd_id, int(access))

    def handshake(self) -> socket.socket:
        """Connect the QP to the fake peer, which dials (its address is the lower)."""
        qp = self.side.qp
        mine = qp.endpoint()
        errors: list[BaseException] = []

        def connect() -> None:
            try:
                qp.connect(Endpoint(FAKE_QP, FAKE_PSN, address=FAKE_ADDRESS))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=connect)
        thread.start()
        sock = soft_link.dial(self.dev.address, time.monotonic() + 10)
        try:
            sock.settimeout(10)
            soft_link.send_hello(sock, fake_hello(mine))
            soft_link.recv_hello(sock)
        finally:
            thread.join(10)
        assert not errors and qp.state is QPState.RTS, errors
        sock.setblocking(False)
        return sock

    def serve(self) -> None:
        """One service step of the device (no CQ is armed: no event, no completion taken)."""
        assert self.side.channel.get_cq_event() is None

    def close(self) -> None:
        close_quietly(self.sock)
        self.dev.close()


def fake_hello(victim: Endpoint, **changes: Any) -> soft_link.Hello:
    return soft_link.Hello(address=FAKE_ADDRESS, qp=FAKE_QP, psn=FAKE_PSN,
                           dst_qp=victim.qp_num, dst_psn=victim.psn, pid=os.getpid(), host="",
                           table="", probe=0, token="", pd=0)._replace(**changes)


@attrs.frozen
class Frame:
    """A frame of the fake peer, its fields still relative to the state it meets."""

    kind: int
    status: int
    seq: tuple[str, int]  # ("expected" | "head" | "next" | "any", delta or value)
    length: int
    rkey: tuple[str, int]  # ("area", index) | ("lkey", index) | ("any", value)
    addr: tuple[int, int]  # (area index, -1: the rkey's; offset from its MR's start)
    sent: int  # payload bytes that follow (may be fewer than length, or junk)


LENGTHS = [0, 1, 8, 64, GAP, 3 * GAP, 70_000, MAX_MSG, MAX_MSG + 1, MASK]
# Weighted towards frames a correct peer might send (so that runs get past the first
# frame), with every field now and then anything at all; and junk.
frames_on_the_link = st.builds(
    Frame,
    mostly(st.sampled_from([F_SEND, F_WRITE, F_READ]),
           st.one_of(st.sampled_from([F_ACK, F_NAK, F_RNR, F_READ_RESP]), st.integers(0, 255))),
    st.one_of(st.sampled_from(sorted(NAK_STATUSES)), st.integers(0, 255)),
    mostly(st.just(("expected", 0)), st.one_of(
        st.tuples(st.sampled_from(["expected", "head", "next"]), st.sampled_from([0, -1, 1, 2])),
        st.tuples(st.just("any"), st.integers(0, MASK)))),
    mostly(st.integers(0, 64), st.one_of(st.sampled_from(LENGTHS), st.integers(0, 4 * GAP)), 2),
    mostly(st.tuples(st.just("area"), st.sampled_from([0, 0, 1, 2])),
           st.one_of(st.tuples(st.sampled_from(["area", "lkey"]), st.integers(0, 6)),
                     st.tuples(st.just("any"), st.integers(0, MASK))), 2),
    st.tuples(mostly(st.just(-1), st.integers(0, 6)), mostly(
        st.integers(0, 64),
        st.sampled_from([-1, -GAP, GAP, 2 * GAP, 69_000, -(1 << 40), 1 << 63]), 2)),
    mostly(st.just(-1), st.integers(0, 300)))  # -1: the whole payload
frame_lists = st.lists(mostly(frames_on_the_link, st.binary(min_size=1, max_size=64), 9),
                       min_size=1, max_size=12)


def resolve(frame: Frame | bytes, model: LinkModel, names: list[str],
            requests: list[Request]) -> bytes:
    """The bytes of `frame`, its relative fields resolved against the model's state."""
    if isinstance(frame, bytes):
        return frame
    where, value = frame.seq
    base = {"expected": model.expected,
            "head": model.unacked[0].seq if model.unacked else model.next_seq,
            "next": model.next_seq}.get(where, 0)
    seq = (base + value) & MASK
    how, index = frame.rkey
    area = model.areas[names[index % len(names)]]
    rkey = index if how == "any" else (area.mr.rkey if how == "area" else area.mr.lkey)
    target = area if frame.addr[0] < 0 else model.areas[names[frame.addr[0] % len(names)]]
    addr = max(target.mr.addr + frame.addr[1], 0) & (2**64 - 1)
    length = frame.length
    if frame.kind == F_READ_RESP and requests and frame.length == GAP:
        length = requests[-1].length  # now and then the length a READ asked for
    payload_kinds = (F_SEND, F_WRITE, F_READ_RESP)
    sent = (min(length, 100_000) if frame.sent < 0 else frame.sent) if (
        frame.kind in payload_kinds) else max(frame.sent, 0) * (frame.sent > 250)
    payload = bytes((i * 31 + seq) & 0xFF for i in range(sent))
    return struct.pack("<BBHIIIQ", frame.kind, frame.status, 0, seq, length & MASK, rkey,
                       addr) + payload


def victim_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """The frames the victim sent: (kind, status, seq, payload)."""
    out, i = [], 0
    while len(data) - i >= 24:
        kind, status, _, seq, length, _, _ = struct.unpack_from("<BBHIIIQ", data, i)
        i += 24
        n = length if kind in (F_SEND, F_WRITE, F_READ_RESP) else 0
        out.append((kind, status, seq, data[i:i + n]))
        i += n
    return out


@FUZZ
@given(requests=st.lists(st.tuples(st.sampled_from([F_SEND, F_WRITE, F_READ]),
                                   st.sampled_from([0, 8, 100])), max_size=3),
       wqes=st.lists(st.tuples(st.sampled_from([0, 8, 64, 200]), st.booleans()), max_size=5),
       frames=frame_lists,
       chunks=st.lists(st.integers(1, 400), min_size=1, max_size=8))
def test_a_fake_peer_on_the_link_gets_exactly_what_the_protocol_allows(
        requests: list[tuple[int, int]], wqes: list[tuple[int, bool]],
        frames: list[Frame | bytes], chunks: list[int]) -> None:
    victim = Victim()
    try:
        run_link(victim, requests, wqes, frames, chunks)
    finally:
        victim.close()


def run_link(victim: Victim, requests: list[tuple[int, int]], wqes: list[tuple[int, bool]],
             frames: list[Frame | bytes], chunks: list[int]) -> None:
    side, areas = victim.side, victim.areas
    names = list(areas)
    inbox = areas["inbox"]
    posted = []
    offset = GAP
    for i, (room, valid) in enumerate(wqes):
        lkey = inbox.mr.lkey if valid else areas["gone"].mr.lkey
        side.srq.post_recv(RecvWR(100 + i, SGE(inbox.buf.addr + offset, room, lkey)))
        posted.append((100 + i, "inbox", offset, room, valid or room == 0))
        offset += 200
    local = areas["local"]
    reqs = []
    for i, (op, length) in enumerate(requests):
        opcode = {F_SEND: Opcode.SEND, F_WRITE: Opcode.RDMA_WRITE, F_READ: Opcode.RDMA_READ}[op]
        sge = SGE(local.mr.addr + 100 * i, length, local.mr.lkey) if length else None
        side.qp.post_send(SendWR(i + 1, opcode, sge, True, 0x1000, 0x77))
        reqs.append(Request(i + 1, op, length, GAP + 100 * i))
    model = LinkModel(areas, posted, reqs, side.qp.psn, side.pd.pd_id)
    stream = bytearray()
    for frame in frames:
        data = resolve(frame, model, names, reqs)
        model.feed(data)
        stream += data
    # Send it in pieces, the victim serving between them.
    written, i = 0, 0
    while written < len(stream) and victim.side.qp._rsock is not None:
        piece = bytes(stream[written:written + chunks[i % len(chunks)] * 97])
        i += 1
        try:
            written += victim.sock.send(piece)
        except BlockingIOError:
            pass
        except OSError:
            break  # the victim closed the link (a malformed frame)
        victim.serve()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        victim.serve()
        if victim.dev.bytes_received >= written or side.qp._rsock is None:
            break
    victim.serve()
    assert victim.dev.bytes_received >= written or side.qp._rsock is None
    event(f"the link: {model.state}{' (closed)' if model.link_closed else ''}")
    event(f"requests executed: {min(len(model.executed), 3)}")
    event(f"answers: {sorted({kind for kind, *_ in model.responses})}")
    expected_state = QPState.ERR if model.state == "ERR" else QPState.RTS
    assert side.qp.state is expected_state, (side.qp.state, model.state)
    for name, area in areas.items():
        assert area.buf.canaries_intact(), name
        assert area.buf.read() == bytes(model.memory[name]), f"{name} differs from the model"
    # What the victim answered: the model's responses, in order, and ACKs of what it executed.
    answers = victim_frames(drain(victim.sock))
    assert [a for a in answers if a[0] in (F_NAK, F_RNR, F_READ_RESP)] == model.responses
    assert all(a[2] in model.executed for a in answers if a[0] == F_ACK)
    # Then the peer goes away: everything outstanding ends.
    close_quietly(victim.sock)
    deadline = time.monotonic() + 5
    while side.qp.state is not QPState.ERR and time.monotonic() < deadline:
        victim.serve()
    if model.state != "ERR":
        model.malformed()  # a lost link, as the model has it
    got_recv = [(wc.wr_id, int(wc.status), wc.byte_len) for wc in side.rcq.poll(64)]
    got_send = [(wc.wr_id, int(wc.status)) for wc in side.scq.poll(64)]
    assert got_recv == model.recv_wcs
    assert got_send == model.send_wcs


def drain(sock: socket.socket) -> bytes:
    got = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except (BlockingIOError, OSError):
            return bytes(got)
        if not chunk:
            return bytes(got)
        got += chunk


# -- before the handshake: junk at the device's listener -----------------------------------------

def framed(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def hello_json(hello: soft_link.Hello, **changes: Any) -> bytes:
    return framed(json.dumps({"v": 1, **hello._asdict(), **changes}).encode())


@attrs.frozen
class Dial:
    """One connection to the victim's listener: what it sends, and what it is."""

    data: bytes
    decides: str = ""  # "accept" or "refuse": the first hello that names the connecting QP


@st.composite
def dials(draw: st.DrawFn, good: soft_link.Hello) -> Dial:
    """Junk, near-hellos, hellos for another QP, and hellos for this QP (right or wrong)."""
    what = draw(st.sampled_from([
        "bytes", "oversized", "not-json", "json", "nested", "version", "missing", "extra",
        "type", "another-qp", "cut", "wrong-psn", "wrong-dst-psn", "good"]))
    if what == "bytes":
        return Dial(draw(st.binary(max_size=64)))
    if what == "oversized":
        return Dial(struct.pack("<I", draw(st.integers((1 << 16) + 1, MASK))))
    if what == "not-json":
        return Dial(framed(draw(st.binary(max_size=100))))
    if what == "json":
        value = draw(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                                  lambda inner: st.lists(inner) | st.dictionaries(st.text(),
                                                                                   inner),
                                  max_leaves=10))
        return Dial(framed(json.dumps(value).encode()))
    if what == "nested":  # deeper than json's recursion limit
        depth = draw(st.integers(1_000, 20_000))
        return Dial(framed(b"[" * depth + b"]" * depth))
    if what == "version":
        return Dial(hello_json(good, v=draw(st.sampled_from([0, 2, "1", None]))))
    if what == "missing":  # ("error" may be left out: it has a default)
        fields = good._asdict()
        del fields[draw(st.sampled_from(sorted(set(fields) - {"error"})))]
        return Dial(framed(json.dumps({"v": 1, **fields}).encode()))
    if what == "extra":
        return Dial(hello_json(good, **{draw(st.sampled_from(["x", "qp_num", ""])): 1}))
    if what == "type":  # a value of another type (a bool is no int here)
        field = draw(st.sampled_from(sorted(good._asdict())))
        wrong = [True, 1.5, "1", None, []] if isinstance(good._asdict()[field], int) else [
            1, None, [], True]
        return Dial(hello_json(good, **{field: draw(st.sampled_from(wrong))}))
    if what == "another-qp":
        return Dial(hello_json(good, dst_qp=good.dst_qp ^ 1))
    if what == "cut":  # (a fraction: the hello's length varies with the QP's numbers)
        data = hello_json(good)
        return Dial(data[:len(data) * draw(st.integers(0, 99)) // 100])
    if what == "wrong-psn":
        return Dial(hello_json(good, psn=good.psn ^ 1), "refuse")
    if what == "wrong-dst-psn":
        return Dial(hello_json(good, dst_psn=good.dst_psn ^ 1), "refuse")
    return Dial(hello_json(good), "accept")


@FUZZ
@given(data=st.data())
def test_junk_at_the_listener_leaves_a_connect_waiting_or_refused(data: st.DataObject) -> None:
    dev = soft.open_device(link="unix", one_sided="served")
    try:
        side = Side.open(dev)
        qp = side.qp
        good = fake_hello(qp.endpoint())
        connections = data.draw(st.lists(dials(good), max_size=6))
        if not any(c.decides for c in connections) or data.draw(st.booleans()):
            connections.append(Dial(hello_json(good), "accept"))
        outcome: list[BaseException | None] = []

        def connect() -> None:
            try:
                qp.connect(Endpoint(FAKE_QP, FAKE_PSN, address=FAKE_ADDRESS))
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=connect)
        thread.start()
        socks = []
        try:
            for connection in connections:  # one at a time, up to the first hello for the QP
                sock = soft_link.dial(dev.address, time.monotonic() + 10)
                socks.append(sock)
                sock.sendall(connection.data)
                if not connection.decides:
                    sock.close()  # junk: the device drops it and waits on
                    continue
                sock.settimeout(10)
                with contextlib.suppress(OSError, soft_link.VerbsError):
                    soft_link.recv_hello(sock)  # the device's answer: its hello, or a refusal
                break
            thread.join(15)
        finally:
            for sock in socks:
                close_quietly(sock)
        assert not thread.is_alive(), "connect hangs"
        decisive = next(c.decides for c in connections if c.decides)
        if decisive == "accept":
            assert outcome == [None] and qp.state is QPState.RTS, outcome
        else:
            assert len(outcome) == 1 and isinstance(outcome[0], soft_link.VerbsError), outcome
            assert qp.state is QPState.ERR
    finally:
        dev.close()


# -- mate-run's rendezvous: processes without the secret -----------------------------------------

@st.composite
def impostors(draw: st.DrawFn, secret: str) -> list[bytes]:
    """What a process that does not hold the job's secret (or holds it and lies about its
    rank) sends the rendezvous: lines, after reading its challenge."""
    what = draw(st.sampled_from(["nothing", "bytes", "json", "no-proof", "wrong-proof",
                                 "odd-proof", "bad-rank", "nested", "long", "unterminated"]))
    hello: Any
    if what == "nothing":
        return []
    if what == "bytes":
        return [draw(st.binary(max_size=100)) + b"\n"]
    if what == "json":
        hello = draw(st.recursive(st.none() | st.integers() | st.text(),
                                  lambda inner: st.lists(inner) | st.dictionaries(st.text(),
                                                                                   inner),
                                  max_leaves=8))
    elif what == "no-proof":
        hello = {"rank": 0, "blob": "impostor"}
    elif what == "wrong-proof":
        hello = {"rank": 0, "blob": "impostor", "proof": draw(st.sampled_from(
            ["00" * 32, "", secret, "zz", 0, None, [], "\u00e9" * 64]))}
    elif what == "odd-proof":
        hello = {"rank": 0, "blob": "impostor", "proof": draw(st.text(max_size=80))}
    elif what == "bad-rank":  # holds the secret (a proof is computed below), not a rank
        hello = {"rank": draw(st.sampled_from([-1, 2, 2**70, "0", None, 1.0, [0]])),
                 "blob": "impostor", "proof": "PROOF"}
    elif what == "nested":
        depth = draw(st.integers(1_000, 50_000))
        return [b"[" * depth + b"]" * depth + b"\n"]
    elif what == "long":  # past the rendezvous' line limit
        return [b"x" * (bootstrap.LINE_LIMIT + 10) + b"\n"]
    else:
        return [b'{"rank": 0, "proof": "']
    return [json.dumps(hello).encode() + b"\n"]


async def impostor(address: str, secret: str, lines: list[bytes]) -> None:
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        challenge = json.loads(await reader.readline())["challenge"]
        for line in lines:
            writer.write(line.replace(b'"PROOF"', json.dumps(
                bootstrap._proof(secret, challenge)).encode()))
        await writer.drain()
        writer.write_eof()
        reply = await asyncio.wait_for(reader.read(), 35)
        assert reply in (b"", b'{"error":"refused"}\n'), reply
    finally:
        writer.close()


@FUZZ
@given(data=st.data())
async def test_the_rendezvous_refuses_processes_without_the_secret(data: st.DataObject) -> None:
    server = bootstrap.Rendezvous(2)
    address = await server.start()
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
    try:
        lines = data.draw(st.lists(impostors(server.secret), max_size=4))
        await asyncio.wait_for(asyncio.gather(
            *(impostor(address, server.secret, each) for each in lines)), 60)
        tables = await asyncio.wait_for(asyncio.gather(*(
            bootstrap.exchange(f"blob{r}", server.environment(r)) for r in range(2))), 30)
    finally:
        await server.close()
    assert tables == [["blob0", "blob1"]] * 2  # no impostor's blob got in
    assert server.refused == len(lines)
    assert not errors, errors


# -- fixed cases: the defects this fuzzing found ------------------------------------------------

def inject(fabric: Fabric, frame: bytes) -> None:
    """`frame` into rank 0's oldest receive buffer, as from rank 2's QP."""
    buffer = fabric.ranks[VICTIM].srq.popleft()
    ctypes.memmove(buffer.sge.addr, frame, len(frame))
    fabric.inject(VICTIM, WorkCompletion(buffer.wr_id, WcStatus.SUCCESS, WcOpcode.RECV,
                                         len(frame), VICTIM * 1000 + ADVERSARY))


def test_an_rts_id_used_twice_loses_its_sender_and_raises_nothing() -> None:
    # Before: both RTSs waited unexpected under one id, and the receive that matched the
    # second raised KeyError out of Engine.post.
    fabric = Fabric(3, eager_size=EAGER, credits=CREDITS, adversary=ADVERSARY)
    rts = wire.encode(ADVERSARY, Kind.RTS, tag=5, length=100, msg_id=7, addr=0x1000, rkey=9)
    inject(fabric, rts)
    inject(fabric, rts)
    receives = [fabric.post(VICTIM, Operation(Op.RECV, memoryview(bytearray(200)), ADVERSARY,
                                              5)) for _ in range(2)]
    fabric.run()
    for op in receives:
        report = fabric.outcome(VICTIM, op)
        assert report is not None and report.input is Input.FAILED
        assert report.error is not None
        assert report.error.reason is FailureReason.PEER_UNREACHABLE
    assert fabric.engine(VICTIM)._lost[ADVERSARY]


@pytest.mark.parametrize("kind", [Kind.FIN, Kind.CANCEL_ACK])
@pytest.mark.parametrize("flags", [0, wire.FAILED])
def test_an_answer_for_a_send_to_another_rank_is_refused(kind: Kind, flags: int) -> None:
    # Before: a FIN was looked up by message id alone: any rank could complete (or fail)
    # a rendezvous send that went to another, which had not read it.
    fabric = Fabric(3, eager_size=EAGER, credits=CREDITS, adversary=ADVERSARY)
    data = random.Random(1).randbytes(500)
    send = fabric.post(VICTIM, Operation(Op.SEND, memoryview(data), HONEST, 4))
    fabric.run()  # the RTS is at rank 1, unmatched
    (msg_id,) = fabric.engine(VICTIM)._rdv
    inject(fabric, wire.encode(ADVERSARY, kind, flags=flags, msg_id=msg_id))
    assert fabric.outcome(VICTIM, send) is None  # still waits for rank 1
    assert fabric.engine(VICTIM)._lost[ADVERSARY]
    inbox = bytearray(500)
    got = fabric.post(HONEST, Operation(Op.RECV, memoryview(inbox), VICTIM, 4))
    fabric.run()
    for rank, op in ((VICTIM, send), (HONEST, got)):
        report = fabric.outcome(rank, op)
        assert report is not None and report.input is Input.COMPLETED, report
    assert inbox == data


def connect_with(junk: bytes) -> QPState:
    """Connect a QP to the fake peer after a connection that sends `junk` to its device."""
    dev = soft.open_device(link="unix", one_sided="served")
    try:
        qp = Side.open(dev).qp
        errors: list[BaseException] = []

        def connect() -> None:
            try:
                qp.connect(Endpoint(FAKE_QP, FAKE_PSN, address=FAKE_ADDRESS))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=connect)
        thread.start()
        with contextlib.closing(soft_link.dial(dev.address, time.monotonic() + 10)) as sock:
            sock.sendall(junk)
        with contextlib.closing(soft_link.dial(dev.address, time.monotonic() + 10)) as sock:
            sock.sendall(hello_json(fake_hello(qp.endpoint())))
            sock.settimeout(10)
            soft_link.recv_hello(sock)
            thread.join(10)
        assert not errors, errors
        return qp.state
    finally:
        dev.close()


def test_a_hello_nested_too_deep_leaves_the_connect_waiting() -> None:
    # Before: json raised RecursionError, which escaped the device's accept: the
    # connecting QP failed with it.
    assert connect_with(framed(b"[" * 10_000 + b"]" * 10_000)) is QPState.RTS


async def test_the_rendezvous_refuses_a_hello_nested_too_deep() -> None:
    # Before: RecursionError escaped the connection's handler, the connection was neither
    # refused nor closed.
    server = bootstrap.Rendezvous(2)
    address = await server.start()
    try:
        await impostor(address, server.secret, [b"[" * 10_000 + b"]" * 10_000 + b"\n"])
        tables = await asyncio.wait_for(asyncio.gather(*(
            bootstrap.exchange(r, server.environment(r)) for r in range(2))), 30)
    finally:
        await server.close()
    assert server.refused == 1 and tables == [[0, 1]] * 2


@pytest.mark.parametrize("secret", [None, "not hex"], ids=["missing", "malformed"])
async def test_a_rank_without_a_usable_secret_is_refused_before_it_connects(
        secret: str | None) -> None:
    # Before: KeyError (missing) or ValueError (malformed) from exchange, after connecting.
    server = bootstrap.Rendezvous(1)
    await server.start()
    environ = server.environment(0)
    if secret is None:
        del environ[bootstrap.SECRET]
    else:
        environ[bootstrap.SECRET] = secret
    try:
        with pytest.raises(InvalidArgument, match="environment is incomplete"):
            await bootstrap.exchange("blob", environ)
    finally:
        await server.close()
    assert server.refused == 0  # nothing reached it


@pytest.mark.parametrize("table", ["/proc/self/mem", "/etc/hostname"])
def test_a_peer_naming_another_file_as_its_mr_table_fails_the_rdma(table: str) -> None:
    # Before, /proc/self/mem (this process's own memory, a regular file): the shared
    # lock or read of the "table" raised OSError out of post_send, so out of world.put.
    dev = soft.open_device(link="unix", one_sided="direct")
    try:
        side = Side.open(dev)
        qp = side.qp
        probe = ctypes.create_string_buffer(os.urandom(16), 16)
        hello = fake_hello(qp.endpoint(), host=host_identity(), table=table,
                           probe=ctypes.addressof(probe), token=probe.raw.hex())
        thread = threading.Thread(target=qp.connect,
                                  args=(Endpoint(FAKE_QP, FAKE_PSN, address=FAKE_ADDRESS),))
        thread.start()
        with contextlib.closing(soft_link.dial(dev.address, time.monotonic() + 10)) as sock:
            soft_link.send_hello(sock, hello)
            soft_link.recv_hello(sock)
            thread.join(10)
            local = Buf(64)
            mr = side.pd.reg_mr(local.addr, 64, Access.LOCAL_WRITE)
            qp.post_send(SendWR(1, Opcode.RDMA_WRITE, SGE(local.addr, 8, mr.lkey), True,
                                0x1000, 0x1234))
            assert [(wc.wr_id, wc.status) for wc in side.scq.poll(4)] == [
                (1, WcStatus.REM_ACCESS_ERR)]
            assert qp.state is QPState.ERR
    finally:
        dev.close()


def test_a_cancel_ack_for_a_send_nobody_cancelled_is_refused() -> None:
    # Before: the send was reported CANCELLED with no cancel asked; the core refuses such
    # a report (a ProtocolError, logged by the progress pass) while the engine had
    # forgotten the send: the user's message never ended, not even by its timeout.
    fabric = Fabric(3, eager_size=EAGER, credits=CREDITS, adversary=ADVERSARY)
    send = fabric.post(VICTIM, Operation(Op.SEND, memoryview(bytes(500)), ADVERSARY, 4))
    fabric.run()  # the RTS is at rank 2, unmatched
    (msg_id,) = fabric.engine(VICTIM)._rdv
    inject(fabric, wire.encode(ADVERSARY, Kind.CANCEL_ACK, msg_id=msg_id))
    report = fabric.outcome(VICTIM, send)
    assert report is not None and report.input is Input.FAILED, report
    assert report.error is not None and report.error.reason is FailureReason.PEER_UNREACHABLE
