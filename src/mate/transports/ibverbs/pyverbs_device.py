"""The verbs surface (`verbs.py`) over pyverbs, rdma-core's Python bindings, on a real HCA.

Each `verbs.py` object wraps the pyverbs object of the same libibverbs name:
`Context` (with one port: its LID and, on RoCE, a GID), `PD`, `MR` over memory
the caller owns, `CQ`, `SRQ`, and RC `QP`s connected by hand (INIT -> RTR ->
RTS with an address vector: a LID on InfiniBand, a GRH to the peer's GID on
RoCE). iWARP devices (siw, ...) are refused: their QPs connect only through
rdma_cm, which this layer does not use.

Two things pyverbs does not offer are built here. A `verbs.CompletionChannel`
is an epoll descriptor over one pyverbs `CompChannel` per CQ, because pyverbs'
`get_cq_event` must be told which CQ to expect; and pyverbs before rdma-core 61
hides a channel's descriptor, which is then found in /proc/self/fd. A failed
completion's opcode is undefined in libibverbs, so each QP keeps a record of
its posted sends to say what failed.

Importing this module does not import pyverbs: `load_pyverbs` does, at first
use, from the environment or else from the system's Python directories (where
Debian's python3-pyverbs lives). `USES` lists every pyverbs name used here, for
tests/test_pyverbs_device.py to check against the installed pyverbs.

What was run where this was written: pyverbs 44 (Debian python3-pyverbs) was
imported and introspected, and every pyverbs object that needs no device (work
requests, QP attributes, completions, GIDs) was built and read back through this
module's helpers; there was no RDMA device, so nothing here has opened a
context, registered memory, connected a QP or moved data. The device tests in
tests/test_pyverbs_device.py do that where an HCA (or rxe) exists.
"""

from __future__ import annotations

import collections
import errno
import functools
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import random
import select
import sys
import threading
from types import ModuleType
from typing import Any, Literal, NamedTuple, TypeVar

