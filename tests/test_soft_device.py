"""The soft RC device (`mate.transports.ibverbs.soft`) against the verbs contract.

Most tests open two devices in this process (so frames really cross sockets)
and drive both by polling their CQs: there is no device thread, the poller
does the device's work. The two-process tests run the peer under
multiprocessing's "spawn" context.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import multiprocessing
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pytest

from mate.transports.ibverbs import soft
from mate.transports.ibverbs.soft_table import PeerTable
from mate.transports.ibverbs.verbs import (
    SGE,
    Access,
    Endpoint,
    Opcode,
    QPState,
    RecvWR,
    SendWR,
    VerbsError,
    WcOpcode,
    WcStatus,
    WorkCompletion,
)

ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
CANARY = b"\xcc" * 64
MiB = 1 << 20


class Buf:
    """`size` bytes of memory between two canaries that nothing may ever write."""

    def __init__(self, size: int, fill: bytes = b"") -> None:
        self.size = size
        self._mem = ctypes.create_string_buffer(size + 2 * len(CANARY))
        base = ctypes.addressof(self._mem)
        ctypes.memmove(base, CANARY, len(CANARY))
        ctypes.memmove(base + len(CANARY) + size, CANARY, len(CANARY))
        self.addr = base + len(CANARY)
        if fill:
            self.write(0, (fill * (size // len(fill) + 1))[:size])

    def read(self, offset: int = 0, length: int | None = None) -> bytes:
        return ctypes.string_at(self.addr + offset, self.size - offset if length is None
                                else length)

    def write(self, offset: int, data: bytes) -> None:
        assert offset + len(data) <= self.size
        ctypes.memmove(self.addr + offset, data, len(data))

    def canaries_intact(self) -> bool:
        base = ctypes.addressof(self._mem)
        return (ctypes.string_at(base, len(CANARY)) == CANARY
                and ctypes.string_at(self.addr + self.size, len(CANARY)) == CANARY)


@dataclass
class Side:
    dev: soft.SoftDevice
    pd: soft.SoftPD
    channel: soft.SoftChannel
    scq: soft.SoftCQ
    rcq: soft.SoftCQ
    srq: soft.SoftSRQ
    qp: soft.SoftQP

    @classmethod
    def open(cls, dev: soft.SoftDevice, max_send_wr: int = 64) -> Side:
        pd = dev.alloc_pd()
        channel = dev.create_comp_channel()
        scq = dev.create_cq(1024, channel)
        rcq = dev.create_cq(1024, channel)
        srq = dev.create_srq(pd, 1024)
        return cls(dev, pd, channel, scq, rcq, srq,
                   dev.create_qp(pd, scq, rcq, srq, max_send_wr=max_send_wr))

    def new_qp(self) -> soft.SoftQP:
        return self.dev.create_qp(self.pd, self.scq, self.rcq, self.srq, max_send_wr=64)


def connect(qp_a: soft.SoftQP, qp_b: soft.SoftQP) -> None:
    """Both sides at once, as the transport does (a connect may wait for the other)."""
    ea, eb = qp_a.endpoint(), qp_b.endpoint()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            qp_a.connect(eb)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    qp_b.connect(ea)
    thread.join()
    assert not errors, errors


@contextlib.contextmanager
def pair(link: str = "unix", **options: Any) -> Iterator[tuple[Side, Side]]:
    """Two devices in this process, one connected QP on each."""
    devs = [soft.open_device(link=link, **options) for _ in range(2)]
    try:
        a, b = Side.open(devs[0]), Side.open(devs[1])
        connect(a.qp, b.qp)
        yield a, b
    finally:
        for dev in devs:
            dev.close()


class Collector:
    """Polls CQs (which drives their devices) and keeps what they return."""

    def __init__(self, *cqs: soft.SoftCQ) -> None:
        self.cqs = cqs
        self.got: dict[int, list[WorkCompletion]] = {id(cq): [] for cq in cqs}

    def __getitem__(self, cq: soft.SoftCQ) -> list[WorkCompletion]:
        return self.got[id(cq)]

    def poll(self) -> None:
        for cq in self.cqs:
            self.got[id(cq)] += cq.poll(64)

    def until(self, done: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"timed out; got {self.got}"
            self.poll()

    def run_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.poll()
            time.sleep(0.0002)


def sides(*all_sides: Side) -> Collector:
    return Collector(*(cq for s in all_sides for cq in (s.scq, s.rcq)))


def post_recv(side: Side, buf: Buf, mr: soft.SoftMR, wr_id: int, offset: int = 0,
              length: int | None = None) -> None:
    length = buf.size - offset if length is None else length
    side.srq.post_recv(RecvWR(wr_id, SGE(buf.addr + offset, length, mr.lkey)))


def send_wr(wr_id: int, buf: Buf | None, mr: soft.SoftMR | None, length: int,
            offset: int = 0, signaled: bool = True) -> SendWR:
    sge = None if buf is None or mr is None else SGE(buf.addr + offset, length, mr.lkey)
    return SendWR(wr_id, Opcode.SEND, sge, signaled)


def rdma_wr(wr_id: int, opcode: Opcode, buf: Buf, mr: soft.SoftMR, length: int,
            remote_addr: int, rkey: int, offset: int = 0) -> SendWR:
    return SendWR(wr_id, opcode, SGE(buf.addr + offset, length, mr.lkey), True,
                  remote_addr, rkey)


def statuses(wcs: list[WorkCompletion]) -> list[tuple[int, WcStatus]]:
    return [(wc.wr_id, wc.status) for wc in wcs]


# -- SEND / RECV -----------------------------------------------------------------------------

@pytest.mark.parametrize("link", ["unix", "tcp"])
def test_send_recv_bytes_length_and_order(link: str) -> None:
    with pair(link) as (a, b):
        assert a.qp.state is QPState.RTS and b.qp.state is QPState.RTS
        assert a.qp.endpoint().address.startswith({"unix": "unix:@", "tcp": "tcp:"}[link])
        src = Buf(4096, b"abcdefgh")
        dst = Buf(4 * 1024)
        smr = a.pd.reg_mr(src.addr, src.size, Access.LOCAL_WRITE)
        dmr = b.pd.reg_mr(dst.addr, dst.size, Access.LOCAL_WRITE)
        for i in range(4):
            post_recv(b, dst, dmr, 100 + i, offset=i * 1024, length=1024)
        a.qp.post_send(send_wr(1, src, smr, 8))
        a.qp.post_send(send_wr(2, src, smr, 1000, offset=3))
        a.qp.post_send(send_wr(3, None, None, 0))  # a zero-length SEND
        a.qp.post_send(send_wr(4, src, smr, 5, offset=1, signaled=False))
        c = sides(a, b)
        c.until(lambda: len(c[b.rcq]) == 4 and len(c[a.scq]) == 3)
        recvs = c[b.rcq]
        assert [wc.wr_id for wc in recvs] == [100, 101, 102, 103]  # the SRQ is FIFO
        assert [wc.byte_len for wc in recvs] == [8, 1000, 0, 5]
        assert all(wc.opcode is WcOpcode.RECV and wc.status is WcStatus.SUCCESS
                   and wc.qp_num == b.qp.qp_num for wc in recvs)
        assert dst.read(0, 8) == b"abcdefgh"
        assert dst.read(1024, 1000) == src.read(3, 1000)
        assert dst.read(3072, 5) == b"bcdef"
        assert dst.canaries_intact()
        # Only signalled requests complete, in posting order, on the requester's QP.
        assert [(wc.wr_id, wc.opcode, wc.qp_num) for wc in c[a.scq]] == [
            (1, WcOpcode.SEND, a.qp.qp_num), (2, WcOpcode.SEND, a.qp.qp_num),
            (3, WcOpcode.SEND, a.qp.qp_num)]
        stats = a.dev.stats()
        assert stats["frames_sent"] >= 4 and stats["bytes_sent"] >= 4 * 24 + 1013
        assert b.dev.stats()["frames_received"] >= 4


def test_send_completes_only_once_placed() -> None:
    with pair() as (a, b):
        src = Buf(64, b"x")
        dst = Buf(64)
        smr = a.pd.reg_mr(src.addr, 64, 0)
        dmr = b.pd.reg_mr(dst.addr, 64, Access.LOCAL_WRITE)
        post_recv(b, dst, dmr, 1)
        a.qp.post_send(send_wr(7, src, smr, 64))
        deadline = time.monotonic() + 0.05
        while time.monotonic() < deadline:  # the responder is not polled: no ACK
            assert a.scq.poll(8) == []
        c = sides(a, b)
        c.until(lambda: len(c[a.scq]) == 1)
        assert c[b.rcq][0].byte_len == 64 and dst.read() == b"x" * 64


def test_same_device_pair_and_self_connected_loopback() -> None:
    dev = soft.open_device()
    try:
        a = Side.open(dev)
        other = a.new_qp()
        loop = a.new_qp()
        # Same device: connect never waits, whichever side goes first.
        a.qp.connect(other.endpoint())
        other.connect(a.qp.endpoint())
        loop.connect(loop.endpoint())  # a rank sending to itself
        assert {a.qp.state, other.state, loop.state} == {QPState.RTS}
        src = Buf(256, b"0123456789")
        dst = Buf(256)
        smr = a.pd.reg_mr(src.addr, 256, ALL)
        dmr = a.pd.reg_mr(dst.addr, 256, ALL)
        for i in range(3):
            post_recv(a, dst, dmr, 10 + i, offset=64 * i, length=64)
        a.qp.post_send(send_wr(1, src, smr, 10))
        other.post_send(send_wr(2, src, smr, 20))
        loop.post_send(send_wr(3, src, smr, 30))
        loop.post_send(rdma_wr(4, Opcode.RDMA_WRITE, src, smr, 16, dst.addr + 200, dmr.rkey))
        c = sides(a)
        c.until(lambda: len(c[a.rcq]) == 3 and len(c[a.scq]) == 4)
        by_qp = {wc.qp_num: wc.byte_len for wc in c[a.rcq]}
        assert by_qp == {other.qp_num: 10, a.qp.qp_num: 20, loop.qp_num: 30}
        assert all(wc.status is WcStatus.SUCCESS for wc in c[a.scq])
        assert dst.read(200, 16) == src.read(0, 16) and dst.canaries_intact()
    finally:
        dev.close()


# -- receiver not ready ----------------------------------------------------------------------

def test_rnr_retries_until_a_buffer_is_posted_keeping_order() -> None:
    with pair() as (a, b):
        src = Buf(64, b"s")
        dst = Buf(3 * 64)
        smr = a.pd.reg_mr(src.addr, 64, 0)
        dmr = b.pd.reg_mr(dst.addr, dst.size, Access.LOCAL_WRITE)
        for i in range(3):  # posted while the SRQ is empty: all wait, in order
            a.qp.post_send(send_wr(i, src, smr, 10 + i))
        c = sides(a, b)
        c.run_for(0.05)
        assert c[a.scq] == [] and c[b.rcq] == []
        assert a.dev.stats()["rnr_retries"] >= 3
        for i in range(3):
            post_recv(b, dst, dmr, 50 + i, offset=64 * i, length=64)
        c.until(lambda: len(c[a.scq]) == 3)
        assert statuses(c[a.scq]) == [(0, WcStatus.SUCCESS), (1, WcStatus.SUCCESS),
                                      (2, WcStatus.SUCCESS)]
        assert [(wc.wr_id, wc.byte_len) for wc in c[b.rcq]] == [(50, 10), (51, 11), (52, 12)]
        time.sleep(0.01)  # the RNR timer has fired since: drained, it leaves the fd quiet
        c.poll()
        assert not readable(a.channel.fileno(), 0.02)


def test_the_rnr_timer_wakes_a_waiting_progress_loop() -> None:
    with pair(rnr_timer=0.005) as (a, b):
        dst = Buf(8)
        dmr = b.pd.reg_mr(dst.addr, 8, Access.LOCAL_WRITE)
        a.qp.post_send(send_wr(1, None, None, 0))
        c = sides(a, b)
        c.until(lambda: a.dev.stats()["rnr_retries"] == 1)  # the retry waits for a's timer
        post_recv(b, dst, dmr, 3)
        fd = a.channel.fileno()
        start = time.monotonic()
        assert readable(fd, 1.0)  # the timerfd: nobody needs to poll for the retry to go
        assert time.monotonic() - start < 0.5
        assert a.scq.poll(4) == []  # the retry goes; the ACK is not there yet
        c.until(lambda: len(c[a.scq]) == 1)
        assert statuses(c[a.scq]) == [(1, WcStatus.SUCCESS)]
        assert not readable(fd, 0.05)  # the expired timer was drained: no spinning


def test_rnr_retry_exhausted() -> None:
    with pair(rnr_retry=2, rnr_timer=0.002) as (a, b):
        src = Buf(64, b"s")
        smr = a.pd.reg_mr(src.addr, 64, 0)
        a.qp.post_send(send_wr(1, src, smr, 8))
        a.qp.post_send(send_wr(2, src, smr, 8, signaled=False))
        c = sides(a, b)
        c.until(lambda: len(c[a.scq]) == 2)
        assert statuses(c[a.scq]) == [(1, WcStatus.RNR_RETRY_EXC_ERR), (2, WcStatus.WR_FLUSH_ERR)]
        assert a.qp.state is QPState.ERR
        assert a.dev.stats()["rnr_retries"] == 2  # then the third RNR exceeded the limit
        c.until(lambda: b.qp.state is QPState.ERR)  # the link closes behind it


def test_payload_longer_than_the_buffer() -> None:
    with pair() as (a, b):
        src = Buf(64, b"L")
        dst = Buf(64)
        smr = a.pd.reg_mr(src.addr, 64, 0)
        dmr = b.pd.reg_mr(dst.addr, 64, Access.LOCAL_WRITE)
        post_recv(b, dst, dmr, 9, length=16)
        a.qp.post_send(send_wr(1, src, smr, 17))
        c = sides(a, b)
        c.until(lambda: len(c[a.scq]) == 1 and len(c[b.rcq]) == 1)
        assert statuses(c[b.rcq]) == [(9, WcStatus.LOC_LEN_ERR)]
        assert statuses(c[a.scq]) == [(1, WcStatus.REM_INV_REQ_ERR)]
        assert dst.read() == bytes(64) and dst.canaries_intact()
        assert b.qp.state is QPState.ERR and a.qp.state is QPState.ERR


# -- RDMA WRITE / READ -----------------------------------------------------------------------

@pytest.mark.parametrize("one_sided", ["direct", "served"])
def test_rdma_write_then_read(one_sided: str) -> None:
    with pair(one_sided=one_sided) as (a, b):
        local = Buf(8192, b"local!")
        remote = Buf(8192, b"REMOTE")
        lmr = a.pd.reg_mr(local.addr, local.size, Access.LOCAL_WRITE)
        rmr = b.pd.reg_mr(remote.addr, remote.size, ALL)
        a.qp.post_send(rdma_wr(1, Opcode.RDMA_WRITE, local, lmr, 1000, remote.addr + 100,
                               rmr.rkey))
        a.qp.post_send(rdma_wr(2, Opcode.RDMA_READ, local, lmr, 3000, remote.addr + 5000,
                               rmr.rkey, offset=4096))
        c = sides(a, b)
        c.until(lambda: len(c[a.scq]) == 2)
        assert [(wc.wr_id, wc.status, wc.opcode) for wc in c[a.scq]] == [
            (1, WcStatus.SUCCESS, WcOpcode.RDMA_WRITE), (2, WcStatus.SUCCESS, WcOpcode.RDMA_READ)]
        assert remote.read(100, 1000) == local.read(0, 1000)
        assert remote.read(0, 100) == (b"REMOTE" * 20)[:100]  # nothing else changed
        assert local.read(4096, 3000) == remote.read(5000, 3000)
        assert local.canaries_intact() and remote.canaries_intact()
        assert (a.dev.stats()["direct_ops"] == 2) == (one_sided == "direct")
        assert c[b.rcq] == []  # one-sided: nothing at the target


@pytest.mark.parametrize("one_sided", ["direct", "served"])
def test_zero_length_read_completes_after_the_write_is_visible(one_sided: str) -> None:
    with pair(one_sided=one_sided) as (a, b):
        local = Buf(MiB, b"w")
        remote = Buf(MiB)
        lmr = a.pd.reg_mr(local.addr, local.size, Access.LOCAL_WRITE)
        rmr = b.pd.reg_mr(remote.addr, remote.size, ALL)
        a.qp.post_send(SendWR(1, Opcode.RDMA_WRITE, SGE(local.addr, MiB, lmr.lkey), False,
                              remote.addr, rmr.rkey))
        a.qp.post_send(SendWR(2, Opcode.RDMA_READ, None, True, remote.addr, rmr.rkey))
        c = Collector(a.scq)
        target = Collector(b.scq)
        while not c[a.scq]:
            target.poll()
            c.poll()
        # Checked the moment the READ completes: the WRITE ahead of it is all there.
        assert remote.read() == local.read()
        assert statuses(c[a.scq]) == [(2, WcStatus.SUCCESS)]


ACCESS_CASES = ["bad_rkey", "no_remote_write", "no_remote_read", "out_of_bounds", "dereg"]


@pytest.mark.parametrize("one_sided", ["direct", "served"])
@pytest.mark.parametrize("case", ACCESS_CASES)
def test_remote_access_errors(one_sided: str, case: str) -> None:
    with pair(one_sided=one_sided) as (a, b):
        local = Buf(4096, b"evil")
        remote = Buf(4096, b"safe")
        before = remote.read()
        lmr = a.pd.reg_mr(local.addr, local.size, Access.LOCAL_WRITE)
        access = {"no_remote_write": Access.LOCAL_WRITE | Access.REMOTE_READ,
                  "no_remote_read": Access.LOCAL_WRITE | Access.REMOTE_WRITE}.get(case, ALL)
        rmr = b.pd.reg_mr(remote.addr, 1024, access)  # the region is the first 1 KiB
        opcode = Opcode.RDMA_READ if case == "no_remote_read" else Opcode.RDMA_WRITE
        rkey, addr, length = rmr.rkey, remote.addr, 512
        if case == "bad_rkey":
            rkey ^= 0x5A5A0000
        elif case == "out_of_bounds":
            addr, length = remote.addr + 600, 512  # crosses the region's end
        elif case == "dereg":
            rmr.dereg()
        a.qp.post_send(rdma_wr(1, opcode, local, lmr, length, addr, rkey))
        a.qp.post_send(send_wr(2, local, lmr, 4))  # behind it: flushed
        c = sides(a, b)
        c.until(lambda: len(c[a.scq]) == 2)
        assert statuses(c[a.scq]) == [(1, WcStatus.REM_ACCESS_ERR), (2, WcStatus.WR_FLUSH_ERR)]
        assert a.qp.state is QPState.ERR
        assert remote.read() == before and remote.canaries_intact()
        assert local.read() == Buf(4096, b"evil").read() and local.canaries_intact()
        c.until(lambda: b.qp.state is QPState.ERR)  # the link is closed: both ends in ERR


def test_local_protection_error() -> None:
    with pair() as (a, b):
        src = Buf(64)
        smr = a.pd.reg_mr(src.addr, 32, 0)
        a.qp.post_send(send_wr(1, src, smr, 33))  # one byte beyond the region
        c = sides(a, b)
        c.until(lambda: len(c[a.scq]) == 1)
        assert statuses(c[a.scq]) == [(1, WcStatus.LOC_PROT_ERR)]
        assert a.qp.state is QPState.ERR


def test_dereg_waits_for_a_direct_copy_in_progress() -> None:
    dev = soft.open_device()
    try:
        pd = dev.alloc_pd()
        buf = Buf(4096)
        mr = pd.reg_mr(buf.addr, 4096, ALL)
        assert dev._table is not None
        peer = PeerTable(dev._table.path)  # what an initiator in another process opens
        try:
            peer.lock(mr.rkey)  # a peer between its check and the end of its copy
            assert peer.allows(mr.rkey, Access.REMOTE_WRITE, buf.addr, 4096, pd.pd_id)
            dereg = threading.Thread(target=mr.dereg)
            dereg.start()
            dereg.join(0.1)
            assert dereg.is_alive()  # dereg cannot return while the copy may run
            peer.unlock(mr.rkey)
            dereg.join(2)
            assert not dereg.is_alive()
            peer.lock(mr.rkey)
            assert not peer.allows(mr.rkey, Access.REMOTE_WRITE, buf.addr, 1, pd.pd_id)
            peer.unlock(mr.rkey)
        finally:
            peer.close()
    finally:
        dev.close()


def test_keys_are_distinct_nonzero_and_dereg_is_final() -> None:
    dev = soft.open_device()
    try:
        pd = dev.alloc_pd()
        buf = Buf(4096)
        mrs = [pd.reg_mr(buf.addr, 4096, ALL) for _ in range(200)]
        keys = [k for mr in mrs for k in (mr.lkey, mr.rkey)]
        assert len(set(keys)) == len(keys) and all(0 < k < 1 << 32 for k in keys)
        old = mrs[0].rkey
        mrs[0].dereg()
        mrs[0].dereg()  # idempotent
        assert all(pd.reg_mr(buf.addr, 1, 0).rkey != old for _ in range(50))
        with pytest.raises(VerbsError):
            pd.reg_mr(buf.addr, 16, Access.REMOTE_WRITE)  # needs LOCAL_WRITE, as ibv_reg_mr
    finally:
        dev.close()


# -- errors and flushing ---------------------------------------------------------------------

def test_to_error_flushes_and_srq_buffers_survive() -> None:
    devs = [soft.open_device(), soft.open_device()]
    try:
        x, y = Side.open(devs[0]), Side.open(devs[1])
        x2, y2 = x.new_qp(), y.new_qp()  # a second pair sharing x's SRQ
        connect(x.qp, y.qp)
        connect(x2, y2)
        buf = Buf(256, b"q")
        xmr = x.pd.reg_mr(buf.addr, 256, Access.LOCAL_WRITE)
        ymr = y.pd.reg_mr(buf.addr, 256, 0)
        # y's SRQ is empty: x's requests stay outstanding (RNR, retried forever).
        for i in range(3):
            x.qp.post_send(send_wr(i, buf, xmr, 8, signaled=i != 1))
        c = sides(x, y)
        c.run_for(0.02)
        assert c[x.scq] == []
        post_recv(x, buf, xmr, 77, length=64)
        x.qp.to_error()
        assert x.qp.state is QPState.ERR
        c.poll()
        assert statuses(c[x.scq]) == [(0, WcStatus.WR_FLUSH_ERR), (1, WcStatus.WR_FLUSH_ERR),
                                      (2, WcStatus.WR_FLUSH_ERR)]
        # Posting on a QP in ERR completes with a flush, as on hardware.
        x.qp.post_send(send_wr(9, buf, xmr, 8))
        c.poll()
        assert statuses(c[x.scq][3:]) == [(9, WcStatus.WR_FLUSH_ERR)]
        c.until(lambda: y.qp.state is QPState.ERR)  # the peer sees the link close
        assert c[x.rcq] == []  # SRQ buffers are not flushed by a QP error...
        y2.post_send(send_wr(5, buf, ymr, 3))  # ...and the other QPs carry on
        c.until(lambda: len(c[x.rcq]) == 1 and len(c[y.scq]) == 1)
        assert [(wc.wr_id, wc.status, wc.qp_num) for wc in c[x.rcq]] == [
            (77, WcStatus.SUCCESS, x2.qp_num)]
        assert x2.state is QPState.RTS
    finally:
        for dev in devs:
            dev.close()


def test_post_send_outside_rts_raises() -> None:
    dev = soft.open_device()
    try:
        side = Side.open(dev, max_send_wr=2)
        assert side.qp.state is QPState.INIT
        with pytest.raises(VerbsError):
            side.qp.post_send(send_wr(1, None, None, 0))
        side.qp.connect(side.qp.endpoint())
        side.qp.post_send(send_wr(1, None, None, 0))
        side.qp.post_send(send_wr(2, None, None, 0))
        with pytest.raises(VerbsError):  # max_send_wr outstanding (no receive buffer: RNR)
            side.qp.post_send(send_wr(3, None, None, 0))
        with pytest.raises(VerbsError):
            side.qp.connect(side.qp.endpoint())  # not in INIT any more
    finally:
        dev.close()


def test_malformed_frames_move_the_qp_to_error() -> None:
    with pair() as (a, b):
        dst = Buf(64)
        dmr = b.pd.reg_mr(dst.addr, 64, ALL)
        post_recv(b, dst, dmr, 1)
        assert a.qp._wsock is not None
        a.qp._wsock.send(b"\xee" * 24 + b"garbage")  # an unknown frame type
        c = sides(a, b)
        c.until(lambda: b.qp.state is QPState.ERR and a.qp.state is QPState.ERR)
        assert c[b.rcq] == [] and dst.read() == bytes(64) and dst.canaries_intact()


def test_a_forged_write_outside_every_region_is_refused() -> None:
    with pair(one_sided="served") as (a, b):
        dst = Buf(64, b"k")
        dmr = b.pd.reg_mr(dst.addr, 32, ALL)
        header = soft._HDR.pack(soft._F_WRITE, 0, 0, b.qp._expected, 40, dmr.rkey, dst.addr)
        assert a.qp._wsock is not None
        a.qp._wsock.send(header + b"X" * 40)  # 8 bytes too many for the region
        c = sides(a, b)
        c.until(lambda: b.qp.state is QPState.ERR)
        assert dst.read() == b"k" * 64 and dst.canaries_intact()


# -- the completion channel ------------------------------------------------------------------

def readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def test_completion_channel_fd_and_events() -> None:
    with pair() as (a, b):
        fd = b.channel.fileno()
        assert isinstance(fd, int) and fd >= 0
        assert not readable(fd, 0.02)
        assert b.channel.get_cq_event() is None
        with pytest.raises(VerbsError):
            b.rcq.ack_events(1)  # no event to acknowledge
        src = Buf(16, b"e")
        dst = Buf(16)
        smr = a.pd.reg_mr(src.addr, 16, 0)
        dmr = b.pd.reg_mr(dst.addr, 16, Access.LOCAL_WRITE)
        post_recv(b, dst, dmr, 1)
        b.rcq.req_notify()
        a.qp.post_send(send_wr(1, src, smr, 16))
        # The frame arrives: the fd is readable (device work), and get_cq_event does the work.
        assert readable(fd, 2.0)
        assert b.channel.get_cq_event() is b.rcq
        assert b.channel.get_cq_event() is None  # one event per arming
        b.rcq.ack_events(1)
        b.rcq.req_notify()
        wcs = b.rcq.poll(8)
        assert statuses(wcs) == [(1, WcStatus.SUCCESS)] and dst.read() == b"e" * 16
        assert not readable(fd, 0.02)  # all done, nothing pending: no spinning
        # The requester's side: the ACK makes its fd readable; the armed CQ raises its event.
        afd = a.channel.fileno()
        a.scq.req_notify()
        assert readable(afd, 2.0)
        assert a.channel.get_cq_event() is a.scq
        a.scq.ack_events(1)
        assert statuses(a.scq.poll(8)) == [(1, WcStatus.SUCCESS)]
        assert not readable(afd, 0.02)


def test_locally_generated_completions_make_the_fd_readable() -> None:
    with pair(one_sided="direct") as (a, b):
        fd = a.channel.fileno()
        local = Buf(64, b"d")
        remote = Buf(64)
        lmr = a.pd.reg_mr(local.addr, 64, Access.LOCAL_WRITE)
        rmr = b.pd.reg_mr(remote.addr, 64, ALL)
        a.scq.req_notify()
        a.qp.post_send(rdma_wr(1, Opcode.RDMA_WRITE, local, lmr, 64, remote.addr, rmr.rkey))
        assert remote.read() == b"d" * 64  # done inside post_send, without the target
        assert readable(fd, 0)  # through the eventfd
        assert a.channel.get_cq_event() is a.scq
        a.scq.ack_events(1)
        assert statuses(a.scq.poll(4)) == [(1, WcStatus.SUCCESS)]
        assert not readable(fd, 0.02)
        a.scq.req_notify()
        a.qp.to_error()
        a.qp.post_send(send_wr(2, None, None, 0))  # flushed
        assert readable(fd, 0)
        assert a.channel.get_cq_event() is a.scq
        a.scq.ack_events(1)
        assert statuses(a.scq.poll(4)) == [(2, WcStatus.WR_FLUSH_ERR)]


def test_an_event_raised_while_serving_another_channel_shows_on_its_own_fd() -> None:
    devs = [soft.open_device(), soft.open_device()]
    try:
        a = Side.open(devs[0])
        pd = devs[1].alloc_pd()
        recv_channel, send_channel = devs[1].create_comp_channel(), devs[1].create_comp_channel()
        rcq, scq = devs[1].create_cq(8, recv_channel), devs[1].create_cq(8, send_channel)
        srq = devs[1].create_srq(pd, 8)
        qp = devs[1].create_qp(pd, scq, rcq, srq, max_send_wr=8)
        connect(a.qp, qp)
        srq.post_recv(RecvWR(5, SGE(0, 0, 0)))
        rcq.req_notify()
        a.qp.post_send(send_wr(1, None, None, 0))
        assert readable(send_channel.fileno(), 2.0)  # device work shows on every channel
        assert send_channel.get_cq_event() is None  # it does the work: rcq gains its event
        assert readable(recv_channel.fileno(), 0)
        assert recv_channel.get_cq_event() is rcq
        rcq.ack_events(1)
        assert not readable(recv_channel.fileno(), 0)
        assert statuses(rcq.poll(4)) == [(5, WcStatus.SUCCESS)]
    finally:
        for dev in devs:
            dev.close()


def test_progress_loop_on_the_channel_never_misses_a_completion() -> None:
    """The transport's pattern: select -> get_cq_event -> req_notify -> poll until empty."""
    count = 300
    with pair() as (a, b):
        src = Buf(64, b"p")
        dst = Buf(64 * count)
        smr = a.pd.reg_mr(src.addr, 64, 0)
        dmr = b.pd.reg_mr(dst.addr, dst.size, Access.LOCAL_WRITE)
        for i in range(count):
            post_recv(b, dst, dmr, i, offset=64 * i, length=64)
        got: list[WorkCompletion] = []
        idle_wakeups = 0
        stop = threading.Event()

        def progress() -> None:  # b's progress thread
            nonlocal idle_wakeups
            fd = b.channel.fileno()
            b.rcq.req_notify()
            while not stop.is_set():
                if not readable(fd, 0.05):
                    continue
                moved = False
                while (cq := b.channel.get_cq_event()) is not None:
                    cq.ack_events(1)
                    cq.req_notify()
                while wcs := b.rcq.poll(16):
                    got.extend(wcs)
                    moved = True
                idle_wakeups += not moved

        thread = threading.Thread(target=progress)
        thread.start()
        try:
            ca = Collector(a.scq)
            for i in range(count):
                a.qp.post_send(send_wr(i, src, smr, 1 + i % 64))
                while i + 1 - len(ca[a.scq]) >= 32:  # stay within max_send_wr
                    ca.poll()
                if i % 50 == 0:
                    time.sleep(0.005)  # let the progress thread go idle now and then
            ca.until(lambda: len(ca[a.scq]) == count)  # all acknowledged: all placed
            deadline = time.monotonic() + 5
            while len(got) < count and time.monotonic() < deadline:
                time.sleep(0.001)
        finally:
            stop.set()
            thread.join()
        assert [wc.wr_id for wc in got] == list(range(count))
        # Wake-ups that found nothing are the rare ACK-only ones, never a spin.
        assert idle_wakeups < count
        assert not readable(b.channel.fileno(), 0.05)


