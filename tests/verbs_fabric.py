"""An in-memory verbs fabric for testing the ibverbs engine without I/O.

N engines, each with a fake protection domain (registrations in a table) and
a fake wire. Work requests wait in per-QP queues until the scheduler
*executes* them: a SEND is copied (ctypes.memmove) into the destination's
oldest posted receive buffer, an RDMA READ/WRITE checks the keys, access
rights and bounds of both sides and copies. Completions wait in per-QP send
and receive queues until the scheduler *delivers* them to the engine. Each
step picks one QP to execute or one queue to deliver from, at random (a
`random.Random`, from hypothesis when a test wants it); the order within a
QP is kept. Every report the engines make goes through `Checker`, which
fails on a second terminal report, a late or repeated submission, or an
unrequested cancel. An empty SRQ when a SEND lands is an RNR: it fails the
test at once. The fabric also checks the credit protocol's two promises
directly: a sender never holds more than `credits + 1` of a receiver's
buffers (frames landed there and not yet reposted), and never has more than
one CREDIT frame sent and not yet processed.

A fabric may have an `adversary`: a rank whose frames may be anything
(tests/test_wire_fuzz.py forges and mutates them). Lied to, an engine may
break its credit promises towards that rank, so they are checked only
between the others; a SEND on a link to it that finds the SRQ empty, or a
receive buffer too short, fails as on a device (RNR retries exhausted, a
length error) and breaks the link.
"""

from __future__ import annotations

import ctypes
import itertools
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from mate.buffers import address_of
from mate.constants import ANY_SOURCE, ANY_TAG
from mate.machine import Input
from mate.schedule import Op
from mate.transports.base import Operation, Report
from mate.transports.ibverbs.engine import Engine
from mate.transports.ibverbs.pincache import PinCache
from mate.transports.ibverbs.verbs import (
    Access,
    MemoryRegion,
    Opcode,
    ProtectionDomain,
    RecvWR,
    SendWR,
    VerbsError,
    WcOpcode,
    WcStatus,
    WorkCompletion,
)
from mate.transports.ibverbs.wire import Kind

_keys = itertools.count(1)


