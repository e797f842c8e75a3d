"""The litmus language: small straight-line programs of mate calls, one per rank.

A `Litmus` test declares each rank's memory (named byte variables, `Var`)
and each rank's program, a list of instructions:

* `Write(var, value)` and `Read(var, reg)`: local stores and loads of every
  byte of a variable (a read lands in a named register);
* `Send`, `Recv`, `Put`, `Get`: the four calls, each naming the operation
  (`op`) so that later instructions can refer to it, and the variable that is
  its buffer; `Put` and `Get` name a variable of the target rank (and an
  offset into it), which the runner turns into ``region.address + offset``;
* `Wait(op, event)`: await the operation's submission or its terminal outcome;
* `Cancel(op)`: ``msg.cancel()``;
* `WaitFor(var, value)`: spin on local memory until every byte of the
  variable holds `value` (a flag set by a peer's put).

Operations may be *timed* (``timed=True``): the runner arms a short random
timeout that races the transfer, so either outcome may happen.

What is observed at the end of each run: every register, the final value of
the variables listed in `final`, the terminal state of every operation, the
messages left over at each receiver (drained after the program, in channel
order), and whether the canary bytes around every variable are intact.
`mate.litmus.model` computes the set of outcomes the spec allows;
`mate.litmus.runner` observes what a transport does.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from mate.constants import ANY_SOURCE, ANY_TAG
from mate.errors import InvalidArgument


@attrs.frozen
class Var:
    """A named variable of `size` bytes in one rank's memory, every byte `init` at start."""

    name: str
    size: int = 1
    init: int = 0


@attrs.frozen
class Write:
    var: str
    value: int


@attrs.frozen
class Read:
    var: str
    reg: str


@attrs.frozen
class Send:
    op: str
    var: str
    dest: int
    tag: int = 0
    timed: bool = False


@attrs.frozen
class Recv:
    op: str
    var: str
    source: int = ANY_SOURCE
    tag: int = ANY_TAG
    timed: bool = False


@attrs.frozen
class Put:
    op: str
    var: str
    dest: int
    target: str
    offset: int = 0


@attrs.frozen
class Get:
    op: str
    var: str
    source: int
    target: str
    offset: int = 0
    timed: bool = False


@attrs.frozen
class Wait:
    op: str
    event: str = "completion"  # or "submission"


@attrs.frozen
class Cancel:
    op: str


@attrs.frozen
class WaitFor:
    var: str
    value: int


Instruction = Write | Read | Send | Recv | Put | Get | Wait | Cancel | WaitFor
Operation = Send | Recv | Put | Get
OPERATIONS = (Send, Recv, Put, Get)


def peer_of(ins: Operation) -> int:
    """The other rank an operation names (possibly ANY_SOURCE for a receive)."""
    if isinstance(ins, (Send, Put)):
        return ins.dest
    return ins.source


@attrs.frozen
class Litmus:
    """One test: per-rank memory and programs, what is observed, what it is about."""

    name: str
    about: str
    memory: tuple[tuple[Var, ...], ...]
    programs: tuple[tuple[Instruction, ...], ...]
    final: tuple[tuple[int, str], ...] = ()  # (rank, var) read after the run

    @property
    def ranks(self) -> int:
        return len(self.programs)

    def var(self, rank: int, name: str) -> Var:
        for var in self.memory[rank]:
            if var.name == name:
                return var
        raise InvalidArgument(f"{self.name}: rank {rank} has no variable {name!r}")

    def operations(self) -> dict[str, tuple[int, Operation]]:
        """Every operation by name, with the rank that issues it."""
        found: dict[str, tuple[int, Operation]] = {}
        for rank, program in enumerate(self.programs):
            for ins in program:
                if isinstance(ins, OPERATIONS):
                    found[ins.op] = (rank, ins)
        return found

    def channels(self) -> set[tuple[int, int, int]]:
        """The (source, destination, tag) of every send: where leftovers are drained."""
        return {(rank, ins.dest, ins.tag) for rank, program in enumerate(self.programs)
                for ins in program if isinstance(ins, Send)}

    def check(self) -> Litmus:
        """Refuse a malformed test (unknown names, bad ranks, sizes that do not fit)."""
        if len(self.memory) != self.ranks:
            raise InvalidArgument(f"{self.name}: memory for {len(self.memory)} ranks, "
                                  f"programs for {self.ranks}")
        ops = self.operations()
        if len(ops) != sum(isinstance(i, OPERATIONS) for p in self.programs for i in p):
            raise InvalidArgument(f"{self.name}: an operation name is used twice")
        registers: set[str] = set()
        for rank, program in enumerate(self.programs):
            for ins in program:
                self._check(rank, ins, ops, registers)
        for rank, name in self.final:
            self.var(rank, name)
        return self

    def _check(self, rank: int, ins: Instruction, ops: dict[str, tuple[int, Operation]],
               registers: set[str]) -> None:
        if isinstance(ins, (Write, Read, WaitFor)):
            self.var(rank, ins.var)
        if isinstance(ins, Read):
            if ins.reg in registers:
                raise InvalidArgument(f"{self.name}: register {ins.reg!r} is written twice")
            registers.add(ins.reg)
        if isinstance(ins, (Wait, Cancel)):
            if ins.op not in ops or ops[ins.op][0] != rank:
                raise InvalidArgument(f"{self.name}: rank {rank} waits on or cancels "
                                      f"{ins.op!r}, which it did not issue")
            if isinstance(ins, Wait) and ins.event not in ("completion", "submission"):
                raise InvalidArgument(f"{self.name}: unknown event {ins.event!r}")
        if isinstance(ins, OPERATIONS):
            self.var(rank, ins.var)
            peer = peer_of(ins)
            if not (0 <= peer < self.ranks or (isinstance(ins, Recv) and peer == ANY_SOURCE)):
                raise InvalidArgument(f"{self.name}: {ins.op} names rank {peer}")
            if isinstance(ins, Send) and ins.tag == ANY_TAG:
                raise InvalidArgument(f"{self.name}: {ins.op} sends to ANY_TAG")
            if isinstance(ins, (Put, Get)):
                target = self.var(peer, ins.target)
                if ins.offset + self.var(rank, ins.var).size > target.size:
                    raise InvalidArgument(f"{self.name}: {ins.op} runs past {ins.target}")


def litmus(name: str, about: str, memory: Sequence[Sequence[Var]],
           programs: Sequence[Sequence[Instruction]],
           final: Sequence[tuple[int, str]] = ()) -> Litmus:
    """A checked `Litmus` from lists (the catalogue's shorthand)."""
    return Litmus(name, about, tuple(tuple(m) for m in memory),
                  tuple(tuple(p) for p in programs), tuple(final)).check()
