"""The soak run (`python -m mate.soak`, issue 12): its checks, each shown to fail, and
short runs on every transport as users run them.

* The checks on hand-made records: a payload corrupted, events that break SPEC §1
  (a double terminal event, a late submission...), a lost and a duplicated
  message, a put that landed in part, memory or pins over their bounds.
* The whole program against deliberately broken transports (the local transport
  patched in this process): each breakage must end NOT verified, for its reason.
* 10**4 messages through the command line: local, mpi (poll; thread with handlers
  in the progress thread) and ibverbs (loop, poll, thread) under mate-run.
"""

from __future__ import annotations

import gc
import itertools
import json
import mmap
import re
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LAUNCHED
from launch import run_bounded

from mate import soak
from mate.schedule import Event, Op, Receipt, Schedule, State
from mate.transports import local
from mate.transports.base import Operation
from mate.world import World

pytestmark = pytest.mark.skipif(LAUNCHED is not None, reason="this is the launcher")

MATE_RUN = str(Path(sys.executable).with_name("mate-run"))
SUMMARY = re.compile(r"soak: (\d+) messages in ([\d.]+) s = (\d+) messages/s; (\d+) timed out, "
                     r"(\d+) cancelled, (\d+) failed; RSS start ([\d.]+) MiB, end ([\d.]+) MiB, "
                     r"growth after warm-up ([-+][\d.]+) MiB \(bound (\d+) MiB\)")

# -- the checks, on hand-made records -----------------------------------------------------------

CONFIG = soak.Config(messages=400, round=100, max_size=256 * 1024)


def payload(header: soak.Header) -> bytearray:
    pool = memoryview(bytes(range(256)) * 2048)
    data = bytearray(header.size)
    soak.write_payload(memoryview(data), pool, header)
    return data


def test_a_payload_reads_back_and_any_flipped_bit_is_caught() -> None:
    header = soak.Header(soak.Kind.DATA, 1, 3, 7, 200, 5)
    data = payload(header)
    assert soak.read_payload(memoryview(data)) == header
    for i in (0, 5, soak.HEADER.size, 199):
        spoiled = bytearray(data)
        spoiled[i] ^= 0x10
        assert "checksum" in str(soak.read_payload(memoryview(spoiled)))
    assert "checksum" in str(soak.read_payload(memoryview(data)[:150]))  # cut short
    assert "shorter than a header" in str(soak.read_payload(memoryview(data)[:10]))


def receipt(op: Op, event: Event | None, length: int = 8) -> Receipt:
    return Receipt(op, 3 if op in (Op.SEND, Op.RECV) else None, length, 0, 1, 4096,
                   None if op in (Op.SEND, Op.RECV) else 8192, event)


def events(op: Op, *kinds: Event) -> list[Receipt]:
    return [receipt(op, kind) for kind in kinds]


S, C, T, F = Event.SUBMISSION, Event.COMPLETION, Event.TIMEOUT, Event.FAILURE
GOOD = [
    (Op.SEND, State.COMPLETED, [S, C], State.COMPLETED),
    (Op.PUT, State.COMPLETED, [S, C], None),
    (Op.SEND, State.TIMED_OUT, [S, T], State.TIMED_OUT),
    (Op.SEND, State.TIMED_OUT, [T], None),
    (Op.SEND, State.CANCELLED, [S], State.CANCELLED),
    (Op.RECV, State.CANCELLED, [], State.CANCELLED),
    (Op.RECV, State.COMPLETED, [C], State.COMPLETED),
    (Op.GET, State.FAILED, [F], State.FAILED),
]


@pytest.mark.parametrize(("op", "state", "kinds", "awaited"), GOOD)
def test_events_that_keep_spec_1_pass(op: Op, state: State, kinds: list[Event],
                                      awaited: State | None) -> None:
    final = receipt(op, soak.TERMINAL_EVENT.get(state))
    assert soak.check_events(op, state, events(op, *kinds), awaited, final) == []


