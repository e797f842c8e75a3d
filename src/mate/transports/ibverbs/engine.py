"""The ibverbs protocol engine (thesis §5.3): messages in, work requests out, no I/O.

Theory of operation
-------------------
The engine is a state machine in the manner of h11. Its inputs are the
core's calls (`post`, `cancel`, `expose`, `unexpose`) and the device's work
completions (`completion`, `peer_lost`); its outputs are work requests,
handed to a `Wire` (one RC QP per peer, the rank itself included, and one
shared receive queue), and `Report`s, collected until the driver takes them
(`take_reports`). It never blocks, sleeps, locks or reads a clock: the
driver (transport.py) calls it under one lock and hands the reports to the
sink after the call returns, so no report is ever delivered from inside
`post`. Frames are defined in wire.py.

Credits (§5.3). At `start` the engine posts ``size * (credits + 1)`` receive
buffers of ``header + eager_size`` bytes to the SRQ: for every peer,
`credits` data slots and one control slot. Every SEND to a peer consumes one
of our `credits[peer]`, except an explicit CREDIT frame. The receiver reposts
a buffer as soon as it has taken what it needs out of it (eager data is
copied first), and only then counts it as `owed[peer]`; what it owes rides in
the `grant` field of its next frame to that peer. An explicit CREDIT frame is
sent when ``owed >= credits / 2``, or ``owed > 0`` and the peer asked
(`CREDIT_REQUEST`, set by a sender whose credits fall below a quarter). At
most one CREDIT per peer is unacknowledged: every header echoes how many
CREDIT frames its sender has processed from the receiver (`ack`), and
another CREDIT waits until the echo matches.

* The SRQ cannot run dry (no RNR): a buffer holding a frame from peer p is
  counted against p until p gets its credit back, which the receiver grants
  only after reposting. So at any time p holds at most `credits` buffers with
  data frames plus one with its single unacknowledged CREDIT, and all peers
  together at most ``size * (credits + 1)``: exactly what is posted.
* Credits cannot deadlock: the receiver reposts and grants whatever the
  application does (unmatched frames go to the unexpected table), and the
  CREDIT frame bypasses the queue of frames waiting for credit (it needs only
  a send slot, and slots come back with send completions, which depend on no
  peer). Let both engines keep being driven, and suppose p waits with no
  credit forever. Its last frame before that left it below the watermark, so
  it carries CREDIT_REQUEST; we process it and then owe p at least one. If we
  have frames for p, they carry the grant. Otherwise we send a CREDIT unless
  an earlier CREDIT is unacknowledged. If p has not processed that earlier
  one, doing so gives p credit; if it has, it used that credit for frames
  sent after processing it, which carry the ack, and once we process them
  (the request flag stays remembered) we send the CREDIT. Either way p gets
  credit: a contradiction.

Frames to a peer wait, in order, in that peer's FIFO while there is no
credit, no free send slot (`send_slots` pre-registered slots, shared) or no
room in the QP's send queue (`max_send_wr`); RDMA work requests go through the
same FIFO so the send queue is never overfilled. Nothing is dropped. Frames
to one peer leave in posting order on one QP, which gives non-overtaking; the
matching tables (`mate.matching`) give the receive side's order.

Two-sided. A send of at most `eager_size` bytes is EAGER: copied behind the
header into a send slot (SUBMITTED then), completed at the SEND's completion.
A larger send is rendezvous: its buffer is registered through the pin cache
and an RTS carries its address and rkey; the receiver that matches it
RDMA-READs ``min(length, room)`` bytes into the receive buffer and answers
FIN; the sender completes at the FIN. A send with a deadline (which a
timeout may abandon) is sent from a registered scratch copy instead, so a
cancel ends it at once; the copy is freed at the FIN or CANCEL_ACK. A
zero-copy rendezvous send that is cancelled asks the receiver (CANCEL_REQ):
an RTS still unmatched is dropped (CANCEL_ACK: CANCELLED), a matched one is
read and FIN'd (COMPLETED: the match wins). An eager send already posted is
abandoned (CANCELLED; the data may still arrive). A receive whose RTS was
matched is never cancelled: its data is being read.

One-sided. put = RDMA WRITE and then a zero-length RDMA READ, whose
completion proves the data is in the target's memory (remote completion);
get = RDMA READ. The origin caches, per peer, the regions it was given keys
for; an access that no cached region contains sends KEY_REQ, and the target
answers KEY_REPLY for an exposed region that contains the whole range, or
KEY_REFUSED (REMOTE_ACCESS, nothing touched). `unexpose` sends REVOKE to
every peer the key was given to; a peer forgets the key, waits for its
operations using it, and answers REVOKE_ACK; with all acks in (lost peers
count as acked) the region is deregistered and `done()` called. A put or
get with a deadline works on a scratch copy, so a cancel ends it at once
(a get's copy is never copied out after that); without one, an access on
the wire completes.

Faults. An error completion fails its operation (REM_ACCESS_ERR: REMOTE_ACCESS;
flush and retry errors: PEER_UNREACHABLE; else TRANSPORT). `peer_lost` fails
everything still going on with that peer, drops its FIFO and its unexpected
RTSs, and counts it as having acked every revoke; receives from ANY_SOURCE
stay. Frames from a lost peer are dropped. A malformed frame means the peer
whose QP it came on is broken: it is treated as lost (counted in `protocol_errors`; the QP itself
is the driver's). So does a frame that no correct peer sends where it
arrives: an RTS with an id its sender still has unmatched here, a FIN or
CANCEL_ACK for a send that went to another rank, a CANCEL_ACK for a send
whose cancel was not asked, an answer to a key request that was not made. A
post that the device refuses (QP not in RTS) loses that peer the same way.

Liveness. An RC QP learns that its peer is gone only from a work request
that fails; a rank that merely waits on a peer (a receive from it, a
rendezvous send waiting for its FIN, a key request, an `unexpose` waiting for
its REVOKE_ACK: the peer's device may have taken the REVOKE just before the
peer closed) has none on the wire. So the driver calls `keepalive` every few
seconds, and to each peer that operations or revokes wait on while none of
our work requests is on its QP the engine posts a probe: a zero-length RDMA
READ, which needs no key, no receive buffer and no CPU at the target, but
must be answered by the peer's device. A probe that fails loses the peer.

Reports. Every operation gets exactly one terminal report (`_Rec.ended`
guards it) and at most one SUBMITTED, before it. Where submission and
completion are learnt together (rendezvous at the FIN, put at its READ) only
COMPLETED is reported: the core fires both events.

The driver. Every call may append reports; the driver takes them after the
call (`take_reports`) and hands them to the sink. Completions are told apart
by `wr_id` alone (receive buffers from 0, send slots from `SEND_BASE`, RDMA
requests from `RDMA_BASE`, probes from `PROBE_BASE`), never by opcode, which
an error completion does not define. Mapping a completion's `qp_num` to the
peer that QP is connected to (the `peer` of `completion`), and calling
`peer_lost` when that QP is in ERR, is the driver's job. A frame's sender is
that peer, whatever the frame says: a frame whose `source` names another rank
is malformed, so no peer can speak for another. Its CQs must hold
up to ``size * max_send_wr`` send completions and ``size * (credits + 1)``
receive completions. When every user operation has ended the rank may still
owe peers a FIN, a grant or an ack: before closing the device, the driver
progresses until `idle()` (for a bounded time: a peer may be gone).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Final, NamedTuple, Protocol

from mate.buffers import address_of
from mate.constants import ANY_SOURCE
from mate.errors import FailureReason
from mate.machine import Input
from mate.matching import PostedReceives, UnexpectedMessages
from mate.schedule import Op, Region
from mate.transports.base import Operation, Report, failure
from mate.transports.ibverbs.pincache import PAGE, Pin, PinCache
from mate.transports.ibverbs.verbs import (
    SGE,
    Access,
    MemoryRegion,
    Opcode,
    ProtectionDomain,
    RecvWR,
    SendWR,
    VerbsError,
    WcStatus,
    WorkCompletion,
)
from mate.transports.ibverbs.wire import (
    CREDIT_REQUEST,
    FAILED,
    HEADER_SIZE,
    TRUNCATED,
    Header,
    Kind,
    ProtocolError,
    decode,
    pack_into,
)


class Wire(Protocol):
    def post_send(self, peer: int, wr: SendWR) -> None:
        """On the QP connected to `peer` (the rank itself: the loopback QP)."""

    def post_recv(self, wr: RecvWR) -> None:
        """To the shared receive queue."""


# wr_id spaces: receive buffers are numbered from 0, send slots and RDMA requests above.
SEND_BASE: Final = 1 << 40
RDMA_BASE: Final = 1 << 41  # READ ids are even; a put's WRITE is its READ's id + 1
PROBE_BASE: Final = 1 << 42  # + the peer's rank: a keepalive probe

SCRATCH_KEEP: Final = 64 << 20  # bytes of freed scratch buffers kept registered for reuse
_ALL_ACCESS: Final = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
_SCRATCH_ACCESS: Final = Access.LOCAL_WRITE | Access.REMOTE_READ

# What a record is (`_Rec.kind`)
_EAGER: Final = 0
_RDV: Final = 1
_RECV: Final = 2
_PUT: Final = 3
_GET: Final = 4
# Where it is (`_Rec.stage`)
_QUEUED: Final = 0  # in its peer's FIFO, or waiting for a key (put/get)
_POSTED: Final = 1  # a receive in the posted table
_READING: Final = 2  # a receive matched to an RTS: its READ is queued or on the wire
_WIRE: Final = 3  # on the wire
_DONE: Final = 4  # the wire is done with it and its resources are released

# Enum members read per message, as module constants: a read through the class is
# slow on Python 3.11 (see mate.message).
_COMPLETED: Final = Input.COMPLETED
_SUBMITTED: Final = Input.SUBMITTED
_OP_SEND: Final = Op.SEND
_OP_RECV: Final = Op.RECV
_OP_PUT: Final = Op.PUT
_EAGER_FRAME: Final = Kind.EAGER
_RTS_FRAME: Final = Kind.RTS
_FIN_FRAME: Final = Kind.FIN
_CREDIT_FRAME: Final = Kind.CREDIT
_WR_SEND: Final = Opcode.SEND
_WR_READ: Final = Opcode.RDMA_READ
_WR_WRITE: Final = Opcode.RDMA_WRITE
_SUCCESS: Final = WcStatus.SUCCESS
_FLUSH: Final = WcStatus.WR_FLUSH_ERR
_LOCAL_WRITE: Final = Access.LOCAL_WRITE
_REMOTE_READ: Final = Access.REMOTE_READ
_NO_ACCESS: Final = Access(0)
# A NamedTuple's own __new__ runs interpreted; a frame's SendWR and SGE skip it, the
# SendWR taking its defaulted fields (signaled, remote_addr, rkey) from here.
_new_tuple: Final = tuple.__new__
_SEND_DEFAULTS: Final = tuple(SendWR._field_defaults.values())
# Imported names read per message: Final, they are not looked up per use.
_SGE: Final = SGE
_SEND_WR: Final = SendWR
_ADDRESS_OF: Final = address_of
_REASONS: Final = {
    WcStatus.REM_ACCESS_ERR: FailureReason.REMOTE_ACCESS,
    WcStatus.WR_FLUSH_ERR: FailureReason.PEER_UNREACHABLE,
    WcStatus.RETRY_EXC_ERR: FailureReason.PEER_UNREACHABLE,
    WcStatus.RNR_RETRY_EXC_ERR: FailureReason.PEER_UNREACHABLE,
}

# A frame with no user data waiting in a FIFO: (kind, flags, tag, length, msg_id, addr, rkey)
_Control = tuple[Kind, int, int, int, int, int, int]


class _Rec:
    """The engine's state of one user operation (`Operation.transport_data`)."""

    __slots__ = ("arrival", "cancel_sent", "ended", "key", "kind", "msg_id", "op", "peer",
                 "pin", "rkey", "scratch", "stage", "wired")

    def __init__(self, op: Operation, kind: int) -> None:
        self.op = op
        self.kind = kind
        self.stage = _QUEUED
        self.peer = op.peer  # resolved for a receive once matched; -1 while unknown
        self.ended = False  # the terminal report was made
        self.wired = False  # an RDMA request of ours reads or writes its memory
        self.cancel_sent = False
        self.msg_id = 0
        self.pin: Pin | None = None
        self.scratch: _Scratch | None = None
        self.key = -1  # the region id of the key it holds (put/get), else -1
        self.rkey = 0
        self.arrival: _Arrival | None = None  # a receive's matched RTS


