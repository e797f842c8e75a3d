"""Progress for the MPI transport: outstanding requests, tested and acted upon.

MPI has no completion callbacks, so someone must test requests (thesis §5.2).
The `Engine` keeps every outstanding request with an *action* to run when it
completes, and one `test()` pass runs `MPI_Testsome` over them: the transport's
own requests and the oldest user requests in every pass, the others now and
then (`Engine._test_live`). Who runs passes, and when, is the progress mode,
each a small strategy of its own sharing one `Backoff`:

* `PollProgress` (``poll``): a callback on the event loop, rescheduled with
  `call_soon` while user messages are outstanding (lowest latency), which runs
  passes while they move (`loop_slice`: MPICH takes in one message per call,
  so a window of messages completes in one callback). A task that awaits a
  message runs passes itself first (`await_spin`), within the same bound of
  SLICE since the loop last turned and until the loop has other work: a reply
  that comes meanwhile costs no turn of the loop and no wake-up of the task,
  which is what lets an awaited ping-pong go below the asyncio floor (a loop
  callback per test). After `SPIN` seconds without progress it backs off to
  timers of growing delay (up to `MAX_BACKOFF`, and `LONG_IDLE_BACKOFF` once
  nothing moved for `LONG_IDLE`), and with only the transport's own standing
  receives left it polls every `IDLE_INTERVAL`, so that an idle rank does not
  spin but still serves peers' one-sided requests. A rank with native RMA
  operations in flight, or whose memory a peer holds a lease on (the peer's
  operations move only inside this rank's MPI calls: rma_native.py, leases),
  is *hot* and does not back off (see `Engine.hot`).
* `ThreadProgress` (``thread``): a progress thread (MPI_THREAD_MULTIPLE) runs
  the passes, with the same backoff done by sleeping, and sleeps on a
  condition when nothing at all is outstanding. With handlers on the loop, a
  task awaiting a message (or a post made on the loop) also has the loop run
  passes, as poll mode does, until `SPIN` passes without progress, and the
  thread stands back meanwhile: a completion found on the loop's thread needs
  no hop onto it (most of thread mode's latency), while the thread still moves
  messages whenever the loop computes or has given up. Standing back, it
  watches the loop's clock without the GIL (`mate._stand_back`). The awaiting task
  runs passes itself first (`await_spin`, under the pass lock), as in poll
  mode. Actions run in whichever thread ran the pass.
* `ManualProgress` (``manual``): passes run only from `world.progress()` and
  while a task awaits a message (`drive_until`), and, so that timeouts (the
  core's clock, not progress) take effect at once, while a cancel is carried
  out (`call_at_once`).

Everything that touches a request after it was posted (testing, cancelling)
happens in the progress context (`call`), because MPI forbids two threads to
use one request at once. Posting itself (Isend, Irecv, Rput) may happen on any
thread.

A large message needs many passes, not one. Where MPI cannot copy it straight
from the sender's memory (MPICH without CMA: Linux's Yama ptrace_scope >= 1,
as on Ubuntu, or a container that forbids process_vm_readv), it crosses
shared memory a fragment (8 KiB here) per MPI call, on both ranks, and a
rank backing off moves one fragment per pause: a 4 MiB message sent to a
rank that had waited a while took 2.1 s instead of about 1 ms. Passes cannot
see a message move before it completes, so a request of `TRANSFER_SIZE`
bytes or more with a known peer is a *transfer*: its posting holds the
backoff for `SPIN` plus its size at `TRANSFER_RATE`, and if it is not
complete `SPIN` after its posting, the engine *nudges* the peer (`nudge`, a
control message that holds the peer's backoff the same way) and holds its
own again. The nudges of one transfer come ever further apart (each after
twice the wait before the last), so a transfer whose peer never comes costs
a few held spins, not a spinning rank. But a nudge from a peer with which
this rank has a transfer of its own says that both ends are posted: the
data is crossing, so the rank answers `SPIN` later, and the two keep each
other held until one end completes (from the first such nudge on, for at
most the transfer's size at `TRANSFER_RATE_FLOOR`, should the two transfers
not be each other's). A nudge travels as the data does, in order, so one
sent after a large send waits behind its data: a large send or receive
posted while its rank was quiet is preceded by a nudge, since its peer may
be backing off (`MpiTransport._nudge_if_quiet`). A native put or get is a
transfer too, but its target has no request of its own to see it by: the
origin nudges the target as it issues one, unless its last nudge still has
the target poking (`NativeRma.nudge`).

While a native put or get of `TRANSFER_SIZE` or more is under way, at its
origin and (told by the nudge) at its target, a pass that finds nothing,
where no completion waits to be handed over, is followed by bare progress
calls (`Engine._poke`), a quarter of a pass each: MPICH moves such an
operation a fragment per call, so the calls' density sets its speed. Not for
two-sided transfers: there they cost an emulated put of 64 KiB a third of its
speed, and MPICH moves a message with CMA in one call.

A pass whose Testsome completes a large receive runs Testsome once more
before any action (`Engine._testsome`): the copy just passed the message
through the caches, and what came beside it is found without another pass.

Sends that timed out but that MPI still holds (*orphans*, see transport.py)
are kept apart from the live requests and tested only every
`ORPHAN_INTERVAL`: a `Testsome` over 20,000 forgotten requests costs ~1.5 ms,
which no pass for live messages should pay.

Nothing that goes wrong inside a pass stops progress: every queued call,
action and end-of-pass hook runs guarded, and an exception is handed to
`on_error` with the message it concerned (the transport fails that message),
so the progress thread survives and other messages carry on.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import math
import os
import select
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any, Final

from librt.threading import Lock
from mpi4py import MPI

from mate.debug import HotSpotHook
from mate.transports.mpi import calls

logger = logging.getLogger("mate")

#: Run when a request completes: `action(owner, status, error)`. Passing the owner lets
#: the hot paths add one bound method for every request instead of a closure per request.
#: The status is the engine's scratch, which the next Testsome overwrites: an action
#: reads it, and keeps none of it but the values it read.
Action = Callable[[Any, MPI.Status, "MPI.Exception | None"], None]
#: Told of an exception raised inside the progress context, with the object
#: (usually a message) that the failed call or action was about, if any.
ErrorHandler = Callable[[BaseException, Any], None]

# Final: compiled code reads each as a constant, not from the module's dictionary.
SPIN: Final = 0.002  # seconds of busy polling after the last progress
SLICE: Final = 500e-6  # longest busy poll inside one loop callback
MAX_BACKOFF: Final = 0.001  # longest pause between passes while user messages are outstanding,
LONG_IDLE: Final = 0.05  # ... until this long without progress,
LONG_IDLE_BACKOFF: Final = 0.004  # ... when waiting gets cheaper still (waited on for long)
IDLE_INTERVAL: Final = 0.005  # pause between passes when only standing receives are outstanding
ORPHAN_INTERVAL: Final = 0.05  # how often orphaned sends are tested (so MPI can free them)
STAND_BACK: Final = 2 * SLICE  # a progress thread leaves passes to a loop that ran one lately
FRONT: Final = 8  # the oldest user requests, tested in every pass (Engine._test_live) ...
WHOLE_EVERY: Final = 8  # ... and all of them when those stop moving, and every this many passes
COMPACT_SLACK: Final = 16  # holes a request list may hold beyond as many as its requests
TRANSFER_SIZE: Final = 64 * 1024  # a request moving this many bytes or more is a transfer ...
TRANSFER_RATE: Final = 1e9  # ... which holds the backoff for SPIN + its size at this rate (B/s),
TRANSFER_RATE_FLOOR: Final = 1e8  # ... and answers its peer's nudges for its size at this rate
POKES: Final = 256  # bare progress calls after a pass that found nothing (Engine._poke),
LOOK_EVERY: Final = 8  # ... looking at the front's requests every this many

# Read once: through the module, each use costs a dictionary and an attribute lookup.
_REQUEST_NULL: Final = MPI.REQUEST_NULL
_get_ident: Final = threading.get_ident
_monotonic: Final = time.monotonic  # read in every pass


def _no_loop_work() -> int:
    return 0  # an engine with no core above it (tests, bench/window_passes.py)


#: `Entry.index` of a request handed to the progress context but not taken in yet
#: (thread mode's inbox), of one disowned meanwhile (taken in as an orphan), and of
#: one that left the engine (it completed, or was freed).
TAKING_IN: Final = -2
DISOWNED: Final = -3
GONE: Final = -1


class Entry:
    """What the engine knows of one outstanding request."""

    __slots__ = ("action", "cancelled", "index", "owner", "receive", "request", "standing",
                 "transfer")

    def __init__(self, request: MPI.Request, action: Action, owner: Any, standing: bool,
                 receive: bool, transfer: Transfer | None = None) -> None:
        self.request = request
        self.action = action
        self.owner = owner  # what the action is about: failed if the action raises
        self.standing = standing  # the transport's own, not a user message
        self.receive = receive  # receives are the only requests ever cancelled ...
        self.cancelled = False  # ... and only once (Engine.cancel)
        self.index = TAKING_IN  # position in its request list (`_Requests`), or GONE
        self.transfer = transfer


class Transfer:
    """A request that moves `nbytes` (at least `TRANSFER_SIZE`) with `peer`: when to
    nudge the peer next, and after how long a wait (doubled at every nudge)."""

    __slots__ = ("answer_until", "nbytes", "nudge_at", "one_sided", "peer", "wait")

    def __init__(self, peer: int, nbytes: int, one_sided: bool) -> None:
        self.peer = peer
        self.nbytes = nbytes
        self.one_sided = one_sided  # a native put or get: pokes between passes (_poke)
        self.wait = SPIN  # before the next nudge
        self.nudge_at = math.inf  # set when the engine takes the request in
        self.answer_until: float | None = None  # the peer's nudges are answered until then

    def answers(self, now: float) -> bool:
        """Whether a nudge of the peer's, now, is answered (see the module's docstring)."""
        if self.answer_until is None:
            self.answer_until = now + SPIN + self.nbytes / TRANSFER_RATE_FLOOR
        return now < self.answer_until


def transfer_hold(nbytes: int) -> float:
    """How long the posting of a transfer of `nbytes`, or a nudge for it, holds the
    backoff (see the module's docstring)."""
    return SPIN + nbytes / TRANSFER_RATE


#: What a pass's Testsome found: the entries whose requests completed, each with the
#: request list it was in, its status and, if it completed in error, the error that
#: Testsome raised (MPI_ERR_IN_STATUS).
_Finished = list[tuple["_Requests", Entry, MPI.Status, "MPI.Exception | None"]]


class _Requests:
    """Requests with their entries, in posting order.

    A request that goes leaves a hole (`MPI.REQUEST_NULL`, which `MPI_Testsome`
    skips), and the arrays are compacted once holes outnumber requests: removal
    costs O(1), amortised, and the oldest requests stay in front, where a pass
    looks first (MPI matches in order, so they are the ones that complete first).
    """

    def __init__(self) -> None:
        self.requests: list[MPI.Request] = []
        self.entries: list[Entry | None] = []  # None at a hole
        self.first = 0  # the oldest request's index: only holes before it
        self.changed = True  # a request came or went (the engine lists its front again)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def holds(self, entry: Entry) -> bool:
        i = entry.index
        return 0 <= i < len(self.entries) and self.entries[i] is entry

    def add(self, entry: Entry) -> None:
        entry.index = len(self.requests)
        self.requests.append(entry.request)
        self.entries.append(entry)
        self._count += 1
        self.changed = True

    def remove(self, entry: Entry) -> None:
        i = entry.index
        self.requests[i] = _REQUEST_NULL
        self.entries[i] = None
        entry.index = GONE
        self._count -= 1
        self.changed = True
        if i == self.first:
            entries, first, end = self.entries, i + 1, len(self.entries)
            while first < end and entries[first] is None:
                first += 1
            self.first = first
        if len(self.entries) > 2 * self._count + COMPACT_SLACK:
            live = [entry for entry in self.entries if entry is not None]
            for index, entry in enumerate(live):
                entry.index = index
            self.requests = [entry.request for entry in live]
            self.entries = list(live)
            self.first = 0


class Backoff:
    """How long to pause before the next pass: none while things move, then longer."""

    def __init__(self) -> None:
        self.last_progress = _monotonic()
        self._moved = False  # progress since the clock was last read
        self._pause = 0.0
        self._held_until = 0.0  # no backoff before this time (transfers, nudges)
        # True while native RMA needs this rank's MPI calls (its own operations, or a
        # peer's on its memory): MPICH moves them only inside MPI calls, at both ends.
        self.hot: Callable[[], bool] = lambda: False

    def moved(self) -> None:
        """Progress. The clock is read when the time since is next asked for, not here:
        a message moves twice (posted, completed), and its passes ask once."""
        self._moved = True
        self._pause = 0.0

    def hold(self, seconds: float, now: float) -> None:
        """Do not back off for `seconds` from `now` (a large message is crossing)."""
        self._held_until = max(self._held_until, now + seconds)
        self._pause = 0.0

    def idle(self) -> float:
        """Seconds since the last progress (from the first look after it)."""
        return self._idle(_monotonic())

    def _idle(self, now: float) -> float:
        if self._moved:
            self._moved = False
            self.last_progress = now
        return now - self.last_progress

    def spinning(self) -> bool:
        """Still in the first SPIN seconds after the last progress, or held."""
        now = _monotonic()
        return self._idle(now) < SPIN or now < self._held_until

    def quiet(self) -> bool:
        """Not `spinning()` (a large post asks, `MpiTransport._nudge_if_quiet`). Progress
        since the clock was last read is not quiet, and needs no clock: the flag is
        left for the next reader, which stamps the progress's time (`_idle`)."""
        return not (self._moved or self.spinning())

    def pause(self) -> float:
        """The pause before the next pass while user messages are outstanding."""
        now = _monotonic()
        idle = self._idle(now)
        if idle < SPIN or self.hot() or now < self._held_until:
            return 0.0
        cap = MAX_BACKOFF if idle < LONG_IDLE else LONG_IDLE_BACKOFF
        self._pause = min(cap, max(self._pause * 2, 50e-6))
        return self._pause


class Engine:
    """The outstanding requests, the work queued for the progress context, and one pass."""

    def __init__(self, loop: asyncio.AbstractEventLoop, mode: str,
                 on_error: ErrorHandler, on_pass_end: Callable[[], None],
                 hot_spot: HotSpotHook | None = None, *, loop_helps: bool = True) -> None:
        self.mode = mode
        # Thread mode: whether an awaiting loop may run passes too (not when handlers
        # must run in the progress thread: a pass runs actions, and so handlers).
        self.loop_helps = loop_helps
        self._hot_spot = hot_spot  # mate.debug: called between a test and its actions
        self._on_error = on_error
        self._on_pass_end = on_pass_end  # the transport hands the pass's reports over
        self._live = _Requests()  # user messages' requests
        self._standing = _Requests()  # the transport's own, tested in every pass
        self._orphans = _Requests()  # abandoned sends, left for MPI to finish
        self._next_orphan_test = 0.0
        # Scratch for Testsome (mpi4py lengthens it as needed and fills it in place),
        # kept from pass to pass so that a message makes no Status of its own.
        self._statuses: list[MPI.Status] = []
        self._statuses_again: list[MPI.Status] = []  # a second Testsome's (_testsome)
        self._testsome_call: calls.Testsome = calls.testsome  # from C where it can (calls.py)
        # What a pass tests first (see _test_live): the user's oldest requests, from
        # index _front_first, _front_size of them, then the transport's own.
        self._front: list[MPI.Request] = []
        self._front_first = self._front_size = 0
        self._front_whole = True  # the front holds every user request
        self._live_moved = False  # whether the last pass found a completion
        self._back_tested = 0  # the pass that last tested the requests behind the front
        # Work handed to the progress context: (function, args, owner).
        self._inbox: list[tuple[Callable[..., None], tuple[Any, ...], Any]] = []
        self._after_pass: list[tuple[Callable[[], None], Any]] = []
        # Calls for a later pass (`call_later`): (when, function, owner), the soonest first due.
        self._later: list[tuple[float, Callable[[], None], Any]] = []
        self._later_due = math.inf
        # The outstanding requests that are transfers (a dict: dropped in O(1) as they
        # complete), and the soonest time one of them nudges (maybe one already gone).
        self._transfers: dict[Entry, None] = {}
        self._nudge_due = math.inf
        self._poke_until = 0.0  # native RMA asks for bare progress until then (_poke)
        #: Tells `peer` that a transfer of `nbytes` with it is under way, and whether it
        #: is a native put or get (the transport's control message); None: nobody to
        #: tell, transfers only hold this rank's backoff.
        self.nudge: Callable[[int, int, bool], None] | None = None
        self.late_nudges = 0  # sent for transfers not complete at their time
        #: The core's count of work that reports gave the loop (`Sink.loop_work`).
        self.loop_work: Callable[[], int] = _no_loop_work
        self.passes = 0
        self.lock = Lock()  # guards the inbox (mypyc's lock: two C calls a pass)
        # A progress thread sleeps on it. Whatever makes work for the thread notifies it
        # after making it, under this condition's lock: no wake-up is lost.
        self.wake = threading.Condition()
        self.backoff = Backoff()
        # For bare progress (`_poke`): a receive that nothing ever matches, on a
        # communicator of this rank alone.
        self._poke_comm = MPI.COMM_SELF.Dup()
        self._poke_buffer = bytearray(1)
        self._poke_request = self._poke_comm.Irecv(self._poke_buffer, 0, 0)
        self._add_entry = self._add  # bound once: thread mode calls it for every message
        strategies: dict[str, Callable[[Engine, asyncio.AbstractEventLoop], Progress]] = {
            "poll": PollProgress, "thread": ThreadProgress, "manual": ManualProgress}
        self._progress = strategies[mode](self, loop)

    @property
    def hot(self) -> Callable[[], bool]:
        return self.backoff.hot

    @hot.setter
    def hot(self, predicate: Callable[[], bool]) -> None:
        self.backoff.hot = predicate

    # -- adding work (any thread) --------------------------------------------------------

    def add(self, request: MPI.Request, action: Action, *, owner: Any = None,
            standing: bool = False, receive: bool = False, peer: int | None = None,
            nbytes: int = 0, one_sided: bool = False,
            first: Callable[[Any], None] | None = None) -> Entry:
        """Test `request` from now on; run `action(owner, status, error)` when it completes.

        A request that moves `nbytes` >= `TRANSFER_SIZE` with one known `peer` is a
        transfer (see the module's docstring); a `one_sided` one (a native put or
        get) has passes poke while it lasts. `first(owner)`, if given, runs in the
        progress context just before the request is taken in (a report that must
        precede its completion's): one entry into the context for both, which in
        thread mode costs a lock and a kick. The returned entry is the request's
        handle for `disown`.
        """
        transfer = (Transfer(peer, nbytes, one_sided)
                    if nbytes >= TRANSFER_SIZE and peer is not None
                    else None)
        entry = Entry(request, action, owner, standing, receive, transfer)
        if self._progress.threaded:
            if first is None:
                self.call_in_context(self._add_entry, entry)
            else:
                self.call_in_context(self._first_then_add, first, entry, owner=owner)
        else:  # `call_in_context`, without its generic call: this runs for every message
            if first is not None:
                first(owner)
            self._add(entry)
            self._progress.kick()
        return entry

    def _first_then_add(self, first: Callable[[Any], None], entry: Entry) -> None:
        try:  # `_guarded`, inline: this runs for every copied send in thread mode
            first(entry.owner)
        except Exception as exc:
            self._on_error(exc, entry.owner)
        self._add(entry)

    def _add(self, entry: Entry) -> None:
        if entry.index == DISOWNED:  # while it waited in the inbox (`disown`)
            self._orphans.add(entry)
            return
        (self._standing if entry.standing else self._live).add(entry)
        if entry.cancelled:  # asked while it waited in the inbox (`cancel`)
            entry.request.Cancel()
        self.backoff.moved()
        transfer = entry.transfer
        if transfer is not None:
            now = self._hold(transfer.nbytes, transfer.one_sided)
            transfer.nudge_at = now + transfer.wait
            self._nudge_due = min(self._nudge_due, transfer.nudge_at)
            self._transfers[entry] = None

    def nudged(self, peer: int, nbytes: int, one_sided: bool) -> None:
        """`peer` nudged: a transfer of `nbytes` with it has not crossed yet (progress
        context). Hold the backoff, and if it is a native put or get, poke between
        passes meanwhile (`_poke`); answer soon if this rank has a transfer with it."""
        now = self._hold(nbytes, one_sided)
        for entry in self._transfers:
            transfer = entry.transfer
            assert transfer is not None
            if transfer.peer == peer and transfer.answers(now):
                transfer.wait = SPIN
                transfer.nudge_at = min(transfer.nudge_at, now + SPIN)
                self._nudge_due = min(self._nudge_due, transfer.nudge_at)

    def _hold(self, nbytes: int, one_sided: bool) -> float:
        """Hold the backoff for a transfer of `nbytes`, and if it is a native put or get,
        poke for as long; the time now."""
        hold = transfer_hold(nbytes)
        now = _monotonic()
        self.backoff.hold(hold, now)
        if one_sided:
            self._poke_until = max(self._poke_until, now + hold)
        return now

    def _nudge_transfers(self, now: float) -> None:
        """Nudge the peers of the transfers that waited past their time."""
        due = math.inf
        for entry in list(self._transfers):  # a nudge that fails may orphan a transfer
            transfer = entry.transfer
            assert transfer is not None
            if now >= transfer.nudge_at:
                transfer.wait *= 2  # until a nudge of the peer's answers
                transfer.nudge_at = now + transfer.wait
                self._hold(transfer.nbytes, transfer.one_sided)  # a native one: pokes too
                if self.nudge is not None:
                    self.late_nudges += 1
                    self._guarded(entry.owner, self.nudge, transfer.peer, transfer.nbytes,
                                  transfer.one_sided)
            due = min(due, transfer.nudge_at)
        self._nudge_due = due

    def call(self, fn: Callable[..., None], *args: Any, owner: Any = None) -> None:
        """Run `fn(*args)` in the progress context, before the next pass."""
        with self.lock:
            self._inbox.append((fn, args, owner))
        self._progress.kick()

    def call_in_context(self, fn: Callable[..., None], *args: Any, owner: Any = None) -> None:
        """`fn(*args)` at once where the caller is in the progress context already (poll
        and manual modes: everything runs on the loop's thread) or enters it without
        waiting (thread mode: no pass runs); else, or behind earlier calls, `call`.

        In thread mode the inbox cost each message a lock, a queued call and its run
        in a later pass; posts on the loop's thread usually find no pass running,
        since the thread stands back while the loop helps.
        """
        progress = self._progress
        if not progress.threaded:
            fn(*args)
        # Calls this thread queued before (that no pass has taken yet) go first, so that
        # requests are taken in in posting order (a large receive waits there for the
        # next send). A pass that took them has run them by the time the lock is free.
        elif not self._inbox and progress.enter():
            try:  # `_guarded`, inline: this runs for every message in thread mode
                fn(*args)
            except Exception as exc:
                self._on_error(exc, owner)
            finally:
                progress.leave()
        else:
            self.call(fn, *args, owner=owner)
            return
        progress.kick()

    def call_at_once(self, fn: Callable[..., None], *args: Any, owner: Any = None) -> None:
        """`call`, and have passes run until it has run and one pass more has reported
        what it started (a cancel: its receive, say), even in manual mode."""
        self.call(fn, *args, owner=owner)
        self._progress.drive_passes(2)

    def after_pass(self, fn: Callable[[], None], *, owner: Any = None) -> None:
        """Run `fn()` at the end of the next pass (progress context only)."""
        self._after_pass.append((fn, owner))

    def call_later(self, delay: float, fn: Callable[[], None], *, owner: Any = None) -> None:
        """Run `fn()` in the first pass `delay` seconds or more from now (progress context
        only). Passes come at least every `IDLE_INTERVAL` while the transport's standing
        receives are posted, and only when driven by hand in manual mode."""
        when = _monotonic() + delay
        self._later.append((when, fn, owner))
        self._later_due = min(self._later_due, when)

    @property
    def user_outstanding(self) -> int:
        return len(self._live)

    @property
    def orphans(self) -> int:
        return len(self._orphans)

    def busy(self) -> bool:
        """Whether passes should follow each other, backing off: user work, or hot."""
        return bool(self.user_outstanding or self._inbox or self.backoff.hot())

    def idle_interval(self) -> float | None:
        """With nothing busy: the pause before the next pass, or None for no pass.

        Looks at the backoff's clock, so that the time of the last progress is known
        within an interval even while no pass backs off (a large message asks
        whether its rank was quiet: `MpiTransport._nudge_if_quiet`)."""
        self.backoff.idle()
        if self._standing:
            return IDLE_INTERVAL  # the standing receives: peers' requests
        return ORPHAN_INTERVAL if self._orphans else None

    def has_calls(self) -> bool:
        return bool(self._inbox)

    def passes_between_calls(self) -> bool:
        """Whether passes may run between the program's calls now (`Progress`)."""
        return self._progress.passes_between_calls()

    # -- one pass ------------------------------------------------------------------------

    def poking(self) -> bool:
        """Whether a native put or get, this rank's or (by its nudge) a peer's, asks for
        bare progress between passes now."""
        return _monotonic() < self._poke_until

    def test(self, poke: bool = False) -> bool:
        """Run queued calls, test every request, run the actions; True if anything moved.

        With `poke`, a pass that found nothing while a native put or get asks for it
        (`poking`) is followed by bare progress (`_poke`). Callers ask for it only
        where no earlier completion waits to be handed over (`loop_slice`): pokes
        that wait for the next completion would hold back the delivery of the last
        (at 64 KiB, a ping-pong lost a quarter of its speed).
        """
        try:
            moved = self._pass()
            if poke and not moved and self.poking():
                self._poke()
            return moved
        finally:
            self._on_pass_end()

    def _pass(self) -> bool:
        self.passes += 1
        moved = False
        if self._inbox:  # read unlocked: a call added meanwhile kicks another pass
            with self.lock:
                inbox, self._inbox = self._inbox, []
            for fn, args, owner in inbox:
                self._guarded(owner, fn, *args)
            moved = True
        if self._live or self._standing:
            moved = self._test_live() or moved
        if self._orphans and _monotonic() >= self._next_orphan_test:
            self._next_orphan_test = _monotonic() + ORPHAN_INTERVAL
            orphans = self._orphans
            requests = orphans.requests[orphans.first:]
            self._complete(self._testsome(requests, orphans, orphans.first, len(requests)))
        # A transfer makes a large message cross a fragment per pass: keep its passes
        # light, one look at the clock (see the module's docstring, transfers).
        if self._transfers:
            now = _monotonic()
            if now >= self._nudge_due:
                self._nudge_transfers(now)
        if self._later:
            now = _monotonic()
            if now >= self._later_due:
                self._run_later(now)
        if self._after_pass:
            hooks, self._after_pass = self._after_pass, []
            for fn, owner in hooks:
                self._guarded(owner, fn)
            moved = True
        if moved:
            self.backoff.moved()
        return moved

    def _run_later(self, now: float) -> None:
        """Run the `call_later` calls due by `now` (the pass's look at the clock)."""
        due = [call for call in self._later if call[0] <= now]
        self._later = [call for call in self._later if call[0] > now]
        self._later_due = min((call[0] for call in self._later), default=math.inf)
        for _, fn, owner in due:
            self._guarded(owner, fn)

    def _poke(self) -> None:
        """Run MPI's progress up to `POKES` times, until a request of the front completes.

        MPICH moves a large native put or get a fragment per MPI call, at its origin
        and at its passive target. The time between calls then sets the speed: a
        target that tested every 1, 2 or 4 us took in a 4 MiB put at 51, 37 and 21 %
        of the speed of one sitting in MPI, and one that poked so, at 97 %
        (`bench/rma_target.py`); a pass costs a few microseconds. A bare call,
        `MPI_Request_get_status` on a receive that nothing matches, costs a quarter
        of one; every `LOOK_EVERY` calls, `MPI_Request_get_status_any` over the
        front (0.6 us for six requests) looks whether one completed, which the next
        pass then finds (neither frees a request). Work handed to the progress
        context (thread mode) ends the pokes too, and so does a request that
        completed in error, for which the look raises.
        """
        if self._live.changed or self._standing.changed:
            return  # the front is out of date: the next pass makes it again
        front, look = self._front, MPI.Request.Get_status_any
        progress = self._poke_request.Get_status
        try:
            for _ in range(POKES // LOOK_EVERY):
                if self._inbox or look(front)[1]:
                    return
                for _ in range(LOOK_EVERY - 1):
                    progress()
        except MPI.Exception:
            pass  # a request completed in error (a truncated receive): the next pass reports it

    def _test_live(self) -> bool:
        """Test the oldest `FRONT` user requests and the transport's own, and now and
        then the user's requests behind them. True if any completed.

        `MPI_Testsome` costs mpi4py O(n) for n requests, and MPICH takes in one
        message per call, so testing a window of n messages whole in every pass
        would cost O(n) a message. MPI matches in order, so a window completes
        from its front: every pass tests the front, and the b requests behind it
        are tested when the front stops moving (what completed out of order
        meanwhile is found at once) or `WHOLE_EVERY` passes after they last were,
        but never sooner than b / `FRONT` passes after that, so that testing them
        costs a pass no more than the front does, whatever the window. A request
        that completes out of order waits at most max(`WHOLE_EVERY`, b / `FRONT`)
        passes. The front's list is made again only when a request comes or goes,
        so that an idle pass allocates nothing.

        While messages flow (the last pass found a completion), the Testsome is
        preceded by a bare progress call for every request of the front but one,
        so that one pass finds as many completions as the front holds: MPICH
        takes in one message per call, and a pass costs as much as several bare
        calls. A window of 64 received 8 B messages, all arrived, took 58 passes
        and 4.7-6.2 us a message in the engine without them, and 10 passes and
        2.7-3.4 us with them (`bench/window_passes.py`). A lone request gets none,
        a ping-pong's send and receive one.
        """
        live, standing = self._live, self._standing
        if live.changed or standing.changed:
            live.changed = standing.changed = False
            first = live.first
            front = live.requests[first:first + FRONT]
            self._front_first, self._front_size = first, len(front)
            self._front_whole = first + len(front) == len(live.requests)
            self._front = front + standing.requests
        if self._live_moved and self._front_size > 1:
            progress = self._poke_request.Get_status
            for _ in range(self._front_size - 1):
                progress()
        moved = self._complete(self._testsome(self._front, live, self._front_first,
                                              self._front_size, standing))
        stopped, since = self._live_moved and not moved, self.passes - self._back_tested
        # Behind the front; or, if requests went (the list may have been compacted),
        # everything from the oldest on.
        first = live.first if moved else self._front_first + self._front_size
        if (not self._front_whole and since * FRONT > len(live.requests) - first
                and (stopped or since >= WHOLE_EVERY)):
            self._back_tested = self.passes
            requests = live.requests[first:]
            moved = self._complete(self._testsome(requests, live, first, len(requests))) or moved
        self._live_moved = moved
        return moved

    def _testsome(self, requests: list[MPI.Request], group: _Requests, first: int, size: int,
                  also: _Requests | None = None) -> _Finished:
        """Testsome over `requests`: the first `size` are `group`'s from index `first` on,
        the rest all of `also`'s. The entries whose requests completed (now removed),
        with their statuses and errors.

        If a transfer's receive completed and requests of `group` are left, Testsome
        runs again at once, before any action. The receive's data has just been
        copied here, through the caches, so the next pass runs cold: in a 4 MiB
        pingping it came 14-65 us later. MPI takes in one message per call, so what
        came beside the data (the acknowledgement of the pingping's own send) is
        found now, by a call of a few microseconds. Not after a send: in a
        pingpong nothing comes beside its acknowledgement, and the call, wasted,
        cost the 64 KiB pingpong about 6 %; nor when only holes are left beside
        the receive (requests gone, not compacted yet), which cost it as much.
        """
        found: _Finished = []
        received = self._find(requests, self._statuses, group, first, size, also, found)
        if received and any(r != _REQUEST_NULL for r in requests[:size]):  # holes are null
            self._find(requests, self._statuses_again, group, first, size, also, found)
        # Every entry is found before any is removed: a removal may compact `group`.
        for owner, entry, _, _ in found:
            owner.remove(entry)
            if entry.transfer is not None:  # its message is let go now, not at a nudge
                self._transfers.pop(entry, None)  # (an orphan's was dropped already)
        return found

    def _find(self, requests: list[MPI.Request], statuses: list[MPI.Status],
              group: _Requests, first: int, size: int, also: _Requests | None,
              found: _Finished) -> bool:
        """One Testsome over `requests` (as `_testsome`'s), its completions added to
        `found` with their statuses (not copied: the actions run before the next
        Testsome with these statuses, see Action) and errors. True if one was a
        transfer's receive, and none failed."""
        earlier: set[int] | None = None
        try:
            done = self._testsome_call(requests, statuses)
            error = None
        except MPI.Exception as exc:
            # MPI_ERR_IN_STATUS (e.g. a truncated receive): the index list is lost, but
            # the completed requests were set to MPI_REQUEST_NULL (as the holes are),
            # and MPICH and Open MPI both report completions in ascending index order.
            # What an earlier call of this pass found is null too, and is left out.
            earlier = {id(entry) for _, entry, _, _ in found}
            done = [i for i, r in enumerate(requests) if r == _REQUEST_NULL]
            error = exc
        if not done:
            return False
        received = False
        k = 0  # Testsome's k-th status belongs to its k-th completion
        for i in done:
            owner, entry = ((group, group.entries[first + i]) if i < size or also is None
                            else (also, also.entries[i - size]))
            if entry is None or (earlier is not None and id(entry) in earlier):
                continue  # None: a hole, which only an error's list holds
            status = statuses[k]
            k += 1
            failed = error if error is not None and status.Get_error() != MPI.SUCCESS else None
            found.append((owner, entry, status, failed))
            if entry.receive and entry.transfer is not None:
                received = True
        return received and error is None

    def _complete(self, finished: _Finished) -> bool:
        """Run the actions of what a Testsome found; True if it found anything."""
        if not finished:
            return False
        if self._hot_spot is not None:
            self._hot_spot("mpi.pass")
        for _, entry, status, failed in finished:
            owner = entry.owner
            try:  # `_guarded`, inline: this runs for every message
                entry.action(owner, status, failed)
            except Exception as exc:
                self._on_error(exc, owner)
        return True

    def _guarded(self, owner: Any, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self._on_error(exc, owner)

    # -- who runs passes -----------------------------------------------------------------

    def start(self) -> None:
        """Begin running passes; called once the standing receives are posted."""
        self._progress.start()

    def drive_until(self, done: Callable[[], bool]) -> bool:
        """A task awaits something until `done()`: make sure passes run until then. True
        if the task should give the loop one turn and then ask again (`await_spin`)."""
        return self._progress.drive_until(done)

    def stop(self) -> None:
        """Stop running passes; a progress thread has ended on return."""
        self._progress.stop()

    # -- shutdown and orphans ------------------------------------------------------------

    def drain(self, deadline: float) -> None:
        """After `stop`: run passes on the caller's thread until no request that can
        still finish is left (orphaned sends excepted) or the deadline passes."""
        while _monotonic() < deadline:
            self.test()
            if not self._inbox and not self._live and not self._standing:
                return

    def free(self) -> None:
        """After `drain`: release the engine's own MPI objects."""
        self._poke_request.Cancel()
        self._poke_request.Wait()
        self._poke_comm.Free()

    def cancel(self, entry: Entry) -> None:
        """Cancel an outstanding receive, once however often asked (progress context only).

        MPICH's ch4 device corrupts a request made between two MPI_Cancel calls on
        one wildcard receive, so a receive whose cancel was asked again before a
        pass tested it (a timeout's, then shutdown's) must not be cancelled again.
        A receive posted from the loop in thread mode may still wait in the inbox
        when its cancel comes (an emulated get's refusal, answered within the
        pass that found it): it is cancelled as the engine takes it in (`_add`).
        """
        if entry.receive and not entry.cancelled and entry.index != GONE:  # outstanding
            entry.cancelled = True
            if entry.index >= 0:
                entry.request.Cancel()

    def cancel_receives(self, *, standing: bool) -> None:
        """Cancel the outstanding user receives (and the standing ones if `standing`),
        those still waiting in the inbox too: in thread mode a pass that serves a control
        message reposts the standing receive through it, and may be the thread's last."""
        with self.lock:
            waiting = [args[0] for fn, args, _ in self._inbox if fn is self._add_entry]
        for entry in waiting:
            if standing or not entry.standing:
                self.cancel(entry)
        for group in (self._live, self._standing) if standing else (self._live,):
            for entry in group.entries:
                if entry is not None:
                    self.cancel(entry)

    def disown(self, entry: Entry) -> bool:
        """Move a live request to the orphans (tested rarely, so MPI can free it).

        False if it is not live (it completed already). One still waiting in the inbox
        (thread mode: an emulated get's send, abandoned in the pass that posted it) is
        taken in as an orphan. Progress context only.
        """
        if entry.index == TAKING_IN:
            entry.index = DISOWNED
            return True
        group = self._standing if entry.standing else self._live
        if not group.holds(entry):
            return False
        group.remove(entry)
        self._orphans.add(entry)
        self._transfers.pop(entry, None)  # an orphan's peer is not nudged
        return True


class Progress(abc.ABC):
    """Who runs the engine's passes, and when."""

    threaded = False  # passes run in a thread of their own

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def kick(self) -> None:
        """Work was added: make sure a pass comes soon."""

    def drive_until(self, done: Callable[[], bool]) -> bool:
        """A task awaits until `done()` (only passes driven by hand need to know); True
        to have the task give the loop one turn and ask again."""
        return False

    def drive_passes(self, count: int) -> None:  # noqa: B027
        """Run at least `count` more passes soon (only passes driven by hand need it)."""

    def enter(self) -> bool:
        """Enter the progress context from the caller's thread if no pass runs (then
        `leave` it); False where passes have no context to enter (not threaded)."""
        return False

    def leave(self) -> None:  # noqa: B027
        """Leave what `enter` entered."""

    def passes_between_calls(self) -> bool:
        """Whether passes may run now between the program's calls, taking in messages
        that its next receive would then match as it is posted (MPI copies such a
        message inside MPI_Irecv): only a progress thread runs those passes."""
        return False

    @abc.abstractmethod
    def stop(self) -> None: ...


def _stand_back_in_python(clock: array[float], period: float, fd: int, /) -> bool:
    """`mate._stand_back.stand_back` in Python, where that is not built: the same
    wait, but each look at `clock` needs the GIL."""
    while True:
        left = clock[0] + period - _monotonic()
        if not left > 0:
            return False
        if select.select([fd], [], [], min(left, period))[0]:
            return True


def _stand_back_function() -> Callable[[array[float], float, int], bool]:
    try:
        from mate._stand_back import stand_back
    except ImportError:  # not built, or refused by mate.native (pure Python, or stale)
        return _stand_back_in_python
    return stand_back


stand_back: Final = _stand_back_function()


def loop_slice(engine: Engine, test: Callable[[bool], bool]) -> None:
    """The passes of one callback on the event loop: one, or while user messages are
    outstanding (and passes not backing off), more for up to SLICE.

    Going round the loop costs a system call and a wake-up of each task a pass
    resolved, so the callback tests again until a pass moves, and then goes on
    while passes move: MPICH takes in one message per call, so a window of
    messages arriving together completes in one callback, and each task that
    awaits them wakes once. The pass after the last completion finds nothing and
    ends the slice; a pass that leaves no user message outstanding ends it at once.

    A rank may have nothing of its own outstanding and yet be the target of a
    peer's native put or get, which MPICH moves a fragment per MPI call of the
    target.
    One pass per turn of the loop moved a 4 MiB put at 29 % of the speed of a
    target that sits in MPI (`bench/rma_target.py`), so such a rank follows a
    pass that found nothing with bare progress (`Engine._poke`), once per turn,
    while the put's nudge asks for it (`Engine.poking`).
    Not for a whole slice: the loop may have work waiting, the tasks of messages
    that just completed (spinning a slice on every held rank made some emulated
    puts of 64 KiB take 300-600 us instead of 100).
    """
    moved = test(False)
    if not (engine.user_outstanding and engine.backoff.spinning()):
        if not moved and engine.poking():
            test(True)  # a target's pokes, once per turn: the loop may have work waiting
        return
    give_up = _monotonic() + SLICE
    while not moved and _monotonic() < give_up:
        moved = test(True)  # nothing to hand over yet: a pass may poke
    while moved and engine.user_outstanding and _monotonic() < give_up:
        moved = test(False)


def await_spin(engine: Engine, test: Callable[[bool], bool], done: Callable[[], bool],
               give_up: float) -> bool:
    """Passes (`test`) run by a task that awaits, until `done()`, the loop has work, or
    `give_up`; True if it gave up with the loop given no work and passes still spinning.

    A message that completes while its task spins here is awaited with no turn
    of the loop and no wake-up of the task. Bounded as `loop_slice` is: only
    while the loop turned within the last SLICE, and over once what the passes
    moved gave the loop work (`Engine.loop_work`: another task woken, a handler
    queued), which this task's spinning would hold up. Messages that merely end,
    awaited by nobody yet (the receive posted beside an awaited send), need no
    turn of the loop and do not stop it.

    Given up while passes still spin, the task yields for one bare turn of the
    loop, in which the queued pass runs, and spins again (`Ledger.waiter`): with
    a future instead, the pass that ends the message resolves it and the task
    wakes a turn later, two turns for one. A 4 MiB message takes most of a SLICE.
    """
    loop_work = engine.loop_work
    mark = loop_work()
    while not done() and _monotonic() < give_up:
        # A pass that ended the message returns at once: the loop's work is not asked
        # for on the way from its completion to its task.
        if test(True) and (done() or loop_work() != mark):
            return False
    return not done() and loop_work() == mark and engine.backoff.spinning()


class PollProgress(Progress):
    """Passes as callbacks on the event loop while there is work (see the docstring).

    At most one pass is queued with `call_soon` and at most one timer is armed.
    A pass wanted later only moves `_due`: the armed timer is left alone, and
    when it fires it runs the pass, re-arms for a later `_due`, or does nothing
    if a pass came sooner. So the rhythm of a ping-pong -- the pass that ends a
    message plans the idle pause, the next post wants a pass at once -- creates
    and cancels no timer per message (asyncio's timers are Python code).
    """

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(engine, loop)
        self._soon: asyncio.Handle | None = None  # the pass queued with call_soon ...
        self._soon_at = 0.0  # ... since then (the loop has not turned since)
        self._timer: asyncio.TimerHandle | None = None  # the one armed timer ...
        self._timer_when = 0.0  # ... and when it fires (loop time)
        self._due = math.inf  # when the next pass is wanted, if not at once (loop time)
        self._stopped = False

    def start(self) -> None:
        self.schedule(0.0)

    def kick(self) -> None:
        self.schedule(0.0)

    def drive_until(self, done: Callable[[], bool]) -> bool:
        turn = False
        if self._soon is not None and self.engine.backoff.spinning():
            # If it gives up, the queued pass runs in the turn that the task yields.
            turn = await_spin(self.engine, self.engine.test, done, self._soon_at + SLICE)
        self.schedule(0.0)
        return turn

    def schedule(self, delay: float) -> None:
        """Make sure a pass runs within `delay` seconds (sooner than any pass planned)."""
        if self._stopped or self._soon is not None:
            return  # a pass comes at once, and plans the next one itself
        if delay <= 0:
            self._due = math.inf
            self._soon = self.loop.call_soon(self._poll)
            self._soon_at = _monotonic()
            return
        when = self.loop.time() + delay
        if when < self._due:
            self._due = when
            if self._timer is None or self._timer_when > when:
                if self._timer is not None:
                    self._timer.cancel()  # armed for later than now wanted: rare
                self._arm(when)

    def _arm(self, when: float) -> None:
        self._timer_when = when
        self._timer = self.loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        fired, self._timer = self._timer_when, None
        if self._soon is not None or self._due == math.inf:
            return  # the pass it was armed for came sooner
        if self._due > fired:
            self._arm(self._due)  # the pass is now wanted later
            return
        self._poll()

    def _poll(self) -> None:
        self._soon = None
        self._due = math.inf
        loop_slice(self.engine, self.engine.test)
        self.next_pass()

    def next_pass(self) -> None:
        if self.engine.busy():
            self.schedule(self.engine.backoff.pause())
        else:
            interval = self.engine.idle_interval()
            if interval is not None:
                self.schedule(interval)

    def stop(self) -> None:
        self._stopped = True
        for handle in (self._soon, self._timer):
            if handle is not None:
                handle.cancel()
        self._soon = self._timer = None


class ManualProgress(PollProgress):
    """Passes on the loop only while someone waits for them (see the docstring)."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(engine, loop)
        self._drivers: list[Callable[[], bool]] = []  # until when passes are wanted

    def start(self) -> None:
        pass  # world.progress() runs the passes

    def kick(self) -> None:
        pass  # idem

    def drive_until(self, done: Callable[[], bool]) -> bool:
        self._drivers.append(done)
        self.schedule(0.0)
        return False

    def drive_passes(self, count: int) -> None:
        until = self.engine.passes + count
        self.drive_until(lambda: self.engine.passes >= until)

    def next_pass(self) -> None:
        self._drivers = [done for done in self._drivers if not done()]
        if self._drivers:
            self.schedule(self.engine.backoff.pause())


class ThreadProgress(Progress):
    """Passes in a progress thread of their own, helped by an awaiting loop (see the
    docstring).

    The pass lock keeps the two threads' passes apart (MPI forbids two threads to
    test one request at once); the loop waits for the thread's pass to end. Holding
    it is being in the progress context: a post that finds it free takes its request
    in at once (`enter`, `Engine.call_in_context`) instead of through the inbox. While
    the loop helps (it ran passes lately), the thread sleeps instead of polling:
    two threads polling in Python fight over the GIL, which costs both. The loop
    stops helping when nothing moved for `SPIN` (and wakes the thread) or no user
    message is left; if a long callback keeps the loop away instead, the thread
    takes over once `STAND_BACK` has passed.

    The thread stands back without the GIL (`stand_back`): the loop marks in
    `_clock` when it last ran passes (+inf while it runs them), and the thread
    sleeps in C until `STAND_BACK` after that time, reading the clock again
    each time it wakes, or until `_wake_thread` writes its pipe. It looked in
    Python before, once per `STAND_BACK`, and each look took the GIL from the
    loop, which keeps it while it polls (mpi4py holds it even across an
    MPI_Testsome that copies a 4 MiB message): a thread-mode 4 MiB pingping took
    1.4-1.8x as long as poll mode's, and about as long with looks every 100 ms
    (bench/results/stand-back-2026-11-28.txt).
    """

    threaded = True

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(engine, loop)
        self._stopping = False
        # mypyc's lock, as the engine's: compiled code calls it directly, where a
        # threading.Lock's acquire(False) parsed its arguments at every post. Waiting
        # for it releases the GIL, which `_loop_test` relies on.
        self._pass_lock = Lock()
        self._help: asyncio.Handle | None = None  # the loop's next pass, if it helps
        self._helped = -math.inf  # when the loop last began to help (monotonic), while it helps
        # When the loop last ran passes or began to help (monotonic; +inf while it runs
        # them, -inf once it gave up), for the thread's `stand_back`, which reads it
        # without the GIL: a double in an array, not an attribute. Marked around a help
        # pass's slice and an awaiting task's spin, not around every pass.
        self._clock = array("d", [-math.inf])
        self._standing_back = False  # the thread sleeps in `stand_back`: wake it by the pipe
        # The thread ran a pass since the loop's last one: it may have taken in messages
        # while the program ran (`passes_between_calls`).
        self._thread_passed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Held to write the pipe and to close it: a wake from another thread racing
        # `stop` must not write to its number once closed, which may be reused by then.
        self._pipe_lock = threading.Lock()
        self._loop_thread = threading.get_ident()  # made on the loop's thread
        self._worker = threading.Thread(target=self._run, name="mate-mpi-progress",
                                        daemon=True)
        self._worker.start()

    def start(self) -> None:
        pass  # the thread runs from the start

    def kick(self) -> None:
        if self.engine.loop_helps and _get_ident() == self._loop_thread:
            # Posted on the loop: its next pass takes the new work, as in poll mode,
            # and a thread standing back looks again soon enough should the loop
            # compute instead. Waking it for nothing would cost the loop the GIL.
            self._start_helping()
            if self._standing_back:
                return
        self._wake_thread()

    def _wake_thread(self) -> None:
        with self.engine.wake:
            self.engine.wake.notify()
        # Read after the caller's change: a thread that has not set the flag yet reads
        # `_stopping` after it (`_stand_back`), and a loop that gave up has set its clock
        # to -inf, which the wait reads first.
        if self._standing_back:
            with self._pipe_lock, contextlib.suppress(BlockingIOError):  # full: readable
                if self._wake_w >= 0:  # -1 once stopped
                    os.write(self._wake_w, b"\0")

    # -- the loop's passes (on the loop's thread) ----------------------------------------

    def drive_until(self, done: Callable[[], bool]) -> bool:
        turn = False
        if self.engine.loop_helps:
            # As in poll mode, the awaiting task runs passes first, within SLICE of the
            # loop's last help (the thread stands back for STAND_BACK, longer than that).
            if self._help is not None and self.engine.backoff.spinning():
                self._clock[0] = math.inf
                try:
                    # If it gives up, the help pass runs in the turn that the task yields.
                    turn = await_spin(self.engine, self._loop_test, done, self._helped + SLICE)
                finally:
                    self._clock[0] = _monotonic()
            self._start_helping()
        return turn

    def _start_helping(self) -> None:
        if self._help is None and not self._stopping:
            self._helped = self._clock[0] = _monotonic()
            self._help = self.loop.call_soon(self._help_pass)

    def _help_pass(self) -> None:
        self._help = None
        if self._stopping:
            return
        engine = self.engine
        self._helped = _monotonic()
        self._clock[0] = math.inf
        try:
            loop_slice(engine, self._loop_test)
        finally:
            self._clock[0] = _monotonic()
        if engine.user_outstanding and engine.backoff.spinning():
            self._help = self.loop.call_soon(self._help_pass)
        else:
            self._helped = self._clock[0] = -math.inf
            if engine.user_outstanding:
                self._wake_thread()  # the loop gave up: the thread carries on, backing off

    def enter(self) -> bool:
        return self._pass_lock.acquire(False)  # never waits: the caller falls back on `call`

    def leave(self) -> None:
        self._pass_lock.release()

    def _loop_test(self, poke: bool) -> bool:
        # If the thread is in a pass, wait for its end: a pass is short and never blocks,
        # and waiting releases the GIL that the pass needs. (Trying the lock in a spin
        # instead kept the GIL from the thread for the whole spin: pingping and put/get
        # in thread mode went 1.5-2x slower.)
        with self._pass_lock:
            self._thread_passed = False
            return self.engine.test(poke)

    # -- the thread's passes -------------------------------------------------------------

    def _loop_helping(self) -> bool:
        return self._clock[0] + STAND_BACK > _monotonic()

    def passes_between_calls(self) -> bool:
        # While the loop runs the passes (it helps, or nothing is outstanding) the thread
        # stands back or sleeps: no pass runs until the program awaits again, as in poll
        # mode.
        return self._thread_passed

    def _stand_back(self) -> None:
        """Sleep while the loop runs the passes, or until woken (`_wake_thread`)."""
        self._standing_back = True
        try:
            # `_stopping` read after the flag is set: see `_wake_thread`.
            if not self._stopping and stand_back(self._clock, STAND_BACK, self._wake_r):
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)  # woken: empty the pipe
        finally:
            self._standing_back = False

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            if self._loop_helping():
                self._stand_back()
                continue
            with engine.wake:
                while not (self._stopping or self._loop_helping()
                           or engine.busy() or engine.idle_interval() is not None):
                    engine.wake.wait()
                if self._stopping:
                    return
            if self._loop_helping():
                continue  # stand back (a post on the loop woke the thread)
            try:
                # No pokes here: they would keep the pass lock from an awaiting loop's
                # passes (64 KiB native puts took 1.5x as long); the loop's passes poke.
                with self._pass_lock:
                    self._thread_passed = True
                    engine.test()
            except Exception as exc:  # a fault in the pass itself: log it, keep progressing
                logger.exception("mate: MPI progress pass failed", exc_info=exc)
            if engine.has_calls():
                continue
            pause = engine.backoff.pause() if engine.busy() else engine.idle_interval()
            if pause:
                with engine.wake:
                    if not engine.has_calls() and not self._stopping:
                        engine.wake.wait(pause)
            else:
                os.sched_yield()  # let the loop's thread have the GIL (sleep(0) costs ~60 us here)

    def stop(self) -> None:
        with self.engine.wake:
            stopped, self._stopping = self._stopping, True
        if stopped:  # asked again: the thread has ended (or is ending) and the pipe is
            self._worker.join()  # closed (or is being closed) by the first call
            return
        self._wake_thread()
        if self._help is not None:
            self._help.cancel()
            self._help = None
        self._worker.join()
        with self._pipe_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
