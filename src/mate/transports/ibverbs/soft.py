"""A software RC device in user space: the verbs of `verbs.py` without RDMA hardware.

Theory of operation
===================

What it models
--------------
One `SoftDevice` is one opened HCA context (`open_device`). It keeps what an
HCA keeps -- protection domains, memory regions with their keys, completion
queues and channels, shared receive queues, reliable-connected queue pairs --
and carries each connected QP pair over one stream socket: "unix" or "tcp"
(the `link`) between devices, a socketpair when both QPs are on this device
(a QP connected to itself writes to one end and reads the other). RC
semantics are kept: requests execute at the responder in posting order and
are acknowledged; a SEND takes the oldest posted SRQ buffer; an empty SRQ
makes the responder answer receiver-not-ready and the requester retry after
`rnr_timer` (`rnr_retry` times, 7 = forever); remote accesses are checked
against the *target's* MR table; an error completion moves the QP to ERR and
flushes its outstanding requests. A signalled SEND completes only when the
responder has placed it (its ACK came back).

Who does the work: there is no device thread
--------------------------------------------
The device's work -- reading frames from the QP sockets, placing SENDs,
answering RNR, serving one-sided requests, processing answers, generating
work completions, RNR retries, writing queued output, noticing lost links --
is the "service" step, done without blocking by whichever thread calls
`CompletionQueue.poll` or `CompletionChannel.get_cq_event` when it has
nothing queued to return (so a caller draining events or completions pays
for one service step, not one per call); `post_send`
transmits (or performs direct RDMA) at once when it can. Everything runs
under one device lock, so the loop thread and a progress thread may call
anything concurrently. A process that does not poll does not serve: SENDs
and served RDMA aimed at it wait (as for a stalled HCA), direct RDMA on it
still completes. `QueuePair.connect` of a pair of devices may block until the
peer's `connect` of that pair runs: call a rank's connects concurrently.

The completion channel's descriptor
-----------------------------------
`CompletionChannel.fileno()` is an epoll descriptor watching (1) the device's
epoll set -- every QP socket (EPOLLIN; EPOLLOUT while output is queued) and a
timerfd armed for the next RNR retry -- and (2) the channel's eventfd, which
shows whether the channel holds events: a CQ armed with `req_notify` that
gained a completion, whatever produced it (a frame, a direct RDMA or a flush
inside `post_send`, `to_error`). The eventfd is written when the locked call
that raised the event returns, unless `get_cq_event` handed the event over
in that same call. So the descriptor is readable exactly when the device has
work to do or the channel has an event. All is level-triggered and a
service step drains what it serves (sockets until EAGAIN or a short read,
the timerfd; the eventfd once the last event is taken), so a caller looping
"select -> get_cq_event -> req_notify -> poll until empty" neither misses a
completion nor spins. As in libibverbs, arming a CQ raises an event only for
completions added after it, once.

Frames
------
A frame is a 24-byte header (`_HDR`, little endian: type u8, status u8, pad
u16, seq u32, length u32, rkey u32, remote address u64) followed, for SEND,
WRITE and READ_RESP, by `length` bytes of payload. Requests (SEND, WRITE,
READ) are numbered from the requester's PSN; the responder executes them in
order and answers with a cumulative ACK (once per batch of frames it read),
NAK(seq, status), RNR(seq) or READ_RESP(seq, data); an answer also
acknowledges every earlier request. After RNR(seq) the responder drops
requests until seq comes again; the requester, when its RNR timer expires,
sends every unacknowledged request again, in order (later requests wait
behind). Sockets are non-blocking: what the kernel does not take waits in a
per-QP output queue written when the socket is writable, so two sides
sending large frames at once never deadlock. Payloads land in a per-QP
receive buffer and are copied into place (large remainders are received
straight into place); each copy is preceded by the check of the region,
which is also re-checked per chunk against a concurrent `dereg`. A frame
that breaks these rules moves its QP to ERR; nothing is ever written outside
a checked memory region.

A QP entering ERR flushes its requests, sends what its output queue holds (a
final NAK), shuts its socket down for writing and discards input until the
peer closes: the peer reads EOF and its QP goes to ERR too, its request in
flight completing with RETRY_EXC_ERR and the rest with WR_FLUSH_ERR. A peer
process that dies closes its sockets, with the same effect.

One-sided operations: direct and served
---------------------------------------
"served": RDMA WRITE/READ travel as frames; the target's device checks rkey,
access and bounds against its MR table and copies, when it is serviced.
"direct": the initiator does it alone, without the target's CPU, with
`process_vm_writev`/`process_vm_readv` (or memmove within one process). The
target publishes its remotely accessible regions in a shared-memory table
(`soft_table`, a memfd that peers open as /proc/<pid>/fd/<n>); the initiator
holds a shared OFD byte-range lock on the region's entry across check and
copy, `dereg` takes the exclusive lock before zeroing the entry, so once
`dereg` returns no peer touches the memory. "auto" is direct when the
handshake shows the peer in the same kernel and PID namespace and a probe
read of its memory through process_vm_readv returns the right bytes, else
served. A direct operation runs inside `post_send` when nothing is ahead of
it on the QP, else once every earlier request is acknowledged (keeping RC
order); its completion comes through the eventfd.

Differences from a real HCA
---------------------------
* Progress needs polling (above). There is no transport timeout: a silent
  peer is noticed only when its socket closes (process exit included).
* A QP in ERR closes its link, so the peer QP goes to ERR at once, where an
  HCA's would notice only when its next request timed out.
* CQs grow instead of overflowing; `depth` is only checked to be positive.
* Keys are a 16-bit slot plus 16 random bits: a stale key hits a reused
  slot with probability 1/65535. Zero-length RDMA checks no key (as in IB).
* The MR table lives in this process's memory, readable by same-uid peers;
  direct access trusts that a dead peer's pid is not reused before its
  closed socket is noticed.
* `dereg` of a region under a direct copy waits for the copy, holding the
  device lock meanwhile.
* SEND and WRITE payloads are copied when sent and READ responses when
  served (never read from memory after `dereg`); messages are at most
  `MAX_MSG` bytes (2**31 - 1).
* Flushed or failed requests may or may not have executed at the peer.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import itertools
import math
import os
import random
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Final, Protocol

from librt.threading import Lock

from mate import buffers
from mate.transports.ibverbs import soft_link
from mate.transports.ibverbs.soft_link import Hello, close_quietly
from mate.transports.ibverbs.soft_sys import PeerMemory, Timer, host_identity
from mate.transports.ibverbs.soft_table import SLOT_BITS, SLOTS, MrTable, PeerTable
from mate.transports.ibverbs.verbs import (
    SGE,
    Access,
    CompletionChannel,
    CompletionQueue,
    Device,
    Endpoint,
    MemoryRegion,
    Opcode,
    ProtectionDomain,
    QPState,
    QueuePair,
    RecvWR,
    SendWR,
    SharedReceiveQueue,
    VerbsError,
    WcOpcode,
    WcStatus,
    WorkCompletion,
)

__all__ = ["SoftCQ", "SoftChannel", "SoftDevice", "SoftMR", "SoftPD", "SoftQP", "SoftSRQ",
           "open_device"]

# -- the wire ------------------------------------------------------------------------------

_HDR: Final = struct.Struct("<BBHIIIQ")  # type, status, pad, seq, length, rkey, remote addr
_HDR_SIZE: Final = _HDR.size
# Final: compiled code reads each as a constant, not from the module's dictionary.
_F_SEND: Final = 1  # requests
_F_WRITE: Final = 2
_F_READ: Final = 3
_F_ACK: Final = 16  # responses
_F_NAK: Final = 17
_F_RNR: Final = 18
_F_READ_RESP: Final = 19
_NAK_STATUSES: Final = frozenset({WcStatus.REM_ACCESS_ERR, WcStatus.REM_INV_REQ_ERR,
                                  WcStatus.REM_OP_ERR})

MAX_MSG: Final = (1 << 31) - 1  # the largest message (IB's is 2 GiB; ctypes.string_at's c_int)
_SEQ_MASK: Final = 0xFFFFFFFF
_RBUF: Final = 256 * 1024  # a QP's receive buffer
_DIRECT_RECV: Final = 64 * 1024  # payload remainders this large are received straight into place
_READ_BUDGET: Final = 8 << 20  # bytes read from one socket per service step (fairness)
_OUT_HIGH: Final = 4 << 20  # no new requests go out while this much output is queued
_MAX_RD_ATOMIC: Final = 16  # READs outstanding per QP (bounds the responder's queued data)
_IOV_MAX: Final = 64
_CREDS: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid
_INFINITE_RNR: Final = 7
CONNECT_TIMEOUT: Final = 60.0

# Receive kinds: what the payload of the frame being received is for.
_K_DROP: Final = 0
_K_SEND: Final = 1
_K_WRITE: Final = 2
_K_READ_RESP: Final = 3

_SUCCESS: Final = WcStatus.SUCCESS
_FLUSH: Final = WcStatus.WR_FLUSH_ERR
_RTS: Final = QPState.RTS
_ERR: Final = QPState.ERR
_SEND_OP: Final = Opcode.SEND
_RDMA_READ: Final = Opcode.RDMA_READ
_RDMA_WRITE: Final = Opcode.RDMA_WRITE
_WC_OPCODE: Final = {Opcode.SEND: WcOpcode.SEND, Opcode.RDMA_WRITE: WcOpcode.RDMA_WRITE,
                     Opcode.RDMA_READ: WcOpcode.RDMA_READ}
_FRAME_OF: Final = {Opcode.SEND: _F_SEND, Opcode.RDMA_WRITE: _F_WRITE,
                    Opcode.RDMA_READ: _F_READ}
_OPCODE_OF: Final = {op: op for op in _FRAME_OF}  # also maps the plain ints to members
_IN_EVENTS: Final = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_EPOLLOUT: Final = select.EPOLLOUT
_NOSIGNAL: Final = socket.MSG_NOSIGNAL
# Access flags as plain ints: IntFlag arithmetic is slow on the hot path.
_LOCAL_WRITE: Final = int(Access.LOCAL_WRITE)
_REMOTE_WRITE: Final = int(Access.REMOTE_WRITE)
_REMOTE_READ: Final = int(Access.REMOTE_READ)
_ALL_ACCESS: Final = _LOCAL_WRITE | _REMOTE_WRITE | _REMOTE_READ
_RECV: Final = WcOpcode.RECV
_new_tuple: Final = tuple.__new__  # WorkCompletion without its Python-level __new__
_memmove: Final = buffers.memmove
_string_at: Final = buffers.string_at
_monotonic: Final = time.monotonic
# Imported classes read per message: Final, they are not looked up per use.
_WORK_COMPLETION: Final = WorkCompletion
_SGE: Final = SGE


def _seq_diff(a: int, b: int) -> int:
    """a - b on the 32-bit sequence circle."""
    return ((a - b + 0x80000000) & _SEQ_MASK) - 0x80000000


def _covers(mr: SoftMR | None, pd: SoftPD, addr: int, length: int, need: int) -> bool:
    """Whether `mr` is a live region of `pd` granting `need` on [addr, addr+length)."""
    return (mr is not None and mr.valid and mr.pd is pd and mr.bits & need == need
            and mr.addr <= addr and addr + length <= mr.addr + mr.length)


# -- memory ----------------------------------------------------------------------------------

class SoftPD(ProtectionDomain):
    def __init__(self, device: SoftDevice, pd_id: int) -> None:
        self.device = device
        self.pd_id = pd_id

    def reg_mr(self, addr: int, length: int, access: Access) -> SoftMR:
        return self.device._reg_mr(self, addr, length, access)


class SoftMR(MemoryRegion):
    __slots__ = ("bits", "pd", "valid")

    def __init__(self, pd: SoftPD, addr: int, length: int, access: Access, lkey: int,
                 rkey: int) -> None:
        self.pd = pd
        self.addr = addr
        self.length = length
        self.access = access
        self.bits = int(access)
        self.lkey = lkey
        self.rkey = rkey
        self.valid = True

    def dereg(self) -> None:
        self.pd.device._dereg_mr(self)


# -- completions -----------------------------------------------------------------------------

class SoftChannel(CompletionChannel):
    def __init__(self, device: SoftDevice) -> None:
        self._device = device
        self._events: collections.deque[SoftCQ] = collections.deque()
        self._signalled = False
        self._epoll = select.epoll()
        try:
            self._evfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError:
            self._epoll.close()
            raise
        self._epoll.register(device._epoll.fileno(), select.EPOLLIN)
        self._epoll.register(self._evfd, select.EPOLLIN)

    def fileno(self) -> int:
        return self._epoll.fileno()

    def get_cq_event(self) -> SoftCQ | None:
        device = self._device
        with device._lock:
            events = self._events
            if not events:  # else the device's work can wait for the next call
                device._service()
            cq = None
            if events:
                cq = events.popleft()
                cq._unacked_events += 1
                if not events and self._signalled:
                    self._signalled = False
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._evfd)
            if device._raised:
                device._signal()
            return cq

    def _raise(self, cq: SoftCQ) -> None:
        # The eventfd is written when the locked call ends (`SoftDevice._signal`): an event
        # that get_cq_event returns in the same call never costs the two system calls.
        self._events.append(cq)
        self._device._raised = True

    def _close(self) -> None:
        self._epoll.close()
        os.close(self._evfd)


class SoftCQ(CompletionQueue):
    def __init__(self, device: SoftDevice, depth: int, channel: SoftChannel | None) -> None:
        self._device = device
        self.depth = depth
        self._channel = channel
        self._wcs: collections.deque[WorkCompletion] = collections.deque()
        self._armed = False
        self._unacked_events = 0

    def poll(self, max_entries: int) -> list[WorkCompletion]:
        device = self._device
        with device._lock:
            wcs = self._wcs
            if not wcs:  # else the device's work can wait for the next call
                device._service()
            if device._raised:
                device._signal()
            if len(wcs) <= max_entries:
                taken = list(wcs)
                wcs.clear()
                return taken
            popleft = wcs.popleft
            return [popleft() for _ in range(max_entries)]

    def req_notify(self) -> None:
        with self._device._lock:
            if self._channel is None:
                raise VerbsError("req_notify on a CQ without a completion channel")
            self._armed = True

    def ack_events(self, count: int) -> None:
        with self._device._lock:
            if not 0 <= count <= self._unacked_events:
                raise VerbsError(f"ack_events({count}) with {self._unacked_events} unacknowledged")
            self._unacked_events -= count

    def _push(self, wc: WorkCompletion) -> None:
        self._wcs.append(wc)
        if self._armed:
            self._armed = False
            assert self._channel is not None  # armed only with a channel
            self._channel._raise(self)


# -- receive queue ---------------------------------------------------------------------------

class SoftSRQ(SharedReceiveQueue):
    def __init__(self, device: SoftDevice, pd: SoftPD, max_wr: int) -> None:
        self._device = device
        self.pd = pd
        self.max_wr = max_wr
        self._wqes: collections.deque[RecvWR] = collections.deque()

    def post_recv(self, wr: RecvWR) -> None:
        if not isinstance(wr.sge, _SGE) or wr.sge.length < 0:
            raise VerbsError(f"bad receive work request {wr!r}")
        with self._device._lock:
            self._device._check_open()
            if len(self._wqes) >= self.max_wr:
                raise VerbsError(f"shared receive queue full ({self.max_wr} work requests)")
            self._wqes.append(wr)


# -- one-sided access performed by the initiator ---------------------------------------------

class _Direct(Protocol):
    def run(self, write: bool, local: int, remote: int, length: int, rkey: int) -> WcStatus: ...


class _SameDeviceDirect:
    """Both QPs on this device: its own MR table, under the device lock that `dereg` takes."""

    def __init__(self, device: SoftDevice, target_pd: SoftPD) -> None:
        self._rkeys = device._rkeys
        self._pd = target_pd

    def run(self, write: bool, local: int, remote: int, length: int, rkey: int) -> WcStatus:
        if not length:
            return _SUCCESS
        need = _REMOTE_WRITE if write else _REMOTE_READ
        if not _covers(self._rkeys.get(rkey), self._pd, remote, length, need):
            return WcStatus.REM_ACCESS_ERR
        if write:
            _memmove(remote, local, length)
        else:
            _memmove(local, remote, length)
        return _SUCCESS


class _PeerDirect:
    """Another device on this host: its shared MR table, then process_vm (or memmove)."""

    def __init__(self, table: PeerTable, memory: PeerMemory | None, target_pd: int) -> None:
        self._table = table
        self._memory = memory  # None: the peer device is in this process
        self._pd = target_pd

    def run(self, write: bool, local: int, remote: int, length: int, rkey: int) -> WcStatus:
        if not length:
            return _SUCCESS
        need = _REMOTE_WRITE if write else _REMOTE_READ
        table = self._table
        try:
            table.lock(rkey)
        except OSError:  # the file the peer named is no MR table: it grants no key
            return WcStatus.REM_ACCESS_ERR
        try:
            if not table.allows(rkey, need, remote, length, self._pd):
                return WcStatus.REM_ACCESS_ERR
            if self._memory is None:
                if write:
                    _memmove(remote, local, length)
                else:
                    _memmove(local, remote, length)
                return _SUCCESS
            err = self._memory.copy(write, local, remote, length)
        except OSError:  # (its entries cannot be read: the same)
            return WcStatus.REM_ACCESS_ERR
        finally:
            table.unlock(rkey)
        if not err:
            return _SUCCESS
        # ESRCH: the peer process is gone, as a lost link; else its memory failed the copy.
        return WcStatus.RETRY_EXC_ERR if err == errno.ESRCH else WcStatus.REM_ACCESS_ERR


# -- queue pairs -----------------------------------------------------------------------------

class _Req:
    """A send work request between `post_send` and its completion."""

    __slots__ = ("barrier", "error", "length", "mr", "op", "rnr", "seq", "wc_op", "wr")

    def __init__(self, wr: SendWR, op: Opcode, mr: SoftMR | None, length: int,
                 error: WcStatus | None, direct: bool) -> None:
        self.wr = wr
        self.op = op
        self.wc_op = _WC_OPCODE[op]
        self.mr = mr
        self.length = length
        self.error = error
        # Run locally once every earlier request is acknowledged: direct RDMA, local errors.
        self.barrier = direct or error is not None
        self.seq = -1  # assigned at the first transmission, kept by retransmissions
        self.rnr = 0


class SoftQP(QueuePair):
    def __init__(self, device: SoftDevice, pd: SoftPD, send_cq: SoftCQ, recv_cq: SoftCQ,
                 srq: SoftSRQ, max_send_wr: int, qp_num: int, psn: int) -> None:
        self._dev = device
        self.qp_num = qp_num
        self.psn = psn
        self._pd = pd
        self._send_cq = send_cq
        self._recv_cq = recv_cq
        self._srq_wqes = srq._wqes
        self._srq_pd = srq.pd  # receive buffers belong to the SRQ's protection domain
        self._max_send_wr = max_send_wr
        self._state = QPState.INIT
        # requester
        self._waiting: collections.deque[_Req] = collections.deque()  # not yet transmitted
        self._unacked: collections.deque[_Req] = collections.deque()  # transmitted, in order
        self._next_seq = psn
        self._reads_out = 0
        self._rnr_deadline = 0.0  # nonzero: waiting for the RNR timer, nothing is sent
        # responder
        self._expected = 0
        self._rnr_drop = False  # after RNR(expected): drop requests until it comes again
        self._ack_due = False
        self._ack_seq = 0
        # link
        self._direct: _Direct | None = None
        self._rsock: socket.socket | None = None
        self._wsock: socket.socket | None = None  # differs from _rsock only when self-connected
        self._rfd = -1
        self._wfd = -1
        self._out: collections.deque[bytes | memoryview] = collections.deque()
        self._out_bytes = 0
        # receiving: _rbuf[_rstart:_rend] is unparsed; a payload goes to _rx_dst (0: dropped)
        self._rbuf = (ctypes.c_char * 0)()
        self._rmv = memoryview(self._rbuf).cast("B")
        self._raddr = 0
        self._rstart = 0
        self._rend = 0
        self._rx_need = 0
        self._rx_dst = 0
        self._rx_guard: SoftMR | None = None
        self._rx_bad = False  # the guard region was deregistered during the payload
        self._rx_kind = _K_DROP
        self._rx_seq = 0
        self._rx_wr_id = 0
        self._rx_len = 0

    # -- verbs -------------------------------------------------------------------------------

    @property
    def state(self) -> QPState:
        return self._state

    def endpoint(self) -> Endpoint:
        return Endpoint(self.qp_num, self.psn, address=self._dev.address)

    def connect(self, remote: Endpoint) -> None:
        self._dev._connect(self, remote)

    def post_send(self, wr: SendWR) -> None:
        op = _OPCODE_OF.get(wr.opcode)
        if op is None:
            raise VerbsError(f"unsupported opcode {wr.opcode!r}")
        sge = wr.sge
        if sge is not None and sge.length < 0:
            raise VerbsError(f"negative SGE length in {wr!r}")
        dev = self._dev
        with dev._lock:
            dev._check_open()
            state = self._state
            if state is not _RTS:
                if state is _ERR:  # as on hardware: accepted, then flushed
                    self._send_cq._push(WorkCompletion(wr.wr_id, _FLUSH, _WC_OPCODE[op], 0,
                                                       self.qp_num))
                    if dev._raised:
                        dev._signal()
                    return
                raise VerbsError(f"post_send on a QP in {state.name}")
            if len(self._waiting) + len(self._unacked) >= self._max_send_wr:
                raise VerbsError(f"send queue full ({self._max_send_wr} work requests)")
            mr = None
            error = None
            length = 0
            if sge is not None and sge.length:
                length = sge.length
                mr = dev._lkeys.get(sge.lkey)
                need = _LOCAL_WRITE if op is _RDMA_READ else 0
                if length > MAX_MSG:
                    error = WcStatus.LOC_LEN_ERR
                elif not _covers(mr, self._pd, sge.addr, length, need):
                    error = WcStatus.LOC_PROT_ERR
            direct = op is not _SEND_OP and self._direct is not None
            self._waiting.append(_Req(wr, op, mr, length, error, direct))
            self._pump()
            if dev._raised:
                dev._signal()

    def to_error(self) -> None:
        dev = self._dev
        with dev._lock:
            self._enter_error(None)
            if dev._raised:
                dev._signal()

    # -- requester ---------------------------------------------------------------------------

    def _pump(self) -> None:
        """Transmit (or, for barriers, run) waiting requests as far as the QP allows."""
        waiting = self._waiting
        if not waiting or self._state is not _RTS or self._rnr_deadline:
            return
        unacked = self._unacked
        while waiting:
            req = waiting[0]
            if req.barrier:
                if unacked:
                    return
                waiting.popleft()
                self._run_barrier(req)
                if self._state is not _RTS:
                    return
                continue
            if self._out_bytes > _OUT_HIGH:
                return  # resumed by _on_writable
            op = req.op
            if op is _RDMA_READ:
                if self._reads_out >= _MAX_RD_ATOMIC:
                    return  # resumed by a READ response
                self._reads_out += 1
            elif req.mr is not None and not req.mr.valid:  # deregistered since the post
                req.error = WcStatus.LOC_PROT_ERR
                req.barrier = True
                continue
            waiting.popleft()
            if req.seq < 0:
                req.seq = self._next_seq
                self._next_seq = (self._next_seq + 1) & _SEQ_MASK
            unacked.append(req)  # first: a failing send flushes it with the others
            wr = req.wr
            length = req.length
            sge = wr.sge
            payload = (_string_at(sge.addr, length)
                       if length and op is not _RDMA_READ and sge is not None else b"")
            self._send(_FRAME_OF[op], 0, req.seq, length, wr.rkey, wr.remote_addr, payload)
            if self._state is not _RTS:
                return

    def _run_barrier(self, req: _Req) -> None:
        status = req.error
        if status is None:
            assert self._direct is not None  # barriers without an error are direct RDMA
            wr = req.wr
            mr = req.mr
            if mr is not None and not mr.valid:
                status = WcStatus.LOC_PROT_ERR
            else:
                self._dev.direct_ops += 1
                status = self._direct.run(req.op is _RDMA_WRITE, wr.sge.addr if wr.sge else 0,
                                          wr.remote_addr, req.length, wr.rkey)
        self._finish(req, status)
        if status is not _SUCCESS:
            self._enter_error(None)
            if status is WcStatus.RETRY_EXC_ERR:  # the peer process is gone
                self._close_link()

    def _finish(self, req: _Req, status: WcStatus) -> None:
        if status is _SUCCESS and not req.wr.signaled:
            return
        self._send_cq._push(_new_tuple(_WORK_COMPLETION, (req.wr.wr_id, status, req.wc_op,
                                                           req.length, self.qp_num)))

    def _retire(self, seq: int, inclusive: bool) -> bool:
        """Complete what an answer to `seq` acknowledges; False (QP in ERR) if it is bogus."""
        if _seq_diff(seq, self._next_seq) >= 0:
            self._malformed()  # an answer to a request never sent
            return False
        unacked = self._unacked
        last = seq if inclusive else (seq - 1) & _SEQ_MASK
        while unacked:
            req = unacked[0]
            if (last - req.seq) & _SEQ_MASK >= 0x80000000:  # req.seq is after `last`
                break
            if req.op is _RDMA_READ:  # only its READ_RESP may complete it
                self._malformed()
                return False
            unacked.popleft()
            self._finish(req, _SUCCESS)
        return True

    def _head(self, seq: int) -> _Req | None:
        """The oldest unacknowledged request, which an answer to `seq` must be about."""
        if not self._retire(seq, False):
            return None
        if not self._unacked or self._unacked[0].seq != seq:
            self._malformed()
            return None
        return self._unacked[0]

    def _on_nak(self, seq: int, status: int) -> None:
        req = self._head(seq)
        if req is None:
            return
        if status not in _NAK_STATUSES:
            self._malformed()
            return
        self._unacked.popleft()
        self._finish(req, WcStatus(status))
        self._enter_error(None)

    def _on_rnr(self, seq: int) -> None:
        req = self._head(seq)
        if req is None:
            return
        dev = self._dev
        req.rnr += 1
        if dev._rnr_retry != _INFINITE_RNR and req.rnr > dev._rnr_retry:
            self._unacked.popleft()
            self._finish(req, WcStatus.RNR_RETRY_EXC_ERR)
            self._enter_error(None)
            return
        dev.rnr_retries += 1
        # Rewind: the responder drops everything after seq, so all of it goes again, in order.
        self._waiting.extendleft(reversed(self._unacked))
        self._unacked.clear()
        self._reads_out = 0
        dev._start_rnr_timer(self)

    def _begin_read_resp(self, seq: int, length: int) -> None:
        req = self._head(seq)
        if req is None:
            return
        if req.op is not _RDMA_READ or length != req.length:
            self._malformed()
            return
        sge = req.wr.sge
        self._expect(length, sge.addr if sge is not None else 0, req.mr, _K_READ_RESP)

    def _end_read_resp(self) -> None:
        req = self._unacked.popleft()
        self._reads_out -= 1
        if self._rx_bad:
            self._finish(req, WcStatus.LOC_PROT_ERR)
            self._enter_error(None)
        else:
            self._finish(req, _SUCCESS)

    # -- responder ---------------------------------------------------------------------------

    def _take_seq(self, seq: int) -> bool:
        """Whether to execute request `seq` (False: drop it; the QP may have gone to ERR)."""
        if seq == self._expected:
            self._rnr_drop = False
            return True
        if not self._rnr_drop:
            self._malformed()
        return False

    def _respond(self, kind: int, status: int, seq: int, payload: bytes = b"") -> None:
        self._ack_due = False  # any answer acknowledges every earlier request
        self._send(kind, status, seq, len(payload), 0, 0, payload)

    def _fatal(self, seq: int, status: WcStatus) -> None:
        """A responder error: NAK the request (it goes out before the FIN), then ERR."""
        self._respond(_F_NAK, status, seq)
        self._enter_error(None)

    def _begin_send(self, seq: int, length: int) -> None:
        wqes = self._srq_wqes
        if not wqes:
            self._respond(_F_RNR, 0, seq)
            self._rnr_drop = True
            self._expect(length, 0, None, _K_DROP)
            return
        wqe = wqes.popleft()
        sge = wqe.sge
        recv_cq = self._recv_cq
        if length > sge.length:
            recv_cq._push(WorkCompletion(wqe.wr_id, WcStatus.LOC_LEN_ERR, WcOpcode.RECV, 0,
                                         self.qp_num))
            self._fatal(seq, WcStatus.REM_INV_REQ_ERR)
            return
        mr = None
        if length:
            mr = self._dev._lkeys.get(sge.lkey)
            if not _covers(mr, self._srq_pd, sge.addr, sge.length, _LOCAL_WRITE):
                recv_cq._push(WorkCompletion(wqe.wr_id, WcStatus.LOC_PROT_ERR, WcOpcode.RECV, 0,
                                             self.qp_num))
                self._fatal(seq, WcStatus.REM_OP_ERR)
                return
        self._rx_seq = seq
        self._rx_wr_id = wqe.wr_id
        self._rx_len = length
        self._expect(length, sge.addr, mr, _K_SEND)

    def _begin_write(self, seq: int, length: int, rkey: int, addr: int) -> None:
        mr = None
        if length:
            mr = self._dev._rkeys.get(rkey)
            if not _covers(mr, self._pd, addr, length, _REMOTE_WRITE):
                self._fatal(seq, WcStatus.REM_ACCESS_ERR)
                return
        self._rx_seq = seq
        self._expect(length, addr, mr, _K_WRITE)

    def _serve_read(self, seq: int, length: int, rkey: int, addr: int) -> None:
        payload = b""
        if length:
            if not _covers(self._dev._rkeys.get(rkey), self._pd, addr, length, _REMOTE_READ):
                self._fatal(seq, WcStatus.REM_ACCESS_ERR)
                return
            payload = _string_at(addr, length)
        self._expected = (seq + 1) & _SEQ_MASK
        self._respond(_F_READ_RESP, 0, seq, payload)

    def _executed(self, seq: int) -> None:
        self._expected = (seq + 1) & _SEQ_MASK
        self._ack_due = True
        self._ack_seq = seq

    # -- frames in ---------------------------------------------------------------------------

    def _expect(self, length: int, dst: int, guard: SoftMR | None, kind: int) -> None:
        """The current frame's payload: `length` bytes for `dst` (0: dropped)."""
        self._rx_kind = kind
        self._rx_dst = dst
        self._rx_guard = guard
        self._rx_bad = False
        if length:
            self._rx_need = length
        else:
            self._frame_done()

    def _frame_begin(self, kind: int, status: int, seq: int, length: int, rkey: int,
                     addr: int) -> None:
        if kind in (_F_SEND, _F_WRITE):
            if length > MAX_MSG:
                self._malformed()
            elif not self._take_seq(seq):
                if self._state is not _ERR:
                    self._expect(length, 0, None, _K_DROP)
            elif kind == _F_SEND:
                self._begin_send(seq, length)
            else:
                self._begin_write(seq, length, rkey, addr)
        elif kind == _F_READ:
            if length > MAX_MSG:
                self._malformed()
            elif self._take_seq(seq):
                self._serve_read(seq, length, rkey, addr)
        elif kind == _F_READ_RESP:
            self._begin_read_resp(seq, length)
        elif kind == _F_NAK:
            self._on_nak(seq, status)
        elif kind == _F_RNR:
            self._on_rnr(seq)
        else:
            self._malformed()

    def _frame_done(self) -> None:
        kind = self._rx_kind
        if kind == _K_SEND:
            if self._rx_bad:
                self._recv_cq._push(WorkCompletion(self._rx_wr_id, WcStatus.LOC_PROT_ERR,
                                                   WcOpcode.RECV, 0, self.qp_num))
                self._fatal(self._rx_seq, WcStatus.REM_OP_ERR)
                return
            self._recv_cq._push(_new_tuple(_WORK_COMPLETION, (self._rx_wr_id, _SUCCESS, _RECV,
                                                              self._rx_len, self.qp_num)))
            self._executed(self._rx_seq)
        elif kind == _K_WRITE:
            if self._rx_bad:
                self._fatal(self._rx_seq, WcStatus.REM_ACCESS_ERR)
            else:
                self._executed(self._rx_seq)
        elif kind == _K_READ_RESP:
            self._end_read_resp()

    def _parse(self) -> None:
        """Act on the buffered bytes: whole headers and what is there of payloads."""
        rmv = self._rmv
        raddr = self._raddr
        start = self._rstart
        end = self._rend
        dev = self._dev
        wqes = self._srq_wqes
        lkeys = dev._lkeys
        frames = 0
        while self._state is not _ERR:
            need = self._rx_need
            if need:
                n = end - start
                if not n:
                    break
                if n > need:
                    n = need
                dst = self._rx_dst
                if dst:
                    guard = self._rx_guard
                    if guard is None or guard.valid:
                        _memmove(dst, raddr + start, n)
                        self._rx_dst = dst + n
                    else:  # deregistered meanwhile: the rest is dropped, the request fails
                        self._rx_dst = 0
                        self._rx_bad = True
                start += n
                self._rx_need = need - n
                if n == need:
                    self._frame_done()
                continue
            if end - start < _HDR_SIZE:
                break
            kind, status, _, seq, length, rkey, addr = _HDR.unpack_from(rmv, start)
            start += _HDR_SIZE
            frames += 1
            if kind == _F_ACK:
                self._retire(seq, True)
                continue
            if (kind == _F_SEND and seq == self._expected and length <= end - start and wqes
                    and length <= wqes[0].sge.length):
                # The hot case, inlined: a whole SEND in the buffer and a buffer that fits it.
                sge = wqes[0].sge
                if not length or _covers(lkeys.get(sge.lkey), self._srq_pd, sge.addr,
                                         sge.length, _LOCAL_WRITE):
                    wr_id = wqes.popleft().wr_id
                    if length:
                        _memmove(sge.addr, raddr + start, length)
                        start += length
                    self._rnr_drop = False
                    self._recv_cq._push(_new_tuple(_WORK_COMPLETION, (wr_id, _SUCCESS, _RECV,
                                                                      length, self.qp_num)))
                    self._expected = (seq + 1) & _SEQ_MASK
                    self._ack_due = True
                    self._ack_seq = seq
                    continue
            self._frame_begin(kind, status, seq, length, rkey, addr)
        dev.frames_received += frames
        self._rstart = start
        self._rend = end

    def _on_readable(self) -> None:
        sock = self._rsock
        assert sock is not None
        dev = self._dev
        budget = _READ_BUDGET
        while True:
            need = self._rx_need
            dst = self._rx_dst
            guard = self._rx_guard
            try:
                if (need >= _DIRECT_RECV and dst and self._rstart == self._rend
                        and (guard is None or guard.valid)):
                    # A large remainder: straight into place, no copy through the buffer.
                    asked = need
                    n = sock.recv_into(memoryview((ctypes.c_char * need).from_address(dst))
                                       .cast("B"))
                    self._rx_dst = dst + n
                    self._rx_need = need - n
                    if n == need:
                        self._frame_done()
                else:
                    left = self._rend - self._rstart  # < one header, or payload in progress
                    if self._rstart:
                        if left:
                            _memmove(self._raddr, self._raddr + self._rstart, left)
                        self._rstart = 0
                        self._rend = left
                    asked = _RBUF - left
                    n = sock.recv_into(self._rmv[left:] if left else self._rmv)
                    self._rend = left + n
            except BlockingIOError:
                break
            except OSError:
                self._link_lost()
                return
            if not n:
                self._link_lost()  # EOF
                return
            dev.bytes_received += n
            if self._state is _ERR:  # lingering until the peer's FIN: drop everything
                self._rstart = self._rend = self._rx_need = 0
            else:
                self._parse()
            if self._rsock is not sock:
                return  # the link failed meanwhile
            budget -= n
            if n < asked or budget <= 0:
                break  # a short read: the socket is (almost surely) drained; epoll says if not
        if self._ack_due and self._state is _RTS:
            # At once, as an HCA does. Holding it for a reply to carry was measured slower,
            # with a timer and without one (held to the end of the loop's turn): the
            # requester woken by the ACK is still awake when the reply comes, where one
            # that slept through the peer's whole turn wakes much later (docs/ibverbs.md).
            self._respond(_F_ACK, 0, self._ack_seq)
        if self._waiting:  # answers may have unblocked requests (RNR ends by the timer)
            self._pump()

    # -- frames out --------------------------------------------------------------------------

    def _send(self, kind: int, status: int, seq: int, length: int, rkey: int, addr: int,
              payload: bytes) -> None:
        """One frame out, at once or queued behind the output the socket has not taken."""
        wsock = self._wsock
        if wsock is None:
            return
        header = _HDR.pack(kind, status, 0, seq, length, rkey, addr)
        dev = self._dev
        dev.frames_sent += 1
        total = len(header) + len(payload)
        if self._out:
            self._out.append(header)
            if payload:
                self._out.append(payload)
            self._out_bytes += total
            return
        try:
            if payload:
                n = wsock.sendmsg((header, payload), (), _NOSIGNAL)
            else:
                n = wsock.send(header, _NOSIGNAL)
        except BlockingIOError:
            n = 0
        except OSError:
            self._link_lost()
            return
        dev.bytes_sent += n
        if n < total:
            if n < len(header):
                self._out.append(header[n:])
                if payload:
                    self._out.append(payload)
            else:
                self._out.append(memoryview(payload)[n - len(header):])
            self._out_bytes = total - n
            self._watch_output(True)

    def _on_writable(self) -> None:
        wsock = self._wsock
        assert wsock is not None
        out = self._out
        while out:
            bufs = list(itertools.islice(out, _IOV_MAX))
            try:
                n = wsock.sendmsg(bufs, (), _NOSIGNAL)
            except BlockingIOError:
                return
            except OSError:
                self._link_lost()
                return
            self._dev.bytes_sent += n
            self._out_bytes -= n
            drained = n == sum(len(b) for b in bufs)
            while n:
                head = out[0]
                if len(head) <= n:
                    n -= len(head)
                    out.popleft()
                else:
                    out[0] = memoryview(head)[n:]
                    n = 0
            if not drained:
                return
        self._watch_output(False)
        if self._state is _ERR:
            self._shutdown_write()
        else:
            self._pump()

    def _watch_output(self, on: bool) -> None:
        mask = _EPOLLOUT if on else 0
        if self._wfd == self._rfd:
            mask |= select.EPOLLIN
        self._dev._epoll.modify(self._wfd, mask)

    # -- links and errors --------------------------------------------------------------------

    def _attach(self, rsock: socket.socket, wsock: socket.socket, direct: _Direct | None,
                remote_psn: int) -> None:
        dev = self._dev
        self._rbuf = (ctypes.c_char * _RBUF)()
        self._rmv = memoryview(self._rbuf).cast("B")
        self._raddr = ctypes.addressof(self._rbuf)
        self._expected = remote_psn
        self._direct = direct
        self._rsock = rsock
        self._wsock = wsock
        self._rfd = rsock.fileno()
        self._wfd = wsock.fileno()
        dev._epoll.register(self._rfd, select.EPOLLIN)
        dev._fd_owner[self._rfd] = self
        if wsock is not rsock:
            dev._epoll.register(self._wfd, 0)
            dev._fd_owner[self._wfd] = self
        self._state = _RTS

    def _enter_error(self, first: WcStatus | None) -> None:
        """Move to ERR: complete every outstanding request (the oldest with `first`)."""
        if self._state is _ERR:
            return
        self._state = _ERR
        reqs = [*self._unacked, *self._waiting]
        self._unacked.clear()
        self._waiting.clear()
        self._reads_out = 0
        self._ack_due = False
        self._rx_need = 0
        if self._rnr_deadline:
            self._rnr_deadline = 0.0
            self._dev._rnr_qps.discard(self)
        for i, req in enumerate(reqs):
            self._finish(req, first if first is not None and i == 0 else _FLUSH)
        # Queued output (a final NAK) still goes, then the FIN; the peer sees the link close.
        if not self._out:
            self._shutdown_write()

    def _shutdown_write(self) -> None:
        if self._wsock is not None:
            with contextlib.suppress(OSError):
                self._wsock.shutdown(socket.SHUT_WR)

    def _link_lost(self) -> None:
        """EOF or a socket error: the request in flight timed out, the rest flush."""
        self._enter_error(WcStatus.RETRY_EXC_ERR if self._unacked else None)
        self._close_link()

    def _malformed(self) -> None:
        """The peer broke the protocol: treated as a lost link (the stream is unusable)."""
        self._link_lost()

    def _close_link(self) -> None:
        dev = self._dev
        for sock, fd in ((self._rsock, self._rfd), (self._wsock, self._wfd)):
            if sock is not None and fd in dev._fd_owner:
                del dev._fd_owner[fd]
                dev._epoll.unregister(fd)
                close_quietly(sock)
        self._rsock = self._wsock = None
        self._rfd = self._wfd = -1
        self._out.clear()
        self._out_bytes = 0