class _Arrival:
    """An EAGER (data) or RTS (descriptor) frame kept for a receive."""

    __slots__ = ("addr", "data", "length", "msg_id", "rkey", "source", "tag")

    def __init__(self, source: int, tag: int, length: int, data: bytes | None,
                 msg_id: int = 0, addr: int = 0, rkey: int = 0) -> None:
        self.source = source
        self.tag = tag
        self.length = length
        self.data = data
        self.msg_id = msg_id
        self.addr = addr
        self.rkey = rkey


class _Scratch:
    """A registered copy buffer, for operations that a cancel may abandon."""

    __slots__ = ("addr", "mr", "size", "view")

    def __init__(self, size: int, mr: MemoryRegion, view: memoryview, addr: int) -> None:
        self.size = size
        self.mr = mr
        self.view = view
        self.addr = addr


class _Key(NamedTuple):
    """A region a peer gave us a key for."""

    addr: int
    length: int
    rkey: int
    xid: int  # the target's id of the region (REVOKE names it)


class _KeyRequest:
    __slots__ = ("addr", "length", "peer", "waiters")

    def __init__(self, peer: int, addr: int, length: int) -> None:
        self.peer = peer
        self.addr = addr
        self.length = length
        self.waiters: list[_Rec] = []


class _Exposed:
    __slots__ = ("done", "granted", "mr", "region", "revoking", "waiting", "xid")

    def __init__(self, xid: int, region: Region, mr: MemoryRegion | None) -> None:
        self.xid = xid
        self.region = region
        self.mr = mr  # None for a zero-length region: nothing to reach
        self.granted: set[int] = set()  # peers given its key
        self.revoking = False
        self.waiting: set[int] = set()  # peers whose REVOKE_ACK is still due
        self.done: Callable[[], None] | None = None


