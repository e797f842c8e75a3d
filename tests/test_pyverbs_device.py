"""The pyverbs device (`mate.transports.ibverbs.pyverbs_device`).

Without hardware: every pyverbs name the module uses (its `USES` table) is
checked against the installed pyverbs, including that each call accepts the
arguments passed; the enums are checked against libibverbs' numbers; the work
requests, QP attributes and completions are built from real pyverbs objects;
and the loader and the "missing" messages are checked in subprocesses.

With an RDMA device (an HCA, or rxe): a loopback pair of RC QPs on one port
moves data by SEND/RECV, RDMA WRITE and READ, fails with REM_ACCESS_ERR, and
raises events on the channel's descriptor. Those tests skip where pyverbs finds
no device.
"""

from __future__ import annotations

import ast
import ctypes
import inspect
import re
import select
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from mate.errors import InvalidArgument
from mate.transports.ibverbs import pyverbs_device as pd
from mate.transports.ibverbs.verbs import (
    SGE,
    Access,
    CompletionQueue,
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


def _load() -> pd.Pyverbs | None:
    try:
        return pd.load_pyverbs()
    except InvalidArgument:
        return None


PV = _load()
needs_pyverbs = pytest.mark.skipif(
    PV is None, reason="pyverbs not importable: python3-pyverbs (rdma-core) is not installed")
needs_device = pytest.mark.skipif(not pd.available(), reason="no RDMA device (pyverbs finds none)")


def _pv() -> pd.Pyverbs:
    assert PV is not None
    return PV


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=60, check=False)


# -- finding pyverbs -----------------------------------------------------------------------


def test_import_does_not_import_pyverbs() -> None:
    done = _run("""
        import sys
        import mate.transports.ibverbs.pyverbs_device
        loaded = [m for m in sys.modules if m == "pyverbs" or m.startswith("pyverbs.")]
        assert not loaded, loaded
    """)
    assert done.returncode == 0, done.stderr


# Run in a subprocess whose imports of pyverbs fail, looking only in the given directories.
WITHOUT_PYVERBS = """
    import sys
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name == "pyverbs" or name.startswith("pyverbs."):
                raise ModuleNotFoundError(f"No module named {{name!r}}")
    sys.meta_path.insert(0, Refuse())
    from mate.errors import InvalidArgument
    from mate.transports.ibverbs import pyverbs_device
    pyverbs_device._system_site_dirs = lambda: {dirs!r}
    assert pyverbs_device.devices() == []
    assert pyverbs_device.available() is False
    try:
        pyverbs_device.open_device()
    except InvalidArgument as exc:
        print(exc)
    else:
        raise SystemExit("open_device() did not fail")
"""


def test_missing_pyverbs_is_named() -> None:
    done = _run(WITHOUT_PYVERBS.format(dirs=["/nonexistent"]))
    assert done.returncode == 0, done.stderr
    assert "pyverbs" in done.stdout
    assert "apt install python3-pyverbs" in done.stdout
    assert "rdma-core" in done.stdout


def test_pyverbs_for_another_python_is_named(tmp_path: Path) -> None:
    package = tmp_path / "pyverbs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "device.cpython-39-x86_64-linux-gnu.so").write_bytes(b"")
    done = _run(WITHOUT_PYVERBS.format(dirs=[str(tmp_path)]))
    assert done.returncode == 0, done.stderr
    assert f"found {package}, but built for another Python" in done.stdout


@needs_pyverbs
def test_loader_leaves_sys_path_and_logging_alone() -> None:
    done = _run("""
        import logging, sys
        from mate.transports.ibverbs import pyverbs_device
        path = list(sys.path)
        pv = pyverbs_device.load_pyverbs()
        assert sys.path == path, set(sys.path) ^ set(path)
        assert logging.getLogger().handlers == [], logging.getLogger().handlers
        assert logging.getLogger().level == logging.WARNING
        print(pv.device.__file__)
    """)
    assert done.returncode == 0, done.stderr
    assert "pyverbs" in done.stdout


@needs_pyverbs
def test_no_device_is_named() -> None:
    if pd.devices():
        pytest.skip("this host has RDMA devices")
    assert pd.available() is False
    with pytest.raises(InvalidArgument, match="no RDMA device found") as raised:
        pd.open_device()
    assert "rdma_rxe" in str(raised.value)
    assert 'device="soft"' in str(raised.value)
    with pytest.raises(InvalidArgument, match="no RDMA device found"):
        pd.open_device("mlx5_0")