from mate.errors import InvalidArgument
from mate.transports.ibverbs.verbs import (
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

# -- the verbs.py enums, named in libibverbs (pyverbs.enums) ------------------------------

ACCESS_NAMES: tuple[tuple[Access, str], ...] = (
    (Access.LOCAL_WRITE, "IBV_ACCESS_LOCAL_WRITE"),
    (Access.REMOTE_WRITE, "IBV_ACCESS_REMOTE_WRITE"),
    (Access.REMOTE_READ, "IBV_ACCESS_REMOTE_READ"),
)
OPCODE_NAMES: tuple[tuple[Opcode, str], ...] = (
    (Opcode.RDMA_WRITE, "IBV_WR_RDMA_WRITE"),
    (Opcode.SEND, "IBV_WR_SEND"),
    (Opcode.RDMA_READ, "IBV_WR_RDMA_READ"),
)
WC_OPCODE_NAMES: tuple[tuple[WcOpcode, str], ...] = (
    (WcOpcode.SEND, "IBV_WC_SEND"),
    (WcOpcode.RDMA_WRITE, "IBV_WC_RDMA_WRITE"),
    (WcOpcode.RDMA_READ, "IBV_WC_RDMA_READ"),
    (WcOpcode.RECV, "IBV_WC_RECV"),
)
WC_STATUS_NAMES: tuple[tuple[WcStatus, str], ...] = (
    (WcStatus.SUCCESS, "IBV_WC_SUCCESS"),
    (WcStatus.LOC_LEN_ERR, "IBV_WC_LOC_LEN_ERR"),
    (WcStatus.LOC_QP_OP_ERR, "IBV_WC_LOC_QP_OP_ERR"),
    (WcStatus.LOC_PROT_ERR, "IBV_WC_LOC_PROT_ERR"),
    (WcStatus.WR_FLUSH_ERR, "IBV_WC_WR_FLUSH_ERR"),
    (WcStatus.REM_INV_REQ_ERR, "IBV_WC_REM_INV_REQ_ERR"),
    (WcStatus.REM_ACCESS_ERR, "IBV_WC_REM_ACCESS_ERR"),
    (WcStatus.REM_OP_ERR, "IBV_WC_REM_OP_ERR"),
    (WcStatus.RETRY_EXC_ERR, "IBV_WC_RETRY_EXC_ERR"),
    (WcStatus.RNR_RETRY_EXC_ERR, "IBV_WC_RNR_RETRY_EXC_ERR"),
    (WcStatus.GENERAL_ERR, "IBV_WC_GENERAL_ERR"),
)
QP_STATE_NAMES: tuple[tuple[QPState, str], ...] = (
    (QPState.RESET, "IBV_QPS_RESET"),
    (QPState.INIT, "IBV_QPS_INIT"),
    (QPState.RTR, "IBV_QPS_RTR"),
    (QPState.RTS, "IBV_QPS_RTS"),
    (QPState.ERR, "IBV_QPS_ERR"),
)

# What a send work request completes as.
_COMPLETES_AS = {Opcode.SEND: WcOpcode.SEND, Opcode.RDMA_WRITE: WcOpcode.RDMA_WRITE,
                 Opcode.RDMA_READ: WcOpcode.RDMA_READ}

# RC connection parameters, those of rdma-core's tests and ibv_rc_pingpong.
MIN_RNR_TIMER = 12  # 0.64 ms before a sender retries a SEND that found no receive posted
TIMEOUT = 14  # 4.096 us * 2**14 = 67 ms before an unacknowledged packet is resent
RETRY_CNT = 7
RNR_RETRY = 7  # 7 = retry forever: the engine's credits, not the HCA, bound receives
HOP_LIMIT = 64  # RoCE v2 packets may cross IP routers
MAX_RD_ATOMIC = 16  # outstanding RDMA READs per QP, at most; lowered to what the HCA allows


# -- the pyverbs names used, for the test that checks them ------------------------------


class Use(NamedTuple):
    """One pyverbs name this module uses, and how.

    `name` is dotted from the pyverbs package ("cq.CQ.poll"). A "call" passes
    `args` positional arguments (after self) and the `keywords`; "get" and
    "set" read and write an attribute; "const" is an `enums` value. `optional`
    names are missing from some pyverbs releases, and the code checks first.
    """

    name: str
    kind: Literal["call", "get", "set", "const"]
    args: int = 0
    keywords: tuple[str, ...] = ()
    optional: bool = False


USES: tuple[Use, ...] = (
    Use("pyverbs_error.PyverbsError", "get"),
    Use("pyverbs_error.PyverbsRDMAError.error_code", "get"),
    Use("device.get_device_list", "call"),
    Use("device.Device.name", "get"),
    Use("device.Device.transport_type", "get"),
    Use("device.port_state_to_str", "call", 1),
    Use("device.Context", "call", 0, ("name",)),
    Use("device.Context.query_port", "call", 1),
    Use("device.Context.query_device", "call"),
    Use("device.Context.query_gid", "call", 2),
    Use("device.Context.query_gid_type", "call", 2),
    Use("device.Context.close", "call"),
    Use("device.PortAttr.state", "get"),
    Use("device.PortAttr.lid", "get"),
    Use("device.PortAttr.link_layer", "get"),
    Use("device.PortAttr.active_mtu", "get"),
    Use("device.PortAttr.gid_tbl_len", "get"),
    Use("device.DeviceAttr.max_cqe", "get"),
    Use("device.DeviceAttr.max_qp_rd_atom", "get"),
    Use("device.DeviceAttr.max_qp_init_rd_atom", "get"),
    Use("addr.GID", "call", 1),
    Use("addr.GID.gid", "get"),
    Use("addr.GlobalRoute", "call", 0, ("dgid", "sgid_index", "hop_limit")),
    Use("addr.AHAttr", "call", 0, ("dlid", "port_num", "is_global", "gr")),
    Use("pd.PD", "call", 1),
    Use("pd.PD.close", "call"),
    Use("mr.MR", "call", 3, ("address",)),
    Use("mr.MR.lkey", "get"),
    Use("mr.MR.rkey", "get"),
    Use("mr.MR.close", "call"),
    Use("cq.CompChannel", "call", 1),
    Use("cq.CompChannel.fd", "get", optional=True),
    Use("cq.CompChannel.get_cq_event", "call", 1),
    Use("cq.CompChannel.close", "call"),
    Use("cq.CQ", "call", 5),
    Use("cq.CQ.poll", "call", 1),
    Use("cq.CQ.req_notify", "call"),
    Use("cq.CQ.ack_events", "call", 1),
    Use("cq.CQ.close", "call"),
    Use("cq.WC.wr_id", "get"),
    Use("cq.WC.status", "get"),
    Use("cq.WC.opcode", "get"),
    Use("cq.WC.byte_len", "get"),
    Use("cq.WC.qp_num", "get"),
    Use("srq.SrqAttr", "call", 0, ("max_wr", "max_sge")),
    Use("srq.SrqInitAttr", "call", 1),
    Use("srq.SRQ", "call", 2),
    Use("srq.SRQ.post_recv", "call", 1),
    Use("srq.SRQ.close", "call"),
    Use("qp.QPCap", "call", 0, ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge")),
    Use("qp.QPInitAttr", "call", 0, ("qp_type", "scq", "rcq", "srq", "cap", "sq_sig_all")),
    Use("qp.QP", "call", 2),
    Use("qp.QP.qp_num", "get"),
    Use("qp.QP.qp_state", "get"),
    Use("qp.QP.modify", "call", 2),
    Use("qp.QP.query", "call", 1),
    Use("qp.QP.post_send", "call", 1),
    Use("qp.QP.close", "call"),
    Use("qp.QPAttr", "call", 0, ("qp_state", "port_num", "path_mtu")),
    *(Use(f"qp.QPAttr.{name}", "set") for name in (
        "pkey_index", "qp_access_flags", "dest_qp_num", "rq_psn", "max_dest_rd_atomic",
        "min_rnr_timer", "ah_attr", "timeout", "retry_cnt", "rnr_retry", "sq_psn",
        "max_rd_atomic")),
    Use("qp.QPAttr.qp_state", "get"),
    Use("wr.SGE", "call", 3),
    Use("wr.SGE.close", "call"),
    Use("wr.SendWR", "call", 0, ("wr_id", "opcode", "num_sge", "sg", "send_flags")),
    Use("wr.SendWR.num_sge", "set"),
    Use("wr.SendWR.set_wr_rdma", "call", 2),
    Use("wr.SendWR.close", "call"),
    Use("wr.RecvWR", "call", 0, ("wr_id", "num_sge", "sg")),
    Use("wr.RecvWR.close", "call"),
    *(Use(f"enums.{name}", "const") for table in (
        ACCESS_NAMES, OPCODE_NAMES, WC_OPCODE_NAMES, WC_STATUS_NAMES, QP_STATE_NAMES)
      for _, name in table),
    *(Use(f"enums.{name}", "const") for name in (
        "IBV_SEND_SIGNALED", "IBV_QPT_RC", "IBV_PORT_ACTIVE", "IBV_LINK_LAYER_ETHERNET",
        "IBV_TRANSPORT_IB", "IBV_GID_TYPE_SYSFS_ROCE_V2", "IBV_QP_STATE", "IBV_QP_PKEY_INDEX",
        "IBV_QP_PORT", "IBV_QP_ACCESS_FLAGS", "IBV_QP_AV", "IBV_QP_PATH_MTU",
        "IBV_QP_DEST_QPN", "IBV_QP_RQ_PSN", "IBV_QP_MAX_DEST_RD_ATOMIC",
        "IBV_QP_MIN_RNR_TIMER", "IBV_QP_TIMEOUT", "IBV_QP_RETRY_CNT", "IBV_QP_RNR_RETRY",
        "IBV_QP_SQ_PSN", "IBV_QP_MAX_QP_RD_ATOMIC")),
)


# -- finding pyverbs ------------------------------------------------------------------------


class Pyverbs(NamedTuple):
    """The pyverbs modules this backend uses, as `load_pyverbs` imported them."""

    device: ModuleType
    pd: ModuleType
    mr: ModuleType
    cq: ModuleType
    srq: ModuleType
    qp: ModuleType
    wr: ModuleType
    addr: ModuleType
    enums: ModuleType
    pyverbs_error: ModuleType


def _system_site_dirs() -> list[str]:
    """Where distributions install python3-pyverbs, outside any virtual environment."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return ["/usr/lib/python3/dist-packages", f"/usr/lib/{version}/dist-packages",
            f"/usr/lib/{version}/site-packages", f"/usr/lib64/{version}/site-packages",
            f"/usr/local/lib/{version}/dist-packages"]


def _built_for_this_python(package_dir: str) -> bool:
    return any(os.path.exists(os.path.join(package_dir, "device" + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def _import_package() -> None:
    """Import the `pyverbs` package: from sys.path, else from a system directory.

    Only the package is taken from a system directory (registered in
    sys.modules): putting the whole directory on sys.path would let its other
    packages shadow the environment's.
    """
    try:
        importlib.import_module("pyverbs")
        return
    except ImportError:
        pass
    other_python = []
    for directory in _system_site_dirs():
        spec = importlib.machinery.PathFinder.find_spec("pyverbs", [directory])
        if spec is None or spec.loader is None or not spec.submodule_search_locations:
            continue
        if not _built_for_this_python(spec.submodule_search_locations[0]):
            other_python.append(spec.submodule_search_locations[0])
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["pyverbs"]
            raise
        return
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = (f" (found {', '.join(other_python)}, but built for another Python than {version})"
             if other_python else "")
    raise InvalidArgument(
        f"the pyverbs device needs pyverbs, rdma-core's Python bindings, which this Python "
        f"({version}) cannot import{found}: install them with `apt install python3-pyverbs` "
        f"(Debian, Ubuntu; `dnf install python3-pyverbs` on Fedora, RHEL) or build rdma-core "
        f"with its Python bindings; looked on sys.path and in {', '.join(_system_site_dirs())}")


@functools.cache  # a failure is not cached: a later call looks again
def load_pyverbs() -> Pyverbs:
    """Import pyverbs (see `_import_package`); InvalidArgument saying what is missing."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        _import_package()
        modules = {name: importlib.import_module(f"pyverbs.{name}")
                   for name in Pyverbs._fields}
    except ImportError as exc:
        raise InvalidArgument(
            f"pyverbs, rdma-core's Python bindings, failed to import ({exc}): reinstall "
            f"python3-pyverbs and libibverbs1 (rdma-core) for this Python") from exc
    finally:
        # pyverbs.base calls logging.basicConfig() on import; the host's logging is not ours.
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
    return Pyverbs(**modules)


# -- devices ----------------------------------------------------------------------------------


def _device_list(pv: Pyverbs) -> list[Any]:
    try:
        return list(pv.device.get_device_list())
    except pv.pyverbs_error.PyverbsError:  # no RDMA subsystem at all (no /sys/class/infiniband)
        return []


def _usable(pv: Pyverbs, dev: Any) -> bool:
    """Whether QPs on `dev` connect by address vector: InfiniBand and RoCE, not iWARP."""
    return bool(dev.transport_type == pv.enums.IBV_TRANSPORT_IB)


def devices() -> list[str]:
    """The names of this host's RDMA devices; [] without pyverbs or devices."""
    try:
        pv = load_pyverbs()
    except InvalidArgument:
        return []
    return [dev.name.decode() for dev in _device_list(pv)]


def available() -> bool:
    """Whether pyverbs imports and finds a device it can drive (InfiniBand or RoCE)."""
    try:
        pv = load_pyverbs()
    except InvalidArgument:
        return False
    return any(_usable(pv, dev) for dev in _device_list(pv))


NO_DEVICE = (
    "no RDMA device found: pyverbs (libibverbs) lists none. It needs an RDMA NIC with its kernel "
    "driver and ib_uverbs loaded (mlx5_ib for ConnectX, ...), or a software RoCE device over an "
    "Ethernet interface (`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0`). "
    "Without RDMA hardware use device=\"soft\".")


def open_device(name: str | None = None, *, port: int = 1,
                gid_index: int | None = None) -> PyverbsDevice:
    """Open RDMA device `name` (None: the first InfiniBand or RoCE one) on `port`.

    `gid_index` picks the port's GID (None: on RoCE the best v2 GID, IPv4 first;
    on InfiniBand 0). InvalidArgument if pyverbs or the device is missing or unusable.
    """
    pv = load_pyverbs()
    listing = _device_list(pv)
    if not listing:
        raise InvalidArgument(NO_DEVICE)
    names = [dev.name.decode() for dev in listing]
    if name is None:
        usable = [dev.name.decode() for dev in listing if _usable(pv, dev)]
        if not usable:
            raise InvalidArgument(
                f"no InfiniBand or RoCE device among {names}: iWARP devices connect QPs only "
                f"through rdma_cm, which the pyverbs device does not use; use device=\"soft\"")
        name = usable[0]
    elif name not in names:
        raise InvalidArgument(f"no RDMA device named {name!r}; pyverbs finds {names}")
    elif not _usable(pv, listing[names.index(name)]):
        raise InvalidArgument(
            f"{name} is an iWARP device: its QPs connect only through rdma_cm, which the "
            f"pyverbs device does not use; use an InfiniBand or RoCE device or device=\"soft\"")
    return PyverbsDevice(pv, name, port=port, gid_index=gid_index)


# -- conversions, with no device needed ----------------------------------------------------


class Tables(NamedTuple):
    """The verbs.py enums as pyverbs' numbers, resolved once per `Pyverbs`."""

    access: tuple[tuple[Access, int], ...]
    wr_opcode: dict[Opcode, int]
    wc_opcode: dict[int, WcOpcode]
    wc_status: dict[int, WcStatus]
    qp_state: dict[int, QPState]
    qp_state_number: dict[QPState, int]
    signaled: int


@functools.cache
def tables(pv: Pyverbs) -> Tables:
    def number(name: str) -> int:
        return int(getattr(pv.enums, name))

    return Tables(
        access=tuple((flag, number(name)) for flag, name in ACCESS_NAMES),
        wr_opcode={opcode: number(name) for opcode, name in OPCODE_NAMES},
        wc_opcode={number(name): opcode for opcode, name in WC_OPCODE_NAMES},
        wc_status={number(name): status for status, name in WC_STATUS_NAMES},
        qp_state={number(name): state for state, name in QP_STATE_NAMES},
        qp_state_number={state: number(name) for state, name in QP_STATE_NAMES},
        signaled=number("IBV_SEND_SIGNALED"))


def access_flags(t: Tables, access: Access) -> int:
    return sum(number for flag, number in t.access if flag in access)


def gid_text(gid: bytes) -> str:
    """16 GID bytes as pyverbs writes a GID: eight groups of four hex digits."""
    if len(gid) != 16:
        raise VerbsError(f"a GID has 16 bytes, not {len(gid)}")
    digits = gid.hex()
    return ":".join(digits[i:i + 4] for i in range(0, 32, 4))


def gid_bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


def choose_gid_index(candidates: list[tuple[int, bytes, bool]]) -> int | None:
    """The RoCE GID to use from (index, gid, is RoCE v2): v2 over v1, IPv4 over IPv6.

    Both peers choose the same way, so they agree on the RoCE version; v2 is
    routable, and an IPv4-mapped GID is what an address on the interface gives.
    """
    def rank(candidate: tuple[int, bytes, bool]) -> tuple[bool, bool, int]:
        index, gid, v2 = candidate
        ipv4 = gid[:12] == bytes(10) + b"\xff\xff"
        return v2, ipv4, -index

    usable = [c for c in candidates if any(c[1])]
    return max(usable, key=rank)[0] if usable else None


def send_wr(pv: Pyverbs, t: Tables, wr: SendWR) -> Any:
    """The pyverbs SendWR for `wr`; the caller closes it (pyverbs up to 63 leaks it otherwise)."""
    sge = pv.wr.SGE(*wr.sge) if wr.sge is not None else pv.wr.SGE(0, 0, 0)
    try:
        flags = t.signaled if wr.signaled else 0
        pv_wr = pv.wr.SendWR(wr_id=wr.wr_id, opcode=t.wr_opcode[wr.opcode], num_sge=1,
                             sg=[sge], send_flags=flags)
    finally:
        sge.close()  # SendWR copied it
    if wr.sge is None:
        pv_wr.num_sge = 0  # pyverbs demands an SGE at construction; zero length has none
    if wr.opcode is not Opcode.SEND:
        pv_wr.set_wr_rdma(wr.rkey, wr.remote_addr)
    return pv_wr


def recv_wr(pv: Pyverbs, wr: RecvWR) -> Any:
    """The pyverbs RecvWR for `wr`; the caller closes it."""
    sge = pv.wr.SGE(*wr.sge)
    try:
        return pv.wr.RecvWR(wr_id=wr.wr_id, num_sge=1, sg=[sge])
    finally:
        sge.close()


def init_attr(pv: Pyverbs, port: int) -> tuple[Any, int]:
    """RESET -> INIT: the port, and what remote peers may do to our memory."""
    e = pv.enums
    attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_INIT, port_num=port)
    attr.pkey_index = 0
    attr.qp_access_flags = int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
                               | e.IBV_ACCESS_REMOTE_WRITE)
    mask = e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS
    return attr, int(mask)