# -- two processes ---------------------------------------------------------------------------

PEER_SIZE = 8 * MiB


def _peer_main(conn: Connection, link: str, one_sided: str) -> None:
    """The other process: a device serving its memory until told to stop."""
    dev = soft.open_device(link=link, one_sided=one_sided)
    side = Side.open(dev)
    buf = Buf(PEER_SIZE, b"peer-memory")
    mr = side.pd.reg_mr(buf.addr, buf.size, ALL)
    conn.send((tuple(side.qp.endpoint()), buf.addr, mr.rkey))
    endpoint, their_addr, their_rkey = conn.recv()
    side.qp.connect(Endpoint(*endpoint))
    conn.send("connected")
    fd = side.channel.fileno()
    while True:
        select.select([fd, conn.fileno()], [], [], 0.5)
        done = side.scq.poll(16)
        if done:
            conn.send(("completed", [(wc.wr_id, int(wc.status)) for wc in done]))
        if not conn.poll():
            continue
        command = conn.recv()
        if command == "stop":
            break
        if command == "pause":  # stop polling: nothing is served until the next command
            conn.send("paused")
            command = conn.recv()
        if command == "digest":
            conn.send((hashlib.sha256(buf.read()).hexdigest(), buf.canaries_intact()))
        elif command == "write-to-you":  # 4 MiB into the test's memory, as it writes here
            side.qp.post_send(rdma_wr(42, Opcode.RDMA_WRITE, buf, mr, 4 * MiB, their_addr,
                                      their_rkey, offset=4 * MiB))
    dev.close()