# -- the pyverbs names used, against the installed pyverbs ----------------------------------

PROBE = "_mate_probe_"
# Arity messages of CPython's METH_NOARGS and METH_O (Cython 0.29 makes methods so).
REFUSED_EXTRA = {0: "takes no arguments", 1: "takes exactly one argument"}


def _check_call(use: pd.Use, target: Callable[..., Any], self_obj: object | None) -> None:
    """Call `target` as the module does, plus one unknown keyword, so that it fails parsing.

    Cython parses every argument before running the body: an error naming the
    probe means all the real arguments were accepted, and nothing ran.
    """
    def call(*args: Any, **keywords: Any) -> Any:
        return target(self_obj, *args, **keywords) if self_obj is not None else target(
            *args, **keywords)

    args = [None] * use.args
    keywords = dict.fromkeys(use.keywords)
    try:
        call(*args, **keywords, **{PROBE: None})
    except TypeError as exc:
        message = str(exc)
        if PROBE in message:
            return
        if "takes no keyword arguments" in message:
            assert not use.keywords, f"{use.name} takes no keywords: {message}"
            assert use.args in REFUSED_EXTRA, f"{use.name}: {message}"
            with pytest.raises(TypeError, match=REFUSED_EXTRA[use.args]):
                call(*args, None)
            return
        assert not re.search(r"positional argument|keyword argument|multiple values", message), (
            f"{use.name}: {message}")
    except Exception:  # the body ran: see below
        pass
    # The probe went into **kwargs: keyword names can only be checked against the docstring.
    doc = target.__doc__ or ""
    for keyword in use.keywords:
        assert re.search(rf":param {keyword}:|\*{keyword}\*", doc), (
            f"{use.name} takes **kwargs and does not document {keyword!r}")


def _bare(cls: Any) -> Any:
    """An instance whose __init__ has not run: Cython zeroes it, so its C pointers are NULL."""
    return cls.__new__(cls)


def _init_of(cls: Any) -> Any:
    return cls.__init__


def _instances(pv: pd.Pyverbs) -> dict[str, Callable[[], Any]]:
    """Real objects, for the attributes the module writes."""
    return {"qp.QPAttr": lambda: pv.qp.QPAttr(),
            "wr.SendWR": lambda: pd.send_wr(pv, pd.tables(pv),
                                            SendWR(1, Opcode.SEND, SGE(4096, 8, 1)))}


@needs_pyverbs
@pytest.mark.parametrize("use", pd.USES, ids=lambda use: f"{use.kind}:{use.name}")
def test_pyverbs_has_what_is_used(use: pd.Use) -> None:
    pv = _pv()
    module_name, *path = use.name.split(".")
    owner: Any = getattr(pv, module_name)
    for part in path[:-1]:
        owner = getattr(owner, part)
    last = path[-1]
    if use.optional and not hasattr(owner, last):
        return
    assert hasattr(owner, last), f"pyverbs has no {use.name}"
    if use.kind == "const":
        int(getattr(owner, last))
    elif use.kind == "call":
        obj = getattr(owner, last)
        if isinstance(obj, type):  # a constructor: __init__ on an instance never initialised
            _check_call(use, _init_of(obj), _bare(obj))
        elif isinstance(owner, type):
            _check_call(use, obj, _bare(owner))
        else:
            _check_call(use, obj, None)
    elif isinstance(owner, types.ModuleType):
        assert use.kind == "get"
    else:
        descriptor = inspect.getattr_static(owner, last)
        assert isinstance(descriptor, property | types.GetSetDescriptorType
                          | types.MemberDescriptorType), f"{use.name} is {descriptor!r}"
        if use.kind == "set":
            factory = _instances(pv).get(".".join([module_name, *path[:-1]]))
            assert factory is not None, f"no instance to write {use.name} on"
            instance = factory()
            value = getattr(instance, last)
            setattr(instance, last, value)
            assert type(value) is not int or getattr(instance, last) == value


def _names_in_source() -> set[str]:
    """The pyverbs names the code reaches: pv.<module>.<name>, x._pv.<module>.<name>, e.<name>."""
    tree = ast.parse(Path(pd.__file__).read_text())
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        inner = node.value
        if isinstance(inner, ast.Name) and inner.id == "e":
            found.add(f"enums.{node.attr}")
        elif isinstance(inner, ast.Attribute) and (
                (isinstance(inner.value, ast.Name) and inner.value.id == "pv")
                or (isinstance(inner.value, ast.Attribute) and inner.value.attr == "_pv")):
            found.add(f"{inner.attr}.{node.attr}")
    return found