class FakeMR(MemoryRegion):
    def __init__(self, pd: FakePD, addr: int, length: int, access: Access) -> None:
        self.pd = pd
        self.addr = addr
        self.length = length
        self.access = access
        self.lkey = next(_keys)
        self.rkey = self.lkey + 1_000_000

    def dereg(self) -> None:
        assert self.lkey in self.pd.by_lkey, "deregistered twice"
        del self.pd.by_lkey[self.lkey]
        del self.pd.by_rkey[self.rkey]
        self.pd.deregs += 1

    def covers(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length


class FakePD(ProtectionDomain):
    def __init__(self) -> None:
        self.by_lkey: dict[int, FakeMR] = {}
        self.by_rkey: dict[int, FakeMR] = {}
        self.regs = 0
        self.deregs = 0
        self.fail = 0  # refuse this many registrations

    def reg_mr(self, addr: int, length: int, access: Access) -> FakeMR:
        if self.fail:
            self.fail -= 1
            raise VerbsError("no memory to pin")
        assert length > 0, "zero-length registration"
        mr = FakeMR(self, addr, length, access)
        self.by_lkey[mr.lkey] = mr
        self.by_rkey[mr.rkey] = mr
        self.regs += 1
        return mr


class FabricError(AssertionError):
    pass


class _QP:
    def __init__(self, src: int, dst: int) -> None:
        self.src = src
        self.dst = dst
        self.num = src * 1000 + dst
        self.pending: deque[SendWR] = deque()  # posted, not executed
        self.unretired: list[SendWR] = []  # posted, completion not delivered yet
        self.error = False


class Checker:
    """The core's rules for what a transport reports about one operation."""

    def __init__(self) -> None:
        self.submitted: dict[int, int] = {}
        self.final: dict[int, Report] = {}
        self.cancel_asked: set[int] = set()
        self.ops: dict[int, Operation] = {}

    def posted(self, op: Operation) -> None:
        self.ops[id(op)] = op

    def feed(self, report: Report) -> None:
        key = id(report.op)
        if key not in self.ops:
            raise FabricError(f"a report for an operation never posted: {report}")
        if key in self.final:
            raise FabricError(f"a report after the end: {report} (ended {self.final[key]})")
        if report.input is Input.SUBMITTED:
            if report.op.op not in (Op.SEND, Op.PUT):
                raise FabricError(f"submission of a {report.op.op}")
            if self.submitted.get(key):
                raise FabricError("a second submission")
            self.submitted[key] = 1
            return
        if report.input is Input.CANCELLED and key not in self.cancel_asked:
            raise FabricError("cancelled without a cancel")
        self.final[key] = report

    def outcome(self, op: Operation) -> Report | None:
        return self.final.get(id(op))


class Rank:
    def __init__(self, fabric: Fabric, rank: int, pin_limit: int, **kw: Any) -> None:
        self.fabric = fabric
        self.rank = rank
        self.pd = FakePD()
        self.pins = PinCache(self.pd, pin_limit)
        self.srq: deque[RecvWR] = deque()
        self.lost_told: set[int] = set()
        self.engine = Engine(rank=rank, size=fabric.size, wire=_Wire(fabric, self), pd=self.pd,
                             pins=self.pins, **kw)
        self.checker = Checker()

    def collect(self) -> None:
        for report in self.engine.take_reports():
            self.checker.feed(report)

    def outcome(self, op: Operation) -> Report | None:
        return self.checker.outcome(op)


class _Wire:
    def __init__(self, fabric: Fabric, rank: Rank) -> None:
        self.fabric = fabric
        self.rank = rank

    def post_send(self, peer: int, wr: SendWR) -> None:
        qp = self.fabric.qps[self.rank.rank, peer]
        if qp.error:
            raise VerbsError("QP not in RTS")
        if len(qp.unretired) >= self.fabric.max_send_wr:
            raise FabricError("send queue overflow")
        if wr.opcode is Opcode.SEND and _kind(wr.sge.addr) == Kind.CREDIT:
            key = self.rank.rank, peer
            self.fabric.credit_frames[key] = self.fabric.credit_frames.get(key, 0) + 1
            if self.fabric.credit_frames[key] > 1 and self.fabric.trusted(*key):
                raise FabricError("a second CREDIT frame before the first was acknowledged")
        qp.pending.append(wr)
        qp.unretired.append(wr)

    def post_recv(self, wr: RecvWR) -> None:
        self.rank.srq.append(wr)


class Fabric:
    def __init__(self, size: int, *, pin_limit: int = 1 << 30, max_send_wr: int = 1024,
                 credits: int = 32, adversary: int | None = None, **kw: Any) -> None:
        self.size = size
        self.adversary = adversary
        self.max_send_wr = max_send_wr
        self.credits = credits
        self.held: dict[tuple[int, int], int] = {}  # (sender, receiver): buffers in use
        self.credit_frames: dict[tuple[int, int], int] = {}  # (sender, receiver): unprocessed
        self.dead: set[int] = set()  # ranks whose device no longer answers (a killed node)
        self.qps = {(a, b): _QP(a, b) for a in range(size) for b in range(size)}
        self.scq: dict[tuple[int, int], deque[WorkCompletion]] = {
            key: deque() for key in self.qps}
        self.rcq: dict[tuple[int, int], deque[WorkCompletion]] = {
            key: deque() for key in self.qps}
        self.ranks = [Rank(self, r, pin_limit, max_send_wr=max_send_wr, credits=credits, **kw)
                      for r in range(size)]
        for rank in self.ranks:
            rank.engine.start()
        self.steps = 0
        self.after_step: Callable[[], None] | None = None

    def trusted(self, a: int, b: int) -> bool:
        """Whether the link between `a` and `b` is held to the credit promises."""
        return self.adversary not in (a, b)

    # -- the core's side -------------------------------------------------------------

    def post(self, rank: int, op: Operation) -> Operation:
        r = self.ranks[rank]
        r.checker.posted(op)
        r.engine.post(op)
        r.collect()
        return op

    def cancel(self, rank: int, op: Operation) -> None:
        r = self.ranks[rank]
        r.checker.cancel_asked.add(id(op))
        r.engine.cancel(op)
        r.collect()

    def outcome(self, rank: int, op: Operation) -> Report | None:
        return self.ranks[rank].outcome(op)

    def engine(self, rank: int) -> Engine:
        return self.ranks[rank].engine

    # -- the wire's side -------------------------------------------------------------

    def actions(self) -> list[tuple[str, tuple[int, int]]]:
        ready: list[tuple[str, tuple[int, int]]] = []
        for key, qp in self.qps.items():
            if qp.pending:
                ready.append(("x", key))
        for key, q in self.scq.items():
            if q:
                ready.append(("s", key))
        for key, q in self.rcq.items():
            if q:
                ready.append(("r", key))
        return ready

    def step(self, rnd: random.Random | None = None) -> bool:
        ready = self.actions()
        if not ready:
            return False
        what, key = ready[rnd.randrange(len(ready))] if rnd is not None else ready[0]
        if what == "x":
            self._execute(self.qps[key])
        else:
            queue = self.scq[key] if what == "s" else self.rcq[key]
            self._deliver(key[0], key[1], queue.popleft())
        self.steps += 1
        for r in self.ranks:
            for credits in r.engine._credits:
                if credits < 0:
                    raise FabricError("negative credits")
        if self.after_step is not None:
            self.after_step()
        return True

    def run(self, rnd: random.Random | None = None, limit: int = 200_000) -> None:
        """Step until nothing is left to do."""
        for _ in range(limit):
            if not self.step(rnd):
                return
        raise FabricError("the fabric did not go quiet (livelock?)")

    def _deliver(self, rank: int, peer: int, wc: WorkCompletion, made_up: bool = False) -> None:
        r = self.ranks[rank]
        qp = self.qps[rank, peer]
        landed = wc.opcode is WcOpcode.RECV and wc.status is WcStatus.SUCCESS and not made_up
        if landed:
            buffer = r.engine._recv_wrs[wc.wr_id]
            if wc.byte_len >= 5 and _kind(buffer.sge.addr) == Kind.CREDIT:
                self.credit_frames[peer, rank] = self.credit_frames.get((peer, rank), 0) - 1
        elif wc.opcode is not WcOpcode.RECV:
            # retire this request and the unsignalled ones before it
            i = next(i for i, wr in enumerate(qp.unretired) if wr.wr_id == wc.wr_id)
            del qp.unretired[:i + 1]
        r.engine.completion(wc, peer)
        if landed:
            self.held[peer, rank] -= 1  # the engine reposted it (or the test fails on RNR)
        if wc.status is not WcStatus.SUCCESS and qp.error and peer not in r.lost_told:
            r.lost_told.add(peer)
            r.engine.peer_lost(peer, f"QP to {peer} in error")
        r.collect()

    def _execute(self, qp: _QP) -> None:
        wr = qp.pending.popleft()
        src, dst = self.ranks[qp.src], self.ranks[qp.dst]
        sge = wr.sge
        n = sge.length if sge is not None else 0
        status = WcStatus.SUCCESS
        opcode = {Opcode.SEND: WcOpcode.SEND, Opcode.RDMA_READ: WcOpcode.RDMA_READ,
                  Opcode.RDMA_WRITE: WcOpcode.RDMA_WRITE}[wr.opcode]
        local = None
        if qp.dst in self.dead:  # nobody answers: the requester's retries run out
            status = WcStatus.RETRY_EXC_ERR
        elif sge is not None:
            local = src.pd.by_lkey.get(sge.lkey)
            need = Access.LOCAL_WRITE if wr.opcode is Opcode.RDMA_READ else Access(0)
            if local is None or not local.covers(sge.addr, n) or local.access & need != need:
                status = WcStatus.LOC_PROT_ERR
        trusted = self.trusted(qp.src, qp.dst)
        if status is WcStatus.SUCCESS and wr.opcode is Opcode.SEND and not dst.srq:
            if trusted:
                raise FabricError(f"RNR: rank {qp.dst}'s SRQ is empty (from {qp.src})")
            status = WcStatus.RNR_RETRY_EXC_ERR
        if status is WcStatus.SUCCESS and wr.opcode is Opcode.SEND:
            recv = dst.srq.popleft()
            rmr = dst.pd.by_lkey.get(recv.sge.lkey)
            assert rmr is not None and rmr.covers(recv.sge.addr, recv.sge.length)
            wc_status = WcStatus.SUCCESS
            if n > recv.sge.length:
                if trusted:
                    raise FabricError("a frame longer than the receive buffer")
                status, wc_status, n = WcStatus.REM_INV_REQ_ERR, WcStatus.LOC_LEN_ERR, 0
            if n:
                assert sge is not None
                ctypes.memmove(recv.sge.addr, sge.addr, n)
            key = qp.src, qp.dst
            self.held[key] = self.held.get(key, 0) + 1
            if self.held[key] > self.credits + 1 and trusted:
                raise FabricError(f"rank {qp.src} holds {self.held[key]} of rank {qp.dst}'s "
                                  f"receive buffers (credits {self.credits})")
            self.rcq[qp.dst, qp.src].append(WorkCompletion(
                recv.wr_id, wc_status, WcOpcode.RECV, n, qp.dst * 1000 + qp.src))
        elif status is WcStatus.SUCCESS and n:
            need = Access.REMOTE_READ if wr.opcode is Opcode.RDMA_READ else Access.REMOTE_WRITE
            remote = dst.pd.by_rkey.get(wr.rkey)
            if remote is None or not remote.covers(wr.remote_addr, n) or (
                    remote.access & need != need):
                status = WcStatus.REM_ACCESS_ERR
            else:
                assert sge is not None
                if wr.opcode is Opcode.RDMA_READ:
                    ctypes.memmove(sge.addr, wr.remote_addr, n)
                else:
                    ctypes.memmove(wr.remote_addr, sge.addr, n)
        if status is not WcStatus.SUCCESS:
            self.scq[qp.src, qp.dst].append(WorkCompletion(wr.wr_id, status, opcode, 0, qp.num))
            self.break_link(qp.src, qp.dst, notify=False)
        elif wr.signaled:
            self.scq[qp.src, qp.dst].append(WorkCompletion(wr.wr_id, status, opcode, n, qp.num))

    def break_link(self, a: int, b: int, *, notify: bool = True) -> None:
        """Both QPs between `a` and `b` go to ERR; their requests are flushed."""
        for src, dst in ((a, b), (b, a)):
            qp = self.qps[src, dst]
            qp.error = True
            while qp.pending:
                wr = qp.pending.popleft()
                self.scq[src, dst].append(WorkCompletion(
                    wr.wr_id, WcStatus.WR_FLUSH_ERR, WcOpcode.SEND, 0, qp.num))
            if notify and dst not in self.ranks[src].lost_told:
                self.ranks[src].lost_told.add(dst)
                self.ranks[src].engine.peer_lost(dst, f"link to {dst} broken")
                self.ranks[src].collect()

    def inject(self, rank: int, wc: WorkCompletion) -> None:
        """Hand one made-up completion to `rank`'s engine."""
        self._deliver(rank, wc.qp_num % 1000, wc, made_up=True)


# -- making operations ---------------------------------------------------------------


def send(data: bytes | bytearray, dest: int, tag: int = 0,
         deadline: float | None = None) -> Operation:
    return Operation(Op.SEND, memoryview(bytes(data)), dest, tag, deadline=deadline)


def recv(room: int, source: int = ANY_SOURCE, tag: int = ANY_TAG,
         deadline: float | None = None) -> Operation:
    return Operation(Op.RECV, memoryview(bytearray(room)), source, tag, deadline=deadline)


def put(data: bytes | bytearray, dest: int, address: int,
        deadline: float | None = None) -> Operation:
    return Operation(Op.PUT, memoryview(bytes(data)), dest, 0, address, deadline)


def get(room: int, source: int, address: int, deadline: float | None = None) -> Operation:
    return Operation(Op.GET, memoryview(bytearray(room)), source, 0, address, deadline)


def _kind(addr: int) -> int:
    """The kind of the frame at `addr` (wire.py: after the 4-byte source)."""
    return ctypes.string_at(addr + 4, 1)[0]


def pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


__all__ = ["Fabric", "FabricError", "FakePD", "address_of", "get", "pattern", "put", "recv",
           "send"]
