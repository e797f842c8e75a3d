"""Running litmus tests on a transport: one rank's side, many iterations, outcomes counted.

Every rank holds two worlds: the *test* world, where the programs run, and a
*control* world on the same transport, which carries the coordination
(barriers, region addresses, the observations and the decision to go on), so
that no control message can ever match a receive of a test. One iteration of
a test:

1. every rank's memory holds the variables' initial values and the canary
   bytes around them (each rank resets its own before step 4, so rank 0's
   "go" of step 5 certifies that all are reset);
2. each rank runs its program, with a random delay before each instruction
   (nothing, a few turns of the loop, a spin, or a short sleep) and timed
   operations armed with a random short timeout; then it waits for its
   receives, puts and gets to end (a send may need a receive that only the
   drain will post);
3. all ranks meet; every left-over message is drained: each sender sends an
   END marker on every channel (source, destination, tag) it used, and each
   receiver receives each of its channels until the END, recording what came
   before it (non-overtaking puts the left-overs before the END); then every
   send is awaited;
4. each rank checks SPEC §1 on each of its operations (exactly one terminal
   outcome, handlers and awaiters agreeing, submission at most once and
   before completion) and its canaries, and sends what it observed to rank 0,
   which assembles the outcome and counts it;
5. rank 0 tells everyone whether to go on (a rank that hung stops the run:
   what is left on the wire would spoil the tests after it).

Every wait is bounded; a hang is an outcome of its own (`hung@rank`), as are
violations (`violation@rank`) and damaged canaries (`canary@rank`): the
model allows none of them, so each is a forbidden outcome.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from mate import debug
from mate.errors import MessageFailed, MessageTimeout
from mate.litmus.language import (
    Cancel,
    Get,
    Litmus,
    Put,
    Read,
    Recv,
    Send,
    Var,
    Wait,
    WaitFor,
    Write,
)
from mate.litmus.model import Outcome, allowed, drained
from mate.message import Message
from mate.schedule import Event, Op, Schedule, State
from mate.world import World

CANARY = 0x5A
CANARY_SIZE = 4
END = b"\xee" * 24  # longer than any litmus variable: never a program's message
BOUND = 10.0  # seconds any one phase of an iteration may take before it counts as hung
CONTROL_BUFFER = 1 << 16
_BARRIER, _GATHER, _GO, _ADDRESS = 1, 2, 3, 4  # control world tags


@attrs.frozen
class Result:
    """What one test gave: the outcomes it allows and those seen, with counts."""

    test: Litmus
    allowed: frozenset[Outcome]
    observed: Counter[Outcome]

    @property
    def iterations(self) -> int:
        return sum(self.observed.values())

    @property
    def forbidden(self) -> Counter[Outcome]:
        return Counter({o: n for o, n in self.observed.items() if o not in self.allowed})


class Layout:
    """Where each variable of one rank lives in its memory, canaries around each."""

    def __init__(self, variables: Iterable[Var]) -> None:
        self.variables = list(variables)
        self.offset: dict[str, int] = {}
        size = CANARY_SIZE
        for var in self.variables:
            self.offset[var.name] = size
            size += var.size + CANARY_SIZE
        self.size = size
        self.pristine = bytearray([CANARY]) * size
        for var in self.variables:
            start = self.offset[var.name]
            self.pristine[start:start + var.size] = bytes([var.init]) * var.size

    def span(self, name: str) -> slice:
        start = self.offset[name]
        return slice(start, start + next(v.size for v in self.variables if v.name == name))

    def damaged(self, memory: bytearray) -> list[int]:
        """Canary bytes that were written (offsets)."""
        inside = {i for var in self.variables for i in range(self.offset[var.name],
                                                              self.offset[var.name] + var.size)}
        return [i for i in range(self.size) if i not in inside and memory[i] != CANARY]


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def hot_spot_jitter(seed: int | None) -> Callable[[str], None]:
    """A transport hot-spot hook that sometimes spins or yields the GIL there."""
    rng = random.Random(seed)

    def jitter(spot: str) -> None:
        roll = rng.random()
        if roll < 0.8:
            return
        if roll < 0.95:
            spin(rng.uniform(0, 20e-6))
        else:
            time.sleep(0)  # lets another thread (a progress thread, the loop) run here
    return jitter


class Hung(Exception):
    """A bounded wait ran out."""


class _Execution:
    """One iteration of one program on one rank: its messages and what it saw."""

    def __init__(self, rank: LitmusRank, test: Litmus, bases: list[int]) -> None:
        self.rank = rank
        self.world = rank.world
        self.test = test
        self.layouts = rank.layouts
        self.memory = rank.memory
        self.view = memoryview(rank.memory)
        self.bases = bases
        self.messages: dict[str, Message] = {}
        self.logs: dict[str, list[Event]] = {}
        self.awaited: dict[str, Any] = {}
        self.registers: dict[str, tuple[int, ...]] = {}

    def _log(self, receipt: Any, name: str) -> None:
        self.logs[name].append(receipt.event)

    def _schedule(self, name: str) -> Schedule:
        """Every event of operation `name` logged, to check SPEC §1 against the awaiter."""
        log = self._log
        return Schedule(completion=log, completion_data=name, submission=log,
                        submission_data=name, timeout=log, timeout_data=name, failure=log,
                        failure_data=name)

    def _address(self, rank: int, name: str, offset: int) -> int:
        return self.bases[rank] + self.layouts[rank].offset[name] + offset

    async def program(self) -> None:
        me = self.world.mypid
        layout = self.layouts[me]
        rank = self.rank
        for ins in self.test.programs[me]:
            await rank.delay()
            if isinstance(ins, Write):
                span = layout.span(ins.var)
                self.memory[span] = bytes([ins.value]) * (span.stop - span.start)
            elif isinstance(ins, Read):
                self.registers[ins.reg] = tuple(self.memory[layout.span(ins.var)])
            elif isinstance(ins, WaitFor):
                await self._wait_for(layout.span(ins.var), ins.value)
            elif isinstance(ins, Cancel):
                self.messages[ins.op].cancel()
            elif isinstance(ins, Wait):
                msg = self.messages[ins.op]
                if ins.event == "submission" and msg.submitted is not None:
                    await _outcome(msg.submitted)
                else:
                    self.awaited[ins.op] = await _outcome(msg)
            else:
                buffer = self.view[layout.span(ins.var)]
                self.logs[ins.op] = []
                schedule = self._schedule(ins.op)
                timeout = rank.timeout() if getattr(ins, "timed", False) else None
                if isinstance(ins, Send):
                    msg = self.world.send(buffer, ins.dest, ins.tag, schedule=schedule,
                                          timeout=timeout)
                elif isinstance(ins, Recv):
                    msg = self.world.recv(buffer, ins.source, ins.tag, schedule=schedule,
                                          timeout=timeout)
                elif isinstance(ins, Put):
                    msg = self.world.put(buffer, ins.dest,
                                         self._address(ins.dest, ins.target, ins.offset),
                                         schedule=schedule, timeout=timeout)
                else:
                    assert isinstance(ins, Get)
                    msg = self.world.get(buffer, ins.source,
                                         self._address(ins.source, ins.target, ins.offset),
                                         schedule=schedule, timeout=timeout)
                self.messages[ins.op] = msg

    async def _wait_for(self, span: slice, value: int) -> None:
        want = bytes([value]) * (span.stop - span.start)
        give_up = time.monotonic() + BOUND
        while self.memory[span] != want:
            if time.monotonic() > give_up:
                raise Hung("WaitFor")
            await asyncio.sleep(0)

    async def settle(self, ops: tuple[Op, ...]) -> None:
        """Await every message of these kinds that the program did not await."""
        for name, msg in self.messages.items():
            if msg.op in ops and name not in self.awaited:
                self.awaited[name] = await _outcome(msg)

    async def drain(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """Send the END markers; receive each channel to this rank up to its END."""
        me = self.world.mypid
        channels = self.test.channels()
        ends = [self.world.send(END, dest, tag, timeout=None)
                for source, dest, tag in sorted(channels) if source == me]
        found = await asyncio.gather(*(self._drain_channel(source, tag)
                                       for source, dest, tag in sorted(channels) if dest == me),
                                     *ends)
        return [m for got in found if isinstance(got, list) for m in got]

    async def _drain_channel(self, source: int, tag: int) -> list[tuple[int, int, tuple[int, ...]]]:
        left: list[tuple[int, int, tuple[int, ...]]] = []
        buffer = bytearray(len(END))
        while True:
            receipt = await self.world.recv(buffer, source, tag, timeout=None)
            if buffer[:receipt.length] == END:
                return left
            left.append((source, tag, tuple(buffer[:receipt.length])))

    async def handlers_ran(self) -> None:
        """Give handlers that are still queued the turns of the loop they need."""
        give_up = time.monotonic() + BOUND
        while any(_terminal_events(self.logs[name]) == 0 and msg.state is not State.CANCELLED
                  for name, msg in self.messages.items()):
            if time.monotonic() > give_up:
                return  # the check below reports the missing handler
            await asyncio.sleep(0)

    def observations(self) -> list[tuple[str, Any]]:
        me = self.world.mypid
        items: list[tuple[str, Any]] = list(self.registers.items())
        for rank, name in self.test.final:
            if rank == me:
                items.append((f"{name}@{me}", tuple(self.memory[self.layouts[me].span(name)])))
        for name, msg in self.messages.items():
            items.append((name, _state_name(msg)))
            for problem in _violations(msg, self.logs[name], self.awaited.get(name)):
                items.append((f"violation@{me}", f"{name}: {problem}"))
        damaged = self.layouts[me].damaged(self.memory)
        if damaged:
            items.append((f"canary@{me}", tuple(damaged)))
        return items


async def _outcome(awaitable: Any) -> Any:
    """What awaiting a message (or its submission) gave: a receipt or the exception."""
    try:
        return await awaitable
    except (MessageTimeout, MessageFailed) as exc:
        return exc
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this task is being cancelled, not (only) the message
        return exc


def _state_name(msg: Message) -> str:
    if msg.state is State.FAILED:
        error = msg.receipt.error
        reason = error.reason.name if isinstance(error, MessageFailed) else "?"
        return f"FAILED:{reason}"
    return msg.state.name


def _terminal_events(log: list[Event]) -> int:
    return sum(e in (Event.COMPLETION, Event.TIMEOUT, Event.FAILURE) for e in log)


_TERMINAL_EVENT = {State.COMPLETED: Event.COMPLETION, State.TIMED_OUT: Event.TIMEOUT,
                   State.FAILED: Event.FAILURE}
_AWAITED = {State.COMPLETED: "receipt", State.TIMED_OUT: "MessageTimeout",
            State.FAILED: "MessageFailed", State.CANCELLED: "CancelledError"}


def _violations(msg: Message, log: list[Event], awaited: Any) -> list[str]:
    """SPEC §1's invariants for one message, from its handlers and its awaiter."""
    problems = []
    state = msg.state
    if not state.terminal:
        return [f"never ended ({state.name})"]
    terminal = [e for e in log if e is not Event.SUBMISSION]
    expected = [_TERMINAL_EVENT[state]] if state in _TERMINAL_EVENT else []
    if terminal != expected:
        problems.append(f"terminal handlers {[e.value for e in terminal]} for {state.name}")
    submissions = log.count(Event.SUBMISSION)
    if submissions > 1 or (submissions and msg.op in (Op.RECV, Op.GET)):
        problems.append(f"{submissions} submission events for a {msg.op.value}")
    if submissions and terminal and log.index(Event.SUBMISSION) > log.index(terminal[0]):
        problems.append("submission after the terminal event")
    if state is State.COMPLETED and msg.op in (Op.SEND, Op.PUT) and not submissions:
        problems.append("completed without submission")
    got = ("receipt" if awaited is not None and hasattr(awaited, "event")
           else type(awaited).__name__)
    if got != _AWAITED[state]:
        problems.append(f"awaited {got} for {state.name}")
    return problems