def test_uses_cover_the_code() -> None:
    found = _names_in_source()
    assert len(found) > 40, found  # the scan sees the code
    listed = {use.name for use in pd.USES}
    missing = {name for name in found
               if not any(u == name or u.startswith(name + ".") for u in listed)}
    assert not missing, f"used but not in USES: {sorted(missing)}"


# libibverbs' numbers (verbs.h), written out, not taken from pyverbs.
IBV_QP_STATE, IBV_QP_ACCESS_FLAGS, IBV_QP_PKEY_INDEX, IBV_QP_PORT = 1, 8, 16, 32
IBV_QP_AV, IBV_QP_PATH_MTU, IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT = 128, 256, 512, 1024
IBV_QP_RNR_RETRY, IBV_QP_RQ_PSN, IBV_QP_MAX_QP_RD_ATOMIC = 2048, 4096, 8192
IBV_QP_MIN_RNR_TIMER, IBV_QP_SQ_PSN, IBV_QP_MAX_DEST_RD_ATOMIC = 32768, 65536, 131072
IBV_QP_DEST_QPN = 1 << 20


@needs_pyverbs
def test_enums_are_libibverbs_numbers() -> None:
    pv = _pv()
    for table in (pd.ACCESS_NAMES, pd.OPCODE_NAMES, pd.WC_OPCODE_NAMES, pd.WC_STATUS_NAMES,
                  pd.QP_STATE_NAMES):
        for member, name in table:
            assert int(getattr(pv.enums, name)) == member.value, (member, name)
    assert {member for member, _ in pd.WC_STATUS_NAMES} == set(WcStatus)
    assert {member for member, _ in pd.WC_OPCODE_NAMES} == set(WcOpcode)
    assert {member for member, _ in pd.OPCODE_NAMES} == set(Opcode)
    assert {member for member, _ in pd.QP_STATE_NAMES} == set(QPState)
    assert {member for member, _ in pd.ACCESS_NAMES} == set(Access)
    t = pd.tables(pv)
    assert pd.access_flags(t, Access.LOCAL_WRITE | Access.REMOTE_READ) == 1 | 4
    assert pd.access_flags(t, Access(0)) == 0
    assert t.signaled == 2  # IBV_SEND_SIGNALED
    for name, number in [("IBV_QPT_RC", 2), ("IBV_PORT_ACTIVE", 4),
                         ("IBV_LINK_LAYER_ETHERNET", 2), ("IBV_TRANSPORT_IB", 0),
                         ("IBV_GID_TYPE_SYSFS_ROCE_V2", 1), ("IBV_QP_STATE", IBV_QP_STATE),
                         ("IBV_QP_DEST_QPN", IBV_QP_DEST_QPN)]:
        assert int(getattr(pv.enums, name)) == number, name


# -- building pyverbs objects, no device needed ---------------------------------------------


@needs_pyverbs
def test_send_work_requests() -> None:
    pv = _pv()
    t = pd.tables(pv)
    cases = [
        (SendWR(1, Opcode.SEND, SGE(4096, 5, 7)), 2, 1, 2),
        (SendWR(2, Opcode.SEND, None), 2, 0, 2),  # zero length: no SGE
        (SendWR(3, Opcode.RDMA_WRITE, SGE(4096, 5, 7), signaled=False, remote_addr=8192,
                rkey=9), 0, 1, 0),
        (SendWR(2**64 - 1, Opcode.RDMA_READ, SGE(4096, 5, 7), remote_addr=8192, rkey=9), 4, 1, 2),
    ]
    for wr, opcode, num_sge, flags in cases:
        built = pd.send_wr(pv, t, wr)
        try:
            assert (built.wr_id, built.opcode, built.num_sge, built.send_flags) == (
                wr.wr_id, opcode, num_sge, flags), wr
        finally:
            built.close()


@needs_pyverbs
def test_receive_work_request() -> None:
    built = pd.recv_wr(_pv(), RecvWR(42, SGE(4096, 64, 3)))
    try:
        assert (built.wr_id, built.num_sge) == (42, 1)
    finally:
        built.close()


