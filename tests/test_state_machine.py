"""The message state machine without I/O (h11-style): feed inputs, check outputs.

`mate.machine.transition` decides everything a message does; `TABLE` is that
function enumerated. These tests pin the table down case by case (SPEC §1),
check the same rules as a property of any input sequence, and finally check
that `World` carries the outputs out (ask the transport to cancel, run the
handlers, resolve the awaitable) with a recording fake transport.
"""

from __future__ import annotations

import asyncio
import functools
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mate
from mate.ledger import Ledger
from mate.machine import TABLE, Input, Pending, ProtocolError, Step, transition
from mate.message import Message
from mate.schedule import Event, Op, Region, Schedule, State
from mate.transports.base import Transport
from mate.world import World

LIVE = (State.POSTED, State.SUBMITTED)
TERMINAL = (State.COMPLETED, State.TIMED_OUT, State.FAILED, State.CANCELLED)
ALL_KEYS = list(itertools.product((True, False), State, Pending, Input))


def illegal(origin: bool, state: State, pending: Pending, inp: Input) -> bool:
    """The inputs a transport must never send, written out independently of the table."""
    if state.terminal:
        return False
    if inp is Input.SUBMITTED:
        return not origin or state is State.SUBMITTED
    if inp is Input.CANCELLED:
        return pending is Pending.NONE
    return False


# -- the table, case by case ---------------------------------------------------------


def test_state_terminal_flags() -> None:
    assert [s for s in State if s.terminal] == list(TERMINAL)
    assert [s for s in State if not s.terminal] == list(LIVE)


def test_table_is_transition_on_exactly_the_legal_keys() -> None:
    missing = []
    for key in ALL_KEYS:
        if illegal(*key):
            assert key not in TABLE, key
            with pytest.raises(ProtocolError):
                transition(*key)
        elif key not in TABLE:
            missing.append(key)
        else:
            assert TABLE[key] == transition(*key), key
    assert missing == []
    # 2 origins x 6 states x 3 pendings x 7 inputs, minus the illegal ones:
    # non-origin SUBMITTED in 2 live states (6 keys), origin SUBMITTED in
    # SUBMITTED (3 keys), CANCELLED with nothing pending in 2 live states (4 keys).
    assert len(ALL_KEYS) == 252
    assert len(TABLE) == 252 - 6 - 3 - 4


@pytest.mark.parametrize("origin", [True, False])
@pytest.mark.parametrize("state", TERMINAL)
def test_terminal_states_ignore_everything(origin: bool, state: State) -> None:
    for pending, inp in itertools.product(Pending, Input):
        assert TABLE[origin, state, pending, inp] == Step(state, pending, (), False)


@pytest.mark.parametrize("pending", list(Pending))
def test_submission_of_an_origin_op(pending: Pending) -> None:
    step = TABLE[True, State.POSTED, pending, Input.SUBMITTED]
    assert step == Step(State.SUBMITTED, pending, (Event.SUBMISSION,), False)


@pytest.mark.parametrize("pending", list(Pending))
@pytest.mark.parametrize("state", LIVE)
def test_submission_of_recv_or_get_is_a_protocol_error(state: State, pending: Pending) -> None:
    assert (False, state, pending, Input.SUBMITTED) not in TABLE
    with pytest.raises(ProtocolError):
        transition(False, state, pending, Input.SUBMITTED)


@pytest.mark.parametrize("pending", list(Pending))
def test_second_submission_is_a_protocol_error(pending: Pending) -> None:
    with pytest.raises(ProtocolError):
        transition(True, State.SUBMITTED, pending, Input.SUBMITTED)


@pytest.mark.parametrize("pending", list(Pending))
def test_completion_from_posted_on_origin_emits_submission_first(pending: Pending) -> None:
    step = TABLE[True, State.POSTED, pending, Input.COMPLETED]
    assert step == Step(State.COMPLETED, Pending.NONE,
                        (Event.SUBMISSION, Event.COMPLETION), False)