BAD = {
    "double terminal event": (Op.SEND, State.COMPLETED, [S, C, C], None),
    "no terminal event": (Op.RECV, State.COMPLETED, [], None),
    "the wrong terminal event": (Op.RECV, State.COMPLETED, [T], None),
    "a terminal event for a cancelled message": (Op.SEND, State.CANCELLED, [S, T], None),
    "two terminal events of two kinds": (Op.GET, State.TIMED_OUT, [T, C], None),
    "submission after the terminal event": (Op.SEND, State.TIMED_OUT, [T, S], None),
    "two submissions": (Op.PUT, State.COMPLETED, [S, S, C], None),
    "a submission for a receive": (Op.RECV, State.COMPLETED, [S, C], None),
    "a submission for a get": (Op.GET, State.COMPLETED, [S, C], None),
    "a completed send without submission": (Op.SEND, State.COMPLETED, [C], None),
    "an await that disagrees": (Op.RECV, State.COMPLETED, [C], State.CANCELLED),
    "an await that disagrees, no schedule": (Op.SEND, State.TIMED_OUT, None, State.COMPLETED),
}


@pytest.mark.parametrize("case", list(BAD))
def test_events_that_break_spec_1_are_caught(case: str) -> None:
    op, state, kinds, awaited = BAD[case]
    final = receipt(op, soak.TERMINAL_EVENT.get(state))
    seen = None if kinds is None else events(op, *kinds)
    assert soak.check_events(op, state, seen, awaited, final)


def test_a_handler_receipt_that_is_not_the_final_one_is_caught() -> None:
    final = receipt(Op.RECV, C, length=8)
    assert soak.check_events(Op.RECV, State.COMPLETED, [receipt(Op.RECV, C, length=7)], None,
                             final)


def planned(*ops: Op, size: int = 100) -> list[soak.Planned]:
    choice = soak.Choice(None, soak.Cancel.NONE, 0.0, soak.Observe.BOTH, False)
    plan, offset = [], 0
    for index, op in enumerate(ops):
        plan.append(soak.Planned(index, op, size, 0, offset if op is Op.PUT else 0, -1, choice))
        offset += size if op is Op.PUT else 0
    return plan


CODE = soak.OUTCOME_CODE


def test_the_accounting_accepts_every_allowed_ending() -> None:
    plan = planned(Op.SEND, Op.SEND, Op.SEND, Op.SEND, Op.PUT)
    outcomes = bytes([CODE[State.COMPLETED], CODE[State.TIMED_OUT], CODE[State.TIMED_OUT],
                      CODE[State.CANCELLED], CODE[State.COMPLETED]])
    assert soak.account(plan, outcomes, bytes([1, 0, 1, 1, 0]), 1, 4) == []


@pytest.mark.parametrize(("what", "outcome", "times"), [
    ("lost", State.COMPLETED, 0),
    ("duplicated", State.COMPLETED, 2),
    ("duplicated after a timeout", State.TIMED_OUT, 2),
    ("duplicated after a cancel", State.CANCELLED, 3),
])
def test_the_accounting_catches_loss_and_duplicates(what: str, outcome: State,
                                                    times: int) -> None:
    problems = soak.account(planned(Op.SEND), bytes([CODE[outcome]]), bytes([times]), 1, 4)
    assert problems and f"delivered {times} times" in problems[0]


def test_the_accounting_catches_a_put_delivered_and_a_missing_outcome() -> None:
    plan = planned(Op.PUT, Op.SEND)
    assert "delivered as a message" in soak.account(
        plan, bytes([CODE[State.COMPLETED]] * 2), bytes([1, 1]), 1, 0)[0]
    assert "no outcome" in soak.account(plan, bytes([CODE[State.COMPLETED], soak.NOT_ENDED]),
                                        bytes([0, 1]), 1, 0)[0]
    assert "outcomes" in soak.account(plan, bytes([0]), bytes([0, 1]), 1, 0)[0]