@needs_pyverbs
def test_qp_transitions() -> None:
    pv = _pv()
    attr, mask = pd.init_attr(pv, 2)
    assert (attr.qp_state, attr.port_num, attr.pkey_index, attr.qp_access_flags) == (1, 2, 0, 7)
    assert mask == IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS

    remote = Endpoint(qp_num=0x1234, psn=0xABCDE, lid=17, gid=bytes(range(16)))
    rtr_mask = (IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)
    attr, mask = pd.rtr_attr(pv, remote, port=1, path_mtu=5, rd_atomic=4, sgid_index=None)
    assert mask == rtr_mask
    assert (attr.qp_state, attr.dest_qp_num, attr.rq_psn, attr.path_mtu) == (2, 0x1234, 0xABCDE, 5)
    assert (attr.max_dest_rd_atomic, attr.min_rnr_timer) == (4, pd.MIN_RNR_TIMER)
    ah = attr.ah_attr
    assert (ah.dlid, ah.port_num, ah.is_global) == (17, 1, 0)

    attr, mask = pd.rtr_attr(pv, remote, port=1, path_mtu=3, rd_atomic=4, sgid_index=3)
    ah = attr.ah_attr
    assert (ah.is_global, ah.sgid_index, ah.hop_limit) == (1, 3, pd.HOP_LIMIT)
    assert ah.dgid == "0001:0203:0405:0607:0809:0a0b:0c0d:0e0f"

    attr, mask = pd.rts_attr(pv, 0x123, 8)
    assert mask == (IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY
                    | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)
    assert (attr.qp_state, attr.sq_psn, attr.max_rd_atomic) == (3, 0x123, 8)
    assert (attr.timeout, attr.retry_cnt, attr.rnr_retry) == (
        pd.TIMEOUT, pd.RETRY_CNT, pd.RNR_RETRY)


@needs_pyverbs
def test_work_completions() -> None:
    pv = _pv()
    t = pd.tables(pv)

    def wc(wr_id: int, status: str, opcode: int, byte_len: int = 0) -> Any:
        return pv.cq.WC(wr_id=wr_id, status=int(getattr(pv.enums, status)), opcode=opcode,
                        byte_len=byte_len, qp_num=7)

    record = pd.SendRecord()
    for wr_id, opcode in [(1, WcOpcode.SEND), (2, WcOpcode.RDMA_READ), (3, WcOpcode.RDMA_WRITE),
                          (4, WcOpcode.SEND)]:
        record.add(wr_id, opcode)
    # Success: the HCA's opcode; 2 retires 1 (unsignalled) too.
    assert pd.work_completion(t, wc(2, "IBV_WC_SUCCESS", 2, 8), record) == WorkCompletion(
        2, WcStatus.SUCCESS, WcOpcode.RDMA_READ, 8, 7)
    assert pd.work_completion(t, wc(1, "IBV_WC_WR_FLUSH_ERR", 255), record).opcode is (
        WcOpcode.RECV)  # retired: not a send any more
    # A failed send's opcode (undefined from the HCA, 255 here) comes from the record.
    assert pd.work_completion(t, wc(3, "IBV_WC_REM_ACCESS_ERR", 255), record) == WorkCompletion(
        3, WcStatus.REM_ACCESS_ERR, WcOpcode.RDMA_WRITE, 0, 7)
    # A successful receive leaves the record alone, even with a send's wr_id.
    assert pd.work_completion(t, wc(4, "IBV_WC_SUCCESS", 128, 5), record) == WorkCompletion(
        4, WcStatus.SUCCESS, WcOpcode.RECV, 5, 7)
    assert pd.work_completion(t, wc(4, "IBV_WC_WR_FLUSH_ERR", 0), record).opcode is WcOpcode.SEND
    # Statuses verbs.py does not name are GENERAL_ERR; unknown QPs' failures are receives.
    assert pd.work_completion(t, wc(5, "IBV_WC_LOC_ACCESS_ERR", 0), None) == WorkCompletion(
        5, WcStatus.GENERAL_ERR, WcOpcode.RECV, 0, 7)
    with pytest.raises(VerbsError, match="opcode 129"):
        pd.work_completion(t, wc(6, "IBV_WC_SUCCESS", 129), None)


def test_send_record() -> None:
    record = pd.SendRecord()
    record.add(1, WcOpcode.SEND)
    record.add(2, WcOpcode.RDMA_WRITE)
    record.drop_newest()
    assert record.retire(2) is None
    assert record.retire(1) is WcOpcode.SEND
    assert record.retire(1) is None