@pytest.mark.parametrize("pending", list(Pending))
def test_completion_after_submission_emits_completion_only(pending: Pending) -> None:
    step = TABLE[True, State.SUBMITTED, pending, Input.COMPLETED]
    assert step == Step(State.COMPLETED, Pending.NONE, (Event.COMPLETION,), False)


@pytest.mark.parametrize("pending", list(Pending))
def test_completion_of_recv_or_get_has_no_submission(pending: Pending) -> None:
    step = TABLE[False, State.POSTED, pending, Input.COMPLETED]
    assert step == Step(State.COMPLETED, Pending.NONE, (Event.COMPLETION,), False)


@pytest.mark.parametrize("origin", [True, False])
@pytest.mark.parametrize("pending", list(Pending))
@pytest.mark.parametrize("state", LIVE)
def test_failure(origin: bool, state: State, pending: Pending) -> None:
    if not origin and state is State.SUBMITTED:
        return  # unreachable: a recv/get is never SUBMITTED
    step = TABLE[origin, state, pending, Input.FAILED]
    assert step == Step(State.FAILED, Pending.NONE, (Event.FAILURE,), False)


@pytest.mark.parametrize("origin", [True, False])
@pytest.mark.parametrize("state", LIVE)
@pytest.mark.parametrize(("inp", "asked"), [(Input.USER_CANCEL, Pending.CANCEL),
                                            (Input.TIMEOUT, Pending.TIMEOUT)])
def test_cancel_and_timeout_only_ask_the_transport(
    origin: bool, state: State, inp: Input, asked: Pending
) -> None:
    step = TABLE[origin, state, Pending.NONE, inp]
    assert step == Step(state, asked, (), True)


@pytest.mark.parametrize("origin", [True, False])
@pytest.mark.parametrize("state", LIVE)
@pytest.mark.parametrize("first", [Pending.CANCEL, Pending.TIMEOUT])
@pytest.mark.parametrize("inp", [Input.USER_CANCEL, Input.TIMEOUT])
def test_first_cancel_request_wins(
    origin: bool, state: State, first: Pending, inp: Input
) -> None:
    step = TABLE[origin, state, first, inp]
    assert step == Step(state, first, (), False)  # not asked again, not overwritten


@pytest.mark.parametrize("origin", [True, False])
@pytest.mark.parametrize("state", LIVE)
def test_transport_cancelled_gives_the_pending_outcome(origin: bool, state: State) -> None:
    assert TABLE[origin, state, Pending.TIMEOUT, Input.CANCELLED] == Step(
        State.TIMED_OUT, Pending.NONE, (Event.TIMEOUT,), False)
    assert TABLE[origin, state, Pending.CANCEL, Input.CANCELLED] == Step(
        State.CANCELLED, Pending.NONE, (), False)


@pytest.mark.parametrize("origin", [True, False])
@pytest.mark.parametrize("state", LIVE)
def test_unrequested_cancelled_is_a_protocol_error(origin: bool, state: State) -> None:
    with pytest.raises(ProtocolError):
        transition(origin, state, Pending.NONE, Input.CANCELLED)


@pytest.mark.parametrize("origin", [True, False])
@pytest.mark.parametrize("pending", [Pending.CANCEL, Pending.TIMEOUT])
def test_match_beats_a_pending_cancel(origin: bool, pending: Pending) -> None:
    step = TABLE[origin, State.POSTED, pending, Input.COMPLETED]
    assert step.state is State.COMPLETED
    assert step.events[-1] is Event.COMPLETION
    assert Event.TIMEOUT not in step.events
    assert step.pending is Pending.NONE


@pytest.mark.parametrize("origin", [True, False])
@pytest.mark.parametrize("state", LIVE)
@pytest.mark.parametrize("pending", list(Pending))
def test_shutdown_cancels_silently(origin: bool, state: State, pending: Pending) -> None:
    if not origin and state is State.SUBMITTED:
        return
    step = TABLE[origin, state, pending, Input.SHUTDOWN]
    assert step == Step(State.CANCELLED, Pending.NONE, (), False)


# -- the same, through Message.apply ---------------------------------------------------


