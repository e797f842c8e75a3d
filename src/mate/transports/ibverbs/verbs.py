"""The narrow verbs surface that the ibverbs protocol engine is written against.

Two devices implement it: `soft.py`, a software RC device in user space for
hosts without RDMA hardware, and `pyverbs_device.py`, the same calls over
pyverbs on a real HCA. The engine (`engine.py`) sees only what is here, so
swapping the device changes no engine code.

The names and numbers are those of libibverbs (`ibv_access_flags`,
`ibv_wr_opcode`, `ibv_wc_status`, `ibv_wc_opcode`, `ibv_qp_state`), so a
reader can hold this file beside `verbs.h`. Work requests and completions are
small immutable tuples: they are made once per message on the hot path.

Threads: a device may be used from the event loop's thread and from one
progress thread at once; each device makes its own calls safe for that.
"""

from __future__ import annotations

import abc
import enum
from typing import NamedTuple


class Access(enum.IntFlag):
    """`ibv_access_flags`: what a memory region allows."""

    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4


class Opcode(enum.IntEnum):
    """`ibv_wr_opcode`: what a send work request does."""

    RDMA_WRITE = 0
    SEND = 2
    RDMA_READ = 4


class WcOpcode(enum.IntEnum):
    """`ibv_wc_opcode`: what a work completion completes."""

    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    RECV = 128


class WcStatus(enum.IntEnum):
    """`ibv_wc_status`: how a work request ended."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    GENERAL_ERR = 21


class QPState(enum.IntEnum):
    """`ibv_qp_state`: the RC queue pair's state machine."""

    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    ERR = 6


class SGE(NamedTuple):
    """`ibv_sge`: a scatter-gather element, memory named by address and local key."""

    addr: int
    length: int
    lkey: int


class SendWR(NamedTuple):
    """`ibv_send_wr` with one SGE. `remote_addr`/`rkey` for RDMA READ and WRITE.

    A zero-length transfer has `sge=None`. An unsignalled request
    (`signaled=False`) produces a completion only if it fails.
    """

    wr_id: int
    opcode: Opcode
    sge: SGE | None
    signaled: bool = True
    remote_addr: int = 0
    rkey: int = 0


class RecvWR(NamedTuple):
    """`ibv_recv_wr` with one SGE: a receive buffer posted to the SRQ."""

    wr_id: int
    sge: SGE


class WorkCompletion(NamedTuple):
    """`ibv_wc`: the end of one work request.

    `byte_len` is meaningful for RECV (bytes received); `qp_num` names the
    local QP the request was on (for RECV through an SRQ: the QP it arrived on).
    """

    wr_id: int
    status: WcStatus
    opcode: WcOpcode
    byte_len: int
    qp_num: int


class Endpoint(NamedTuple):
    """What a peer needs to connect its QP to ours (exchanged at bootstrap).

    `lid`/`gid` address the port on InfiniBand and RoCE; `address` is how the
    soft device reaches this one ("" on hardware). `bootstrap.table_of` encodes a
    rank's endpoints for the exchange.
    """

    qp_num: int
    psn: int
    lid: int = 0
    gid: bytes = b""
    address: str = ""


class VerbsError(Exception):
    """A verbs call failed (bad argument, resources, a device error)."""


class MemoryRegion(abc.ABC):
    """`ibv_mr`: registered memory [addr, addr + length) with its keys."""

    addr: int
    length: int
    lkey: int
    rkey: int
    access: Access

    @abc.abstractmethod
    def dereg(self) -> None:
        """`ibv_dereg_mr`: after it returns, neither key reaches the memory."""


class ProtectionDomain(abc.ABC):
    @abc.abstractmethod
    def reg_mr(self, addr: int, length: int, access: Access) -> MemoryRegion:
        """`ibv_reg_mr` of memory the caller keeps alive until `dereg`."""


class CompletionQueue(abc.ABC):
    @abc.abstractmethod
    def poll(self, max_entries: int) -> list[WorkCompletion]:
        """`ibv_poll_cq`: up to `max_entries` completions, oldest first; never blocks."""

    @abc.abstractmethod
    def req_notify(self) -> None:
        """`ibv_req_notify_cq`: raise one event on the channel at the next completion."""

    @abc.abstractmethod
    def ack_events(self, count: int) -> None:
        """`ibv_ack_cq_events`."""


class CompletionChannel(abc.ABC):
    """`ibv_comp_channel`: a file descriptor that is readable when an armed CQ has an event."""

    @abc.abstractmethod
    def fileno(self) -> int: ...

    @abc.abstractmethod
    def get_cq_event(self) -> CompletionQueue | None:
        """`ibv_get_cq_event` without blocking: the CQ that raised an event, or None."""


class SharedReceiveQueue(abc.ABC):
    @abc.abstractmethod
    def post_recv(self, wr: RecvWR) -> None:
        """`ibv_post_srq_recv`: one buffer for an incoming SEND on any QP."""


class QueuePair(abc.ABC):
    """`ibv_qp` of type RC: RESET -> INIT -> RTR -> RTS, ERR on any fault."""

    qp_num: int

    @property
    @abc.abstractmethod
    def state(self) -> QPState: ...

    @abc.abstractmethod
    def endpoint(self) -> Endpoint:
        """This QP's side of the connection, for the peer's `connect`."""

    @abc.abstractmethod
    def connect(self, remote: Endpoint) -> None:
        """INIT -> RTR -> RTS against the peer's QP; may block until the peer connects too."""

    @abc.abstractmethod
    def post_send(self, wr: SendWR) -> None:
        """`ibv_post_send`: carried out in posting order (RC); VerbsError if not in RTS."""

    @abc.abstractmethod
    def to_error(self) -> None:
        """Move to ERR: outstanding work requests complete with WR_FLUSH_ERR."""


class Device(abc.ABC):
    """An opened device context (`ibv_open_device`) and the objects made from it."""

    name: str

    @abc.abstractmethod
    def alloc_pd(self) -> ProtectionDomain: ...

    @abc.abstractmethod
    def create_comp_channel(self) -> CompletionChannel: ...

    @abc.abstractmethod
    def create_cq(self, depth: int, channel: CompletionChannel | None) -> CompletionQueue: ...

    @abc.abstractmethod
    def create_srq(self, pd: ProtectionDomain, max_wr: int) -> SharedReceiveQueue: ...

    @abc.abstractmethod
    def create_qp(self, pd: ProtectionDomain, send_cq: CompletionQueue,
                  recv_cq: CompletionQueue, srq: SharedReceiveQueue,
                  max_send_wr: int) -> QueuePair:
        """An RC QP in INIT, its receives taken from `srq`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Destroy every object made from this context and close it."""