def rtr_attr(pv: Pyverbs, remote: Endpoint, *, port: int, path_mtu: int, rd_atomic: int,
             sgid_index: int | None) -> tuple[Any, int]:
    """INIT -> RTR toward `remote`: by LID, or through a GRH to its GID when `sgid_index` is set."""
    e = pv.enums
    attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_RTR, port_num=port, path_mtu=path_mtu)
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = rd_atomic
    attr.min_rnr_timer = MIN_RNR_TIMER
    if sgid_index is None:
        attr.ah_attr = pv.addr.AHAttr(dlid=remote.lid, port_num=port, is_global=0)
    else:
        route = pv.addr.GlobalRoute(dgid=pv.addr.GID(gid_text(remote.gid)),
                                    sgid_index=sgid_index, hop_limit=HOP_LIMIT)
        attr.ah_attr = pv.addr.AHAttr(dlid=remote.lid, port_num=port, is_global=1, gr=route)
    mask = (e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN
            | e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)
    return attr, int(mask)


def rts_attr(pv: Pyverbs, psn: int, rd_atomic: int) -> tuple[Any, int]:
    """RTR -> RTS: our first PSN and the retry policy."""
    e = pv.enums
    attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_RTS)
    attr.timeout = TIMEOUT
    attr.retry_cnt = RETRY_CNT
    attr.rnr_retry = RNR_RETRY
    attr.sq_psn = psn
    attr.max_rd_atomic = rd_atomic
    mask = (e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY
            | e.IBV_QP_SQ_PSN | e.IBV_QP_MAX_QP_RD_ATOMIC)
    return attr, int(mask)