@functools.cache
def idle_ledger() -> Ledger:
    """A ledger whose loop never runs: apply() never touches it."""
    loop = asyncio.new_event_loop()
    loop.close()
    return Ledger(loop, "loop")


def make_message(op: Op = Op.SEND) -> Message:
    # Receipts are not asked for here.
    return Message(idle_ledger(), op, memoryview(bytearray(4)), 1, 0, 0, Schedule())


def test_message_apply_h11_style() -> None:
    msg = make_message(Op.SEND)
    assert (msg.state, msg.submitted_seen, msg.done()) == (State.POSTED, False, False)
    assert msg.apply(Input.TIMEOUT) == Step(State.POSTED, Pending.TIMEOUT, (), True)
    assert msg.apply(Input.USER_CANCEL) == Step(State.POSTED, Pending.TIMEOUT, (), False)
    assert msg.apply(Input.SUBMITTED).events == (Event.SUBMISSION,)
    assert msg.submitted_seen and msg.state is State.SUBMITTED
    with pytest.raises(ProtocolError):
        msg.apply(Input.SUBMITTED)
    assert msg.state is State.SUBMITTED  # a rejected input changes nothing
    assert msg.apply(Input.CANCELLED) == Step(State.TIMED_OUT, Pending.NONE,
                                              (Event.TIMEOUT,), False)
    assert msg.done()
    for inp in Input:  # terminal: everything ignored, even inputs illegal when live
        assert msg.apply(inp).events == ()
        assert msg.state is State.TIMED_OUT


def test_message_apply_recv() -> None:
    msg = make_message(Op.RECV)
    assert msg.submitted is None
    with pytest.raises(ProtocolError):
        msg.apply(Input.SUBMITTED)
    with pytest.raises(ProtocolError):
        msg.apply(Input.CANCELLED)
    assert msg.state is State.POSTED
    assert msg.apply(Input.USER_CANCEL).ask_cancel
    assert msg.apply(Input.COMPLETED).events == (Event.COMPLETION,)  # match beats cancel
    assert msg.state is State.COMPLETED and not msg.submitted_seen


def test_origin_ops_are_send_and_put() -> None:
    assert [op for op in Op if make_message(op).origin] == [Op.SEND, Op.PUT]


# -- any sequence of inputs --------------------------------------------------------------

TERMINAL_EVENTS = {Event.COMPLETION: State.COMPLETED, Event.TIMEOUT: State.TIMED_OUT,
                   Event.FAILURE: State.FAILED}


@settings(max_examples=300, deadline=None)
@given(origin=st.booleans(), inputs=st.lists(st.sampled_from(list(Input)), max_size=12))
def test_any_input_sequence_keeps_the_invariants(origin: bool, inputs: list[Input]) -> None:
    state, pending = State.POSTED, Pending.NONE
    msg = make_message(Op.SEND if origin else Op.RECV)
    events: list[Event] = []
    terminal_changes = asks = 0
    for inp in inputs:
        try:
            step = transition(origin, state, pending, inp)
        except ProtocolError:
            assert illegal(origin, state, pending, inp)
            with pytest.raises(ProtocolError):
                msg.apply(inp)
            assert (msg.state, msg._pending) == (state, pending)
            continue
        assert not illegal(origin, state, pending, inp)
        assert msg.apply(inp) == step  # Message.apply is the table
        if step.ask_cancel:
            asks += 1
            assert inp in (Input.USER_CANCEL, Input.TIMEOUT) and pending is Pending.NONE
        if inp is Input.CANCELLED and not state.terminal:
            assert pending is not Pending.NONE  # only an answer to a request
        if step.state.terminal and not state.terminal:
            terminal_changes += 1
        if state.terminal:
            assert step.state is state and step.events == ()
        events.extend(step.events)
        state, pending = step.state, step.pending
        assert (msg.state, msg._pending) == (state, pending)

    assert terminal_changes <= 1
    assert asks <= 1  # the first cancel request wins; nobody asks twice
    assert events.count(Event.SUBMISSION) <= (1 if origin else 0)
    assert msg.submitted_seen == (Event.SUBMISSION in events)
    ends = [e for e in events if e is not Event.SUBMISSION]
    assert len(ends) <= 1
    if ends:
        assert events[-1] is ends[0]  # nothing after the terminal event
        assert TERMINAL_EVENTS[ends[0]] is state
    if Event.COMPLETION in events and origin:
        assert events == [Event.SUBMISSION, Event.COMPLETION]
    if state is State.CANCELLED:
        assert ends == []  # a silent cancellation
    if not state.terminal:
        assert ends == []
    assert msg.done() == state.terminal


