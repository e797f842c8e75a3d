"""The MPI transport's progress engine on its own: requests kept in posting order,
tested from the front, in this process on MPI.COMM_SELF (no mpiexec, no world).

A pass tests the transport's own requests and the oldest `FRONT` user requests,
and the rest in the first pass that finds nothing after one that found something,
and every `WHOLE_EVERY` passes. The tests
complete receives in chosen orders by sending to this process, interleave
passes, orphaning and cancelling, and check that every request's action runs
once, with its own status, within a bounded number of passes.
"""

from __future__ import annotations

import asyncio
import os
import select
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

MPI = pytest.importorskip("mpi4py.MPI")

from mate.transports.mpi import progress  # noqa: E402
from mate.transports.mpi.progress import FRONT, WHOLE_EVERY, Engine, Entry  # noqa: E402


class Recorder:
    """An engine in manual mode (passes run only when the test says), and what its
    actions saw: (tag, the pass it ran in, cancelled) per owner."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.errors: list[BaseException] = []
        self.engine = Engine(self.loop, "manual", lambda exc, owner: self.errors.append(exc),
                             lambda: None)
        self.seen: dict[Any, tuple[int, int, bool]] = {}
        self.buffers: list[bytearray] = []
        self.comm = MPI.COMM_SELF.Dup()  # nothing left from another test can match

    def action(self, owner: Any, status: Any, error: Any) -> None:
        assert owner not in self.seen, f"{owner}'s action ran twice"
        assert error is None
        self.seen[owner] = (status.Get_tag(), self.engine.passes, status.Is_cancelled())

    def receive(self, tag: int, *, standing: bool = False) -> Entry:
        buffer = bytearray(1)
        self.buffers.append(buffer)
        request = self.comm.Irecv(buffer, 0, tag)
        return self.engine.add(request, self.action, owner=("recv", tag), standing=standing,
                               receive=True)

    def queued(self, request: Any, owner: Any, *, standing: bool = False,
               receive: bool = True) -> Entry:
        """`request` handed to the engine as `Engine.add` does in thread mode: through
        the inbox, taken in by the next pass."""
        entry = Entry(request, self.action, owner, standing=standing, receive=receive)
        self.engine.call(self.engine._add_entry, entry)
        return entry

    def queued_receive(self, tag: int, *, standing: bool = False) -> Entry:
        buffer = bytearray(1)
        self.buffers.append(buffer)
        return self.queued(self.comm.Irecv(buffer, 0, tag), ("recv", tag), standing=standing)

    def send(self, tag: int) -> None:
        self.comm.Send(b"x", 0, tag)  # a receive is posted for it: matched at once

    def close(self) -> None:
        self.engine.stop()
        self.engine.cancel_receives(standing=True)
        self.engine.drain(float("inf"))
        self.engine.free()
        self.comm.Free()
        self.loop.close()
        assert not self.errors


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.close()


def settle(engine: Engine) -> None:
    """Run passes until WHOLE_EVERY in a row move nothing (one of them tested every
    request)."""
    still = 0
    while still < WHOLE_EVERY:
        still = 0 if engine.test() else still + 1


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 40), poking=st.booleans(), data=st.data())
def test_every_receive_completes_once_with_its_own_status_in_any_order(
        count: int, poking: bool, data: st.DataObject) -> None:
    """Holes left anywhere in the request list, compactions included, lose nothing;
    nor do the bare progress calls of passes that find nothing (Engine._poke)."""
    r = Recorder()
    if poking:  # a peer's native put of a minute's worth: pokes all along
        r.engine.nudged(1, int(60 * progress.TRANSFER_RATE), True)
    try:
        for tag in range(count):
            r.receive(tag)
        order = data.draw(st.permutations(range(count)))
        passes_between = data.draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
        for tag, passes in zip(order, passes_between, strict=True):
            r.send(tag)
            for _ in range(passes):
                r.engine.test(poking)
        settle(r.engine)
        assert {owner: seen[0] for owner, seen in r.seen.items()} == {
            ("recv", tag): tag for tag in range(count)}
        assert r.engine.user_outstanding == 0 and not r.errors
    finally:
        r.close()


@pytest.mark.parametrize("count", [2 * FRONT, 4 * WHOLE_EVERY + FRONT, 400])
def test_a_receive_behind_a_moving_front_is_found_within_its_bound(
        recorder: Recorder, count: int) -> None:
    """While the front completes one request in every pass, a request that completes
    out of order behind it is still found within max(WHOLE_EVERY, count / FRONT) passes
    (the bound that keeps testing the back as cheap per pass as testing the front)."""
    for tag in range(count):
        recorder.receive(tag)
    late = count - 1
    recorder.send(late)
    sent_at = recorder.engine.passes
    front = iter(range(count - 1))
    while ("recv", late) not in recorder.seen:
        recorder.send(next(front))  # the front moves in every pass
        recorder.engine.test()
        assert recorder.engine.passes - sent_at <= max(WHOLE_EVERY, count // FRONT + 1)
    for tag in front:
        recorder.send(tag)
    settle(recorder.engine)
    assert len(recorder.seen) == count


def test_a_receive_at_the_back_is_found_in_the_first_still_pass_after_a_moving_one(
        recorder: Recorder) -> None:
    for tag in range(3 * FRONT):
        recorder.receive(tag)
    recorder.send(0)
    recorder.engine.test()  # the front moves: the back is left for later ...
    recorder.send(3 * FRONT - 1)
    assert recorder.engine.test()  # ... and tested as soon as the front is still
    assert ("recv", 3 * FRONT - 1) in recorder.seen


def test_a_rank_waiting_on_a_still_window_tests_its_back_every_whole_every_passes(
        recorder: Recorder) -> None:
    for tag in range(3 * FRONT):
        recorder.receive(tag)
    for _ in range(2 * WHOLE_EVERY):
        recorder.engine.test()  # nothing moves
    recorder.send(3 * FRONT - 1)
    sent_at = recorder.engine.passes
    while not recorder.engine.test():
        assert recorder.engine.passes - sent_at < WHOLE_EVERY
    assert ("recv", 3 * FRONT - 1) in recorder.seen


def test_the_transports_own_receives_are_tested_in_every_pass(recorder: Recorder) -> None:
    """A standing receive posted first is never pushed out of the front by user requests."""
    recorder.receive(1000, standing=True)
    for tag in range(4 * FRONT):
        recorder.receive(tag)
    recorder.engine.test()
    front = iter(range(4 * FRONT))
    recorder.send(1000)
    recorder.send(next(front))
    recorder.engine.test()  # the front moves, and the standing receive is in the same call
    assert ("recv", 1000) in recorder.seen
    assert recorder.engine.user_outstanding == 4 * FRONT - 1


def test_orphaned_and_cancelled_requests_leave_the_order_intact(recorder: Recorder) -> None:
    """An orphan leaves a hole where it was; cancelling user receives ends those only."""
    entries = [recorder.receive(tag) for tag in range(3 * FRONT)]
    standing = recorder.receive(1000, standing=True)
    assert recorder.engine.disown(entries[0]) and not recorder.engine.disown(entries[0])
    recorder.send(0)  # completes the orphan: its action still runs, when orphans are tested
    recorder.send(1)
    recorder.engine.test()
    assert ("recv", 1) in recorder.seen and recorder.engine.user_outstanding == 3 * FRONT - 2
    recorder.engine.cancel_receives(standing=False)
    settle(recorder.engine)
    cancelled = {owner for owner, seen in recorder.seen.items() if seen[2]}
    assert cancelled == {("recv", tag) for tag in range(2, 3 * FRONT)}
    assert recorder.engine.user_outstanding == 0
    assert ("recv", 1000) not in recorder.seen and standing.index >= 0
    time.sleep(progress.ORPHAN_INTERVAL)  # orphans are tested this often
    recorder.engine.test()
    assert recorder.seen[("recv", 0)][0] == 0 and recorder.engine.orphans == 0


def test_a_receive_cancelled_before_the_engine_took_it_in_is_cancelled_as_it_is(
        recorder: Recorder) -> None:
    """Thread mode hands a receive posted on the loop to the progress context through
    its inbox. A cancel may come first: an emulated get's refusal, found in the pass
    during which the get was posted. Lost, it would leave the receive waiting for data
    that never comes (the get timed out instead of failing, or hung without a timeout)."""
    entry = recorder.queued_receive(7)
    recorder.engine.cancel(entry)
    recorder.engine.cancel(entry)  # asked again (a timeout's, then shutdown's): once only
    for _ in range(3):
        recorder.engine.test()
    assert recorder.seen[("recv", 7)][2], "not cancelled"
    recorder.engine.cancel(entry)  # gone now: nothing to cancel
    assert recorder.engine.user_outstanding == 0


def test_a_send_disowned_before_the_engine_took_it_in_is_taken_in_as_an_orphan(
        recorder: Recorder) -> None:
    """An emulated get's send, posted from a control message in thread mode, waits in
    the inbox until the next pass; the origin's abandon may be served first. Had the
    send stayed live, it would count as outstanding (no back-off, a shutdown drain
    waiting for it) though nothing will ever match it."""
    engine = recorder.engine
    entry = recorder.queued(recorder.comm.Issend(b"x", 0, 8), ("send", 8), receive=False)
    assert engine.disown(entry), "a send not yet taken in is not complete"
    engine.test()
    assert engine.user_outstanding == 0 and engine.orphans == 1
    recorder.comm.Recv(bytearray(1), 0, 8)  # MPI finishes the orphan, which then leaves
    time.sleep(progress.ORPHAN_INTERVAL)
    engine.test()
    assert ("send", 8) in recorder.seen and engine.orphans == 0


def test_cancelling_all_receives_reaches_those_still_in_the_inbox(recorder: Recorder) -> None:
    """Shutdown cancels every receive once the progress thread has stopped; the control
    channel's standing receive, reposted by the thread's last pass, is still in the
    inbox, and left posted it would wait out the drain and stay with MPI at
    MPI_Finalize."""
    engine = recorder.engine
    entries = [recorder.queued_receive(9), recorder.queued_receive(10, standing=True)]
    engine.cancel_receives(standing=False)
    assert [entry.cancelled for entry in entries] == [True, False]
    engine.cancel_receives(standing=True)
    for _ in range(3):
        engine.test()
    assert recorder.seen[("recv", 9)][2] and recorder.seen[("recv", 10)][2]


# -- transfers: large requests hold the backoff and nudge their peers -----------------------


def large_receive(recorder: Recorder, tag: int, nbytes: int = progress.TRANSFER_SIZE, *,
                  peer: int | None = 0) -> Entry:
    buffer = bytearray(nbytes)
    recorder.buffers.append(buffer)
    request = recorder.comm.Irecv(buffer, 0, tag)
    return recorder.engine.add(request, recorder.action, owner=("recv", tag), receive=True,
                               peer=peer, nbytes=nbytes)


def nudges_over(recorder: Recorder, seconds: float, start: float | None = None) -> list[float]:
    """Run passes until `seconds` after `start` (default: now); the times of the nudges
    they sent, from `start`."""
    sent: list[float] = []
    start = time.monotonic() if start is None else start
    recorder.engine.nudge = lambda peer, nbytes, one_sided: sent.append(time.monotonic() - start)
    while time.monotonic() - start < seconds:
        recorder.engine.test()
    return sent


def test_backoff_held_pauses_not_until_the_hold_ends() -> None:
    backoff = progress.Backoff()
    backoff.last_progress -= 1.0  # a second without progress: backing off
    assert backoff.pause() > 0 and not backoff.spinning()
    backoff.hold(0.05, time.monotonic())
    assert backoff.pause() == 0 and backoff.spinning()
    time.sleep(0.06)
    assert backoff.pause() > 0 and not backoff.spinning()


def test_a_transfer_holds_the_backoff_and_nudges_its_peer_ever_less_often(
        recorder: Recorder) -> None:
    recorder.engine.backoff.last_progress -= 1.0
    posted = time.monotonic()
    large_receive(recorder, 1)
    assert recorder.engine.backoff.pause() == 0  # held: SPIN plus its size at TRANSFER_RATE
    # At each nudge, the wait before the next and its due time, as the engine set them:
    # checked against its own clock, since a loaded host may hold any pass back.
    schedule: list[tuple[float, float]] = []

    def nudge(peer: int, nbytes: int, one_sided: bool) -> None:
        (entry,) = recorder.engine._transfers
        schedule.append((entry.transfer.wait, entry.transfer.nudge_at))

    recorder.engine.nudge = nudge
    give_up = time.monotonic() + 5.0
    while len(schedule) < 4 and time.monotonic() < give_up:
        recorder.engine.test()
    # The first SPIN after posting, then each after twice the wait before: ~2, 6, 14, 30 ms.
    assert [wait for wait, _ in schedule] == [progress.SPIN * 2**k for k in range(1, 5)]
    nudged = [due - wait for wait, due in schedule]  # the engine's clock at each nudge
    assert nudged[0] >= posted + progress.SPIN - 1e-9
    assert all(later >= due - 1e-9 for (_, due), later in zip(schedule, nudged[1:], strict=False))
    assert recorder.engine.late_nudges == len(schedule)
    recorder.send(1)
    # Completed: forgotten at once, and no nudge follows.
    assert nudges_over(recorder, 0.040) == []
    assert recorder.seen[("recv", 1)][0] == 1 and not recorder.engine._transfers


def test_a_completed_transfer_lets_go_of_its_message_at_once(recorder: Recorder) -> None:
    class Message:  # an owner that can be watched for its end
        pass

    buffer = bytearray(progress.TRANSFER_SIZE)
    done: list[int] = []
    for tag in range(1, 4):  # tries: one must end before SPIN, told apart below
        message = Message()
        gone = weakref.ref(message)
        posted = time.monotonic()
        recorder.engine.add(recorder.comm.Irecv(buffer, 0, tag),
                            lambda owner, status, error: done.append(status.Get_tag()),
                            owner=message, receive=True, peer=0, nbytes=len(buffer))
        del message
        recorder.comm.Send(bytes(progress.TRANSFER_SIZE), 0, tag)
        while done[-1:] != [tag]:
            recorder.engine.test()
        # Before the transfer's first nudge fell due (SPIN after posting), the time at
        # which the engine used to look for completed transfers to drop.
        if time.monotonic() - posted < progress.SPIN:
            break
    else:
        pytest.fail("no try completed within SPIN: a host this slow cannot tell")
    assert gone() is None and not recorder.engine._transfers


def test_a_peers_nudge_is_answered_by_the_transfers_with_that_peer_only(
        recorder: Recorder) -> None:
    large_receive(recorder, 1, peer=0)
    large_receive(recorder, 2, peer=3)
    engine, sent = recorder.engine, list[int]()
    engine.nudge = lambda peer, nbytes, one_sided: sent.append(peer)

    def due(peer: int) -> tuple[float, float]:  # a transfer's wait and next nudge's time
        (transfer,) = [e.transfer for e in engine._transfers if e.transfer.peer == peer]
        return transfer.wait, transfer.nudge_at

    while len(sent) < 2:  # both transfers' first nudges; the next come 4 ms later
        engine.test()
    assert sorted(sent) == [0, 3]
    rank3 = due(3)
    engine.nudged(0, progress.TRANSFER_SIZE, False)  # rank 0: its end is posted
    asked = time.monotonic()
    # Rank 0's transfer answers SPIN after that nudge, at ~4 ms, before the wait of
    # 2 * SPIN that both had begun; rank 3's waits on (its next nudge at ~6 ms).
    wait, answer = due(0)
    assert wait == progress.SPIN and answer <= asked + progress.SPIN and due(3) == rank3
    give_up, finished = asked + 5.0, asked
    while 0 not in sent[2:] and time.monotonic() < give_up:
        engine.test()
        finished = time.monotonic()  # the pass read its clock before this
    assert 0 in sent[2:] and finished >= answer, sent
    assert 3 not in sent[2:] or finished >= rank3[1], sent  # a loaded host held passes back
    recorder.send(1)
    recorder.send(2)
    settle(recorder.engine)


def test_small_and_any_source_requests_are_no_transfers(recorder: Recorder) -> None:
    large_receive(recorder, 1, progress.TRANSFER_SIZE - 1)
    large_receive(recorder, 2, peer=None)
    assert nudges_over(recorder, 0.010) == [] and not recorder.engine._transfers
    recorder.send(1)
    recorder.send(2)
    settle(recorder.engine)


def test_a_held_rank_with_nothing_of_its_own_pokes_once_per_callback(
        recorder: Recorder) -> None:
    """The target of a peer's native put has no request of its own for it, but MPICH
    moves the put only inside its MPI calls: held, a callback that found nothing
    follows its pass with another that pokes (Engine._poke), and then ends."""
    recorder.receive(1000, standing=True)  # the transport's own: never completes here
    recorder.engine.backoff.last_progress -= 1.0
    before = recorder.engine.passes
    progress.loop_slice(recorder.engine, recorder.engine.test)
    assert recorder.engine.passes == before + 1  # not held: one pass per callback
    recorder.engine.nudged(0, progress.TRANSFER_SIZE, True)
    pokes: list[bool] = []

    def test(poke: bool) -> bool:
        pokes.append(poke)
        return recorder.engine.test(poke)
    progress.loop_slice(recorder.engine, test)
    assert pokes == [False, True] and not recorder.seen


def short_receive(recorder: Recorder, tag: int) -> tuple[Entry, list[int]]:
    """A 1-byte receive, and the MPI error classes its action is given (SUCCESS if
    none): a longer message fails it with ERR_TRUNCATE."""
    classes: list[int] = []
    buffer = bytearray(1)
    recorder.buffers.append(buffer)
    entry = recorder.engine.add(
        recorder.comm.Irecv(buffer, 0, tag),
        lambda owner, status, error: classes.append(MPI.Get_error_class(
            status.Get_error()) if error is not None else MPI.SUCCESS),
        owner="short", receive=True)
    return entry, classes


def test_a_poke_leaves_a_receive_that_failed_to_the_next_pass(recorder: Recorder) -> None:
    """A look of the pokes at a request that completed in error raises (MPI reports a
    truncation there): the pokes stop, and the next pass's Testsome reports it."""
    _, errors = short_receive(recorder, 7)
    assert not recorder.engine.test()  # the front is made; nothing has come
    recorder.comm.Send(b"too long", 0, 7)
    recorder.engine._poke()
    assert recorder.engine.test()
    assert errors == [MPI.ERR_TRUNCATE]


