"""put and get by size (`rma="auto"`, the default): native below a threshold,
emulated from it on.

Why two. MPICH moves a passive-target `Rput`/`Rget` only while the *target's*
library runs, a fragment per MPI call. A target driven from an event loop
makes one MPI call per turn of its loop, so a large native transfer crawls
(`bench/rma_target.py`: a 4 MiB `Rput` at 29 % of its speed against a target
that sits in MPI). The origin now tells the target (a nudge), which then
pokes MPI's progress between passes (`mate.transports.mpi.progress`), and a
large native put reaches 0.8-0.9x raw; the emulated protocol still does
better, moving a large transfer as one two-sided message into (or out of) the
region, which MPICH carries at full speed with the same target, at the price
of a request and a reply. Small transfers are the other way round: native
costs one flush, emulated a round trip of control messages. `rma_threshold`
(default 64 KiB, where the two cross in `mate-bench put/get` on this host) is
where a transfer changes side.

Both strategies keep one table of this rank's regions (`Regions`): a region
is attached to the window (native) and found by the control channel's
requests (emulated). Unexposing revokes the native keys peers hold, then
waits for emulated transfers in flight: once it returns, neither can touch
the region. Control messages go to the strategy whose protocol they belong
to; an operation's strategy is a function of its size, so its cancel finds
it again.
"""

from __future__ import annotations

from mpi4py import MPI

from mate.schedule import Region
from mate.transports.base import Operation
from mate.transports.mpi.control import (
    Control,
    ControlChannel,
    Lease,
    Revoke,
    RevokeAck,
    TableRequest,
)
from mate.transports.mpi.progress import Engine
from mate.transports.mpi.reports import Reporter
from mate.transports.mpi.rma import CallOnLoop, Rma
from mate.transports.mpi.rma_emulated import EmulatedRma
from mate.transports.mpi.rma_native import NativeRma

_NATIVE_CONTROL = (TableRequest, Revoke, RevokeAck, Lease)


class AutoRma(Rma):
    name = "auto"

    def __init__(self, mypid: int, comm: MPI.Intracomm, engine: Engine, control: ControlChannel,
                 report: Reporter, call_on_loop: CallOnLoop, threshold: int) -> None:
        self.native = NativeRma(mypid, comm, engine, control, report, call_on_loop)
        super().__init__(mypid, engine, control, report, call_on_loop, self.native.regions)
        self.threshold = threshold
        self.emulated = EmulatedRma(mypid, engine, control, report, call_on_loop, self.regions)

    def _strategy(self, op: Operation) -> Rma:
        return self.emulated if len(op.buffer) >= self.threshold else self.native

    def submit(self, op: Operation) -> None:
        self._strategy(op).submit(op)

    def start(self, op: Operation) -> None:
        self._strategy(op).start(op)

    def cancel(self, op: Operation) -> None:
        self._strategy(op).cancel(op)

    def on_control(self, source: int, message: Control) -> None:
        if isinstance(message, _NATIVE_CONTROL):
            self.native.on_control(source, message)
        else:
            self.emulated.on_control(source, message)

    def expose(self, view: memoryview) -> Region:
        return self.native.expose(view)  # attached, and in the table both read

    async def unexpose(self, region: Region) -> None:
        await self.native.unexpose(region)  # out of the table, keys revoked, detached
        await self.emulated.unexpose(region)  # and no emulated transfer left in it

    def cancel_all(self) -> None:
        self.native.cancel_all()
        self.emulated.cancel_all()

    def free(self) -> None:
        self.native.free()

    def counters(self) -> dict[str, int]:
        return {**self.native.counters(), **self.emulated.counters()}