class SendRecord:
    """A QP's posted send work requests not yet known complete, oldest first.

    RC completes a send queue in order, so a completion retires its request
    and every earlier one (unsignalled ones report nothing on success). It is
    what names the opcode of a failed completion, which libibverbs leaves
    undefined. The wr_ids of a QP's sends must differ from those of receives
    sharing its CQ, or a failed receive could be taken for a send.
    """

    def __init__(self) -> None:
        self._posted: collections.deque[tuple[int, WcOpcode]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, wr_id: int, opcode: WcOpcode) -> None:
        with self._lock:
            self._posted.append((wr_id, opcode))

    def drop_newest(self) -> None:
        """Forget the last `add`: its post failed."""
        with self._lock:
            self._posted.pop()

    def retire(self, wr_id: int) -> WcOpcode | None:
        """Retire `wr_id` and what was posted before it; its opcode, or None if not a send."""
        with self._lock:
            for index, (posted, opcode) in enumerate(self._posted):
                if posted == wr_id:
                    for _ in range(index + 1):
                        self._posted.popleft()
                    return opcode
        return None


def work_completion(t: Tables, wc: Any, record: SendRecord | None) -> WorkCompletion:
    """The verbs.py completion for pyverbs `wc`, on a QP whose sends `record` holds."""
    # Statuses verbs.py does not name (LOC_ACCESS_ERR, BAD_RESP_ERR, ...) become GENERAL_ERR.
    status = t.wc_status.get(wc.status, WcStatus.GENERAL_ERR)
    opcode: WcOpcode | None
    if status is WcStatus.SUCCESS:
        opcode = t.wc_opcode.get(wc.opcode)
        if opcode is None:
            raise VerbsError(f"a completion with opcode {wc.opcode}, which is never posted here")
        if opcode is not WcOpcode.RECV and record is not None:
            record.retire(wc.wr_id)
    else:
        opcode = record.retire(wc.wr_id) if record is not None else None
        if opcode is None:  # not a send of this QP, so a receive
            opcode = WcOpcode.RECV
    return WorkCompletion(wc.wr_id, status, opcode, wc.byte_len, wc.qp_num)