def test_only_native_puts_and_gets_have_passes_poke(recorder: Recorder) -> None:
    """Pokes pay where MPICH moves a transfer a fragment per call whatever the rank
    does (a native put or get, at both ends); for two-sided messages they cost an
    emulated put of 64 KiB a third of its speed, so a two-sided transfer only holds,
    here and at its peer, whom its nudge holds too."""
    large_receive(recorder, 1)
    recorder.engine.backoff.last_progress -= 1.0
    assert recorder.engine.backoff.pause() == 0 and not recorder.engine.poking()  # held
    recorder.engine.nudged(0, 1 << 22, False)  # a peer's large send that has not crossed
    assert recorder.engine.backoff.pause() == 0 and not recorder.engine.poking()
    buffer = bytearray(progress.TRANSFER_SIZE)
    recorder.buffers.append(buffer)
    request = recorder.comm.Irecv(buffer, 0, 2)  # stands in for an Rget's request
    recorder.engine.add(request, recorder.action, owner=("recv", 2), peer=0,
                        nbytes=len(buffer), one_sided=True)
    assert recorder.engine.poking()
    recorder.send(1)
    recorder.send(2)
    settle(recorder.engine)


def test_a_native_transfers_nudge_renews_its_own_pokes(recorder: Recorder) -> None:
    """A native put or get that has not crossed SPIN after its posting nudges its
    target again, and it still needs its own MPI calls to move: each nudge holds the
    origin's pokes as long as its posting did, not only its backoff."""
    buffer = bytearray(progress.TRANSFER_SIZE)
    recorder.buffers.append(buffer)
    request = recorder.comm.Irecv(buffer, 0, 3)  # stands in for an Rput's request
    recorder.engine.add(request, recorder.action, owner=("recv", 3), peer=0,
                        nbytes=len(buffer), one_sided=True)
    nudged: list[float] = []
    recorder.engine.nudge = lambda peer, nbytes, one_sided: nudged.append(time.monotonic())
    while not nudged:
        before = time.monotonic()  # the nudging pass read its clock after this
        recorder.engine.test()
    # The posting's pokes ended SPIN plus its size at TRANSFER_RATE after it (the
    # size's part a thirtieth of SPIN here), and the nudge came SPIN after the posting;
    # the nudge's pokes last as long from the nudging pass on.
    while time.monotonic() < nudged[0] + progress.SPIN / 2:
        pass
    poking = recorder.engine.poking()
    asked = time.monotonic()
    recorder.send(3)  # first: the recorder cannot close over a receive still posted
    settle(recorder.engine)
    # Unless a loaded host held this test past the nudge's hold before it asked:
    assert poking or asked >= before + progress.transfer_hold(len(buffer)), (before, asked)


