"""mate.litmus: the model, the runner, and the suite on every transport.

The model is checked against what the spec says of each shape; the runner is
checked against *mutant* transports, each breaking one rule of SPEC §1-§2
(so the litmus suite is shown to catch what it claims to); random programs
check that the local transport never does what the model forbids; and the
whole suite runs briefly on every transport, as CI's short version (the full
run's table is in docs/litmus.md).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from conftest import LAUNCHED
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from launch import run_bounded

import mate
from mate.litmus import __main__ as cli
from mate.litmus import report
from mate.litmus.catalogue import catalogue
from mate.litmus.language import (
    Get,
    Instruction,
    Put,
    Read,
    Recv,
    Send,
    Var,
    Wait,
    Write,
    litmus,
)
from mate.litmus.model import ModelError, Outcome, allowed
from mate.litmus.runner import LitmusRank, Result
from mate.machine import Input
from mate.schedule import Op, Region
from mate.transports.base import Operation, Report, Sink, Transport

pytestmark = pytest.mark.skipif(LAUNCHED is not None, reason="runs its own processes")

TESTS = {t.name: t for t in catalogue()}


def outcomes(name: str) -> list[dict[str, Any]]:
    return [dict(o) for o in allowed(TESTS[name])]


# -- the language -------------------------------------------------------------------------


@pytest.mark.parametrize("programs, memory, why", [
    ([[Read("nope", "a")]], [[Var("x")]], "no variable"),
    ([[Wait("ghost")]], [[Var("x")]], "did not issue"),
    ([[Send("m", "x", 5)]], [[Var("x")]], "names rank 5"),
    ([[Send("m", "x", 0, mate.ANY_TAG)]], [[Var("x")]], "ANY_TAG"),
    ([[Put("p", "x", 0, "x", 1)]], [[Var("x")]], "runs past"),
    ([[Read("x", "a"), Read("x", "a")]], [[Var("x")]], "twice"),
    ([[Send("m", "x", 0), Send("m", "x", 0)]], [[Var("x")]], "used twice"),
])
def test_malformed_tests_are_refused(programs: list[list[Instruction]],
                                     memory: list[list[Var]], why: str) -> None:
    with pytest.raises(mate.InvalidArgument, match=why):
        litmus("bad", "", memory, programs)


def test_a_test_that_can_hang_is_refused() -> None:
    # A receive nothing matches, with no timeout: some execution never ends.
    stuck = litmus("stuck", "", [[Var("b")], []], [[Recv("r", "b", 1, 1), Wait("r")], []])
    with pytest.raises(ModelError, match="stuck"):
        allowed(stuck)


# -- the model says what the spec says ----------------------------------------------------


def test_every_test_has_outcomes() -> None:
    for test in catalogue():
        assert allowed(test), test.name


def test_waiting_is_what_orders() -> None:
    """Each -nowait variant allows everything its -wait (or -submission) variant does, and
    more: the wait is what rules the extra outcomes out."""
    for name in TESTS:
        if "-nowait" not in name:
            continue
        waited = [n for n in (name.replace("-nowait", "-wait"),
                              name.replace("-nowait", "-submission")) if n in TESTS]
        assert waited, name
        strong, weak = allowed(TESTS[waited[0]]), allowed(TESTS[name])
        assert strong < weak, name


def test_message_passing_with_a_wait_forbids_the_stale_read() -> None:
    assert {o["b"] for o in outcomes("MP+put+put-wait")} == {(1,)}
    assert {o["b"] for o in outcomes("MP+put+put-peek-wait") if o["a"] == (1,)} == {(1,)}
    assert {o["b"] for o in outcomes("MP+put+put-nowait")} == {(0,), (1,)}


def test_non_overtaking_and_what_is_left_unordered() -> None:
    assert [(o["x"], o["y"]) for o in outcomes("SS")] == [((1,), (2,))]
    assert {(o["x"], o["y"]) for o in outcomes("SS-tags")} == {((1,), (2,)), ((2,), (1,))}
    # rank 0's two messages stay in order whatever rank 1's does
    orders = {(o["x"], o["y"], o["z"]) for o in outcomes("SS-sources")}
    assert orders == {((1,), (2,), (3,)), ((1,), (3,), (2,)), ((3,), (1,), (2,))}


def test_send_completion_means_delivery() -> None:
    assert {o["first"] for o in outcomes("SC+send+send-wait")} == {(1,)}
    assert {o["first"] for o in outcomes("SC+3-wait")} == {(1,)}
    assert {o["r"] for o in outcomes("SC+send+put-wait")} == {"COMPLETED"}
    assert {o["r"] for o in outcomes("SC+send+put-nowait")} == {"COMPLETED", "CANCELLED"}


def test_no_data_loss_when_a_cancel_or_timeout_races_a_match() -> None:
    for name in ("cancel-recv", "timeout-recv", "cancel-recv-self", "timeout-recv-self"):
        for o in outcomes(name):
            dest = 0 if name.endswith("-self") else 1
            if o["r"] == "COMPLETED":
                assert o[f"b@{dest}"] == (4,) and o[f"drain@{dest}"] == (), (name, o)
            else:  # the message is left for a later receive, and the buffer untouched
                assert o[f"b@{dest}"] == (0,) and o[f"drain@{dest}"] == ((0, 1, (4,)),)


def test_a_send_that_timed_out_may_arrive_but_never_overtakes() -> None:
    seen = {(o["m1"], o["x"], o["drain@1"]) for o in outcomes("timeout-send")}
    assert seen == {("COMPLETED", (1,), ((0, 1, (2,)),)),  # in order
                    ("TIMED_OUT", (1,), ((0, 1, (2,)),)),  # timed out, arrived anyway
                    ("TIMED_OUT", (2,), ())}  # withdrawn


def test_only_the_overlap_of_two_puts_may_tear() -> None:
    finals = {o["x@2"] for o in outcomes("overlap-3")}
    assert len(finals) == 4
    for x in finals:
        assert x[:2] == (0xA, 0xA) and x[4:6] == (0xB, 0xB) and x[6:] == (0, 0)


def test_a_timed_out_get_writes_nothing_after_its_timeout() -> None:
    done = {o["d@0"] for o in outcomes("timeout-get") if o["g"] == "COMPLETED"}
    assert done == {(7, 7)}


# -- the runner catches transports that break the rules ----------------------------------


class Layer(Transport):
    """A transport in front of another that forwards everything (mutants override)."""

    def __init__(self, inner: Transport, sink: Sink) -> None:
        self.inner = inner
        self.mypid, self.numprocs, self.tag_max = inner.mypid, inner.numprocs, inner.tag_max
        self._sink = sink
        self.loop = asyncio.get_running_loop()
        self.carriers: dict[Operation, Operation | None] = {}  # carrier -> original / None
        inner.bind(self)

    def post(self, op: Operation) -> None:
        self.inner.post(op)

    def cancel(self, op: Operation) -> None:
        self.inner.cancel(op)

    def expose(self, buffer: memoryview) -> Region:
        return self.inner.expose(buffer)

    async def unexpose(self, region: Region) -> None:
        await self.inner.unexpose(region)

    async def shutdown(self) -> None:
        await self.inner.shutdown()

    def carry(self, original: Operation | None, op: Op, buffer: memoryview, peer: int,
              tag: int, address: int) -> None:
        """Post a carrier of our own below; its reports become `original`'s (None: dropped)."""
        carrier = Operation(op, buffer, peer, tag, address)
        self.carriers[carrier] = original
        self.inner.post(carrier)

    # the inner transport's sink
    def submitted(self, op: Operation) -> None:
        self.report_all([Report(Input.SUBMITTED, op)])

    def completed(self, op: Operation, length: int, peer: int, tag: int) -> None:
        self.report_all([Report(Input.COMPLETED, op, length, peer, tag)])

    def failed(self, op: Operation, reason: mate.FailureReason, detail: str = "", *,
               cause: BaseException | None = None, length: int = 0,
               peer: int | None = None, tag: int | None = None) -> None:
        self.report_all([Report(Input.FAILED, op, length, peer, tag,
                                mate.MessageFailed(reason, detail))])

    def cancelled(self, op: Operation) -> None:
        self.report_all([Report(Input.CANCELLED, op)])

    def report_all(self, reports: Sequence[Report]) -> None:
        passed = []
        for r in reports:
            if r.op not in self.carriers:
                passed.append(r)
            elif (original := self.carriers[r.op]) is not None and r.input is not Input.SUBMITTED:
                del self.carriers[r.op]
                passed.append(r._replace(op=original))
        if passed:
            self._sink.report_all(passed)

    def call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        self._sink.call_on_loop(fn, *args)

    @property
    def loop_work(self) -> int:
        return self._sink.loop_work