def test_gid_choice() -> None:
    link_local = bytes.fromhex("fe800000000000000202c9fffe000001")
    ipv4 = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 1])
    assert pd.choose_gid_index([(0, link_local, False), (1, link_local, True), (2, ipv4, False),
                                (3, ipv4, True), (4, bytes(16), True)]) == 3
    assert pd.choose_gid_index([(0, link_local, False), (1, link_local, True),
                                (2, ipv4, False)]) == 1
    assert pd.choose_gid_index([(0, link_local, False), (2, ipv4, False)]) == 2
    assert pd.choose_gid_index([(0, bytes(16), True)]) is None


@needs_pyverbs
def test_gid_text_is_pyverbs_gid() -> None:
    gid = bytes.fromhex("fe800000000000000202c9fffe0a0b0c")
    assert pd.gid_bytes(_pv().addr.GID(pd.gid_text(gid)).gid) == gid
    with pytest.raises(VerbsError, match="16 bytes"):
        pd.gid_text(b"\x01")


# -- on a device: a loopback pair of RC QPs ----------------------------------------------------


class Pair(NamedTuple):
    dev: pd.PyverbsDevice
    pd_: pd.PyverbsPD
    channel: pd.PyverbsChannel
    send_cq: pd.PyverbsCQ
    recv_cq: pd.PyverbsCQ
    srq: pd.PyverbsSRQ
    a: pd.PyverbsQP
    b: pd.PyverbsQP


@pytest.fixture
def pair() -> Iterator[Pair]:
    dev = pd.open_device()
    try:
        protection = dev.alloc_pd()
        channel = dev.create_comp_channel()
        send_cq = dev.create_cq(256, channel)
        recv_cq = dev.create_cq(256, channel)
        srq = dev.create_srq(protection, 64)
        a = dev.create_qp(protection, send_cq, recv_cq, srq, max_send_wr=64)
        b = dev.create_qp(protection, send_cq, recv_cq, srq, max_send_wr=64)
        assert a.state is QPState.INIT
        a.connect(b.endpoint())
        b.connect(a.endpoint())
        assert (a.state, b.state) == (QPState.RTS, QPState.RTS)
        yield Pair(dev, protection, channel, send_cq, recv_cq, srq, a, b)
    finally:
        dev.close()


class Buffer:
    """Memory the test owns, registered with `access`."""

    def __init__(self, pair: Pair, size: int, access: Access, data: bytes = b"") -> None:
        self.memory = ctypes.create_string_buffer(data, size)
        self.addr = ctypes.addressof(self.memory)
        self.mr = pair.pd_.reg_mr(self.addr, size, access)

    def sge(self, length: int) -> SGE:
        return SGE(self.addr, length, self.mr.lkey)


def _wait(cq: CompletionQueue, count: int, timeout: float = 10.0) -> list[WorkCompletion]:
    deadline = time.monotonic() + timeout
    found: list[WorkCompletion] = []
    while len(found) < count:
        found += cq.poll(count - len(found))
        assert time.monotonic() < deadline, f"{len(found)} of {count} completions in {timeout} s"
    return found


def _readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


@needs_device
def test_endpoint(pair: Pair) -> None:
    endpoint = pair.a.endpoint()
    assert endpoint.qp_num == pair.a.qp_num
    assert 0 <= endpoint.psn < 2**24
    assert len(endpoint.gid) == 16 and endpoint.address == ""


@needs_device
def test_send_recv(pair: Pair) -> None:
    inbox = Buffer(pair, 64, Access.LOCAL_WRITE)
    outbox = Buffer(pair, 64, Access(0), b"hello")
    pair.srq.post_recv(RecvWR(1, inbox.sge(64)))
    pair.a.post_send(SendWR(2, Opcode.SEND, outbox.sge(5)))
    [sent] = _wait(pair.send_cq, 1)
    assert (sent.wr_id, sent.status, sent.opcode, sent.qp_num) == (
        2, WcStatus.SUCCESS, WcOpcode.SEND, pair.a.qp_num)
    assert _wait(pair.recv_cq, 1) == [WorkCompletion(1, WcStatus.SUCCESS, WcOpcode.RECV, 5,
                                                     pair.b.qp_num)]
    assert inbox.memory.raw[:5] == b"hello"