def put_area(plan: list[soak.Planned], landed: list[bool]) -> bytearray:
    area = bytearray(1024)
    for entry, there in zip(plan, landed, strict=True):
        if there:
            header = soak.Header(soak.Kind.PUT, 1, 2, entry.index, entry.size, 0)
            area[entry.offset:entry.offset + entry.size] = payload(header)
    return area


def test_a_put_area_with_every_allowed_outcome_passes_and_is_zeroed() -> None:
    plan = planned(Op.PUT, Op.PUT, Op.PUT, Op.SEND)
    outcomes = bytes([CODE[State.COMPLETED], CODE[State.TIMED_OUT], CODE[State.CANCELLED],
                      CODE[State.COMPLETED]])
    area = put_area(plan, [True, True, False, False])
    assert soak.check_put_area(memoryview(area), plan, outcomes, 1, 2) == []
    assert area == bytearray(1024)


@pytest.mark.parametrize("breakage", ["missing", "partial", "corrupted", "stray", "foreign"])
def test_a_put_area_that_breaks_the_rules_is_caught(breakage: str) -> None:
    plan = planned(Op.PUT, Op.PUT)
    outcomes = bytes([CODE[State.COMPLETED], CODE[State.TIMED_OUT]])
    area = put_area(plan, [breakage != "missing", True])
    if breakage == "partial":  # the put that timed out landed in part
        area[100 + 50:200] = bytes(50)
    elif breakage == "corrupted":
        area[60] ^= 1
    elif breakage == "stray":  # a byte outside every put's range
        area[500] = 1
    elif breakage == "foreign":  # another round's data where a put should be
        area[0:100] = payload(soak.Header(soak.Kind.PUT, 1, 1, 0, 100, 0))
    assert soak.check_put_area(memoryview(area), plan, outcomes, 1, 2)
    assert area == bytearray(1024)


def report(rank: int, **changes: Any) -> dict[str, Any]:
    mib = 2**20
    fields: dict[str, Any] = {
        "rank": rank, "originated": {"send": 140, "put": 30, "get": 30}, "receives": 150,
        "markers": 40, "cancels": 3, "ended": {"send completed": 150, "recv timed_out": 4},
        "traffic_s": 1.5, "rss": {"start": 50 * mib, "warm": 60 * mib, "end": 61 * mib,
                                  "peak": 62 * mib},
        "pinned_max": 0, "stats": {"outstanding": 0}, "problem_count": 0, "problems": []}
    fields.update(changes)
    return fields


def test_the_verdict_on_good_reports_says_verified_with_the_figures() -> None:
    verdict = soak.judge([report(0), report(1)], [], CONFIG, {}, None)
    assert verdict.verified
    match = SUMMARY.search(verdict.lines[-1])
    assert match and verdict.lines[-1].endswith(": verified")
    assert match.group(1) == "400" and match.group(9) == "+1.0"


@pytest.mark.parametrize("breakage", ["rss", "pins", "count", "problems", "missing"])
def test_the_verdict_catches_each_bound_and_every_rank_problem(breakage: str) -> None:
    mib = 2**20
    reports, missing, pin_limit = [report(0), report(1)], [], None
    if breakage == "rss":
        reports[1]["rss"] = {"start": 50 * mib, "warm": 60 * mib, "end": 125 * mib,
                             "peak": 125 * mib}
    elif breakage == "pins":
        pin_limit = 64 * mib
        reports[0]["pinned_max"] = 65 * mib
    elif breakage == "count":
        reports[0]["originated"] = {"send": 139, "put": 30, "get": 30}
    elif breakage == "problems":
        reports[1] = report(1, problem_count=1, problems=["rank 1: something"])
    else:
        reports, missing = reports[:1], ["rank 1's report did not come"]
    verdict = soak.judge(reports, missing, CONFIG, {}, pin_limit)
    assert not verdict.verified
    assert "NOT verified" in verdict.lines[-1]