def _verbs_error(what: str, exc: BaseException) -> VerbsError:
    return VerbsError(f"{what}: {exc}")


# -- comp channel descriptors -----------------------------------------------------------

_EVENT_FD_LINK = "anon_inode:[infinibandevent]"  # what the kernel names a verbs event file
_fd_search = threading.Lock()


def _event_fds() -> set[int]:
    found = set()
    for entry in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{entry}") == _EVENT_FD_LINK:
                found.add(int(entry))
        except OSError:  # closed since listed
            continue
    return found


def _comp_channel(pv: Pyverbs, ctx: Any) -> tuple[Any, int]:
    """A new pyverbs CompChannel and its file descriptor."""
    if hasattr(pv.cq.CompChannel, "fd"):  # rdma-core 61 and later
        channel = pv.cq.CompChannel(ctx)
        return channel, int(channel.fd)
    # Earlier pyverbs hides the descriptor: it is the one event file the creation added.
    with _fd_search:
        before = _event_fds()
        channel = pv.cq.CompChannel(ctx)
        added = _event_fds() - before
    if len(added) != 1:
        channel.close()
        raise VerbsError(f"cannot tell the new completion channel's descriptor among {added} "
                         f"(another thread created a verbs event file at the same time?)")
    return channel, added.pop()


# -- the device -------------------------------------------------------------------------------


class _Owned:
    """What a device made, and that only it accepts back."""

    device: PyverbsDevice


_T = TypeVar("_T", bound=_Owned)