@contextlib.contextmanager
def peer_process(link: str, one_sided: str
                 ) -> Iterator[tuple[Side, Connection, Any, Buf, soft.SoftMR, int, int]]:
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(child_conn, link, one_sided), daemon=True)
    proc.start()
    dev = soft.open_device(link=link, one_sided=one_sided)
    try:
        side = Side.open(dev)
        mine = Buf(PEER_SIZE, b"test-memory")
        mr = side.pd.reg_mr(mine.addr, mine.size, ALL)
        assert conn.poll(30), "the peer process did not start"
        endpoint, addr, rkey = conn.recv()
        conn.send((tuple(side.qp.endpoint()), mine.addr, mr.rkey))
        side.qp.connect(Endpoint(*endpoint))
        assert conn.recv() == "connected"
        yield side, conn, proc, mine, mr, addr, rkey
    finally:
        dev.close()
        if proc.is_alive():
            with contextlib.suppress(OSError):
                conn.send("stop")
            proc.join(5)
            proc.kill()
        proc.join()


def _expected_peer_memory() -> bytes:
    return Buf(PEER_SIZE, b"peer-memory").read()


@pytest.mark.parametrize("one_sided", ["direct", "served"])
def test_two_processes_4mib_write_and_read(one_sided: str) -> None:
    with peer_process("unix", one_sided) as (side, conn, _, mine, mr, addr, rkey):
        if one_sided == "direct":  # the target's CPU takes no part
            conn.send("pause")
            assert conn.recv() == "paused"
        else:  # both sides send 4 MiB frames at once: must not deadlock
            conn.send("write-to-you")
        size = 4 * MiB
        side.qp.post_send(rdma_wr(1, Opcode.RDMA_WRITE, mine, mr, size, addr, rkey))
        side.qp.post_send(rdma_wr(2, Opcode.RDMA_READ, mine, mr, size, addr + size, rkey,
                                  offset=size))
        c = Collector(side.scq)
        c.until(lambda: len(c[side.scq]) == 2, timeout=20)
        assert statuses(c[side.scq]) == [(1, WcStatus.SUCCESS), (2, WcStatus.SUCCESS)]
        expected = bytearray(_expected_peer_memory())
        test_memory = Buf(PEER_SIZE, b"test-memory").read()
        assert mine.read(size, size) == bytes(expected[size:])  # READ brought the peer's data
        expected[:size] = test_memory[:size]  # WRITE put the test's data there
        if one_sided == "served":
            assert conn.recv() == ("completed", [(42, int(WcStatus.SUCCESS))])
            assert mine.read(0, size) == bytes(expected[size:])  # the peer's WRITE arrived
        conn.send("digest")
        assert conn.recv() == (hashlib.sha256(bytes(expected)).hexdigest(), True)
        assert mine.canaries_intact()
        stats = side.dev.stats()
        assert (stats["direct_ops"] == 2) == (one_sided == "direct")
        if one_sided == "served":
            assert stats["bytes_sent"] > size and stats["bytes_received"] > 2 * size