# -- the device ------------------------------------------------------------------------------

class SoftDevice(Device):
    """An opened soft device; see the module's docstring."""

    def __init__(self, *, link: str, host: str, rnr_retry: int, rnr_timer: float,
                 one_sided: str) -> None:
        if link not in ("unix", "tcp"):
            raise VerbsError(f"link must be 'unix' or 'tcp', not {link!r}")
        if one_sided not in ("auto", "direct", "served"):
            raise VerbsError(f"one_sided must be 'auto', 'direct' or 'served', not {one_sided!r}")
        if not 0 <= rnr_retry <= _INFINITE_RNR:
            raise VerbsError(f"rnr_retry must be in 0..7, not {rnr_retry!r}")
        if not (rnr_timer > 0 and math.isfinite(rnr_timer)):
            raise VerbsError(f"rnr_timer must be a positive number of seconds, not {rnr_timer!r}")
        self._rnr_retry = rnr_retry
        self._rnr_timer = rnr_timer
        self._one_sided = one_sided
        self._lock = Lock()  # mypyc's lock: a with-block is two C calls
        self._closed = False
        self._rng = random.Random(os.urandom(16))
        self.name = f"soft-{self._rng.getrandbits(32):08x}"
        # objects
        self._channels: list[SoftChannel] = []
        self._qps: dict[int, SoftQP] = {}
        self._lkeys: dict[int, SoftMR] = {}
        self._rkeys: dict[int, SoftMR] = {}
        self._free_slots = collections.deque(range(SLOTS))
        self._next_pd = self._rng.getrandbits(31) + 1
        self._next_qpn = self._rng.getrandbits(23) + 1
        # service state
        self._fd_owner: dict[int, SoftQP] = {}
        self._rnr_qps: set[SoftQP] = set()  # waiting for their RNR timer
        self._timer_at = math.inf
        self._raised = False  # a channel gained an event its eventfd does not show yet
        # connection state (guarded by _accept_cv, not the device lock: connect blocks)
        self._accept_cv = threading.Condition()
        self._accepting = False
        self._stash: dict[tuple[int, str, int], tuple[socket.socket, Hello]] = {}
        self._local_stash: dict[tuple[int, int], socket.socket] = {}
        self._peer_tables: dict[str, PeerTable] = {}
        self._host = host_identity()
        self._probe = ctypes.create_string_buffer(os.urandom(16), 16)
        # counters
        self.rnr_retries = 0
        self.frames_sent = 0
        self.frames_received = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.direct_ops = 0
        # descriptors last, released by close() if one of them fails
        self._released = False
        self._epoll = select.epoll()
        self._timer: Timer | None = None
        self._timer_fd = -1
        self._table: MrTable | None = None
        self._listener: socket.socket | None = None
        self.address = ""
        try:
            self._timer = Timer()
            self._timer_fd = self._timer.fd
            self._epoll.register(self._timer_fd, select.EPOLLIN)
            self._table = MrTable()
            self._listener, self.address = soft_link.listen(link, host)
            self._listener.settimeout(0.05)  # acceptors look at the stash between accepts
        except BaseException:
            self.close()
            raise

    # -- verbs -------------------------------------------------------------------------------

    def alloc_pd(self) -> SoftPD:
        with self._lock:
            self._check_open()
            pd = SoftPD(self, self._next_pd)
            self._next_pd = self._next_pd % 0x7FFFFFFF + 1
            return pd

    def create_comp_channel(self) -> SoftChannel:
        with self._lock:
            self._check_open()
            channel = SoftChannel(self)
            self._channels.append(channel)
            return channel

    def create_cq(self, depth: int, channel: CompletionChannel | None) -> SoftCQ:
        if depth < 1:
            raise VerbsError(f"CQ depth must be positive, not {depth}")
        if channel is not None and not (isinstance(channel, SoftChannel)
                                        and channel._device is self):
            raise VerbsError("the completion channel belongs to another device")
        with self._lock:
            self._check_open()
            return SoftCQ(self, depth, channel)

    def create_srq(self, pd: ProtectionDomain, max_wr: int) -> SoftSRQ:
        if not isinstance(pd, SoftPD) or pd.device is not self:
            raise VerbsError("the protection domain belongs to another device")
        if max_wr < 1:
            raise VerbsError(f"SRQ max_wr must be positive, not {max_wr}")
        with self._lock:
            self._check_open()
            return SoftSRQ(self, pd, max_wr)

    def create_qp(self, pd: ProtectionDomain, send_cq: CompletionQueue,
                  recv_cq: CompletionQueue, srq: SharedReceiveQueue,
                  max_send_wr: int) -> SoftQP:
        if not isinstance(pd, SoftPD) or pd.device is not self:
            raise VerbsError("the protection domain belongs to another device")
        if not (isinstance(send_cq, SoftCQ) and send_cq._device is self
                and isinstance(recv_cq, SoftCQ) and recv_cq._device is self):
            raise VerbsError("the completion queue belongs to another device")
        if not isinstance(srq, SoftSRQ) or srq._device is not self:
            raise VerbsError("the shared receive queue belongs to another device")
        if max_send_wr < 1:
            raise VerbsError(f"max_send_wr must be positive, not {max_send_wr}")
        with self._lock:
            self._check_open()
            qp_num = self._next_qpn
            while qp_num in self._qps:
                qp_num = qp_num % 0xFFFFFF + 1
            self._next_qpn = qp_num % 0xFFFFFF + 1
            qp = SoftQP(self, pd, send_cq, recv_cq, srq, max_send_wr, qp_num,
                        self._rng.getrandbits(24))
            self._qps[qp_num] = qp
            return qp

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"rnr_retries": self.rnr_retries, "frames_sent": self.frames_sent,
                    "frames_received": self.frames_received, "bytes_sent": self.bytes_sent,
                    "bytes_received": self.bytes_received, "direct_ops": self.direct_ops}

    def close(self) -> None:
        with self._accept_cv:
            self._closed = True
            self._accept_cv.notify_all()
            # A connect() in accept() holds the listener; it looks at _closed within 0.05 s.
            deadline = _monotonic() + 1.0
            while self._accepting and _monotonic() < deadline:
                self._accept_cv.wait(0.05)
            stashed = [sock for sock, _ in self._stash.values()] + [*self._local_stash.values()]
            self._stash.clear()
            self._local_stash.clear()
        with self._lock:
            if self._released:
                return
            self._released = True
            for sock in stashed:
                close_quietly(sock)
            for qp in self._qps.values():
                qp._close_link()
                qp._state = _ERR
                qp._waiting.clear()
                qp._unacked.clear()
            self._qps.clear()
            self._rnr_qps.clear()
            for mr in self._lkeys.values():
                mr.valid = False
            self._lkeys.clear()
            self._rkeys.clear()
            for table in self._peer_tables.values():
                table.close()
            self._peer_tables.clear()
            for channel in self._channels:
                channel._close()
            self._channels.clear()
            if self._table is not None:
                self._table.close()
                self._table = None
            if self._timer is not None:
                self._timer.close()
                self._timer = None
            self._epoll.close()
            if self._listener is not None:
                close_quietly(self._listener)
                self._listener = None

    # -- memory regions ----------------------------------------------------------------------

    def _reg_mr(self, pd: SoftPD, addr: int, length: int, access: Access) -> SoftMR:
        if int(access) & ~_ALL_ACCESS:
            raise VerbsError(f"unknown access flags {access!r}")
        access = Access(access)
        if Access.REMOTE_WRITE in access and Access.LOCAL_WRITE not in access:
            raise VerbsError("REMOTE_WRITE needs LOCAL_WRITE (as ibv_reg_mr)")
        if addr < 0 or length < 0 or addr + length >= 1 << 64:
            raise VerbsError(f"bad memory range {addr:#x}+{length}")
        with self._lock:
            self._check_open()
            if not self._free_slots:
                raise VerbsError(f"too many memory regions ({SLOTS})")
            slot = self._free_slots.popleft()
            rkey = self._key(slot)
            lkey = self._key(slot)
            while lkey == rkey:
                lkey = self._key(slot)
            mr = SoftMR(pd, addr, length, access, lkey, rkey)
            if mr.bits & (_REMOTE_READ | _REMOTE_WRITE):
                assert self._table is not None
                self._table.publish(rkey, int(access), addr, length, pd.pd_id)
            self._lkeys[lkey] = mr
            self._rkeys[rkey] = mr
            return mr

    def _key(self, slot: int) -> int:
        return (self._rng.getrandbits(32 - SLOT_BITS) or 1) << SLOT_BITS | slot

    def _dereg_mr(self, mr: SoftMR) -> None:
        with self._lock:
            if not mr.valid:
                return  # deregistered already, or the device is closed
            mr.valid = False  # served transfers into it stop at their next chunk
            del self._lkeys[mr.lkey]
            del self._rkeys[mr.rkey]
            if mr.bits & (_REMOTE_READ | _REMOTE_WRITE):
                assert self._table is not None
                self._table.revoke(mr.rkey)  # waits for a peer's direct copy in progress
            self._free_slots.append(mr.rkey & (SLOTS - 1))

    # -- the service step --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise VerbsError("the device is closed")

    def _service(self) -> None:
        """The device's pending work, without blocking (called under the lock)."""
        if self._closed:
            raise VerbsError("the device is closed")
        owner = self._fd_owner
        for fd, events in self._epoll.poll(0):
            qp = owner.get(fd)
            if qp is None:
                if fd == self._timer_fd:
                    assert self._timer is not None
                    self._timer.drain()
                    self._timer_at = math.inf  # one-shot: it is disarmed now
                continue  # else: closed earlier in this step
            if fd == qp._rfd and events & _IN_EVENTS:
                qp._on_readable()
            if fd == qp._wfd and events & _EPOLLOUT:
                qp._on_writable()
        if self._rnr_qps:
            self._run_rnr_timers()

    def _signal(self) -> None:
        """Make the eventfd of each channel holding events readable (ends locked calls)."""
        self._raised = False
        for channel in self._channels:
            if channel._events and not channel._signalled:
                channel._signalled = True
                os.eventfd_write(channel._evfd, 1)

    def _start_rnr_timer(self, qp: SoftQP) -> None:
        qp._rnr_deadline = _monotonic() + self._rnr_timer
        self._rnr_qps.add(qp)
        if qp._rnr_deadline < self._timer_at:
            assert self._timer is not None
            self._timer.arm(self._rnr_timer)
            self._timer_at = qp._rnr_deadline

    def _run_rnr_timers(self) -> None:
        now = _monotonic()
        nearest = math.inf
        for qp in list(self._rnr_qps):
            if qp._rnr_deadline <= now:
                self._rnr_qps.discard(qp)
                qp._rnr_deadline = 0.0
                qp._pump()
            elif qp._rnr_deadline < nearest:
                nearest = qp._rnr_deadline
        if nearest != self._timer_at:
            assert self._timer is not None
            if nearest == math.inf:
                self._timer.disarm()
            else:
                self._timer.arm(nearest - now)
            self._timer_at = nearest

    # -- connecting --------------------------------------------------------------------------

    def _connect(self, qp: SoftQP, remote: Endpoint) -> None:
        with self._lock:
            self._check_open()
            if qp._dev is not self or qp.qp_num not in self._qps:
                raise VerbsError("the QP belongs to another device")
            if qp._state is not QPState.INIT:
                raise VerbsError(f"connect needs a QP in INIT, not {qp._state.name}")
            qp._state = QPState.RTR
        try:
            if remote.address == self.address:
                rsock, wsock, direct = self._connect_here(qp, remote)
            else:
                rsock, direct = self._connect_peer(qp, remote)
                wsock = rsock
        except BaseException:
            with self._lock:
                if qp._state is QPState.RTR:
                    qp._state = _ERR
            raise
        with self._lock:
            # to_error() or close() may have come while the handshake ran outside the lock.
            if qp._state is QPState.RTR and not self._closed:
                qp._attach(rsock, wsock, direct, remote.psn)
                return
        close_quietly(rsock)
        close_quietly(wsock)
        raise VerbsError(f"QP {qp.qp_num} left RTR while connecting (device closed or QP in ERR)")

    def _connect_here(self, qp: SoftQP, remote: Endpoint
                      ) -> tuple[socket.socket, socket.socket, _Direct | None]:
        """A QP of this device: a socketpair, the peer's end kept for its own connect."""
        with self._lock:
            peer = self._qps.get(remote.qp_num)
            if peer is None or peer.psn != remote.psn:
                raise VerbsError(f"no QP {remote.qp_num} with PSN {remote.psn} on this device")
            direct = None if self._one_sided == "served" else _SameDeviceDirect(self, peer._pd)
        if peer is qp:  # self-connected: what it writes to one end it reads from the other
            wsock, rsock = socket.socketpair()
            for sock in (rsock, wsock):
                sock.setblocking(False)
            return rsock, wsock, direct
        with self._accept_cv:
            if self._closed:  # close() has emptied the stash: nothing may be added now
                raise VerbsError("the device is closed")
            stashed = self._local_stash.pop((qp.qp_num, peer.qp_num), None)
            if stashed is not None:
                sock = stashed
            else:
                sock, theirs = socket.socketpair()
                theirs.setblocking(False)
                self._local_stash[(peer.qp_num, qp.qp_num)] = theirs
        sock.setblocking(False)
        return sock, sock, direct

    def _hello(self, qp: SoftQP, remote: Endpoint) -> Hello:
        assert self._table is not None
        return Hello(address=self.address, qp=qp.qp_num, psn=qp.psn, dst_qp=remote.qp_num,
                     dst_psn=remote.psn, pid=os.getpid(), host=self._host,
                     table=self._table.path, probe=ctypes.addressof(self._probe),
                     token=self._probe.raw.hex(), pd=qp._pd.pd_id)

    @staticmethod
    def _mismatch(peer: Hello, qp: SoftQP, remote: Endpoint) -> str:
        if (peer.address, peer.qp, peer.psn) != (remote.address, remote.qp_num, remote.psn):
            return (f"expected QP {remote.qp_num} PSN {remote.psn} at {remote.address}, "
                    f"met QP {peer.qp} PSN {peer.psn} at {peer.address}")
        if (peer.dst_qp, peer.dst_psn) != (qp.qp_num, qp.psn):
            return f"the peer wants QP {peer.dst_qp} PSN {peer.dst_psn}, not this one"
        return ""

    def _connect_peer(self, qp: SoftQP, remote: Endpoint
                      ) -> tuple[socket.socket, _Direct | None]:
        """A QP of another device: one socket, dialed by the lower (address, qp_num)."""
        deadline = _monotonic() + CONNECT_TIMEOUT
        hello = self._hello(qp, remote)
        if (self.address, qp.qp_num) < (remote.address, remote.qp_num):
            sock = soft_link.dial(remote.address, deadline)
            with _handshake(sock, qp):
                sock.settimeout(max(deadline - _monotonic(), 0.01))
                soft_link.send_hello(sock, hello)
                peer = soft_link.recv_hello(sock)
                problem = peer.error or self._mismatch(peer, qp, remote)
                if problem:
                    raise VerbsError(f"connecting QP {qp.qp_num}: {problem}")
        else:
            sock, peer = self._await_dialer(qp, remote, deadline)
            with _handshake(sock, qp):
                problem = self._mismatch(peer, qp, remote)
                soft_link.send_hello(sock, hello._replace(error=problem))
                if problem:
                    raise VerbsError(f"connecting QP {qp.qp_num}: {problem}")
        try:
            direct = self._direct_to(peer, sock)
            sock.setblocking(False)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            close_quietly(sock)
            raise
        return sock, direct

    def _await_dialer(self, qp: SoftQP, remote: Endpoint, deadline: float
                      ) -> tuple[socket.socket, Hello]:
        """The connection the peer dialed for this QP; connects take turns accepting."""
        key = (qp.qp_num, remote.address, remote.qp_num)
        cv = self._accept_cv
        while True:
            with cv:
                while True:
                    found = self._stash.pop(key, None)
                    if found is not None:
                        return found
                    if self._closed:
                        raise VerbsError("the device is closed")
                    if _monotonic() > deadline:
                        raise VerbsError(f"QP {qp.qp_num}: no connection from QP "
                                         f"{remote.qp_num} at {remote.address}")
                    if not self._accepting:
                        self._accepting = True
                        break
                    cv.wait(0.05)
            got = None
            try:
                got = self._accept_one()
            finally:
                with cv:
                    self._accepting = False
                    if got is not None:
                        old = self._stash.pop(got[0], None)
                        if old is not None:
                            close_quietly(old[0])
                        self._stash[got[0]] = got[1:]
                    cv.notify_all()

    def _accept_one(self) -> tuple[tuple[int, str, int], socket.socket, Hello] | None:
        listener = self._listener
        if listener is None or self._closed:
            return None
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            return None
        except OSError as exc:
            if self._closed:
                return None
            raise VerbsError(f"accepting a connection: {exc}") from exc
        try:
            conn.settimeout(5.0)
            hello = soft_link.recv_hello(conn)
        except (VerbsError, OSError):
            close_quietly(conn)  # not a soft device: ignored
            return None
        return (hello.dst_qp, hello.address, hello.qp), conn, hello

    def _direct_to(self, peer: Hello, sock: socket.socket) -> _Direct | None:
        """How this side performs RDMA on `peer`: directly, or None (served)."""
        if self._one_sided == "served":
            return None
        table = None
        try:
            problem = self._unreachable(peer, sock)
            if not problem:
                table = self._peer_table(peer.table)
        except OSError as exc:
            problem = f"the peer's MR table cannot be opened ({exc})"
        if table is None:
            if self._one_sided == "direct":
                raise VerbsError(f"one_sided='direct' is impossible: {problem}")
            return None
        memory = None if peer.pid == os.getpid() else PeerMemory(peer.pid)
        return _PeerDirect(table, memory, peer.pd)

    def _unreachable(self, peer: Hello, sock: socket.socket) -> str:
        """Why this process cannot copy to and from the peer's memory ("" if it can)."""
        if not self._host or peer.host != self._host:
            return "the peer is on another host"
        if sock.family == socket.AF_UNIX:  # the kernel names the peer: no pid to trust
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
            if _CREDS.unpack(creds)[0] != peer.pid:
                return f"the peer says it is process {peer.pid}, its socket disagrees"
        try:
            token = bytes.fromhex(peer.token)
        except ValueError:
            token = b""
        if len(token) != 16 or not 0 < peer.pid < 1 << 31 or not 0 < peer.probe < 1 << 64:
            return "a malformed probe in the handshake"
        # The probe's 16 random bytes must read back: process_vm works on that process.
        probe = ctypes.create_string_buffer(16)
        err = PeerMemory(peer.pid).copy(False, ctypes.addressof(probe), peer.probe, 16)
        if err or probe.raw != token:
            why = os.strerror(err) if err else "other bytes"
            return f"process_vm_readv does not reach process {peer.pid} ({why})"
        return ""

    def _peer_table(self, path: str) -> PeerTable:
        with self._lock:
            table = self._peer_tables.get(path)
            if table is None:
                table = self._peer_tables[path] = PeerTable(path)
            return table


def open_device(*, link: str = "unix", host: str = "127.0.0.1", rnr_retry: int = 7,
                rnr_timer: float = 0.001, one_sided: str = "auto") -> SoftDevice:
    """Open a soft device listening on a "unix" socket or on "tcp" at `host`.

    `rnr_retry` (0..7, 7 = forever) and `rnr_timer` (seconds) govern receiver-not-ready
    retries; `one_sided` is "direct", "served" or "auto" (see the module's docstring).
    """
    return SoftDevice(link=link, host=host, rnr_retry=rnr_retry, rnr_timer=rnr_timer,
                      one_sided=one_sided)


@contextlib.contextmanager
def _handshake(sock: socket.socket, qp: SoftQP) -> Iterator[None]:
    """A connection's handshake: on any error the socket is closed, and a socket error
    becomes a VerbsError naming the QP."""
    try:
        yield
    except BaseException as exc:
        close_quietly(sock)
        if isinstance(exc, OSError):
            raise VerbsError(f"connecting QP {qp.qp_num}: {exc}") from exc
        raise