def test_both_ranks_plan_alike_and_puts_and_gets_stay_in_their_areas() -> None:
    config = soak.Config(messages=4000, round=500, max_size=2**20)
    for rank in (0, 1):
        plan = soak.plan_round(config, rank, 3)
        assert plan == soak.plan_round(config, rank, 3)
        slots = soak.get_slots(config, 1 - rank, 3)
        puts = [e for e in plan if e.op is Op.PUT]
        assert all(a.offset + a.size <= b.offset for a, b in itertools.pairwise(puts))
        assert all(e.offset + e.size <= config.area for e in puts)
        assert all(slots[e.slot] == (e.offset, e.size) for e in plan if e.op is Op.GET)
        sizes = [e.size for e in plan]
        assert min(sizes) >= soak.HEADER.size and max(sizes) <= config.max_size
        assert {Op.SEND, Op.PUT, Op.GET} == {e.op for e in plan}
    assert sum(s for _, s in soak.get_slots(config, 0, 3)) > config.area - soak.HEADER.size


def test_byte_counts_and_bad_options() -> None:
    assert soak.byte_count("64K") == 65536 and soak.byte_count("1M") == 2**20
    assert soak.byte_count("4096") == 4096
    for argv in (["--progress", "manual"], ["--max-size", "1000"], ["--ranks", "3"],
                 ["--round", "5000", "--max-size", "4096"], ["--tags", "2000"]):
        with pytest.raises(SystemExit):
            soak.parse_arguments(argv)


# -- the program against broken transports ------------------------------------------------------

SMALL = ["--transport", "local", "--messages", "1200", "--round", "150", "--stall", "10"]


def is_data(op: Operation, kind: soak.Kind = soak.Kind.DATA) -> bool:
    return len(op.buffer) >= soak.HEADER.size and op.buffer[4] == kind


def every(n: int) -> Callable[[], bool]:
    """True on every n-th call (a fault now and then, not on every message)."""
    calls = iter(range(1, 10**9))
    return lambda: next(calls) % n == 0