def test_tcp_link_two_processes_auto() -> None:
    with peer_process("tcp", "auto") as (side, _, _, mine, mr, addr, rkey):
        assert side.qp.endpoint().address.startswith("tcp:127.0.0.1:")
        side.qp.post_send(rdma_wr(1, Opcode.RDMA_READ, mine, mr, 4096, addr, rkey))
        c = Collector(side.scq)
        c.until(lambda: len(c[side.scq]) == 1)
        assert statuses(c[side.scq]) == [(1, WcStatus.SUCCESS)]
        assert mine.read(0, 4096) == _expected_peer_memory()[:4096]
        assert side.dev.stats()["direct_ops"] == 1  # same host, process_vm works: direct


def test_killed_peer_moves_the_qp_to_error() -> None:
    with peer_process("unix", "served") as (side, conn, proc, mine, mr, addr, rkey):
        conn.send("pause")
        assert conn.recv() == "paused"
        # Outstanding: a READ the paused peer does not serve, SENDs it does not acknowledge.
        side.qp.post_send(rdma_wr(1, Opcode.RDMA_READ, mine, mr, 4096, addr, rkey))
        side.qp.post_send(send_wr(2, mine, mr, 8))
        side.qp.post_send(send_wr(3, mine, mr, 8, signaled=False))
        c = Collector(side.scq)
        c.run_for(0.05)
        assert c[side.scq] == []
        proc.kill()
        start = time.monotonic()
        fd = side.channel.fileno()
        assert readable(fd, 5.0)  # the closed socket wakes a waiting progress loop
        c.until(lambda: len(c[side.scq]) == 3, timeout=5.0)
        assert time.monotonic() - start < 5.0
        assert statuses(c[side.scq]) == [(1, WcStatus.RETRY_EXC_ERR), (2, WcStatus.WR_FLUSH_ERR),
                                         (3, WcStatus.WR_FLUSH_ERR)]
        assert side.qp.state is QPState.ERR


# -- resources -------------------------------------------------------------------------------

def test_close_releases_every_descriptor() -> None:
    before = len(os.listdir("/proc/self/fd"))
    for link, one_sided in (("unix", "direct"), ("tcp", "served")):
        with pair(link, one_sided=one_sided) as (a, b):
            extra = a.new_qp()
            extra.connect(extra.endpoint())
            local = Buf(4096, b"f")
            lmr = a.pd.reg_mr(local.addr, 4096, ALL)
            rmr = b.pd.reg_mr(local.addr, 4096, ALL)
            a.qp.post_send(rdma_wr(1, Opcode.RDMA_WRITE, local, lmr, 64, local.addr, rmr.rkey))
            c = sides(a, b)
            c.until(lambda: len(c[a.scq]) == 1)  # noqa: B023  # used at once
        with pytest.raises(VerbsError):
            a.scq.poll(1)
    assert len(os.listdir("/proc/self/fd")) == before