def test_a_native_rma_origin_nudges_a_target_again_only_when_its_pokes_run_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`NativeRma.nudge`: a target nudged for a native put or get pokes for that
    operation's hold from then on, so the origin nudges it again only once less than
    half the next operation's hold is left of it; peers apart, none once shut down."""
    import types

    from mate.transports.mpi import rma_native

    now = [100.0]
    monkeypatch.setattr(rma_native, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    sent: list[tuple[int, int]] = []
    rma = types.SimpleNamespace(
        engine=types.SimpleNamespace(nudge=lambda peer, nbytes, one_sided: sent.append(
            (peer, nbytes))), poking={})
    small, large = progress.TRANSFER_SIZE, 4 << 20
    hold = progress.transfer_hold(small)

    def nudge(peer: int, nbytes: int, at: float) -> None:
        now[0] = 100.0 + at
        rma_native.NativeRma.nudge(rma, peer, nbytes)  # type: ignore[arg-type]

    nudge(1, small, 0.0)
    nudge(1, small, hold / 2 - 1e-6)  # pokes for more than half a hold still
    assert sent == [(1, small)]
    nudge(2, small, hold / 2 - 1e-6)  # another target: nudged on its own account
    nudge(1, small, hold / 2 + 1e-6)  # less than half a hold left: nudged again
    assert sent == [(1, small), (2, small), (1, small)]
    # A larger operation right after: the pokes just asked for are too short for it.
    nudge(1, large, hold / 2 + 2e-6)
    assert sent[-1] == (1, large)
    nudge(1, small, hold)  # pokes for the large one's hold, less what has passed
    assert len(sent) == 4
    rma.engine.nudge = None  # the transport shut down: no nudge any more
    nudge(2, large, 10.0)
    assert len(sent) == 4


# -- calls for later, and the leases of native RMA built on them --------------------------


def test_a_call_for_later_runs_once_in_the_first_pass_after_its_time(recorder: Recorder) -> None:
    """`Engine.call_later`: not before its time, once, in due order, and one that raises
    is contained (its owner handed to the error handler) without stopping the others."""
    engine, ran = recorder.engine, []
    start = time.monotonic()
    # Each call stamps when it ran: its pass read the clock before, and not earlier than
    # the call's due time. (A loaded host may preempt anywhere: no other clock says.)
    engine.call_later(0.02, lambda: ran.append(("second", time.monotonic())))
    engine.call_later(0.01, lambda: ran.append(("first", time.monotonic())))
    engine.call_later(0.01, lambda: 1 / 0, owner="faulty")  # type: ignore[func-returns-value]
    while len(ran) < 2 and time.monotonic() < start + 5.0:
        engine.test()
    passes_after = time.monotonic() + 0.02
    while time.monotonic() < passes_after:  # once: later passes run neither again
        engine.test()
    assert [name for name, _ in ran] == ["first", "second"]
    assert ran[0][1] >= start + 0.01 and ran[1][1] >= start + 0.02, (start, ran)
    assert [type(exc) for exc in recorder.errors] == [ZeroDivisionError]
    recorder.errors.clear()  # the fixture asserts that nothing else went wrong


class _LeaseWorld:
    """A `NativeRma` cut down to its leases: a fake clock, and what it sends and asks for
    later recorded instead of done (the methods are `NativeRma`'s own)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import types

        from mate.transports.mpi import rma_native

        self.native = rma_native.NativeRma
        self.now = 100.0
        monkeypatch.setattr(rma_native, "time", types.SimpleNamespace(monotonic=lambda: self.now))
        self.sent: list[tuple[int, bool]] = []
        self.later: list[tuple[float, Any]] = []
        self.leases: dict[int, Any] = {}
        self.lessees: dict[int, float] = {}
        self._lapse_check_due = False
        self.engine = types.SimpleNamespace(
            call_later=lambda delay, fn: self.later.append((self.now + delay, fn)))

    def _send_lease(self, peer: int, held: bool) -> None:
        self.sent.append((peer, held))

    def _check(self, peer: int) -> None:
        self.native._check(self, peer)  # type: ignore[arg-type]

    def _lease_told(self, peer: int, held: bool) -> None:
        self.native._lease_told(self, peer, held)  # type: ignore[arg-type]

    def _drop_lapsed(self) -> None:
        self.native._drop_lapsed(self)  # type: ignore[arg-type]

    def use(self, peer: int) -> None:
        self.native._use(self, peer)  # type: ignore[arg-type]

    def used(self, peer: int) -> None:
        self.native._used(self, peer)  # type: ignore[arg-type]

    def advance(self, seconds: float) -> None:
        """Let `seconds` pass, running what was asked for meanwhile, in order."""
        end = self.now + seconds
        while self.later and min(when for when, _ in self.later) <= end:
            call = min(self.later, key=lambda c: c[0])
            self.later.remove(call)
            self.now = max(self.now, call[0])
            call[1]()
        self.now = end


def test_a_native_rma_origin_holds_one_lease_per_target_while_it_uses_its_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An origin takes a lease on a target's memory before its first operation there,
    keeps it while operations are in flight or follow each other within LINGER, lets
    it go within two LINGERs of the last one's end (a check every LINGER, no clock per
    operation), and renews one in use every LEASE / 2; each target on its own account."""
    from mate.transports.mpi.rma_native import LEASE, LINGER

    rma = _LeaseWorld(monkeypatch)
    rma.use(1)
    assert rma.sent == [(1, True)]
    rma.use(1)  # two in flight at once
    rma.used(1)
    rma.advance(LINGER * 5)  # one still in flight: held
    rma.used(1)
    for _ in range(5):  # a stream, an operation issued and ended every 0.9 LINGER
        rma.advance(LINGER * 0.9)
        rma.use(1)
        rma.used(1)
    rma.use(2)  # another target
    rma.used(2)
    assert rma.sent == [(1, True), (2, True)] and len(rma.later) == 2  # one check each
    rma.advance(LINGER * 0.99)
    assert rma.sent == [(1, True), (2, True)]  # used since the last check: held
    rma.advance(LINGER * 1.02)
    assert sorted(rma.sent[2:]) == [(1, False), (2, False)] and not rma.leases
    assert not rma.later
    rma.use(1)  # after the lull: a new lease
    assert rma.sent[-1] == (1, True)
    sent = len(rma.sent)
    for _ in range(int(LEASE / 2 / (LINGER / 2)) + 4):  # in use for longer than LEASE / 2
        rma.used(1)
        rma.advance(LINGER / 2)
        rma.use(1)
    assert rma.sent[sent:] == [(1, True)]  # renewed once, never let go meanwhile


def test_a_target_serves_while_a_peer_holds_its_lease_until_let_go_or_lapsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A target is hot (`Engine.hot`: no backing off) from a peer's Lease(held=True)
    until its Lease(held=False), or, if none comes (the holder may have died), until
    a check every LEASE finds it not renewed for LEASE."""
    from mate.transports.mpi.control import Lease
    from mate.transports.mpi.rma_native import LEASE

    rma = _LeaseWorld(monkeypatch)

    def told(peer: int, held: bool) -> None:
        rma.native.on_control(rma, peer, Lease(held))  # type: ignore[arg-type]

    assert not rma.lessees
    told(1, True)
    told(2, True)
    told(1, False)
    assert list(rma.lessees) == [2]  # rank 2 holds one still
    told(2, False)
    assert not rma.lessees
    rma.advance(LEASE * 1.1)  # the check asked for by the first lease finds none
    assert not rma.later
    told(3, True)
    rma.advance(LEASE * 0.9)
    told(3, True)  # renewed
    rma.advance(LEASE * 0.9)
    assert list(rma.lessees) == [3]
    rma.advance(LEASE * 1.2)  # not renewed for LEASE by the check after: lapsed
    assert not rma.lessees and not rma.later


# -- a pass that completes a large receive tests again at once --------------------------


def taken_in_one_call_later(recorder: Recorder, *late: Entry) -> list[int]:
    """Leave the requests of `late` out of the engine's first Testsome from now on, as
    if MPI took their messages in only at the call after (it takes in one message
    per call). Returns the number of requests each Testsome was given."""
    real, calls = recorder.engine._testsome_call, []

    def testsome(requests: list[Any], statuses: list[Any]) -> list[int]:
        calls.append(len(requests))
        if len(calls) == 1:
            requests = [MPI.REQUEST_NULL if any(r is e.request for e in late) else r
                        for r in requests]
        return real(requests, statuses)  # type: ignore[no-any-return]

    recorder.engine._testsome_call = testsome
    return calls


def test_a_pass_that_completes_a_large_receive_finds_what_came_beside_it(
        recorder: Recorder) -> None:
    """The data of a large receive has just gone through the caches: what came with
    it (a pingping's acknowledgement) is found by a second Testsome in the same
    pass, not by the next pass, which would run cold."""
    large_receive(recorder, 1)
    beside = recorder.receive(2)
    recorder.engine.test()  # the front is made
    recorder.comm.Send(bytes(progress.TRANSFER_SIZE), 0, 1)
    recorder.send(2)
    calls = taken_in_one_call_later(recorder, beside)
    recorder.engine.test()
    assert len(calls) == 2
    assert recorder.seen[("recv", 1)][1] == recorder.seen[("recv", 2)][1] == recorder.engine.passes


@pytest.mark.parametrize("first", ["small receive", "large send"])
def test_other_completions_leave_what_came_beside_them_to_the_next_pass(
        recorder: Recorder, first: str) -> None:
    """After a small receive or a send, a second Testsome mostly finds nothing (the
    reply of a pingpong is a round trip away): the pass makes only one."""
    if first == "small receive":
        recorder.receive(1)
        recorder.send(1)
    else:
        buffer = bytearray(progress.TRANSFER_SIZE)
        recorder.buffers.append(buffer)
        receive = recorder.comm.Irecv(buffer, 0, 1)
        request = recorder.comm.Isend(bytes(progress.TRANSFER_SIZE), 0, 1)
        receive.Wait()
        recorder.engine.add(request, recorder.action, owner=("send", 1), peer=0,
                            nbytes=progress.TRANSFER_SIZE)
    beside = recorder.receive(2)
    recorder.send(2)
    calls = taken_in_one_call_later(recorder, beside)
    recorder.engine.test()
    assert len(calls) == 1 and ("recv", 2) not in recorder.seen
    recorder.engine.test()
    assert ("recv", 2) in recorder.seen


def test_a_receive_that_failed_in_the_second_testsome_is_reported_with_its_error(
        recorder: Recorder) -> None:
    """The second Testsome of a pass may raise (a truncated receive): the completions
    of the first keep their statuses, and the failed one is reported, once."""
    large_receive(recorder, 1)
    short, errors = short_receive(recorder, 7)
    recorder.engine.test()
    recorder.comm.Send(bytes(progress.TRANSFER_SIZE), 0, 1)
    recorder.comm.Send(b"too long", 0, 7)
    calls = taken_in_one_call_later(recorder, short)
    recorder.engine.test()
    assert len(calls) == 2 and errors == [MPI.ERR_TRUNCATE]
    assert recorder.seen[("recv", 1)][0] == 1
    settle(recorder.engine)
    assert errors == [MPI.ERR_TRUNCATE] and recorder.engine.user_outstanding == 0


def test_holes_beside_a_large_receive_call_for_no_second_testsome(recorder: Recorder) -> None:
    """Requests that went leave holes in the front until it is compacted; with only
    holes beside a large receive, a second Testsome could find nothing (a 64 KiB
    pingpong lost 2.8-4.1 us a half round trip to it)."""
    large_receive(recorder, 1)
    recorder.receive(2)
    recorder.receive(3)
    recorder.send(2)
    recorder.send(3)
    settle(recorder.engine)  # 2 and 3 went: holes behind the large receive
    assert recorder.engine._front_size == 3 and recorder.engine.user_outstanding == 1
    recorder.comm.Send(bytes(progress.TRANSFER_SIZE), 0, 1)
    calls = taken_in_one_call_later(recorder)
    recorder.engine.test()
    assert len(calls) == 1 and ("recv", 1) in recorder.seen


def test_a_wake_that_races_stop_writes_to_no_descriptor() -> None:
    """Thread mode wakes a thread that stands back through a pipe, which `stop` closes
    once the thread has ended. A wake from another thread that read the thread as
    standing back just before it left must not write to the pipe's number after the
    close: the process may have reused it. (The flag is set by hand here, as such a
    wake would have read it.)"""
    engine = Engine(asyncio.new_event_loop(), "thread", lambda exc, owner: None,
                    lambda: None)
    thread_progress = engine._progress
    assert isinstance(thread_progress, progress.ThreadProgress)
    wake_w = thread_progress._wake_w
    engine.stop()
    reused_r, reused_w = os.pipe()  # the lowest free numbers: the wake pipe's
    try:
        assert reused_w == wake_w
        thread_progress._standing_back = True
        thread_progress._wake_thread()
        assert select.select([reused_r], [], [], 0)[0] == []  # nothing written
        engine.stop()  # a second stop closes no descriptor, the pipe's old numbers included
        os.fstat(reused_r), os.fstat(reused_w)
    finally:
        os.close(reused_r)
        os.close(reused_w)


# -- thread mode: entering the progress context from the poster's thread ------------------


@pytest.fixture
def threaded() -> Iterator[Engine]:
    loop = asyncio.new_event_loop()
    engine = Engine(loop, "thread", lambda exc, owner: None, lambda: None)
    yield engine
    engine.stop()  # again, if the test stopped it: stopping twice is allowed
    engine.drain(time.monotonic() + 1)
    engine.free()
    loop.close()


def test_a_post_while_no_pass_runs_is_taken_in_on_the_posters_thread(threaded: Engine) -> None:
    """Thread mode: a call in the progress context (a request taken in, a send's
    submission reported) made while no pass runs, as on the loop while the thread
    stands back, runs at once on the caller's thread instead of waiting in the inbox
    for a pass: the inbox cost every message a lock, a queued call and a later run."""
    ran: list[int] = []
    threaded.call_in_context(lambda: ran.append(threading.get_ident()))
    assert ran == [threading.get_ident()]
    comm = MPI.COMM_SELF.Dup()
    try:
        request = comm.Irecv(bytearray(1), 0, 3)
        entry = threaded.add(request, lambda owner, status, error: None, receive=True)
        assert entry.index >= 0 and not threaded.has_calls()  # taken in, not queued
        threaded.cancel_receives(standing=False)  # what shutdown does
        threaded.stop()
        threaded.drain(time.monotonic() + 1)
        assert threaded.user_outstanding == 0
    finally:
        comm.Free()


def test_a_post_while_a_pass_runs_or_calls_wait_queues_behind_them(threaded: Engine) -> None:
    """A call that finds a pass running (its lock held) goes to the inbox; one that finds
    earlier calls waiting there queues behind them, so that the progress context
    takes requests in, and reports, in posting order."""
    order: list[str] = []
    thread_progress = threaded._progress
    assert isinstance(thread_progress, progress.ThreadProgress)
    with thread_progress._pass_lock:  # a pass runs
        threaded.call_in_context(order.append, "first")
        assert order == [] and threaded.has_calls()
    threaded.stop()  # no thread takes the inbox from here on: it stays as it is
    threaded.call_in_context(order.append, "second")
    assert order == []  # behind "first"
    threaded.test()
    assert order == ["first", "second"]


def test_a_report_before_a_request_enters_the_progress_context_with_it() -> None:
    """`add(..., first=report)`: a copied send's submission and its request take one
    entry into the progress context (in thread mode a lock and a kick each, which
    were a good part of what posting a send cost there), the report first, so that
    it precedes whatever the request's completion reports. Queued behind a running
    pass, they wait as one call, in that order; a report that raises is the
    owner's failure and the request is taken in all the same."""
    errors: list[tuple[str, Any]] = []
    loop = asyncio.new_event_loop()
    engine = Engine(loop, "thread", lambda exc, owner: errors.append((str(exc), owner)),
                    lambda: None)
    seen: list[tuple[str, int]] = []

    def report(owner: Any) -> None:
        seen.append((owner, engine.user_outstanding))
        if owner == "raises":
            raise RuntimeError("report failed")

    comm = MPI.COMM_SELF.Dup()
    try:
        def add(owner: str) -> Entry:
            return engine.add(comm.Irecv(bytearray(1), 0, 3), lambda *_: None, owner=owner,
                              receive=True, first=report)

        entry = add("at once")  # no pass runs: on this thread, now
        assert seen == [("at once", 0)] and entry.index >= 0 and not engine.has_calls()
        thread_progress = engine._progress
        assert isinstance(thread_progress, progress.ThreadProgress)
        with thread_progress._pass_lock:  # a pass runs
            queued = add("queued")
            assert len(engine._inbox) == 1 and seen == [("at once", 0)]
        engine.stop()  # from here on no thread takes the inbox
        add("raises")
        engine.test()
        assert seen == [("at once", 0), ("queued", 1), ("raises", 2)]
        assert queued.index >= 0 and engine.user_outstanding == 3
        assert errors == [("report failed", "raises")]
        engine.cancel_receives(standing=False)
        engine.drain(time.monotonic() + 1)
        assert engine.user_outstanding == 0
    finally:
        engine.stop()  # again, if the test got that far: stopping twice is allowed
        engine.free()
        comm.Free()
        loop.close()


def test_the_loop_waiting_for_the_threads_pass_lets_the_pass_run(threaded: Engine) -> None:
    """The loop's pass waits for the progress thread's pass to end (`_loop_test`), and
    the waiting must release the GIL, which the thread's pass needs to end: a lock
    that kept it would hang the rank. Here a thread holds the pass lock while it
    counts in Python, as a pass runs Python between its MPI calls."""
    thread_progress = threaded._progress
    assert isinstance(thread_progress, progress.ThreadProgress)
    counted, holding = [0], threading.Event()

    def pass_in_python() -> None:
        with thread_progress._pass_lock:
            holding.set()
            for _ in range(200_000):
                counted[0] += 1

    passer = threading.Thread(target=pass_in_python)
    passer.start()
    holding.wait()
    thread_progress._loop_test(False)  # waits for the lock, then runs a pass
    assert counted[0] == 200_000
    passer.join()


def test_a_thread_mode_rank_that_waits_lets_its_core_rest() -> None:
    """SPEC §7: a rank waiting in thread mode costs little CPU. The loop helps with
    passes after a post, and must give up once nothing moved for SPIN, which it learns
    from the backoff's clock: a backoff that kept answering "spinning" after one
    progress (its flag never cleared) kept the loop polling, a whole core, for as long
    as the message did not come."""
    loop = asyncio.new_event_loop()
    engine = Engine(loop, "thread", lambda exc, owner: None, lambda: None)
    comm = MPI.COMM_SELF.Dup()

    async def wait() -> float:
        engine.add(comm.Irecv(bytearray(1), 0, 5), lambda *_: None, receive=True)
        await asyncio.sleep(0.05)  # the loop helps, then gives up
        cpu, start = time.process_time(), time.monotonic()
        await asyncio.sleep(0.5)
        return (time.process_time() - cpu) / (time.monotonic() - start)

    try:
        share = loop.run_until_complete(wait())
        assert share < 0.3, f"{share:.0%} of a core while waiting"
    finally:
        engine.cancel_receives(standing=False)
        engine.stop()
        engine.drain(time.monotonic() + 1)
        engine.free()
        comm.Free()
        loop.close()