def breakages() -> Iterator[tuple[str, list[str], str, Callable[[pytest.MonkeyPatch], None]]]:
    """(name, extra options, what NOT verified must say, the breakage)."""
    send, deliver = local.LocalTransport._send, local.LocalTransport._deliver
    cancel, one_sided = local.LocalTransport.cancel, local.LocalTransport._one_sided

    def lose(mp: pytest.MonkeyPatch) -> None:  # an eager send completes, nothing arrives
        now = every(97)

        def lossy(self: local.LocalTransport, op: Operation) -> None:
            if is_data(op) and len(op.buffer) <= self.eager_limit and now():
                self._sink.completed(op, len(op.buffer), op.peer, op.tag)
            else:
                send(self, op)
        mp.setattr(local.LocalTransport, "_send", lossy)
    yield "loss", [], "(lost)", lose

    def duplicate(mp: pytest.MonkeyPatch) -> None:  # an eager message arrives twice
        now = every(97)

        def twice(self: local.LocalTransport, op: Operation) -> None:
            send(self, op)
            dest = self.fabric.ranks[op.peer]
            if is_data(op) and len(op.buffer) <= self.eager_limit and now() and dest:
                arrival = local._Arrival(self.mypid, op.tag, bytes(op.buffer), None)
                dest._unexpected.add(self.mypid, op.tag, arrival)
        mp.setattr(local.LocalTransport, "_send", twice)
    yield "duplicate", [], "delivered 2 times", duplicate

    def corrupt(mp: pytest.MonkeyPatch) -> None:
        now = every(97)

        def flipped(self: local.LocalTransport, recv: Operation, source: int, tag: int,
                    data: memoryview) -> None:
            if len(data) > soak.HEADER.size and data[4] == soak.Kind.DATA and now():
                spoiled = bytearray(data)
                spoiled[-1] ^= 1
                data = memoryview(spoiled)
            deliver(self, recv, source, tag, data)
        mp.setattr(local.LocalTransport, "_deliver", flipped)
    yield "corruption", [], "checksum does not match", corrupt

    def read_after_submission(mp: pytest.MonkeyPatch) -> None:
        # A rendezvous send reports submission while it still waits to be read.
        def early(self: local.LocalTransport, op: Operation) -> None:
            send(self, op)
            if isinstance(op.transport_data, local._Arrival):
                self._sink.submitted(op)
        mp.setattr(local.LocalTransport, "_send", early)
    yield "read after submission", ["--large", "0.3"], "read after submission", \
        read_after_submission

    def double_event(mp: pytest.MonkeyPatch) -> None:  # the core runs a handler twice
        handler_for = Schedule.handler_for
        now = every(53)

        def twice(self: Schedule, event: Event) -> tuple[Any, Any]:
            handler, data = handler_for(self, event)
            if handler is None or event is not Event.COMPLETION or not now():
                return handler, data

            def both(receipt: Receipt, datum: Any) -> None:
                handler(receipt, datum)
                handler(receipt, datum)
            return both, data
        mp.setattr(Schedule, "handler_for", twice)
    yield "double terminal event", [], "terminal handlers fired: completion, completion", \
        double_event

    def recv_writes_on_cancel(mp: pytest.MonkeyPatch) -> None:  # consumes, then says no
        def consuming(self: local.LocalTransport, op: Operation) -> None:
            waiting = op.transport_data is local._Stage.WAITING
            cancel(self, op)
            if op.op is Op.RECV and waiting:
                op.buffer[:4] = b"soak"
        mp.setattr(local.LocalTransport, "cancel", consuming)
    yield "receive consumed on cancel", [], "wrote its buffer", recv_writes_on_cancel

    def get_writes_late(mp: pytest.MonkeyPatch) -> None:  # a cancelled get writes later
        def late(self: local.LocalTransport, op: Operation) -> None:
            queued = op.transport_data is local._Stage.QUEUED
            cancel(self, op)
            if op.op is Op.GET and queued:
                self._loop.call_later(0.001, op.buffer.__setitem__, 0, 0xAA)
        mp.setattr(local.LocalTransport, "cancel", late)
    yield "get writes after it ended", [], "wrote its buffer after it ended", get_writes_late

    def half_put(mp: pytest.MonkeyPatch) -> None:  # a put lands in part, and completes
        now = every(7)

        def partial(self: local.LocalTransport, op: Operation) -> None:
            if op.op is Op.PUT and is_data(op, soak.Kind.PUT) and now():
                target = self.fabric.ranks[op.peer]
                assert target is not None
                n = len(op.buffer)
                memory = target._region_memory(op.address, n)
                assert memory is not None
                memory[:n // 2] = op.buffer[:n // 2]
                self._sink.completed(op, n, op.peer, op.tag)
            else:
                one_sided(self, op)
        mp.setattr(local.LocalTransport, "_one_sided", partial)
    yield "put landed in part", [], "(COMPLETED) left", half_put

    def leak(mp: pytest.MonkeyPatch) -> None:  # 256 KiB kept for every message sent
        kept: list[mmap.mmap] = []

        def leaky(self: local.LocalTransport, op: Operation) -> None:
            # Fresh pages from the kernel, written: the heap's free memory, resident after
            # the tests before this one, would absorb a leak of bytearrays.
            page = mmap.mmap(-1, 256 * 1024)
            page.write(b"\x01" * len(page))
            kept.append(page)
            send(self, op)
        mp.setattr(local.LocalTransport, "_send", leaky)
    yield "leak", ["--rss-bound", "16M"], "the resident set grew", leak

    def miscount(mp: pytest.MonkeyPatch) -> None:  # world.stats() disagrees
        stats = World.stats

        def off_by_one(self: World) -> dict[str, int]:
            counters = stats(self)
            counters["timed_out"] += 1
            return counters
        mp.setattr(World, "stats", off_by_one)
    yield "counters", [], "world.stats()['timed_out']", miscount

    def lose_marker(mp: pytest.MonkeyPatch) -> None:  # a marker never leaves: a round hangs
        def dropped(self: local.LocalTransport, op: Operation) -> None:
            if not (is_data(op, soak.Kind.MARKER) and op.buffer[8] == 2 and op.tag == 1):
                send(self, op)
        mp.setattr(local.LocalTransport, "_send", dropped)
    yield "stall", ["--stall", "2"], "round 2 did not end within 2 s", lose_marker


BREAKAGES = {name: (extra, expected, apply) for name, extra, expected, apply in breakages()}


def test_an_unbroken_transport_is_verified(capsys: pytest.CaptureFixture[str]) -> None:
    assert soak.main(SMALL) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(": verified")


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_a_broken_transport_is_not_verified(name: str, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    extra, expected, apply = BREAKAGES[name]
    apply(monkeypatch)
    code = soak.main([*SMALL, *extra])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 1, lines
    assert "NOT verified" in lines[-1] and expected in lines[-1], lines[-1]


# -- the command line, as users run it ---------------------------------------------------------

SHORT = ["--messages", str(10**4)]


def run(command: list[str], json_path: Path, timeout: float = 300) -> dict[str, Any]:
    done = run_bounded([*command, *SHORT, "--json", str(json_path)], timeout, "mate.soak")
    lines = done.stdout.strip().splitlines()
    output = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, output
    summaries = [line for line in lines if "soak:" in line]
    assert len(summaries) == 1 and summaries[0] == lines[-1], output  # rank 0's, last
    assert lines[-1].endswith("every message accounted for: verified"), output
    match = SUMMARY.search(lines[-1])
    assert match and int(match.group(1)) == 10**4 and int(match.group(3)) > 0, output
    figures: dict[str, Any] = json.loads(json_path.read_text())
    assert figures["verified"] and figures["messages"] == 10**4
    assert figures["timed_out"] > 0 and figures["cancelled"] > 0 and figures["failed"] == 0
    for rank in figures["ranks"]:
        assert rank["stats"]["outstanding"] == 0
        assert rank["rss"]["end"] - rank["rss"]["warm"] <= figures["rss_bound"]
        assert sum(rank["originated"].values()) == 5000
    return figures


def test_local(tmp_path: Path) -> None:
    run([sys.executable, "-m", "mate.soak", "--transport", "local"], tmp_path / "soak.json")


@pytest.mark.parametrize("extra", [[], ["--progress", "thread", "--handlers", "progress"]],
                         ids=["poll", "thread-handlers"])
def test_mpi(extra: list[str], tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    figures = run([MATE_RUN, "-n", "2", sys.executable, "-m", "mate.soak", "--transport", "mpi",
                   *extra], tmp_path / "soak.json")
    assert figures["transport"] == "mpi"


@pytest.mark.parametrize("progress", ["loop", "poll", "thread"])
def test_ibverbs(progress: str, tmp_path: Path) -> None:
    figures = run([MATE_RUN, "-n", "2", "--transport", "ibverbs", sys.executable, "-m",
                   "mate.soak", "--transport", "ibverbs", "--progress", progress,
                   "--pin-limit", "32M"], tmp_path / "soak.json")
    assert figures["pin_limit"] == 32 * 2**20
    for rank in figures["ranks"]:
        assert 0 < rank["pinned_max"] <= 32 * 2**20
        assert rank["stats"]["pin_hits"] > 0 and rank["stats"]["rendezvous_sends"] > 0


def test_the_payload_crc_is_zlibs() -> None:
    """The CRC field is zlib's CRC-32 of everything after it (so other tools can read it)."""
    data = payload(soak.Header(soak.Kind.SLOT, 0, 0, 0, 64, 0))
    assert soak.CRC.unpack_from(data)[0] == zlib.crc32(data[4:])


def test_the_leak_bound_samples_after_garbage_is_collected() -> None:
    # Garbage freed between the warm-up and end samples once hid a real leak; the two
    # samples are taken after a collection, so a cycle holding 64 MiB is gone by then.
    gc.disable()
    try:
        cycle: list[object] = [bytearray(b"\1" * (64 << 20))]
        cycle.append(cycle)
        del cycle
        before = soak.resident()
        after = soak.settled_resident()
    finally:
        gc.enable()
    assert before - after > 32 << 20