class Overtaking(Layer):
    """Sends posted in one turn of the loop leave in reverse order."""

    def __init__(self, inner: Transport, sink: Sink) -> None:
        super().__init__(inner, sink)
        self.held: list[Operation] = []

    def post(self, op: Operation) -> None:
        if op.op is not Op.SEND:
            return super().post(op)
        if not self.held:
            self.loop.call_soon(self._flush)
        self.held.append(op)

    def _flush(self) -> None:
        held, self.held = self.held, []
        for op in reversed(held):
            self.inner.post(op)


class EarlyPut(Layer):
    """A put completes at once; its data lands up to 2 ms later."""

    def post(self, op: Operation) -> None:
        if op.op is not Op.PUT:
            return super().post(op)
        data = memoryview(bytes(op.buffer))
        self.loop.call_soon(self._sink.completed, op, len(op.buffer), op.peer, 0)
        self.loop.call_later(random.uniform(0, 2e-3), self.carry, None, Op.PUT, data,
                             op.peer, 0, op.address)


class LossyCancel(Layer):
    """A cancelled receive is reported cancelled at once, but stays posted below: a message
    it matches later is consumed and lost."""

    def cancel(self, op: Operation) -> None:
        if op.op is not Op.RECV:
            return super().cancel(op)
        self.carriers[op] = None  # whatever it gets from now on is dropped
        self.loop.call_soon(self._sink.cancelled, op)