class PyverbsDevice(Device):
    """One port of an opened HCA: `verbs.Device` over a pyverbs `Context`.

    Every call takes the device's lock, so `close` cannot free what another
    thread is using (pyverbs would pass freed pointers to libibverbs); pyverbs
    holds the GIL through each verb anyway.
    """

    def __init__(self, pv: Pyverbs, name: str, *, port: int, gid_index: int | None) -> None:
        self.name = name
        self.port = port
        self._pv = pv
        self._t = tables(pv)
        self._lock = threading.Lock()
        self._closed = False
        self._pds: list[PyverbsPD] = []
        self._mrs: set[PyverbsMR] = set()
        self._channels: list[PyverbsChannel] = []
        self._cqs: list[PyverbsCQ] = []
        self._srqs: list[PyverbsSRQ] = []
        self._qps: dict[int, PyverbsQP] = {}
        try:
            self._ctx = pv.device.Context(name=name)
        except pv.pyverbs_error.PyverbsError as exc:
            raise VerbsError(f"cannot open RDMA device {name}: {exc}") from exc
        try:
            self._query_port(gid_index)
        except BaseException:
            self._ctx.close()
            raise

    def _query_port(self, gid_index: int | None) -> None:
        pv, ctx, port = self._pv, self._ctx, self.port
        try:
            attr = ctx.query_port(port)
        except pv.pyverbs_error.PyverbsError as exc:
            raise InvalidArgument(f"{self.name} has no port {port}: {exc}") from exc
        if attr.state != pv.enums.IBV_PORT_ACTIVE:
            raise InvalidArgument(
                f"port {port} of {self.name} is {pv.device.port_state_to_str(attr.state)}, "
                f"not active: check its link (`ibv_devinfo -d {self.name}`)")
        self.lid: int = attr.lid
        self.roce = attr.link_layer == pv.enums.IBV_LINK_LAYER_ETHERNET
        self.path_mtu: int = attr.active_mtu  # the peer's port is assumed to allow as much
        if gid_index is None:
            gid_index = self._roce_gid_index(attr.gid_tbl_len) if self.roce else 0
        try:
            self.gid = gid_bytes(ctx.query_gid(port, gid_index).gid)
            device_attr = ctx.query_device()
        except pv.pyverbs_error.PyverbsError as exc:
            raise InvalidArgument(f"GID {gid_index} of {self.name} port {port}: {exc}") from exc
        if self.roce and not any(self.gid):
            raise InvalidArgument(f"GID {gid_index} of {self.name} port {port} is empty: RoCE "
                                  f"needs an IP address on the device's interface")
        self.gid_index = gid_index
        self._max_cqe: int = device_attr.max_cqe
        self._rd_atomic = min(MAX_RD_ATOMIC, device_attr.max_qp_rd_atom,
                              device_attr.max_qp_init_rd_atom)

    def _roce_gid_index(self, table_len: int) -> int:
        pv, candidates = self._pv, []
        for index in range(table_len):
            try:
                gid = gid_bytes(self._ctx.query_gid(self.port, index).gid)
                kind = self._ctx.query_gid_type(self.port, index)
            except pv.pyverbs_error.PyverbsError:  # an unpopulated entry
                continue
            candidates.append((index, gid, kind == pv.enums.IBV_GID_TYPE_SYSFS_ROCE_V2))
        chosen = choose_gid_index(candidates)
        if chosen is None:
            raise InvalidArgument(f"{self.name} port {self.port} is RoCE but has no GID: give "
                                  f"its network interface an IP address")
        return chosen

    def _check_open(self) -> None:
        if self._closed:
            raise VerbsError(f"device {self.name} is closed")

    def _own(self, obj: object, kind: type[_T]) -> _T:
        if not isinstance(obj, kind) or obj.device is not self:
            raise VerbsError(f"{obj!r} is not a {kind.__name__} of device {self.name}")
        return obj

    def alloc_pd(self) -> PyverbsPD:
        with self._lock:
            self._check_open()
            try:
                pd = PyverbsPD(self, self._pv.pd.PD(self._ctx))
            except self._pv.pyverbs_error.PyverbsError as exc:
                raise _verbs_error("alloc_pd", exc) from exc
            self._pds.append(pd)
            return pd

    def create_comp_channel(self) -> PyverbsChannel:
        with self._lock:
            self._check_open()
            channel = PyverbsChannel(self)
            self._channels.append(channel)
            return channel

    def create_cq(self, depth: int, channel: CompletionChannel | None) -> PyverbsCQ:
        with self._lock:
            self._check_open()
            owner = self._own(channel, PyverbsChannel) if channel is not None else None
            pv = self._pv
            try:
                pv_channel, fd = _comp_channel(pv, self._ctx) if owner else (None, -1)
                try:
                    # Capped at what the HCA allows (rxe: 32767): the depth asked is a bound.
                    cq = PyverbsCQ(self, pv.cq.CQ(self._ctx, min(depth, self._max_cqe), None,
                                                  pv_channel, 0))
                except BaseException:
                    if pv_channel is not None:
                        pv_channel.close()
                    raise
            except pv.pyverbs_error.PyverbsError as exc:
                raise _verbs_error("create_cq", exc) from exc
            if owner is not None:
                owner.attach(fd, pv_channel, cq)
            self._cqs.append(cq)
            return cq

    def create_srq(self, pd: ProtectionDomain, max_wr: int) -> PyverbsSRQ:
        with self._lock:
            self._check_open()
            pv = self._pv
            init = pv.srq.SrqInitAttr(pv.srq.SrqAttr(max_wr=max_wr, max_sge=1))
            try:
                srq = PyverbsSRQ(self, pv.srq.SRQ(self._own(pd, PyverbsPD).pd, init))
            except pv.pyverbs_error.PyverbsError as exc:
                raise _verbs_error("create_srq", exc) from exc
            self._srqs.append(srq)
            return srq

    def create_qp(self, pd: ProtectionDomain, send_cq: CompletionQueue,
                  recv_cq: CompletionQueue, srq: SharedReceiveQueue,
                  max_send_wr: int) -> PyverbsQP:
        with self._lock:
            self._check_open()
            pv, e = self._pv, self._pv.enums
            # Receives come from the SRQ, so the QP has no receive queue of its own.
            cap = pv.qp.QPCap(max_send_wr=max_send_wr, max_recv_wr=0, max_send_sge=1,
                              max_recv_sge=0)
            attr = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._own(send_cq, PyverbsCQ).cq,
                                    rcq=self._own(recv_cq, PyverbsCQ).cq,
                                    srq=self._own(srq, PyverbsSRQ).srq, cap=cap, sq_sig_all=0)
            try:
                qp = pv.qp.QP(self._own(pd, PyverbsPD).pd, attr)
            except pv.pyverbs_error.PyverbsError as exc:
                raise _verbs_error("create_qp", exc) from exc
            try:
                qp.modify(*init_attr(pv, self.port))
            except pv.pyverbs_error.PyverbsError as exc:
                qp.close()
                raise _verbs_error("create_qp: RESET -> INIT", exc) from exc
            wrapper = PyverbsQP(self, qp, psn=random.getrandbits(24))
            self._qps[wrapper.qp_num] = wrapper
            return wrapper

    def close(self) -> None:
        """Destroy QPs, SRQs, CQs, channels, MRs and PDs, in that order, then the context."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pv_objects = [*(qp.qp for qp in self._qps.values()), *(s.srq for s in self._srqs),
                          *(cq.cq for cq in self._cqs),
                          *(c for channel in self._channels for c in channel.pv_channels()),
                          *(mr.mr for mr in self._mrs), *(pd.pd for pd in self._pds), self._ctx]
            self._qps.clear()
            failures = []
            for pv_object in pv_objects:
                try:
                    pv_object.close()
                except self._pv.pyverbs_error.PyverbsError as exc:
                    failures.append(exc)
            for channel in self._channels:
                channel.close_epoll()
        if failures:
            raise _verbs_error(f"closing {self.name}", failures[0]) from failures[0]


class PyverbsPD(_Owned, ProtectionDomain):
    def __init__(self, device: PyverbsDevice, pd: Any) -> None:
        self.device = device
        self.pd = pd

    def reg_mr(self, addr: int, length: int, access: Access) -> PyverbsMR:
        device = self.device
        if not addr:
            raise VerbsError("reg_mr of address 0 (pyverbs would register a buffer of its own)")
        with device._lock:
            device._check_open()
            flags = access_flags(device._t, access)
            try:
                mr = device._pv.mr.MR(self.pd, length, flags, address=addr)
            except device._pv.pyverbs_error.PyverbsError as exc:
                hint = (" (is the locked-memory limit, `ulimit -l`, too low?)"
                        if getattr(exc, "error_code", None) == errno.ENOMEM else "")
                raise _verbs_error(f"reg_mr of {length} bytes at {addr:#x}{hint}", exc) from exc
            region = PyverbsMR(device, mr, addr, length, access)
            device._mrs.add(region)
            return region


class PyverbsMR(_Owned, MemoryRegion):
    def __init__(self, device: PyverbsDevice, mr: Any, addr: int, length: int,
                 access: Access) -> None:
        self.device = device
        self.mr = mr
        self.addr = addr
        self.length = length
        self.lkey: int = mr.lkey
        self.rkey: int = mr.rkey
        self.access = access

    def dereg(self) -> None:
        device = self.device
        with device._lock:
            if device._closed:  # closing the device deregistered it
                return
            device._mrs.discard(self)
            try:
                self.mr.close()
            except device._pv.pyverbs_error.PyverbsError as exc:
                raise _verbs_error("dereg_mr", exc) from exc


class PyverbsChannel(_Owned, CompletionChannel):
    """An epoll descriptor over one pyverbs CompChannel per CQ.

    pyverbs' `get_cq_event` takes the CQ it expects and fails on another, and
    a failed event cannot be acknowledged (destroying that CQ would then wait
    forever); with one CQ per pyverbs channel the expected CQ is always right.
    """

    def __init__(self, device: PyverbsDevice) -> None:
        self.device = device
        self._epoll = select.epoll()
        self._members: dict[int, tuple[Any, PyverbsCQ]] = {}

    def attach(self, fd: int, pv_channel: Any, cq: PyverbsCQ) -> None:
        os.set_blocking(fd, False)  # ibv_get_cq_event then fails with EAGAIN instead of waiting
        self._members[fd] = (pv_channel, cq)
        self._epoll.register(fd, select.EPOLLIN)

    def pv_channels(self) -> list[Any]:
        return [pv_channel for pv_channel, _ in self._members.values()]

    def close_epoll(self) -> None:
        self._epoll.close()

    def fileno(self) -> int:
        return self._epoll.fileno()

    def get_cq_event(self) -> PyverbsCQ | None:
        device = self.device
        with device._lock:
            device._check_open()
            for fd, _ in self._epoll.poll(0):
                pv_channel, cq = self._members[fd]
                try:
                    pv_channel.get_cq_event(cq.cq)
                except device._pv.pyverbs_error.PyverbsError as exc:
                    if getattr(exc, "error_code", None) in (errno.EAGAIN, errno.EWOULDBLOCK):
                        continue  # taken by another thread since the poll
                    raise _verbs_error("get_cq_event", exc) from exc
                return cq
        return None


class PyverbsCQ(_Owned, CompletionQueue):
    def __init__(self, device: PyverbsDevice, cq: Any) -> None:
        self.device = device
        self.cq = cq

    def poll(self, max_entries: int) -> list[WorkCompletion]:
        device = self.device
        with device._lock:
            device._check_open()
            try:
                _, wcs = self.cq.poll(max_entries)
            except device._pv.pyverbs_error.PyverbsError as exc:
                raise _verbs_error("poll_cq", exc) from exc
            completions = []
            for wc in wcs:
                qp = device._qps.get(wc.qp_num)
                completions.append(work_completion(device._t, wc,
                                                   qp.sent if qp is not None else None))
            return completions

    def req_notify(self) -> None:
        device = self.device
        with device._lock:
            device._check_open()
            try:
                self.cq.req_notify()
            except device._pv.pyverbs_error.PyverbsError as exc:
                raise _verbs_error("req_notify_cq", exc) from exc

    def ack_events(self, count: int) -> None:
        device = self.device
        with device._lock:
            device._check_open()
            self.cq.ack_events(count)  # ibv_ack_cq_events cannot fail


class PyverbsSRQ(_Owned, SharedReceiveQueue):
    def __init__(self, device: PyverbsDevice, srq: Any) -> None:
        self.device = device
        self.srq = srq

    def post_recv(self, wr: RecvWR) -> None:
        device = self.device
        with device._lock:
            device._check_open()
            pv_wr = recv_wr(device._pv, wr)
            try:
                self.srq.post_recv(pv_wr)
            except device._pv.pyverbs_error.PyverbsError as exc:
                raise _verbs_error("post_srq_recv", exc) from exc
            finally:
                pv_wr.close()


class PyverbsQP(_Owned, QueuePair):
    def __init__(self, device: PyverbsDevice, qp: Any, *, psn: int) -> None:
        self.device = device
        self.qp = qp
        self.qp_num: int = qp.qp_num
        self.psn = psn
        self.sent = SendRecord()

    @property
    def state(self) -> QPState:
        device = self.device
        with device._lock:
            device._check_open()
            try:
                attr, _ = self.qp.query(device._pv.enums.IBV_QP_STATE)
            except device._pv.pyverbs_error.PyverbsError as exc:
                raise _verbs_error("query_qp", exc) from exc
        # SQD and SQE are not states an RC QP of ours enters; taken as failed.
        return device._t.qp_state.get(attr.qp_state, QPState.ERR)

    def endpoint(self) -> Endpoint:
        return Endpoint(self.qp_num, self.psn, self.device.lid, self.device.gid)

    def connect(self, remote: Endpoint) -> None:
        device = self.device
        if device.roce and len(remote.gid) != 16:
            raise VerbsError(f"the peer's endpoint {remote} has no GID, which RoCE needs")
        pv = device._pv
        rtr = rtr_attr(pv, remote, port=device.port, path_mtu=device.path_mtu,
                       rd_atomic=device._rd_atomic,
                       sgid_index=device.gid_index if device.roce else None)
        rts = rts_attr(pv, self.psn, device._rd_atomic)
        with device._lock:
            device._check_open()
            for step, (attr, mask) in (("INIT -> RTR", rtr), ("RTR -> RTS", rts)):
                try:
                    self.qp.modify(attr, mask)
                except pv.pyverbs_error.PyverbsError as exc:
                    raise _verbs_error(f"connect QP {self.qp_num}: {step}", exc) from exc

    def post_send(self, wr: SendWR) -> None:
        device = self.device
        with device._lock:
            device._check_open()
            # libibverbs' view of the state (what we last set): a QP the HCA moved to ERR
            # takes posts and flushes them, as the engine learns from their completions.
            if self.qp.qp_state != device._t.qp_state_number[QPState.RTS]:
                raise VerbsError(f"post_send on QP {self.qp_num}, which is not in RTS")
            pv_wr = send_wr(device._pv, device._t, wr)
            # Recorded first: the completion may be polled before post_send returns.
            self.sent.add(wr.wr_id, _COMPLETES_AS[wr.opcode])
            try:
                self.qp.post_send(pv_wr)
            except device._pv.pyverbs_error.PyverbsError as exc:
                self.sent.drop_newest()
                raise _verbs_error(f"post_send on QP {self.qp_num}", exc) from exc
            finally:
                pv_wr.close()

    def to_error(self) -> None:
        device = self.device
        with device._lock:
            device._check_open()
            e = device._pv.enums
            try:
                self.qp.modify(device._pv.qp.QPAttr(qp_state=e.IBV_QPS_ERR), int(e.IBV_QP_STATE))
            except device._pv.pyverbs_error.PyverbsError as exc:
                raise _verbs_error(f"QP {self.qp_num} -> ERR", exc) from exc
