"""The outcomes SPEC §1-§2 allow for a litmus test, computed by enumeration.

Theory of operation
-------------------
Each instruction and each operation is broken into atomic *actions*, and the
model explores every order of them that the spec's rules allow, collecting
the outcome of every complete execution (`allowed`). Memory is modelled byte
by byte, so torn values are outcomes like any other. The rules:

* **Program order.** A rank runs its instructions in order. A local write or
  read is one action per byte (the bytes of one instruction in any order).
  `Wait` blocks until the operation's event; `WaitFor` until the memory
  holds the value.
* **Entry.** An operation is *issued* by its instruction and *enters* the
  transport later; the operations of one rank enter in the order they were
  issued (a transport may queue a post, never reorder posts). Everything an
  operation does happens after its entry.
* **put.** Each source byte is read at some point after entry and before
  submission; each target byte is written, with the value read, at some point
  after its read and before completion; completion follows submission.
  Nothing orders two puts, or a put and a get, to one target (§5.1.4).
* **get.** Each target byte is read, then written into the local buffer,
  before completion. A timed get may time out at any point before completion,
  and then writes nothing more.
* **send.** Each source byte is read after entry and before submission (at
  entry, for a timed send: a transport that may abandon it works on a copy).
  The message *arrives* at the destination after entry, after every earlier
  send of the same channel (source, destination, tag: non-overtaking) has
  arrived or been withdrawn. On arrival it matches the earliest-posted
  eligible receive, or is held as unexpected. Completion follows submission
  and arrival and, when a receive matched at arrival, that receive's writes:
  "the data has reached the destination process (it is in the matching
  receive buffer, or held there as an unexpected message)". A timed send may
  time out at any point before completion; after that it may still arrive,
  or be withdrawn if no receive has matched it (§5.1.1).
* **recv.** On entry it matches one of the held messages it accepts that is
  the oldest of its channel (nothing orders different channels), or is
  posted. Once matched, it writes each byte of the message (the first
  ``len(buffer)`` bytes) and completes; a longer message fails it with
  TRUNCATED after the writes. A cancel or a timeout takes effect at any point
  after it is asked for, if the receive has not matched by then; otherwise
  the match wins and it completes (no data loss).

An execution ends when every rank has run its program and every operation
has its terminal outcome. Its outcome is every register, the final value of
the observed variables, the terminal state of every operation, and, for
every receiving rank, the messages left over (held or still arriving),
which the runner drains after the program. Actions that may or may not
happen after an execution ended (a withdrawn send arriving anyway) are
explored too, so both outcomes are allowed.

States are memoised, so each reachable state is explored once; a reachable
state from which nothing can happen and which is not an end is a test that
can hang, and is refused (`ModelError`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from mate.constants import ANY_SOURCE, ANY_TAG
from mate.litmus.language import (
    Cancel,
    Get,
    Instruction,
    Litmus,
    Put,
    Read,
    Recv,
    Send,
    Wait,
    WaitFor,
    Write,
)

# Terminal states, as the runner reports them (mate.State names).
NONE, COMPLETED, TIMED_OUT, CANCELLED, TRUNCATED = range(5)
STATE_NAMES = {COMPLETED: "COMPLETED", TIMED_OUT: "TIMED_OUT", CANCELLED: "CANCELLED",
               TRUNCATED: "FAILED:TRUNCATED"}

Outcome = tuple[tuple[str, Any], ...]


class ModelError(Exception):
    """A test the model cannot give outcomes for (it can hang)."""


class _Op:
    """What the model knows statically of one operation."""

    def __init__(self, index: int, rank: int, pc: int, ins: Instruction,
                 offsets: list[dict[str, int]], test: Litmus) -> None:
        assert isinstance(ins, (Send, Recv, Put, Get))
        self.index = index
        self.rank = rank
        self.pc = pc  # the instruction that issues it
        self.ins = ins
        self.kind = type(ins)
        var = test.var(rank, ins.var)
        self.local = offsets[rank][ins.var]  # the buffer's offset in this rank's memory
        self.size = var.size
        self.timed = getattr(ins, "timed", False)
        self.peer = ins.dest if isinstance(ins, (Send, Put)) else ins.source
        self.tag = ins.tag if isinstance(ins, (Send, Recv)) else 0
        self.remote = 0  # put/get: the target bytes' offset in the peer's memory
        if isinstance(ins, (Put, Get)):
            self.remote = offsets[self.peer][ins.target] + ins.offset
        self.earlier: tuple[int, ...] = ()  # sends: earlier sends of the same channel
        self.cancelled_by: int | None = None  # recv: the pc of its Cancel, if any


class Model:
    """The allowed outcomes of one litmus test."""

    def __init__(self, test: Litmus) -> None:
        self.test = test
        self.offsets: list[dict[str, int]] = []
        self.initial_memory: list[tuple[int, ...]] = []
        for variables in test.memory:
            offsets: dict[str, int] = {}
            memory: list[int] = []
            for var in variables:
                offsets[var.name] = len(memory)
                memory += [var.init] * var.size
            self.offsets.append(offsets)
            self.initial_memory.append(tuple(memory))
        self.ops: list[_Op] = []
        self.op_at: dict[tuple[int, int], int] = {}  # (rank, pc) -> op index
        self.op_named: dict[str, int] = {}
        self.registers: list[str] = []
        self.register_sizes: list[int] = []
        self.reg_at: dict[tuple[int, int], int] = {}
        for rank, program in enumerate(test.programs):
            for pc, ins in enumerate(program):
                if isinstance(ins, (Send, Recv, Put, Get)):
                    op = _Op(len(self.ops), rank, pc, ins, self.offsets, test)
                    self.op_at[rank, pc] = op.index
                    self.op_named[ins.op] = op.index
                    self.ops.append(op)
                elif isinstance(ins, Read):
                    self.reg_at[rank, pc] = len(self.registers)
                    self.registers.append(ins.reg)
                    self.register_sizes.append(test.var(rank, ins.var).size)
        for program in test.programs:
            for pc, ins in enumerate(program):
                if isinstance(ins, Cancel):
                    self.ops[self.op_named[ins.op]].cancelled_by = pc
        for op in self.ops:
            if op.kind is Send:
                op.earlier = tuple(o.index for o in self.ops[:op.index] if o.kind is Send
                                   and (o.rank, o.peer, o.tag) == (op.rank, op.peer, op.tag))
        self.by_rank = [[op.index for op in self.ops if op.rank == r] for r in range(test.ranks)]
        self.receivers = sorted({dest for _, dest, _ in test.channels()})

    # -- the state ----------------------------------------------------------------------
    # (pcs, subs, memory, registers, ops, posted, unexpected):
    #   pcs[r]: the next instruction of rank r; subs[r]: the bytes of the current
    #   Read/Write done (a bit mask); memory[r]: its bytes; registers[i]: bytes read;
    #   ops[i]: a tuple per kind (below); posted[r]: receives waiting at r in posting
    #   order; unexpected[r]: sends held at r in arrival order.
    # put:  (entered, read mask, values, written mask, submitted, term)
    # get:  (entered, read mask, values, written mask, term)
    # send: (entered, read mask, values, submitted, arrived, withdrawn, matched recv, term)
    # recv: (entered, matched send, written mask, term)

    def initial(self) -> tuple[Any, ...]:
        ops: list[tuple[Any, ...]] = []
        for op in self.ops:
            blank = (None,) * op.size
            if op.kind is Put:
                ops.append((False, 0, blank, 0, False, NONE))
            elif op.kind is Get:
                ops.append((False, 0, blank, 0, NONE))
            elif op.kind is Send:
                ops.append((False, 0, blank, False, False, False, -1, NONE))
            else:
                ops.append((False, -1, 0, NONE))
        ranks = self.test.ranks
        registers = tuple((None,) * size for size in self.register_sizes)
        return ((0,) * ranks, (0,) * ranks, tuple(self.initial_memory), registers,
                tuple(ops), ((),) * ranks, ((),) * ranks)

    def allowed(self) -> frozenset[Outcome]:
        """Every outcome an execution allowed by the spec can have."""
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 10_000))
        try:
            explore = lru_cache(maxsize=None)(self._explore_from)
            self._explore = explore
            return explore(self.initial())
        finally:
            sys.setrecursionlimit(limit)

    def _explore_from(self, state: tuple[Any, ...]) -> frozenset[Outcome]:
        outcomes: set[Outcome] = set()
        ended = self._ended(state)
        if ended:
            outcomes.add(self.outcome(state))
        moved = False
        for successor in self._successors(state):
            moved = True
            outcomes |= self._explore(successor)
        if not moved and not ended:
            raise ModelError(f"{self.test.name}: an execution can get stuck: "
                             f"{self.describe(state)}")
        return frozenset(outcomes)

    def _ended(self, state: tuple[Any, ...]) -> bool:
        pcs, _, _, _, ops, _, _ = state
        return (all(pc == len(p) for pc, p in zip(pcs, self.test.programs, strict=True))
                and all(s[-1] != NONE for s in ops))

    def outcome(self, state: tuple[Any, ...]) -> Outcome:
        _, _, memory, registers, ops, _, unexpected = state
        items: list[tuple[str, Any]] = []
        for name, value in sorted(zip(self.registers, registers, strict=True)):
            items.append((name, tuple(value)))
        for rank, name in self.test.final:
            start, size = self.offsets[rank][name], self.test.var(rank, name).size
            items.append((f"{name}@{rank}", memory[rank][start:start + size]))
        for op, s in zip(self.ops, ops, strict=True):
            items.append((op.ins.op, STATE_NAMES[s[-1]]))
        for rank in self.receivers:
            items.append((f"drain@{rank}", drained(
                (self.ops[i].rank, self.ops[i].tag, ops[i][2]) for i in unexpected[rank]
                if not ops[i][5])))
        return tuple(sorted(items))

    def describe(self, state: tuple[Any, ...]) -> str:
        pcs, _, _, _, ops, posted, unexpected = state
        return (f"pcs={pcs} ops={dict(zip((o.ins.op for o in self.ops), ops, strict=True))} "
                f"posted={posted} unexpected={unexpected}")

    # -- successors -----------------------------------------------------------------------

    def _successors(self, state: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
        for rank in range(self.test.ranks):
            yield from self._instruction(state, rank)
        for op in self.ops:
            if state[0][op.rank] > op.pc:  # issued
                yield from self._operation(state, op)

    def _instruction(self, state: tuple[Any, ...], rank: int) -> Iterator[tuple[Any, ...]]:
        pcs, subs, memory, registers, ops, posted, unexpected = state
        program = self.test.programs[rank]
        pc = pcs[rank]
        if pc == len(program):
            return
        ins = program[pc]
        advance = _put(pcs, rank, pc + 1)
        if isinstance(ins, (Write, Read)):
            start = self.offsets[rank][ins.var]
            size = self.test.var(rank, ins.var).size
            for i in range(size):
                if subs[rank] >> i & 1:
                    continue
                done = subs[rank] | 1 << i
                whole = done == (1 << size) - 1
                next_pcs, next_subs = (advance, _put(subs, rank, 0)) if whole else (
                    pcs, _put(subs, rank, done))
                if isinstance(ins, Write):
                    yield (next_pcs, next_subs,
                           _put(memory, rank, _put(memory[rank], start + i, ins.value)),
                           registers, ops, posted, unexpected)
                else:
                    reg = self.reg_at[rank, pc]
                    yield (next_pcs, next_subs, memory,
                           _put(registers, reg, _put(registers[reg], i, memory[rank][start + i])),
                           ops, posted, unexpected)
        elif isinstance(ins, (Send, Recv, Put, Get, Cancel)):
            yield (advance, subs, memory, registers, ops, posted, unexpected)
        elif isinstance(ins, Wait):
            op = self.ops[self.op_named[ins.op]]
            s = ops[op.index]
            if s[-1] != NONE or (ins.event == "submission" and (
                    (op.kind is Put and s[4]) or (op.kind is Send and s[3]))):
                yield (advance, subs, memory, registers, ops, posted, unexpected)
        elif isinstance(ins, WaitFor):
            start = self.offsets[rank][ins.var]
            size = self.test.var(rank, ins.var).size
            if all(b == ins.value for b in memory[rank][start:start + size]):
                yield (advance, subs, memory, registers, ops, posted, unexpected)

    def _may_enter(self, state: tuple[Any, ...], op: _Op) -> bool:
        ops = state[4]
        s = ops[op.index]
        if s[0] or s[-1] != NONE:
            return False
        for other in self.by_rank[op.rank]:
            if other == op.index:
                return True
            o = ops[other]
            if not (o[0] or o[-1] != NONE):  # an earlier one has not entered yet
                return False
        return True

    def _operation(self, state: tuple[Any, ...], op: _Op) -> Iterator[tuple[Any, ...]]:
        if op.kind is Put:
            yield from self._put_actions(state, op)
        elif op.kind is Get:
            yield from self._get_actions(state, op)
        elif op.kind is Send:
            yield from self._send_actions(state, op)
        else:
            yield from self._recv_actions(state, op)

    def _put_actions(self, state: tuple[Any, ...], op: _Op) -> Iterator[tuple[Any, ...]]:
        pcs, subs, memory, registers, ops, posted, unexpected = state
        entered, read, values, written, submitted, term = ops[op.index]
        if self._may_enter(state, op):
            yield _with_op(state, op.index, (True, read, values, written, submitted, term))
        if not entered or term != NONE:
            return
        full = (1 << op.size) - 1
        for i in range(op.size):
            if not read >> i & 1:
                v = _put(values, i, memory[op.rank][op.local + i])
                yield _with_op(state, op.index, (True, read | 1 << i, v, written, submitted, term))
            elif not written >> i & 1:
                target = _put(memory[op.peer], op.remote + i, values[i])
                yield (pcs, subs, _put(memory, op.peer, target), registers,
                       _put(ops, op.index, (True, read, values, written | 1 << i, submitted,
                                            term)), posted, unexpected)
        if read == full and not submitted:
            yield _with_op(state, op.index, (True, read, values, written, True, term))
        if written == full and submitted:
            yield _with_op(state, op.index, (True, read, values, written, submitted, COMPLETED))

    def _get_actions(self, state: tuple[Any, ...], op: _Op) -> Iterator[tuple[Any, ...]]:
        pcs, subs, memory, registers, ops, posted, unexpected = state
        entered, read, values, written, term = ops[op.index]
        if self._may_enter(state, op):
            yield _with_op(state, op.index, (True, read, values, written, term))
        if term == NONE and op.timed:
            yield _with_op(state, op.index, (entered, read, values, written, TIMED_OUT))
        if not entered or term != NONE:
            return
        for i in range(op.size):
            if not read >> i & 1:
                v = _put(values, i, memory[op.peer][op.remote + i])
                yield _with_op(state, op.index, (True, read | 1 << i, v, written, term))
            elif not written >> i & 1:
                local = _put(memory[op.rank], op.local + i, values[i])
                yield (pcs, subs, _put(memory, op.rank, local), registers,
                       _put(ops, op.index, (True, read, values, written | 1 << i, term)),
                       posted, unexpected)
        if written == (1 << op.size) - 1:
            yield _with_op(state, op.index, (True, read, values, written, COMPLETED))

    def _send_actions(self, state: tuple[Any, ...], op: _Op) -> Iterator[tuple[Any, ...]]:
        pcs, subs, memory, registers, ops, posted, unexpected = state
        entered, read, values, submitted, arrived, withdrawn, match, term = ops[op.index]
        full = (1 << op.size) - 1
        if self._may_enter(state, op):
            if op.timed:  # a copy is taken at the post
                copy = memory[op.rank][op.local:op.local + op.size]
                yield _with_op(state, op.index, (True, full, copy, submitted, arrived,
                                                 withdrawn, match, term))
            else:
                yield _with_op(state, op.index, (True, read, values, submitted, arrived,
                                                 withdrawn, match, term))
        if not entered or withdrawn:
            return
        if term == NONE:
            for i in range(op.size):
                if not read >> i & 1:
                    v = _put(values, i, memory[op.rank][op.local + i])
                    yield _with_op(state, op.index, (True, read | 1 << i, v, submitted,
                                                     arrived, withdrawn, match, term))
            if read == full and not submitted:
                yield _with_op(state, op.index, (True, read, values, True, arrived,
                                                 withdrawn, match, term))
            if submitted and arrived and (match < 0 or self._delivered(ops, match, op)):
                yield _with_op(state, op.index, (True, read, values, submitted, arrived,
                                                 withdrawn, match, COMPLETED))
            if op.timed:
                yield _with_op(state, op.index, (True, read, values, submitted, arrived,
                                                 withdrawn, match, TIMED_OUT))
        elif term == TIMED_OUT and match < 0:  # abandoned: withdrawn, unless it arrives
            held = tuple(i for i in unexpected[op.peer] if i != op.index)
            yield (pcs, subs, memory, registers,
                   _put(ops, op.index, (True, read, values, submitted, arrived, True, match,
                                        term)), posted, _put(unexpected, op.peer, held))
        if not arrived and all(ops[e][4] or ops[e][5] for e in op.earlier):
            yield self._arrive(state, op)

    def _delivered(self, ops: tuple[Any, ...], recv: int, send: _Op) -> bool:
        """Whether the receive that matched `send` holds all of its data it will get."""
        room = min(send.size, self.ops[recv].size)
        return bool(ops[recv][2] == (1 << room) - 1)

    def _arrive(self, state: tuple[Any, ...], op: _Op) -> tuple[Any, ...]:
        pcs, subs, memory, registers, ops, posted, unexpected = state
        s = ops[op.index]
        waiting = posted[op.peer]
        for recv in waiting:
            if _accepts(self.ops[recv], op):
                ops = _put(ops, recv, (True, op.index, *ops[recv][2:]))
                ops = _put(ops, op.index, (*s[:4], True, False, recv, s[7]))
                return (pcs, subs, memory, registers, ops,
                        _put(posted, op.peer, tuple(r for r in waiting if r != recv)),
                        unexpected)
        ops = _put(ops, op.index, (*s[:4], True, *s[5:]))
        return (pcs, subs, memory, registers, ops, posted,
                _put(unexpected, op.peer, unexpected[op.peer] + (op.index,)))

    def _recv_actions(self, state: tuple[Any, ...], op: _Op) -> Iterator[tuple[Any, ...]]:
        pcs, subs, memory, registers, ops, posted, unexpected = state
        entered, match, written, term = ops[op.index]
        if term != NONE:
            return
        if self._may_enter(state, op):
            held = unexpected[op.rank]
            heads = [i for n, i in enumerate(held) if _accepts(op, self.ops[i])
                     and not any(_same_channel(self.ops[i], self.ops[j]) for j in held[:n])]
            for send in heads:  # nothing orders messages of different channels
                s = ops[send]
                new_ops = _put(_put(ops, op.index, (True, send, written, term)), send,
                               (*s[:6], op.index, s[7]))
                yield (pcs, subs, memory, registers, new_ops, posted,
                       _put(unexpected, op.rank, tuple(i for i in held if i != send)))
            if not heads:
                yield (pcs, subs, memory, registers,
                       _put(ops, op.index, (True, match, written, term)),
                       _put(posted, op.rank, posted[op.rank] + (op.index,)), unexpected)
        if match < 0:
            asked = op.cancelled_by is not None and pcs[op.rank] > op.cancelled_by
            if asked or op.timed:
                yield (pcs, subs, memory, registers,
                       _put(ops, op.index, (entered, match, written,
                                            CANCELLED if asked else TIMED_OUT)),
                       _put(posted, op.rank, tuple(r for r in posted[op.rank] if r != op.index)),
                       unexpected)
            if asked and op.timed:  # either may come first
                yield (pcs, subs, memory, registers,
                       _put(ops, op.index, (entered, match, written, TIMED_OUT)),
                       _put(posted, op.rank, tuple(r for r in posted[op.rank] if r != op.index)),
                       unexpected)
            return
        send = self.ops[match]
        s = ops[match]
        room = min(send.size, op.size)
        for i in range(room):
            if not written >> i & 1 and s[1] >> i & 1:
                local = _put(memory[op.rank], op.local + i, s[2][i])
                yield (pcs, subs, _put(memory, op.rank, local), registers,
                       _put(ops, op.index, (entered, match, written | 1 << i, term)),
                       posted, unexpected)
        if written == (1 << room) - 1:
            done = TRUNCATED if send.size > op.size else COMPLETED
            yield _with_op(state, op.index, (entered, match, written, done))


def _put(items: tuple[Any, ...], index: int, value: Any) -> tuple[Any, ...]:
    return (*items[:index], value, *items[index + 1:])


def _with_op(state: tuple[Any, ...], index: int, value: tuple[Any, ...]) -> tuple[Any, ...]:
    return (*state[:4], _put(state[4], index, value), *state[5:])


def _accepts(recv: _Op, send: _Op) -> bool:
    return (recv.peer in (ANY_SOURCE, send.rank)) and (recv.tag in (ANY_TAG, send.tag))


def _same_channel(a: _Op, b: _Op) -> bool:
    return (a.rank, a.peer, a.tag) == (b.rank, b.peer, b.tag)


def drained(messages: Iterator[tuple[int, int, tuple[int, ...]]]
            ) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """Left-over messages as observed: by channel, each channel in arrival order."""
    return tuple(sorted(messages, key=lambda m: (m[0], m[1])))


def allowed(test: Litmus) -> frozenset[Outcome]:
    """The outcomes SPEC §1-§2 allow for `test`."""
    return Model(test).allowed()
