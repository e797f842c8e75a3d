"""The ibverbs transport (SPEC §3 "ibverbs", thesis §5.3), in layers:

* `verbs.py`: the narrow verbs surface the engine uses;
* `soft.py`: a software RC device (no hardware needed), and
  `pyverbs_device.py`: the same surface over pyverbs on a real HCA;
* `wire.py` and `engine.py`: the protocol (credits, eager and rendezvous,
  matching tables, put/get with key requests), with no I/O;
* `pincache.py`: registrations of user memory, cached (§5.3.2);
* `progress.py`: the ``loop``, ``poll`` and ``thread`` progress modes;
* `bootstrap.py`: the exchange of QP endpoints (mate-run's rendezvous or MPI);
* `transport.py`: all of it wired together behind `mate.transports.base`.

Options to `mate.startup("ibverbs", ...)`, declared with their checks in
`mate.registry`: ``progress`` ("loop", "poll" or "thread"), ``device``
(None: pyverbs when an HCA exists, else "soft"), ``link`` (the soft device's
sockets: "unix" or "tcp"), ``eager_size``, ``credits`` and ``pin_limit``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from mate.errors import InvalidArgument
from mate.transports.base import Sink, Transport
from mate.transports.ibverbs import bootstrap
from mate.transports.ibverbs.verbs import Device, Endpoint

CQ_DEPTH = 1 << 16  # each CQ holds every completion a pass may find (SQs x max_send_wr)
MAX_SEND_WR = 1024  # work requests a QP's send queue holds


def open_device(device: str | None, link: str) -> Device:
    """The device to use: "soft", "pyverbs", or None (pyverbs if an HCA exists, else soft)."""
    from mate.transports.ibverbs import pyverbs_device

    if device == "pyverbs" or (device is None and pyverbs_device.available()):
        return pyverbs_device.open_device()
    if device not in (None, "soft"):
        raise InvalidArgument(f"device must be None, 'soft' or 'pyverbs', not {device!r}")
    from mate.transports.ibverbs import soft

    return soft.open_device(link=link)


async def open_transport(sink: Sink, loop: asyncio.AbstractEventLoop, *, handlers: str,
                         progress: str, device: str | None, link: str, eager_size: int,
                         credits: int, pin_limit: int) -> Transport:
    """This rank's ibverbs transport, connected to every rank; the registry checked options."""
    from mate.transports.ibverbs.engine import Engine
    from mate.transports.ibverbs.pincache import PinCache
    from mate.transports.ibverbs.transport import IbverbsTransport, _Wire

    rank, size = bootstrap.rank_and_size()
    dev = open_device(device, link)
    try:
        pd = dev.alloc_pd()
        channel = dev.create_comp_channel()
        send_cq = dev.create_cq(CQ_DEPTH, channel)
        recv_cq = dev.create_cq(CQ_DEPTH, channel)
        srq = dev.create_srq(pd, size * (credits + 1))
        qps = [dev.create_qp(pd, send_cq, recv_cq, srq, max_send_wr=MAX_SEND_WR)
               for _ in range(size)]
        engine = Engine(rank=rank, size=size, wire=_Wire(qps, srq), pd=pd,
                        pins=PinCache(pd, pin_limit), eager_size=eager_size, credits=credits,
                        max_send_wr=MAX_SEND_WR)
        engine.start()  # receive buffers are posted before any peer can send
        table = await bootstrap.exchange(bootstrap.table_of([qp.endpoint() for qp in qps]))
        remote = [Endpoint(qpn, psn, lid, bytes.fromhex(gid), address)
                  for qpn, psn, lid, gid, address in (table[peer][rank] for peer in range(size))]
        # Every QP connects at once: a connect may wait for the peer's side of it.
        with concurrent.futures.ThreadPoolExecutor(max_workers=size,
                                                   thread_name_prefix="mate-connect") as pool:
            await asyncio.gather(*(loop.run_in_executor(pool, qp.connect, endpoint)
                                   for qp, endpoint in zip(qps, remote, strict=True)))
    except BaseException:
        dev.close()
        raise
    return IbverbsTransport(sink, loop, rank=rank, size=size, device=dev, channel=channel,
                            send_cq=send_cq, recv_cq=recv_cq, qps=qps, engine=engine,
                            progress=progress)