def _encode(items: list[tuple[str, Any]]) -> bytes:
    return json.dumps(items).encode()


def _decode(data: bytes) -> list[tuple[str, Any]]:
    def tuples(value: Any) -> Any:
        return tuple(tuples(v) for v in value) if isinstance(value, list) else value
    return [(key, tuples(value)) for key, value in json.loads(data)]


class LitmusRank:
    """One rank's side of a litmus run: its test world, its control world, its chance."""

    def __init__(self, world: World, control: World, *, seed: int, delays: bool = True) -> None:
        self.world = world
        self.control = control
        self.rng = random.Random(seed * 1000 + world.mypid)
        self.delays = delays
        self.layouts: list[Layout] = []
        self.memory = bytearray()
        self.stopped = False  # a rank hung: what it left on the wire would spoil later tests

    # -- chance -------------------------------------------------------------------------

    async def delay(self) -> None:
        """A random delay before an instruction."""
        if not self.delays:
            return
        roll = self.rng.random()
        if roll < 0.3:
            return
        if roll < 0.6:
            for _ in range(self.rng.randint(1, 4)):
                await asyncio.sleep(0)
        elif roll < 0.85:
            spin(self.rng.uniform(0, 40e-6))
        else:
            await asyncio.sleep(self.rng.uniform(0, 200e-6))

    def timeout(self) -> float:
        """A random timeout short enough to race a transfer (10 us .. 1 ms scale)."""
        return self.rng.choice((10e-6, 100e-6, 1e-3)) * self.rng.random()

    # -- the control world --------------------------------------------------------------

    async def barrier(self) -> None:
        control, n, me = self.control, self.control.numprocs, self.control.mypid
        step, token = 1, bytearray(1)
        while step < n:
            got = control.recv(token, (me - step) % n, _BARRIER, timeout=None)
            await control.send(b"\0", (me + step) % n, _BARRIER, timeout=None)
            await got
            step *= 2

    async def _to_root(self, data: bytes, tag: int) -> list[bytes] | None:
        """Rank 0 gets every rank's `data` (its own first); the others get None."""
        control = self.control
        if control.mypid != 0:
            await control.send(data, 0, tag, timeout=None)
            return None
        found = [data]
        buffer = bytearray(CONTROL_BUFFER)
        for source in range(1, control.numprocs):
            receipt = await control.recv(buffer, source, tag, timeout=None)
            found.append(bytes(buffer[:receipt.length]))
        return found

    async def _from_root(self, data: bytes, tag: int) -> bytes:
        control = self.control
        if control.mypid == 0:
            await asyncio.gather(*(control.send(data, r, tag, timeout=None)
                                   for r in range(1, control.numprocs)))
            return data
        buffer = bytearray(CONTROL_BUFFER)
        receipt = await control.recv(buffer, 0, tag, timeout=None)
        return bytes(buffer[:receipt.length])

    async def _addresses(self, mine: int) -> list[int]:
        found = await self._to_root(str(mine).encode(), _ADDRESS)
        text = await self._from_root(b",".join(found) if found else b"", _ADDRESS)
        return [int(a) for a in text.split(b",")]

    # -- tests --------------------------------------------------------------------------

    async def run(self, tests: list[Litmus], iterations: int,
                  progress: Callable[[Result], None] | None = None) -> list[Result]:
        """Run each test that fits this world; rank 0 returns the results, others []."""
        models = {t.name: allowed(t) for t in tests} if self.world.mypid == 0 else {}
        results = []
        for test in tests:
            if test.ranks > self.world.numprocs:
                continue
            result = await self.run_test(test, iterations, models.get(test.name, frozenset()))
            if result is not None:
                results.append(result)
                if progress is not None:
                    progress(result)
            if self.stopped:
                break
        return results

    async def run_test(self, test: Litmus, iterations: int,
                       allowed_outcomes: frozenset[Outcome]) -> Result | None:
        """Run `test`; rank 0 returns its result. A hang sets `stopped` on every rank."""
        me = self.world.mypid
        active = me < test.ranks
        self.layouts = [Layout(variables) for variables in test.memory]
        layout = self.layouts[me] if active else Layout(())
        self.memory = bytearray(layout.pristine)
        region = self.world.expose(self.memory)
        bases = await self._addresses(region.address)
        observed: Counter[Outcome] = Counter()
        go_on = True
        for _ in range(iterations):
            if not go_on:
                break
            items = await self._iteration(test, bases, active)
            self.memory[:] = layout.pristine  # before reporting: "go" means all are reset
            gathered = await self._to_root(_encode(items), _GATHER)
            verdict = b"go"
            if gathered is not None:
                outcome = tuple(sorted(kv for data in gathered for kv in _decode(data)))
                observed[outcome] += 1
                if any(key.startswith("hung@") for key, _ in outcome):
                    verdict = b"stop"
            go_on = await self._from_root(verdict, _GO) == b"go"
            self.stopped = not go_on
        await self.world.unexpose(region)
        return Result(test, allowed_outcomes, observed) if me == 0 else None

    async def _iteration(self, test: Litmus, bases: list[int],
                         active: bool) -> list[tuple[str, Any]]:
        """One run of `test`; what this rank observed (nothing if it takes no part)."""
        me = self.world.mypid
        run = _Execution(self, test, bases)
        items: list[tuple[str, Any]] = []
        if active:
            try:
                await asyncio.wait_for(run.program(), BOUND)
                await asyncio.wait_for(run.settle((Op.RECV, Op.PUT, Op.GET)), BOUND)
            except (TimeoutError, Hung):
                items.append((f"hung@{me}", "program"))
        await self.barrier()
        if not active:
            return items
        try:
            left = await asyncio.wait_for(run.drain(), BOUND)
            if me in {dest for _, dest, _ in test.channels()}:
                items.append((f"drain@{me}", drained(iter(left))))
            await asyncio.wait_for(run.settle((Op.SEND,)), BOUND)
        except TimeoutError:
            items.append((f"hung@{me}", "drain"))
        if any(key.startswith("hung@") for key, _ in items):
            for msg in run.messages.values():
                msg.cancel()
            return items
        await run.handlers_ran()
        return items + run.observations()


def show(outcome: Outcome) -> str:
    """An outcome as one line: ``b=1 data=COMPLETED drain@1=[0:1:4]``."""
    parts = []
    for key, value in outcome:
        if isinstance(value, tuple) and key.startswith("drain@"):
            text = "[" + " ".join(f"{s}:{t}:" + ",".join(map(str, d)) for s, t, d in value) + "]"
        elif isinstance(value, tuple):
            text = ",".join(map(str, value))
        else:
            text = str(value)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def open_hook(jitter: bool, seed: int) -> None:
    """Turn the transports' hot-spot jitter on (for the worlds opened next) or off."""
    debug.set_hot_spot_hook(hot_spot_jitter(seed) if jitter else None)