class WildPut(Layer):
    """A put also writes the byte before its target."""

    def post(self, op: Operation) -> None:
        if op.op is not Op.PUT:
            return super().post(op)
        self.carry(op, Op.PUT, memoryview(b"\x00" + bytes(op.buffer)), op.peer, 0,
                   op.address - 1)


async def run_local(names: list[str], iterations: int, mutant: type[Layer] | None = None,
                    ranks: int = 3) -> list[Result]:
    tests = [TESTS[n] for n in names]
    async with mate.local.worlds(ranks) as worlds, mate.local.worlds(ranks) as controls:
        if mutant is not None:
            for world in worlds:
                world.interpose(mutant(world.transport, world.sink))
        sides = [LitmusRank(w, c, seed=7) for w, c in zip(worlds, controls, strict=True)]
        found = await asyncio.wait_for(
            asyncio.gather(*(s.run(tests, iterations) for s in sides)), 300)
        return found[0]


def forbidden(results: list[Result]) -> dict[str, int]:
    return {r.test.name: sum(r.forbidden.values()) for r in results if r.forbidden}


async def test_the_local_transport_shows_nothing_forbidden() -> None:
    results = await run_local(list(TESTS), 20)
    assert len(results) == len(TESTS)
    assert forbidden(results) == {}


@pytest.mark.parametrize("mutant, names", [
    (Overtaking, ["SS", "SS-self", "timeout-send"]),
    (EarlyPut, ["MP+put+put-wait", "MP+put+send-wait", "causal-3-wait", "WAW-wait"]),
    (LossyCancel, ["cancel-recv", "cancel-recv-self"]),
    (WildPut, ["write-put"]),
])
async def test_each_broken_rule_is_caught(mutant: type[Layer], names: list[str]) -> None:
    results = await run_local(names, 150, mutant)
    caught = forbidden(results)
    assert set(caught) == set(names), caught


async def test_a_hang_is_forbidden_and_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    class Deaf(Layer):
        """Receives never complete."""

        def post(self, op: Operation) -> None:
            if op.op is not Op.RECV:
                super().post(op)

    monkeypatch.setattr("mate.litmus.runner.BOUND", 0.2)
    results = await run_local(["SS", "WAW-wait"], 5, Deaf)
    assert [r.test.name for r in results] == ["SS"]  # the run stopped at the hang
    (outcome,) = results[0].forbidden
    assert ("hung@1", "program") in outcome


# -- random programs: the local transport within the model ---------------------------------


@st.composite
def programs(draw: st.DrawFn) -> Any:
    """Two ranks, a few operations each, waits and reads at random places."""
    memory: list[list[Var]] = [[], []]
    steps: list[list[Instruction]] = [[], []]
    counter = iter(range(100))
    for _ in range(draw(st.integers(1, 4))):
        rank = draw(st.integers(0, 1))
        peer = draw(st.integers(0, 1))
        n = next(counter)
        kind = draw(st.sampled_from(("put", "get", "send")))
        memory[rank].append(Var(f"v{n}", init=n + 1))
        if kind == "send":
            memory[peer].append(Var(f"b{n}"))
            steps[rank].append(Send(f"s{n}", f"v{n}", peer, n))
            steps[peer] += [Recv(f"r{n}", f"b{n}", rank, n), Wait(f"r{n}"),
                            Read(f"b{n}", f"R{n}")]
        else:
            memory[peer].append(Var(f"t{n}"))
            op = Put(f"p{n}", f"v{n}", peer, f"t{n}") if kind == "put" else Get(
                f"p{n}", f"v{n}", peer, f"t{n}")
            steps[rank].append(op)
            if draw(st.booleans()):
                steps[rank].append(Wait(f"p{n}"))
        if draw(st.booleans()):
            steps[rank].append(Write(f"v{n}", 50 + n))
    final = [(r, v.name) for r in (0, 1) for v in memory[r]]
    for r in (0, 1):
        memory[r].append(Var("pad"))  # no rank without memory
    return litmus("random", "", memory, steps, final=final)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(test=programs())