# -- the world carries the outputs out -------------------------------------------------


class FakeTransport(Transport):
    """Records what the core asks; the test plays the wire through the sink."""

    def __init__(self) -> None:
        self.mypid, self.numprocs, self.tag_max = 0, 2, 100
        self.posted: list[Message] = []
        self.cancels: list[Message] = []
        self.answer_cancel = False

    def post(self, msg: Message) -> None:
        self.posted.append(msg)

    def cancel(self, msg: Message) -> None:
        self.cancels.append(msg)
        if self.answer_cancel:
            self.sink.cancelled(msg)

    def expose(self, buffer: memoryview) -> Region:
        raise NotImplementedError

    async def unexpose(self, region: Region) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        pass


class ClassAttributeTransport(FakeTransport):
    """Says who it is with class attributes, as a Python subclass may."""

    mypid, numprocs, tag_max = 1, 3, 50  # type: ignore[assignment]

    def __init__(self) -> None:
        self.posted = []
        self.cancels = []
        self.answer_cancel = False


async def test_a_transport_may_say_who_it_is_with_class_attributes() -> None:
    """The compiled ledger read Transport.mypid natively and missed a class attribute."""
    world = World(asyncio.get_running_loop(), default_timeout=1.0, handlers="loop")
    transport = ClassAttributeTransport()
    transport.bind(world.sink)
    world.attach(transport)
    assert (world.mypid, world.numprocs, world.tag_max) == (1, 3, 50)
    msg = world.send(b"abcd", 2, 7, timeout=None)
    world.sink.submitted(msg)
    world.sink.completed(msg, 4, 2, 7)
    receipt = await msg
    assert (receipt.local_pid, receipt.remote_pid, receipt.tag) == (1, 2, 7)
    await world.shutdown()


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Event | None, mate.Receipt, object]] = []
        self.schedule = Schedule(
            completion=self.on, completion_data="c", submission=self.on, submission_data="s",
            timeout=self.on, timeout_data="t", failure=self.on, failure_data="f")

    def on(self, receipt: mate.Receipt, data: object) -> None:
        self.calls.append((receipt.event, receipt, data))

    @property
    def events(self) -> list[Event | None]:
        return [event for event, _, _ in self.calls]


async def fake_world(**kwargs: object) -> tuple[World, FakeTransport]:
    world = World(asyncio.get_running_loop(), default_timeout=1.0, handlers="loop")
    transport = FakeTransport()
    transport.bind(world.sink)
    world.attach(transport)
    return world, transport


async def flush() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_world_cancel_asks_once_and_ends_silently() -> None:
    world, transport = await fake_world()
    rec = Recorder()
    msg = world.recv(bytearray(4), 1, 3, schedule=rec.schedule, timeout=None)
    assert transport.posted == [msg] and rec.calls == []
    assert msg.cancel() is True
    assert msg.cancel() is True  # still live: a request, not an outcome
    assert transport.cancels == [msg]  # asked once
    assert msg.state is State.POSTED
    world.sink.cancelled(msg)
    assert msg.state is State.CANCELLED
    assert msg.cancel() is False
    await flush()
    assert rec.calls == []
    with pytest.raises(asyncio.CancelledError):
        await msg
    await world.shutdown()