@needs_device
def test_zero_length_and_unsignalled_sends(pair: Pair) -> None:
    inbox = Buffer(pair, 64, Access.LOCAL_WRITE)
    outbox = Buffer(pair, 64, Access(0), b"x")
    pair.srq.post_recv(RecvWR(1, inbox.sge(32)))
    pair.srq.post_recv(RecvWR(2, SGE(inbox.addr + 32, 32, inbox.mr.lkey)))
    pair.a.post_send(SendWR(3, Opcode.SEND, None, signaled=False))
    pair.a.post_send(SendWR(4, Opcode.SEND, outbox.sge(1)))
    assert [wc.wr_id for wc in _wait(pair.send_cq, 1)] == [4]
    received = _wait(pair.recv_cq, 2)
    assert sorted(wc.wr_id for wc in received) == [1, 2]
    assert sorted(wc.byte_len for wc in received) == [0, 1]
    assert pair.send_cq.poll(4) == []


@needs_device
def test_rdma_write(pair: Pair) -> None:
    target = Buffer(pair, 64, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    source = Buffer(pair, 64, Access(0), b"written")
    pair.a.post_send(SendWR(5, Opcode.RDMA_WRITE, source.sge(7), remote_addr=target.addr + 8,
                            rkey=target.mr.rkey))
    [done] = _wait(pair.send_cq, 1)
    assert (done.wr_id, done.status, done.opcode) == (5, WcStatus.SUCCESS, WcOpcode.RDMA_WRITE)
    assert target.memory.raw[8:15] == b"written"
    assert pair.recv_cq.poll(1) == []


@needs_device
def test_rdma_read(pair: Pair) -> None:
    source = Buffer(pair, 64, Access.REMOTE_READ, b"read me")
    target = Buffer(pair, 64, Access.LOCAL_WRITE)
    pair.a.post_send(SendWR(6, Opcode.RDMA_READ, target.sge(7), remote_addr=source.addr,
                            rkey=source.mr.rkey))
    [done] = _wait(pair.send_cq, 1)
    assert (done.wr_id, done.status, done.opcode) == (6, WcStatus.SUCCESS, WcOpcode.RDMA_READ)
    assert target.memory.raw[:7] == b"read me"


@needs_device
def test_remote_access_error(pair: Pair) -> None:
    target = Buffer(pair, 64, Access.LOCAL_WRITE)  # no REMOTE_WRITE
    source = Buffer(pair, 64, Access(0), b"denied")
    pair.a.post_send(SendWR(7, Opcode.RDMA_WRITE, source.sge(6), remote_addr=target.addr,
                            rkey=target.mr.rkey))
    [failed] = _wait(pair.send_cq, 1)
    assert failed == WorkCompletion(7, WcStatus.REM_ACCESS_ERR, WcOpcode.RDMA_WRITE,
                                    failed.byte_len, pair.a.qp_num)
    assert pair.a.state is QPState.ERR
    assert target.memory.raw[:6] == bytes(6)
    with pytest.raises(VerbsError, match="not in RTS"):
        pair.a.post_send(SendWR(8, Opcode.SEND, None))


@needs_device
def test_channel_descriptor(pair: Pair) -> None:
    fd = pair.channel.fileno()
    assert pair.channel.get_cq_event() is None
    pair.recv_cq.req_notify()  # the send CQ stays unarmed: no event from it
    assert not _readable(fd, 0)
    inbox = Buffer(pair, 64, Access.LOCAL_WRITE)
    pair.srq.post_recv(RecvWR(1, inbox.sge(64)))
    pair.a.post_send(SendWR(2, Opcode.SEND, None))
    assert _readable(fd, 10)
    assert pair.channel.get_cq_event() is pair.recv_cq
    pair.recv_cq.ack_events(1)
    assert pair.channel.get_cq_event() is None
    assert not _readable(fd, 0)
    assert [wc.wr_id for wc in _wait(pair.recv_cq, 1)] == [1]
    assert [wc.wr_id for wc in _wait(pair.send_cq, 1)] == [2]


@needs_device
def test_to_error_and_close(pair: Pair) -> None:
    pair.b.to_error()
    assert pair.b.state is QPState.ERR
    with pytest.raises(VerbsError, match="not in RTS"):
        pair.b.post_send(SendWR(1, Opcode.SEND, None))
    region = Buffer(pair, 64, Access.LOCAL_WRITE).mr
    region.dereg()
    pair.dev.close()
    pair.dev.close()
    with pytest.raises(VerbsError, match="closed"):
        pair.send_cq.poll(1)


@needs_device
def test_unknown_device_is_named() -> None:
    with pytest.raises(InvalidArgument, match="no RDMA device named 'no-such-device'"):
        pd.open_device("no-such-device")
