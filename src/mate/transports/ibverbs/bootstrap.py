"""Bootstrap: every rank learns every other rank's QP endpoints before connecting.

Verbs has no name service: to connect an RC QP a rank needs its peer's QP
number, PSN and address (LID/GID, or the soft device's socket). Each rank
publishes one blob (its endpoints, one per peer) and receives everyone's, in
rank order. Two ways to do that exchange:

* under ``mpiexec``: an ``allgather`` on ``MPI.COMM_WORLD`` (mpi4py);
* under ``mate-run --transport ibverbs``: a *rendezvous* that mate-run serves
  on loopback. mate-run gives each rank ``MATE_RANK``, ``MATE_SIZE``,
  ``MATE_RENDEZVOUS`` (host:port) and ``MATE_SECRET``. A rank proves it knows
  the secret by answering a fresh challenge with an HMAC (the secret never
  crosses the socket); one that cannot is refused and disconnected, and the
  rendezvous waits on for the real rank. Once all ranks have checked in, each
  gets the table.

A process may open several worlds in turn (a test module does): once a
table is served the rendezvous starts afresh, so every world's ranks meet
their own peers, as successive ``allgather`` calls would. (No rank can check
in for the next world before every rank checked in for this one: it waits
for this one's table.)

A world forms only when all N ranks check in, so once a rank's process has
ended (mate-run tells the rendezvous, `ended`), no world still forming can:
its waiting ranks are answered with an error naming the rank that ended, and
so is every later check-in. Their `startup` fails instead of waiting forever.

Frames on the rendezvous socket are one JSON object per line.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from mate.errors import InvalidArgument

logger = logging.getLogger("mate")

RANK, SIZE, RENDEZVOUS, SECRET = "MATE_RANK", "MATE_SIZE", "MATE_RENDEZVOUS", "MATE_SECRET"
LINE_LIMIT = 1 << 20  # the longest frame a rendezvous accepts (bytes)



def started_by_mate_run(environ: Mapping[str, str] | None = None) -> bool:
    return RENDEZVOUS in (os.environ if environ is None else environ)


def _proof(secret: str, challenge: str) -> str:
    return hmac.new(bytes.fromhex(secret), bytes.fromhex(challenge), hashlib.sha256).hexdigest()


def _frame(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def _read(reader: asyncio.StreamReader) -> Any:
    line = await reader.readline()
    if not line.endswith(b"\n"):
        raise ConnectionError("the rendezvous connection closed")
    return json.loads(line)


def rank_and_size(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """This process's rank and the job's size, from mate-run's environment (`environ`,
    by default this process's) or MPI."""
    environ = os.environ if environ is None else environ
    if started_by_mate_run(environ):
        try:
            rank, size = int(environ[RANK]), int(environ[SIZE])
        except (KeyError, ValueError) as exc:
            raise InvalidArgument(f"mate-run's environment is incomplete: {exc}") from None
        return rank, size
    comm = _mpi_world()
    return comm.Get_rank(), comm.Get_size()


def _mpi_world() -> Any:
    try:
        from mpi4py import MPI
    except ImportError:
        raise InvalidArgument(
            "the ibverbs transport was not started by a launcher: run it under "
            "`mate-run -n N --transport ibverbs` (or mpiexec, with mpi4py installed)") from None
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI.COMM_WORLD


async def exchange(blob: Any, environ: Mapping[str, str] | None = None) -> list[Any]:
    """Publish `blob` (JSON-able) and return every rank's, indexed by rank. `environ`
    (by default this process's environment) says whether mate-run started the rank."""
    environ = os.environ if environ is None else environ
    if not started_by_mate_run(environ):
        table: list[Any] = await asyncio.to_thread(_mpi_world().allgather, blob)
        return table
    rank, _ = rank_and_size(environ)
    host, _, port = environ[RENDEZVOUS].rpartition(":")
    try:
        secret = environ[SECRET]
        bytes.fromhex(secret)  # checked before the rendezvous sees anything of this rank
        port_number = int(port)
    except (KeyError, ValueError) as exc:
        raise InvalidArgument(f"mate-run's environment is incomplete: {exc!r}") from None
    reader, writer = await asyncio.open_connection(host, port_number, limit=LINE_LIMIT)
    try:
        challenge = (await _read(reader))["challenge"]
        writer.write(_frame({"rank": rank,
                             "proof": _proof(secret, challenge), "blob": blob}))
        await writer.drain()
        reply = await _read(reader)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    if "table" not in reply:
        raise ConnectionError(f"the rendezvous refused rank {rank}: {reply.get('error')}")
    table = reply["table"]
    return list(table)


class Rendezvous:
    """The server side, run by mate-run: collect `size` blobs, serve the table, start afresh."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.secret = secrets.token_hex(32)
        self.refused = 0  # connections that did not prove the secret (for tests and logs)
        # rank -> (blob, the connection waiting for the table), for the world forming now
        self._members: dict[int, tuple[Any, asyncio.StreamWriter]] = {}
        self._gone = ""  # why no world can form any more: a rank's process ended
        self._server: asyncio.base_events.Server | None = None
        self.address = ""

    async def start(self, host: str = "127.0.0.1") -> str:
        self._server = await asyncio.start_server(self._serve, host, 0, limit=LINE_LIMIT)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{host}:{port}"
        return self.address

    def environment(self, rank: int) -> dict[str, str]:
        return {RANK: str(rank), SIZE: str(self.size), RENDEZVOUS: self.address,
                SECRET: self.secret}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        challenge = secrets.token_hex(16)
        try:
            writer.write(_frame({"challenge": challenge}))
            hello = await asyncio.wait_for(_read(reader), 30)
            rank = hello["rank"]
            proof = str(hello["proof"])
            if not hmac.compare_digest(proof, _proof(self.secret, challenge)):
                raise PermissionError("wrong secret")
            members = self._members
            if not (isinstance(rank, int) and 0 <= rank < self.size) or rank in members:
                raise PermissionError(f"bad or repeated rank {rank!r}")
            if self._gone:
                writer.write(_frame({"error": self._gone}))
                writer.close()
                return
        except (PermissionError, KeyError, TypeError, ValueError, ConnectionError,
                asyncio.TimeoutError, RecursionError) as exc:  # (JSON nested too deep)
            self.refused += 1
            logger.warning("mate-run: rendezvous refused a connection: %s", exc)
            with contextlib.suppress(ConnectionError):
                writer.write(_frame({"error": "refused"}))
                await writer.drain()
            writer.close()
            return
        members[rank] = (hello["blob"], writer)
        if len(members) == self.size:
            self._members = {}
            table = _frame({"table": [members[r][0] for r in range(self.size)]})
            for _, waiting in members.values():
                with contextlib.suppress(ConnectionError):
                    waiting.write(table)
                    await waiting.drain()
                waiting.close()

    def ended(self, rank: int, how: str) -> None:
        """Rank `rank`'s process ended (`how`: its status, as mate-run words it): refuse
        every world still forming, now and later."""
        self._gone = self._gone or (
            f"rank {rank} ended with status {how} before every rank checked in")
        members, self._members = self._members, {}
        for _, waiting in members.values():
            waiting.write(_frame({"error": self._gone}))
            waiting.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for _, writer in self._members.values():
            writer.close()
        self._members = {}


def table_of(endpoints: Sequence[Any]) -> list[list[Any]]:
    """Endpoints as JSON-able lists (a blob); gid bytes as hex."""
    return [[e.qp_num, e.psn, e.lid, e.gid.hex(), e.address] for e in endpoints]