async def test_world_timeout_then_cancelled_times_out() -> None:
    world, transport = await fake_world()
    rec = Recorder()
    msg = world.send(b"abcd", 1, 3, schedule=rec.schedule, timeout=0.0)
    await flush()
    assert transport.cancels == [msg]  # the elapsed timeout only asked
    assert msg.state is State.POSTED
    msg.cancel()  # the first request (the timeout) wins
    assert transport.cancels == [msg]
    world.sink.cancelled(msg)
    await flush()
    assert msg.state is State.TIMED_OUT
    assert rec.events == [Event.TIMEOUT]
    assert isinstance(rec.calls[0][1].error, mate.MessageTimeout)
    assert rec.calls[0][2] == "t"
    with pytest.raises(mate.MessageTimeout):
        await msg
    await world.shutdown()


async def test_world_match_beats_pending_cancel() -> None:
    world, _ = await fake_world()
    rec = Recorder()
    msg = world.send(b"abcd", 1, 3, schedule=rec.schedule, timeout=None)
    msg.cancel()
    world.sink.completed(msg, 4, 1, 3)
    await flush()
    assert msg.state is State.COMPLETED
    assert rec.events == [Event.SUBMISSION, Event.COMPLETION]
    receipt = await msg
    assert (receipt.event, receipt.length, receipt.remote_pid, receipt.tag) == (
        Event.COMPLETION, 4, 1, 3)
    assert (await msg.submitted).event is Event.SUBMISSION  # type: ignore[union-attr]
    world.sink.cancelled(msg)  # a late answer is ignored once terminal
    await flush()
    assert msg.state is State.COMPLETED and len(rec.calls) == 2
    await world.shutdown()


async def test_world_synchronous_cancel_answer() -> None:
    world, transport = await fake_world()
    transport.answer_cancel = True  # answers from inside cancel()
    rec = Recorder()
    msg = world.recv(bytearray(4), schedule=rec.schedule, timeout=None)
    assert msg.cancel() is True
    assert msg.state is State.CANCELLED
    await flush()
    assert rec.calls == []


async def test_world_protocol_errors_reach_the_transport() -> None:
    world, _ = await fake_world()
    recv = world.recv(bytearray(4), timeout=None)
    with pytest.raises(ProtocolError):
        world.sink.submitted(recv)
    with pytest.raises(ProtocolError):
        world.sink.cancelled(recv)
    send = world.send(b"x", 1, timeout=None)
    world.sink.submitted(send)
    with pytest.raises(ProtocolError):
        world.sink.submitted(send)
    assert recv.state is State.POSTED and send.state is State.SUBMITTED
    await world.shutdown()


async def test_world_shutdown_cancels_without_events_or_asking() -> None:
    world, transport = await fake_world()
    rec = Recorder()
    send = world.send(b"abcd", 1, schedule=rec.schedule, timeout=10.0)
    recv = world.recv(bytearray(4), schedule=rec.schedule, timeout=None)
    world.sink.submitted(send)
    await flush()
    assert rec.events == [Event.SUBMISSION]
    await world.shutdown()
    assert (send.state, recv.state) == (State.CANCELLED, State.CANCELLED)
    assert transport.cancels == []
    world.sink.completed(recv, 4, 1, 0)  # too late: ignored
    await flush()
    assert rec.events == [Event.SUBMISSION]
    for msg in (send, recv):
        with pytest.raises(asyncio.CancelledError):
            await msg
    with pytest.raises(mate.InvalidArgument):
        world.send(b"x", 1)


async def test_world_failure_event() -> None:
    world, _ = await fake_world()
    rec = Recorder()
    msg = world.recv(bytearray(2), schedule=rec.schedule, timeout=None)
    world.sink.failed(msg, mate.FailureReason.TRUNCATED, "too long", length=2, peer=1, tag=5)
    await flush()
    assert rec.events == [Event.FAILURE]
    receipt = rec.calls[0][1]
    assert (receipt.length, receipt.remote_pid, receipt.tag) == (2, 1, 5)
    assert isinstance(receipt.error, mate.MessageFailed)
    assert receipt.error.reason is mate.FailureReason.TRUNCATED
    with pytest.raises(mate.MessageFailed):
        await msg
    await world.shutdown()