class Engine:
    def __init__(self, *, rank: int, size: int, wire: Wire, pd: ProtectionDomain,
                 pins: PinCache, eager_size: int = 8192, credits: int = 32,
                 send_slots: int = 256, max_send_wr: int = 1024) -> None:
        if not 1 <= credits <= 0xFFFF:  # grants travel in a u16
            raise ValueError(f"credits must be in [1, 65535], not {credits}")
        if eager_size < 0 or send_slots < 1 or max_send_wr < 2:  # a put posts 2 requests
            raise ValueError("need eager_size >= 0, send_slots >= 1 and max_send_wr >= 2")
        self.rank = rank
        self.size = size
        self._wire = wire
        self._pd = pd
        self._pins = pins
        self.eager_size = eager_size
        self.credits = credits
        self._half = max(1, credits // 2)  # owed this much: send an explicit CREDIT
        self._low = max(1, credits // 4)  # fewer credits than this: ask for more
        self._max_sq = max_send_wr
        self._stride = -(-(HEADER_SIZE + eager_size) // 64) * 64
        # per peer
        self._credits = [credits] * size
        self._owed = [0] * size
        self._requested = [False] * size
        self._acks = [0] * size  # CREDIT frames processed from the peer, mod 2**16
        self._ctrl_sent = [0] * size  # CREDIT frames sent to it, mod 2**16
        self._ctrl_unacked = [False] * size
        self._sq = [0] * size  # our work requests on its QP not yet completed
        self._fifo: list[deque[_Rec | _Control]] = [deque() for _ in range(size)]
        self._lost = [False] * size
        self._active: list[set[_Rec]] = [set() for _ in range(size)]
        self._keys: list[list[_Key]] = [[] for _ in range(size)]
        self._failing: dict[int, str] = {}  # peers found broken, lost at the end of the call
        self._starved: set[int] = set()  # peers waiting for a free send slot
        self._pumping = -1
        # send slots
        self._slot_rec: list[_Rec | None] = [None] * send_slots
        self._slot_peer = [0] * send_slots
        self._free = list(range(send_slots - 1, -1, -1))
        self._send_pool = bytearray(send_slots * self._stride)
        self._sview = memoryview(self._send_pool)
        self._recv_pool = bytearray(size * (credits + 1) * self._stride)
        self._rview = memoryview(self._recv_pool)
        self._pool_mrs: list[MemoryRegion] = []
        self._saddr = 0
        self._slkey = 0
        self._recv_wrs: list[RecvWR] = []
        # matching, rendezvous, one-sided
        self._posted: PostedReceives[_Rec] = PostedReceives()
        self._unexpected: UnexpectedMessages[_Arrival] = UnexpectedMessages()
        self._rts: dict[tuple[int, int], _Arrival] = {}  # unexpected RTS by (source, msg id)
        self._rdv: dict[int, _Rec] = {}  # our rendezvous sends awaiting FIN, by msg id
        self._rdma: dict[int, _Rec] = {}  # RDMA requests on the wire, by READ wr_id
        self._key_requests: dict[int, _KeyRequest] = {}
        self._key_request_of: dict[tuple[int, int, int], int] = {}  # (peer, addr, len) -> id
        self._key_users: dict[tuple[int, int], int] = {}  # (peer, xid) -> ops holding it
        self._revoked: set[tuple[int, int]] = set()  # keys revoked while still in use
        self._exposed: dict[int, _Exposed] = {}
        self._scratch_free: dict[int, list[_Scratch]] = {}
        self._scratch_kept = 0
        self._ids = itertools.count(1)
        self._wr_ids = itertools.count(RDMA_BASE, 2)
        self._reports: list[Report] = []
        self._live = 0
        # statistics
        self._eager_sends = 0
        self._rendezvous_sends = 0
        self._credit_stalls = 0
        self._credit_messages = 0
        self._key_request_count = 0
        self._protocol_errors = 0
        self._probes = 0

    # -- the driver's calls ------------------------------------------------------------

    def start(self) -> None:
        """Register the pools and post every receive buffer (before any peer connects)."""
        recv_mr = self._pd.reg_mr(_ADDRESS_OF(self._rview), len(self._recv_pool),
                                  Access.LOCAL_WRITE)
        send_mr = self._pd.reg_mr(_ADDRESS_OF(self._sview), len(self._send_pool),
                                  Access.LOCAL_WRITE)
        self._pool_mrs = [recv_mr, send_mr]
        self._saddr, self._slkey = send_mr.addr, send_mr.lkey
        stride = self._stride
        self._recv_wrs = [
            RecvWR(i, _SGE(recv_mr.addr + i * stride, HEADER_SIZE + self.eager_size,
                           recv_mr.lkey))
            for i in range(len(self._recv_pool) // stride)
        ]
        for wr in self._recv_wrs:
            self._wire.post_recv(wr)

    def post(self, op: Operation) -> None:
        """Start `op`; its reports are appended for `take_reports`."""
        kind = op.op
        if kind is _OP_RECV:
            rec = _Rec(op, _RECV)
            op.transport_data = rec
            self._live += 1
            self._post_recv(rec)
        else:
            n = len(op.buffer)
            if kind is _OP_SEND:
                rec = _Rec(op, _EAGER if n <= self.eager_size else _RDV)
            else:
                rec = _Rec(op, _PUT if kind is _OP_PUT else _GET)
            op.transport_data = rec
            self._live += 1
            p = op.peer
            if self._lost[p]:
                self._lost_at_post(rec)
            else:
                self._active[p].add(rec)
                if kind is _OP_SEND:
                    self._post_send(rec, n)
                else:
                    self._post_one_sided(rec, n)
        if self._failing:
            self._settle()

    def cancel(self, op: Operation) -> None:
        """Stop `op` if that loses no data (CANCELLED), else let it end by itself."""
        rec = op.transport_data
        if not isinstance(rec, _Rec) or rec.ended:
            return
        stage, kind = rec.stage, rec.kind
        if stage == _POSTED:
            self._posted.remove(op.peer, op.tag, rec)
        elif stage == _WIRE:
            if kind == _RDV and not rec.cancel_sent:
                rec.cancel_sent = True  # the receiver drops the RTS, or has matched it
                self._enqueue(rec.peer, (Kind.CANCEL_REQ, 0, 0, 0, rec.msg_id, 0, 0))
            if kind != _EAGER and rec.scratch is None:
                return  # the wire uses the user's buffer: it ends by itself
            # else abandoned: it ends now; the slot or scratch is freed by the wire
            self._end(rec, Report(Input.CANCELLED, op))
            if self._failing:
                self._settle()
            return
        elif stage != _QUEUED:
            return  # a receive being read, or finished
        self._end(rec, Report(Input.CANCELLED, op))
        self._finish(rec)
        if self._failing:
            self._settle()

    def expose(self, buffer: memoryview) -> Region:
        """Register `buffer` for peers' put and get; VerbsError if the device refuses."""
        address, n = _ADDRESS_OF(buffer), len(buffer)
        mr = self._pd.reg_mr(address, n, _ALL_ACCESS) if n else None
        xid = next(self._ids) & 0x7FFFFFFF  # travels in the int32 tag field
        region = Region(self.rank, address, n)
        self._exposed[xid] = _Exposed(xid, region, mr)
        return region

    def unexpose(self, region: Region, done: Callable[[], None]) -> None:
        """Revoke `region`; `done()` once no peer can reach it (now, or in a later call)."""
        for x in self._exposed.values():
            if x.region == region and not x.revoking:
                break
        else:
            done()
            return
        x.revoking = True
        x.done = done
        x.waiting = {p for p in x.granted if not self._lost[p]}
        if not x.waiting:
            self._unexposed(x)
            return
        for p in x.waiting:
            self._enqueue(p, (Kind.REVOKE, 0, x.xid, 0, 0, 0, 0))
        if self._failing:
            self._settle()

    def completion(self, wc: WorkCompletion, peer: int) -> None:
        """One work completion from either CQ, on the QP connected to `peer`."""
        wr_id = wc.wr_id
        if wr_id < SEND_BASE:
            self._received(wc, peer)
        elif wr_id < RDMA_BASE:
            self._sent(wc)
        elif wr_id < PROBE_BASE:
            self._rdma_done(wc)
        else:
            self._probed(wc)
        if self._failing:
            self._settle()

    def peer_lost(self, peer: int, detail: str) -> None:
        """The QP to `peer` is in error: end everything with it; idempotent."""
        if not self._lost[peer]:
            self._lost[peer] = True
            self._lose(peer, detail)
        if self._failing:
            self._settle()

    def keepalive(self) -> None:
        """Probe every peer that operations or revokes wait on while nothing of ours is on
        its QP."""
        revoking = {p for x in self._exposed.values() if x.revoking for p in x.waiting}
        for p in range(self.size):
            if (p != self.rank and (self._active[p] or p in revoking) and not self._sq[p]
                    and not self._lost[p]):
                try:
                    self._wire.post_send(p, _SEND_WR(PROBE_BASE + p, Opcode.RDMA_READ, None,
                                                     True, 0, 0))
                except VerbsError as exc:
                    self._wire_failed(p, exc)
                    continue
                self._sq[p] += 1
                self._probes += 1
        if self._failing:
            self._settle()

    def outstanding(self) -> int:
        """User operations not yet ended."""
        return self._live

    def idle(self) -> bool:
        """Whether this rank owes no peer (not lost) anything on the wire.

        That is: no frame waits in a FIFO and every work request posted has
        completed. A rank whose user operations have all ended may still owe a
        FIN, a grant or an ack that a peer's operation waits for; a driver
        should keep progressing until this holds (bounded: a peer may be gone)
        before it closes the device.
        """
        return all(lost or not (sq or fifo)
                   for lost, sq, fifo in zip(self._lost, self._sq, self._fifo, strict=True))

    def take_reports(self) -> list[Report]:
        reports = self._reports
        self._reports = []
        return reports

    def shutdown(self) -> None:
        """Forget every operation and deregister all memory (the core ended the operations).

        An unexpose still waiting for peers' REVOKE_ACKs ends here: once its memory
        is deregistered no peer can reach it, and no ack will be read any more.
        """
        unexposing = [x.done for x in self._exposed.values() if x.done is not None]
        for fifo in self._fifo:
            fifo.clear()
        for active in self._active:
            for rec in active:
                if rec.scratch is not None:
                    rec.scratch.mr.dereg()
            active.clear()
        self._posted.clear()
        self._unexpected.clear()
        for table in (self._rts, self._rdv, self._rdma, self._key_requests,
                      self._key_request_of, self._key_users):
            table.clear()
        self._revoked.clear()
        self._reports = []
        self._live = 0
        self._pins.clear()
        for x in self._exposed.values():
            if x.mr is not None:
                x.mr.dereg()
        self._exposed.clear()
        for free in self._scratch_free.values():
            for scratch in free:
                scratch.mr.dereg()
        self._scratch_free.clear()
        self._scratch_kept = 0
        for mr in self._pool_mrs:
            mr.dereg()
        self._pool_mrs = []
        for done in unexposing:
            done()

    def stats(self) -> dict[str, int]:
        counters = {  # (messages and bytes by op are the core's: World.stats)
            "eager_sends": self._eager_sends, "rendezvous_sends": self._rendezvous_sends,
            "credit_stalls": self._credit_stalls, "credit_messages": self._credit_messages,
            "key_requests": self._key_request_count, "protocol_errors": self._protocol_errors,
            "probes": self._probes,
        }
        counters.update(self._pins.stats())
        return counters

    # -- posting -----------------------------------------------------------------------

    def _post_send(self, rec: _Rec, n: int) -> None:
        if rec.kind == _RDV and rec.op.deadline is not None and not self._copy_out(rec, n):
            return
        self._enqueue(rec.peer, rec)

    def _post_recv(self, rec: _Rec) -> None:
        op = rec.op
        arrival = self._unexpected.match(op.peer, op.tag)
        if arrival is None:
            source = op.peer
            if source != ANY_SOURCE:
                if self._lost[source]:
                    self._lost_at_post(rec)
                    return
                self._active[source].add(rec)
            rec.stage = _POSTED
            self._posted.add(source, op.tag, rec)
        elif arrival.data is not None:
            n = arrival.length
            m = min(n, len(op.buffer))
            op.buffer[:m] = memoryview(arrival.data)[:m]
            rec.stage = _DONE
            self._received_data(rec, arrival.source, arrival.tag, n, m)
        else:
            del self._rts[arrival.source, arrival.msg_id]
            self._start_read(rec, arrival)

    def _post_one_sided(self, rec: _Rec, n: int) -> None:
        op = rec.op
        if op.deadline is not None and n and not self._copy_out(rec, n):
            return
        p, address = rec.peer, op.address
        for key in self._keys[p]:
            if key.addr <= address and address + n <= key.addr + key.length:
                self._start_one_sided(rec, key)
                return
        request_id = self._key_request_of.get((p, address, n))
        if request_id is None:
            request_id = next(self._ids)
            self._key_request_of[p, address, n] = request_id
            self._key_requests[request_id] = _KeyRequest(p, address, n)
            self._key_request_count += 1
            self._enqueue(p, (Kind.KEY_REQ, 0, 0, n, request_id, address, 0))
        self._key_requests[request_id].waiters.append(rec)

    def _copy_out(self, rec: _Rec, n: int) -> bool:
        """Give `rec` a scratch buffer: for a send or put a copy of its data (submitted
        now), for a get where its data lands. False if that failed (`rec` ended)."""
        scratch = self._scratch(rec)
        if scratch is None:
            return False
        if rec.kind != _GET:
            scratch.view[:n] = rec.op.buffer
            self._reports.append(Report(_SUBMITTED, rec.op))
        return True

    def _start_one_sided(self, rec: _Rec, key: _Key) -> None:
        n = len(rec.op.buffer)
        if n == 0:  # inside an exposed region, and nothing to move
            self._completed(rec, 0, rec.peer, 0)
            self._finish(rec)
            return
        rec.key, rec.rkey = key.xid, key.rkey
        users = self._key_users
        users[rec.peer, key.xid] = users.get((rec.peer, key.xid), 0) + 1
        self._enqueue(rec.peer, rec)

    def _start_read(self, rec: _Rec, arrival: _Arrival) -> None:
        """Receive the rendezvous message `arrival` into `rec`."""
        source = arrival.source
        if rec.op.peer == ANY_SOURCE:
            self._active[source].add(rec)
        rec.peer = source
        rec.arrival = arrival
        rec.stage = _READING
        if min(arrival.length, len(rec.op.buffer)) == 0:
            self._read_done(rec)
        else:
            self._enqueue(source, rec)

    # -- the FIFO ----------------------------------------------------------------------

    def _enqueue(self, p: int, item: _Rec | _Control) -> None:
        """Send `item` to `p` when its turn, credit and room come; in order."""
        if self._lost[p]:
            return  # only control frames come here for a lost peer; they go nowhere
        fifo = self._fifo[p]
        if not fifo and p != self._pumping and self._ready(p, item):
            # The common case, kept short: nothing waits ahead, so it goes at once.
            # (No explicit CREDIT can be due here: only arrivals make one due.)
            try:
                self._post_item(p, item)
            except VerbsError as exc:
                self._wire_failed(p, exc)
            return
        fifo.append(item)
        if p == self._pumping:
            return  # the pump running for p will reach it
        self._pump(p)
        if fifo and fifo[-1] is item:
            self._credit_stalls += 1

    def _ready(self, p: int, item: _Rec | _Control) -> bool:
        """Whether `item` can be posted to `p` now (a SEND: credit, slot and room)."""
        if isinstance(item, tuple) or item.kind <= _RDV:
            if not self._free:
                self._starved.add(p)
                return False
            return self._credits[p] > 0 and self._sq[p] < self._max_sq
        return self._sq[p] + (2 if item.kind == _PUT else 1) <= self._max_sq

    def _post_item(self, p: int, item: _Rec | _Control) -> None:
        if isinstance(item, tuple):
            self._send_frame(p, *item)
        else:
            self._issue(p, item)

    def _pump(self, p: int) -> None:
        """Post what `p`'s FIFO allows, then an explicit CREDIT if one is due."""
        if self._lost[p]:
            return
        outer, self._pumping = self._pumping, p
        fifo = self._fifo[p]
        try:
            while fifo:
                item = fifo[0]
                if not isinstance(item, tuple) and item.stage == _DONE:
                    fifo.popleft()  # cancelled while it waited
                    continue
                if not self._ready(p, item):
                    break
                fifo.popleft()
                self._post_item(p, item)
            owed = self._owed[p]
            if (owed and not self._ctrl_unacked[p]
                    and (owed >= self._half or self._requested[p])):
                if not self._free:
                    self._starved.add(p)
                elif self._sq[p] < self._max_sq:
                    self._send_frame(p, Kind.CREDIT, 0, 0, 0, 0, 0, 0)
                    self._ctrl_sent[p] = (self._ctrl_sent[p] + 1) & 0xFFFF
                    self._ctrl_unacked[p] = True
                    self._credit_messages += 1
        except VerbsError as exc:
            self._wire_failed(p, exc)
        finally:
            self._pumping = outer

    def _wire_failed(self, p: int, exc: VerbsError) -> None:
        """The wire to `p` failed: lose `p` at the end of this call."""
        self._lost[p] = True
        self._failing[p] = f"the wire to rank {p} failed: {exc}"

    def _send_frame(self, p: int, kind: Kind, flags: int, tag: int, length: int, msg_id: int,
                    addr: int, rkey: int, rec: _Rec | None = None,
                    data: memoryview | None = None) -> None:
        """Post one SEND from a free slot; the caller checked credit, slot and room."""
        slot = self._free.pop()
        off = slot * self._stride
        credits = self._credits[p] if kind == _CREDIT_FRAME else self._credits[p] - 1
        if credits < self._low:
            flags |= CREDIT_REQUEST
        pack_into(self._send_pool, off, self.rank, kind, flags, self._owed[p], self._acks[p],
                  tag, length, msg_id, addr, rkey)
        size = HEADER_SIZE
        if data is not None:
            self._sview[off + HEADER_SIZE:off + HEADER_SIZE + length] = data
            size += length
        try:
            sge = _new_tuple(_SGE, (self._saddr + off, size, self._slkey))
            self._wire.post_send(p, _new_tuple(_SEND_WR, (SEND_BASE + slot, _WR_SEND, sge,
                                                          *_SEND_DEFAULTS)))
        except VerbsError:
            self._free.append(slot)
            raise
        self._credits[p] = credits
        self._owed[p] = 0
        self._requested[p] = False
        self._sq[p] += 1
        self._slot_rec[slot] = rec
        self._slot_peer[slot] = p

    def _issue(self, p: int, rec: _Rec) -> None:
        """Put `rec` on the wire (its turn came and the resources are there)."""
        kind, op = rec.kind, rec.op
        if kind == _EAGER:
            n = len(op.buffer)
            self._send_frame(p, _EAGER_FRAME, 0, op.tag, n, 0, 0, 0, rec, op.buffer)
            rec.stage = _WIRE
            self._eager_sends += 1
            self._reports.append(Report(_SUBMITTED, op))
            return
        if kind == _RDV:
            n = len(op.buffer)
            if rec.scratch is not None:
                addr, rkey = rec.scratch.addr, rec.scratch.mr.rkey
            else:
                addr = _ADDRESS_OF(op.buffer)
                pin = self._pin(rec, addr, n, _REMOTE_READ)
                if pin is None:
                    return
                rkey = pin.mr.rkey
            rec.msg_id = next(self._ids)
            self._send_frame(p, _RTS_FRAME, 0, op.tag, n, rec.msg_id, addr, rkey, rec)
            self._rdv[rec.msg_id] = rec
            rec.stage = _WIRE
            self._rendezvous_sends += 1
            return
        wr_id = next(self._wr_ids)
        if kind == _RECV:
            arrival = rec.arrival
            assert arrival is not None
            m = min(arrival.length, len(op.buffer))
            addr = _ADDRESS_OF(op.buffer)
            pin = self._pin(rec, addr, m, _LOCAL_WRITE)
            if pin is None:  # the sender must hear of it, or it waits for ever
                self._enqueue(p, (Kind.FIN, FAILED, 0, 0, arrival.msg_id, 0, 0))
                return
            self._wire.post_send(p, _SEND_WR(wr_id, _WR_READ, _SGE(addr, m, pin.mr.lkey),
                                             True, arrival.addr, arrival.rkey))
            self._sq[p] += 1
        else:
            n = len(op.buffer)
            if rec.scratch is not None:
                local = _SGE(rec.scratch.addr, n, rec.scratch.mr.lkey)
            else:
                addr = _ADDRESS_OF(op.buffer)
                pin = self._pin(rec, addr, n, _LOCAL_WRITE if kind == _GET else _NO_ACCESS)
                if pin is None:
                    return
                local = _SGE(addr, n, pin.mr.lkey)
            if kind == _PUT:
                # Unsignalled: the READ behind it completes only after the WRITE landed.
                self._wire.post_send(p, _SEND_WR(wr_id + 1, _WR_WRITE, local, False,
                                                 op.address, rec.rkey))
                self._sq[p] += 1
                self._wire.post_send(p, _SEND_WR(wr_id, _WR_READ, None, True,
                                                 op.address, rec.rkey))
            else:
                self._wire.post_send(p, _SEND_WR(wr_id, _WR_READ, local, True,
                                                 op.address, rec.rkey))
            self._sq[p] += 1
            rec.stage = _WIRE
        rec.wired = True
        self._rdma[wr_id] = rec

    # -- completions -------------------------------------------------------------------

    def _received(self, wc: WorkCompletion, peer: int) -> None:
        """A frame from `peer` in receive buffer `wc.wr_id`: handle it, repost the buffer."""
        i = wc.wr_id
        if wc.status is not _SUCCESS:
            if wc.status is not _FLUSH:  # flushed: the SRQ is going away
                self._wire.post_recv(self._recv_wrs[i])
            return
        off = i * self._stride
        try:
            h = decode(self._recv_pool, off, wc.byte_len)
            if h.source != peer:
                raise ProtocolError(f"a frame on rank {peer}'s QP says it is from {h.source}")
        except ProtocolError as exc:
            self._broken(peer, exc)
            self._wire.post_recv(self._recv_wrs[i])
            return
        src, kind = peer, h.kind
        if self._lost[src]:
            self._wire.post_recv(self._recv_wrs[i])
            return
        if h.grant:
            self._credits[src] += h.grant
        if self._ctrl_unacked[src] and h.ack == self._ctrl_sent[src]:
            self._ctrl_unacked[src] = False
        if h.flags & CREDIT_REQUEST:
            self._requested[src] = True
        if kind == _EAGER_FRAME:
            self._eager_arrived(h, off + HEADER_SIZE, i)
        else:
            # Repost before anything can grant the buffer back to a peer.
            self._wire.post_recv(self._recv_wrs[i])
            if kind == _CREDIT_FRAME:
                self._acks[src] = (self._acks[src] + 1) & 0xFFFF
            else:
                self._owed[src] += 1
                self._control_arrived(h)
        self._pump(src)

    def _eager_arrived(self, h: Header, data: int, buffer: int) -> None:
        src, tag, n = h.source, h.tag, h.length
        rec = self._posted.match(src, tag)
        if rec is None:
            self._unexpected.add(src, tag, _Arrival(src, tag, n, bytes(
                self._rview[data:data + n])))
            self._wire.post_recv(self._recv_wrs[buffer])
            self._owed[src] += 1
            return
        buf = rec.op.buffer
        m = min(n, len(buf))
        buf[:m] = self._rview[data:data + m]
        self._wire.post_recv(self._recv_wrs[buffer])
        self._owed[src] += 1
        if rec.peer >= 0:
            self._active[rec.peer].discard(rec)
        rec.stage = _DONE
        self._received_data(rec, src, tag, n, m)

    def _control_arrived(self, h: Header) -> None:
        src, kind = h.source, h.kind
        if kind == _RTS_FRAME:
            if (src, h.msg_id) in self._rts:  # a sender never reuses an id
                self._broken_peer(src, f"rank {src} sent RTS {h.msg_id} twice")
                return
            arrival = _Arrival(src, h.tag, h.length, None, h.msg_id, h.addr, h.rkey)
            rec = self._posted.match(src, h.tag)
            if rec is None:
                self._unexpected.add(src, h.tag, arrival)
                self._rts[src, h.msg_id] = arrival
            else:
                self._start_read(rec, arrival)
        elif kind in (Kind.FIN, Kind.CANCEL_ACK) and self._unasked(src, kind, h.msg_id):
            self._broken_peer(src, f"rank {src} sent a {Kind(kind).name} nobody asked for")
        elif kind == _FIN_FRAME:
            rec = self._rdv.pop(h.msg_id, None)
            if rec is not None:
                if h.flags & FAILED:
                    self._fail(rec, FailureReason.TRANSPORT,
                               f"rank {src} could not read the message")
                else:
                    self._completed(rec, len(rec.op.buffer), src, rec.op.tag)
                self._finish(rec)
        elif kind == Kind.CANCEL_REQ:
            unmatched = self._rts.get((src, h.msg_id))
            if unmatched is not None:  # else matched: it is being read, a FIN follows
                del self._rts[src, h.msg_id]
                self._unexpected.remove(src, unmatched.tag, unmatched)
                self._enqueue(src, (Kind.CANCEL_ACK, 0, 0, 0, h.msg_id, 0, 0))
        elif kind == Kind.CANCEL_ACK:
            rec = self._rdv.pop(h.msg_id, None)
            if rec is not None:
                self._end(rec, Report(Input.CANCELLED, rec.op))
                self._finish(rec)
        elif kind == Kind.KEY_REQ:
            self._key_asked(src, h)
        elif kind in (Kind.KEY_REPLY, Kind.KEY_REFUSED):
            self._key_answered(src, h)
        elif kind == Kind.REVOKE:
            xid = h.tag
            self._keys[src] = [key for key in self._keys[src] if key.xid != xid]
            if (src, xid) in self._key_users:
                self._revoked.add((src, xid))  # acked when its last user ends
            else:
                self._enqueue(src, (Kind.REVOKE_ACK, 0, xid, 0, 0, 0, 0))
        else:  # REVOKE_ACK
            x = self._exposed.get(h.tag)
            if x is not None and x.revoking and src in x.waiting:
                x.waiting.discard(src)
                if not x.waiting:
                    self._unexposed(x)

    def _unasked(self, src: int, kind: int, msg_id: int) -> bool:
        """Whether this FIN or CANCEL_ACK from `src` answers nothing it may: a rendezvous
        send of ours to another rank, or a cancel we never asked for."""
        rec = self._rdv.get(msg_id)
        return rec is not None and (rec.peer != src
                                    or (kind == Kind.CANCEL_ACK and not rec.cancel_sent))

    def _key_asked(self, src: int, h: Header) -> None:
        for x in self._exposed.values():
            if not x.revoking and x.region.contains(h.addr, h.length):
                x.granted.add(src)
                region = x.region
                self._enqueue(src, (Kind.KEY_REPLY, 0, x.xid, region.length, h.msg_id,
                                    region.address, x.mr.rkey if x.mr is not None else 0))
                return
        self._enqueue(src, (Kind.KEY_REFUSED, 0, 0, 0, h.msg_id, 0, 0))

    def _key_answered(self, src: int, h: Header) -> None:
        request = self._key_requests.get(h.msg_id)
        if request is None or request.peer != src:
            self._broken_peer(src, f"an answer to key request {h.msg_id} nobody made")
            return
        if h.kind == Kind.KEY_REPLY and not (
                h.addr <= request.addr
                and request.addr + request.length <= h.addr + h.length):
            self._broken_peer(src, "a key for a region that does not contain the range")
            return
        del self._key_requests[h.msg_id]
        del self._key_request_of[src, request.addr, request.length]
        if h.kind == Kind.KEY_REPLY:
            key = _Key(h.addr, h.length, h.rkey, h.tag)
            self._keys[src].append(key)
            for rec in request.waiters:
                if rec.stage != _DONE:
                    self._start_one_sided(rec, key)
            return
        for rec in request.waiters:
            if rec.stage != _DONE:
                self._fail(rec, FailureReason.REMOTE_ACCESS,
                           f"[{request.addr:#x}, +{request.length}) is not inside a region "
                           f"rank {src} exposed")
                self._finish(rec)

    def _sent(self, wc: WorkCompletion) -> None:
        """A SEND from slot `wc.wr_id - SEND_BASE` completed."""
        slot = wc.wr_id - SEND_BASE
        rec, p = self._slot_rec[slot], self._slot_peer[slot]
        self._slot_rec[slot] = None
        self._free.append(slot)
        self._sq[p] -= 1
        if rec is not None:
            ok = wc.status is _SUCCESS
            if rec.kind == _EAGER:
                if ok:
                    self._completed(rec, len(rec.op.buffer), p, rec.op.tag)
                else:
                    self._wc_failed(rec, wc)
                self._finish(rec)
            elif not ok:  # an RTS: on success the FIN ends it
                self._wc_failed(rec, wc)
                self._finish(rec)
        if self._starved:
            starved = self._starved
            self._starved = set()
            for q in starved:
                self._pump(q)
        if self._fifo[p] or self._owed[p]:  # else nothing can be waiting for this
            self._pump(p)

    def _rdma_done(self, wc: WorkCompletion) -> None:
        wr_id = wc.wr_id
        read_id = wr_id & ~1
        rec = self._rdma.get(read_id)
        if rec is None:
            return
        if wr_id != read_id:  # a put's unsignalled WRITE reports only a failure
            self._wc_failed(rec, wc)
            return
        del self._rdma[read_id]
        p, kind = rec.peer, rec.kind
        self._sq[p] -= 2 if kind == _PUT else 1
        rec.wired = False
        ok = wc.status is _SUCCESS
        if kind == _RECV:
            if ok:
                self._read_done(rec)
            else:
                self._wc_failed(rec, wc)
                arrival = rec.arrival
                assert arrival is not None
                self._finish(rec)
                self._enqueue(p, (Kind.FIN, FAILED, 0, 0, arrival.msg_id, 0, 0))
        else:
            if ok and not rec.ended:
                n = len(rec.op.buffer)
                if kind == _GET and rec.scratch is not None:
                    rec.op.buffer[:] = rec.scratch.view[:n]
                self._completed(rec, n, p, 0)
            elif not ok:
                self._wc_failed(rec, wc)
            self._finish(rec)
        self._pump(p)

    def _probed(self, wc: WorkCompletion) -> None:
        p = wc.wr_id - PROBE_BASE
        self._sq[p] -= 1
        if wc.status is _SUCCESS:
            self._pump(p)
        elif not self._lost[p]:
            self._wire_failed(p, VerbsError(f"rank {p} did not answer a probe ({wc.status.name})"))

    def _read_done(self, rec: _Rec) -> None:
        """`rec`'s rendezvous data is in (or there was no room to read any): FIN, report."""
        arrival = rec.arrival
        assert arrival is not None
        n = arrival.length
        m = min(n, len(rec.op.buffer))
        self._finish(rec)
        self._enqueue(arrival.source, (_FIN_FRAME, TRUNCATED if m < n else 0, 0, 0,
                                       arrival.msg_id, 0, 0))
        self._received_data(rec, arrival.source, arrival.tag, n, m)

    # -- ending operations -------------------------------------------------------------

    def _end(self, rec: _Rec, report: Report) -> None:
        """The one terminal report of `rec`.

        The operation lets go of `rec` (a later cancel finds nothing to do): the
        wire may hold `rec` a while longer, but the cycle op -> rec -> op is broken,
        so that reference counting frees the message, not the cyclic collector.
        """
        if not rec.ended:
            rec.ended = True
            rec.op.transport_data = None
            self._live -= 1
            self._reports.append(report)

    def _completed(self, rec: _Rec, length: int, peer: int, tag: int) -> None:
        if not rec.ended:  # `_end`, inlined: this is every message's path
            rec.ended = True
            rec.op.transport_data = None
            self._live -= 1
            self._reports.append(Report(_COMPLETED, rec.op, length, peer, tag))

    def _received_data(self, rec: _Rec, source: int, tag: int, n: int, m: int) -> None:
        """A receive got `m` bytes of an `n`-byte message."""
        if m < n:
            self._end(rec, Report(
                Input.FAILED, rec.op, m, source, tag,
                failure(FailureReason.TRUNCATED,
                        f"a message of {n} bytes arrived for a buffer of {m} bytes")))
        else:
            self._completed(rec, n, source, tag)

    def _fail(self, rec: _Rec, reason: FailureReason, detail: str) -> None:
        self._end(rec, Report(Input.FAILED, rec.op, 0, None, None, failure(reason, detail)))

    def _wc_failed(self, rec: _Rec, wc: WorkCompletion) -> None:
        self._fail(rec, _REASONS.get(wc.status, FailureReason.TRANSPORT),
                   f"{'SEND' if wc.wr_id < RDMA_BASE else 'RDMA'} to rank "
                   f"{rec.peer} ended with {wc.status.name}")

    def _lost_at_post(self, rec: _Rec) -> None:
        self._fail(rec, FailureReason.PEER_UNREACHABLE, f"rank {rec.op.peer} is unreachable")
        rec.stage = _DONE

    def _finish(self, rec: _Rec) -> None:
        """The wire is done with `rec`: release what it holds."""
        rec.stage = _DONE
        if rec.pin is not None:
            self._pins.release(rec.pin)
            rec.pin = None
        if rec.scratch is not None:
            self._release_scratch(rec.scratch)
            rec.scratch = None
        if rec.key >= 0:
            self._unuse_key(rec.peer, rec.key)
            rec.key = -1
        if rec.kind == _RDV:
            self._rdv.pop(rec.msg_id, None)
        if rec.peer >= 0:
            self._active[rec.peer].discard(rec)

    def _unuse_key(self, p: int, xid: int) -> None:
        users = self._key_users[p, xid] - 1
        if users:
            self._key_users[p, xid] = users
            return
        del self._key_users[p, xid]
        if (p, xid) in self._revoked:
            self._revoked.discard((p, xid))
            self._enqueue(p, (Kind.REVOKE_ACK, 0, xid, 0, 0, 0, 0))

    def _unexposed(self, x: _Exposed) -> None:
        del self._exposed[x.xid]
        if x.mr is not None:
            x.mr.dereg()
        assert x.done is not None
        x.done()

    # -- broken and lost peers ---------------------------------------------------------

    def _broken(self, peer: int, exc: ProtocolError) -> None:
        """A malformed frame: the peer whose QP it came on is broken."""
        self._protocol_errors += 1
        if 0 <= peer < self.size:
            self._broken_peer(peer, f"rank {peer} sent a malformed frame: {exc}")

    def _broken_peer(self, p: int, detail: str) -> None:
        if not self._lost[p]:
            self._lost[p] = True
            self._failing[p] = detail

    def _settle(self) -> None:
        """Lose the peers found broken during this call (now that no handler is midway)."""
        while self._failing:
            p, detail = self._failing.popitem()
            self._lose(p, detail)

    def _lose(self, p: int, detail: str) -> None:
        self._fifo[p].clear()
        self._starved.discard(p)
        self._keys[p] = []
        for request_id in [i for i, r in self._key_requests.items() if r.peer == p]:
            request = self._key_requests.pop(request_id)
            del self._key_request_of[p, request.addr, request.length]
        for key in [key for key in self._rts if key[0] == p]:
            arrival = self._rts.pop(key)
            self._unexpected.remove(p, arrival.tag, arrival)
        self._revoked = {key for key in self._revoked if key[0] != p}
        for rec in list(self._active[p]):
            if rec.stage == _POSTED:
                self._posted.remove(rec.op.peer, rec.op.tag, rec)
            self._fail(rec, FailureReason.PEER_UNREACHABLE, detail)
            if not rec.wired:  # else its flushed completion releases it
                self._finish(rec)
        for x in list(self._exposed.values()):
            x.granted.discard(p)
            if x.revoking and p in x.waiting:
                x.waiting.discard(p)
                if not x.waiting:
                    self._unexposed(x)

    # -- registered memory -------------------------------------------------------------

    def _pin(self, rec: _Rec, addr: int, n: int, access: Access) -> Pin | None:
        """Register `n` bytes of `rec`'s buffer (at `addr`) through the pin cache;
        on failure end `rec`."""
        try:
            rec.pin = self._pins.acquire(addr, n, access, rec.op.buffer.obj)
        except VerbsError as exc:
            self._fail(rec, FailureReason.RESOURCES, f"cannot register the buffer: {exc}")
            self._finish(rec)
            return None
        return rec.pin

    def _scratch(self, rec: _Rec) -> _Scratch | None:
        """A registered buffer for `rec`'s copy; on failure end `rec`."""
        size = max(PAGE, 1 << (len(rec.op.buffer) - 1).bit_length())
        free = self._scratch_free.get(size)
        if free:
            self._scratch_kept -= size
            scratch = rec.scratch = free.pop()
            return scratch
        view = memoryview(bytearray(size))
        try:
            mr = self._pd.reg_mr(_ADDRESS_OF(view), size, _SCRATCH_ACCESS)
        except VerbsError as exc:
            self._fail(rec, FailureReason.RESOURCES, f"cannot register a copy: {exc}")
            self._finish(rec)
            return None
        scratch = rec.scratch = _Scratch(size, mr, view, mr.addr)
        return scratch

    def _release_scratch(self, scratch: _Scratch) -> None:
        if self._scratch_kept + scratch.size <= SCRATCH_KEEP:
            self._scratch_kept += scratch.size
            self._scratch_free.setdefault(scratch.size, []).append(scratch)
        else:
            scratch.mr.dereg()