def test_random_programs_stay_within_the_model(test: Any) -> None:
    try:
        permitted = allowed(test)
    except ModelError:
        assume(False)  # a program that can deadlock is not a test
    results = asyncio.run(_run_one(test))
    assert set(results.observed) <= permitted, report.forbidden_details([results])


async def _run_one(test: Any) -> Result:
    async with mate.local.worlds(2) as worlds, mate.local.worlds(2) as controls:
        sides = [LitmusRank(w, c, seed=3) for w, c in zip(worlds, controls, strict=True)]
        permitted = allowed(test)
        found = await asyncio.gather(*(s.run_test(test, 30, permitted) for s in sides))
        result = found[0]
        assert result is not None
        return result


# -- the command line ----------------------------------------------------------------------


def test_command_line_report_and_json(tmp_path: Any) -> None:
    out = tmp_path / "litmus.json"
    done = subprocess.run(
        [sys.executable, "-m", "mate.litmus", "--transport", "local", "--iterations", "10",
         "--tests", "SS*", "MP*", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no forbidden outcome" in done.stdout
    assert "obs/allowed %" in done.stdout
    document = json.loads(out.read_text())
    names = [t["name"] for t in document["tests"]]
    assert names == [n for n in TESTS if n.startswith(("SS", "MP"))]
    for entry in document["tests"]:
        assert entry["iterations"] == 10 and entry["forbidden"] == {}
        assert set(entry["observed"]) <= set(entry["allowed"])

    # docs/litmus.md's table: runs side by side, a dash where a run skipped a test
    two = tmp_path / "two.json"
    document["tests"] = document["tests"][:1]
    document["progress"] = "poll"
    two.write_text(json.dumps(document))
    done = subprocess.run([sys.executable, "-m", "mate.litmus", "--merge", str(out), str(two)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = done.stdout.splitlines()
    assert rows[0].count("iterations, observed (%), forbidden") == 2
    assert "local poll (" in rows[0]
    first, second = rows[2], rows[3]
    assert first.startswith(f"| `{names[0]}` |") and first.count(", 0 |") == 2
    assert second.startswith(f"| `{names[1]}` |") and second.endswith("| - |")
    assert rows[-1].startswith("| **all** |") and f"| {10 * len(names)}, " in rows[-1]


def test_exit_status_is_1_when_something_forbidden_was_seen(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    test = TESTS["SS"]
    wrong: Outcome = (("x", (2,)), ("y", (1,)))

    async def fake_run(args: Any, tests: Any) -> list[Result]:
        from collections import Counter
        return [Result(test, allowed(test), Counter({wrong: 3}))]

    monkeypatch.setattr(cli, "run", fake_run)
    assert cli.main(["--transport", "local", "--tests", "SS"]) == 1
    assert "FORBIDDEN SS x3: x=2 y=1" in capsys.readouterr().out


def test_list() -> None:
    done = subprocess.run([sys.executable, "-m", "mate.litmus", "--list"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == len(TESTS)


# -- the suite on every transport (CI's short version) ---------------------------------------

SHORT = 200


def _launched(command: list[str]) -> str:
    done = run_bounded(command, 900, "mate.litmus")
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    assert "no forbidden outcome" in done.stdout, done.stdout[-5000:]
    return done.stdout


def test_local_short() -> None:
    out = _launched([sys.executable, "-m", "mate.litmus", "--transport", "local",
                     "--iterations", str(SHORT)])
    assert f"{len(TESTS)} tests" in out


# Three ranks that busy-poll on two cores take turns by the scheduler's time slice (a run
# is ten times slower), so three ranks run in the modes that block, poll mode on two.
# Handlers run in the progress thread where there is one (where reports are applied
# and handlers run then differs the most from the loop's).
@pytest.mark.parametrize("nranks, progress", [(2, "poll"), (3, "thread")])
def test_mpi_short(nranks: int, progress: str) -> None:
    handlers = "progress" if progress == "thread" else "loop"
    _launched([sys.executable, "-m", "mate.run", "-n", str(nranks), "python", "-m",
               "mate.litmus", "--transport", "mpi", "--progress", progress,
               "--handlers", handlers, "--iterations", str(SHORT)])


@pytest.mark.parametrize("nranks, progress", [(2, "poll"), (3, "loop"), (3, "thread")])
def test_ibverbs_short(nranks: int, progress: str) -> None:
    handlers = "progress" if progress == "thread" else "loop"
    _launched([sys.executable, "-m", "mate.run", "-n", str(nranks), "--transport", "ibverbs",
               "python", "-m", "mate.litmus", "--transport", "ibverbs", "--progress", progress,
               "--handlers", handlers, "--iterations", str(SHORT)])
