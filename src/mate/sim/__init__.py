"""The scalability simulation of thesis §6.1: work stealing over simulated processes
with message-passing (MP), message-driven (MD) and Progressive Messages (PM) load
balancing, in NumPy (SPEC §6, the last demo).

``python -m mate.sim`` runs it (see `mate.sim.__main__`); this module is the model.

Theory of operation
-------------------

The workload is a fixed list of work units (default 128K), each a positive integer
duration drawn from a right-tail normal (half-normal) distribution,
``max(1, floor(|N(0, 1)| * 10))`` (median 6, all positive, as the thesis says), from
one seed, so every run sees the same workload. The thesis does not say how it
made its numbers positive; zeros (8% of the draws) are raised to 1 rather than
redrawn because redrawing them shifts the median to 7
(``P(floor <= 6 | floor >= 1) = 0.474``), against the thesis's six. It is dealt to the processes in
contiguous equal blocks. The state is ``clock[p]``, the elapsed time of process
``p``, and its FIFO queue of unit durations.

One *step* (the thesis's ``simstep``):

1. every process completes the first unit of its queue (``clock += duration``;
   an empty queue adds nothing) and drops it;
2. the *sources* are the processes whose queued total is below the threshold;
3. each source draws a uniformly random *target* (any process, itself included;
   several sources may draw the same target);
4. the (source, target) pairs are balanced one after another, in source order,
   by the model's balance function (``x`` = source, ``y`` = target; ``x == y``
   does nothing):

   * PM: thrashing check, then split (no latency: a PM process never waits);
   * MD: ``clock[x] += latency``, ``clock[y] += latency``, thrashing check, split;
   * MP: as MD, and the moved portion is ready later (FIX 4): the target handles
     the request only at the end of the unit it is running when the request
     arrives, and the portion is ready one latency after that.

   The *split* gives the source the first ``k = (n + 1) // 2`` of the target's
   ``n`` queued units (appended to the source's queue); the target keeps the rest.
   The portion is ready (FIX 3) at the target's clock after the balance function
   (PM, MD), or at the later MP time (FIX 4).

Steps repeat until every queue is empty; the speed-up is the total work over the
largest clock (the makespan).

Deliberate deviations from the thesis's q/kdb+ code (documented fixes):

* FIX 1, the thrashing check. The text says the check makes sure "the target
  will have enough to do", but the code ``if[(3*threshold)<sum py; :0b]`` refuses
  exactly when the target has *more* than three thresholds of work. Here the
  text's intent is implemented: the split is refused when the target's queued
  total is below ``3 * threshold``.
* FIX 3, causality. The lock-step simulation would let a source whose clock is
  low start work that its target handed over at a later time. Here every unit
  that moves gets a *ready time*, ``max(its ready time, the target's clock after
  the balance function)``, and a process starting a unit first sets
  ``clock = max(clock, ready time)`` (a no-op for units it always had). PM still
  pays no latency, as in the thesis.
* FIX 4, MP's wait is a delay of the response, not extra work in the step. The
  thesis's ``balancemp`` lets the target, then the source, complete units inside
  the balance function (its ``while`` loops) until the clocks meet. A previous
  revision of this simulation implemented those loops (its FIX 2 removed the
  units they completed; with no units completed while waiting, it is gone). It
  made MD < MP at 27 of the 45 points of the full run (mostly below 1 %, up to
  6 % at threshold 1000): MP drained the queues in fewer lock steps, and as
  every source sends one request per step, each paying the latency, it paid for
  fewer requests. That is an artifact of charging one request per lock step,
  not a property of message passing. Here the three models take the same
  decisions and differ only in the time they pay, as §6.1.3 puts it:
  "message-passing waits for a work unit to complete before handling requests
  and responses". MP changes the clocks exactly as MD; only the moved portion's
  ready time is later. The request is sent at the source's clock ``cx`` (before
  the latency). If the target's clock ``cy >= cx`` it handles the request at
  ``cy``, as MD. Otherwise it handles it at the first unit boundary at or after
  ``cx`` along its queue, as it would run it from ``cy`` (each range starting no
  earlier than its ready time; prefix sums, no unit is completed and no clock
  changes), or at ``cx`` if it is idle then (waiting for a ready time, or out
  of work). The portion is ready at that time plus the latency, and never
  before MD's ready time. The split itself is MD's (the first half of the
  target's queue as it stands in the lock step). The source handling the
  response only between units costs nothing extra: the portion goes behind the
  units it has queued, and an idle source starts it when it is ready.

Two properties follow and the tests check them: the speed-up is at most the
number of processes (every unit's duration lands on exactly one clock), and with
one workload and one stream of random targets the speed-ups are ordered PM >=
MD >= MP, for every seed, size, threshold and latency. For the latter: no
decision (sources, targets, refusals, splits) depends on a clock, so the queues
evolve identically in the three models (same steps, same splits); MD adds the
latency to PM's clock changes and MP takes MD's clock changes with ready times
never earlier than MD's; and every clock update (``+``, ``max``, a ready time
taken from clocks) is monotone, so MD's clocks never fall below PM's nor MP's
below MD's. The CLI still checks the order on its results (exit 1 if broken): a
guard on the implementation.

Two consequences of the lock step are worth knowing when reading the results.
Every process completes one unit per step, so with equal initial blocks all
queues hold the same number of units at every step; a process falls below the
threshold only near the end, when the others hold about as much, and the
thrashing check (a target needs three thresholds) then refuses almost every
request. And sources are chosen by queued work, not by time, so a source may be
ahead in time of its target: the ready-time rule then starts the moved work at
the source's (later) clock, and a split can lengthen the makespan.

Implementation
--------------

A step is NumPy operations over all processes, not a Python loop. All unit
durations live in one flat array ``work`` with prefix sums ``cum``; a queue is a
*current* contiguous range ``[begin[p], end[p])`` of that array (with a ready
time ``ready[p]``) plus, only for processes that received portions while not
empty, a short Python deque of further ranges ``(begin, end, ready)`` whose unit
count and total are kept in arrays. Invariant: an empty current range means an
empty queue (the next pending range is promoted at once). Queued totals are
``cum[end] - cum[begin] + pend_total``.

The pairs of a step are balanced in *rounds*: a round takes every remaining pair
that shares no process with an earlier remaining pair, so the pairs of a round
touch disjoint processes and may be applied at once, and every pair still sees
exactly the state the sequential order would give it (a target asked by several
sources serves them one after another, seeing its already-halved queue and its
clock after the earlier latencies). MP's handling time is a ``searchsorted`` on
the prefix sums; splits of a one-range target to an empty source are array
assignments; only splits that involve the deques (and handling times beyond a
target's current range) run per pair in Python.

Steps in which no process can be a source (every queue stays at or above the
threshold within its current range) change nothing but the clocks and the
ranges; they are taken many at once (``clock = max(clock, ready) + cum[begin +
m] - cum[begin]``). This is what makes one process (128K steps) cheap; it is the
same simulation, not a special case.

Durations are integers and the default latency 0.5 is a binary fraction, so all
clock arithmetic is exact in float64 and the vectorised updates give the same
numbers as adding unit by unit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
Range = tuple[int, int, float]  # (begin, end, ready time) into the flat workload

MODELS = ("mp", "md", "pm")
MODEL_NAMES = {"mp": "message-passing", "md": "message-driven", "pm": "Progressive Messages"}
DEFAULT_UNITS = 128 * 1024
DEFAULT_LATENCY = 0.5
DEFAULT_THRESHOLDS = (10.0, 100.0, 1000.0)
DEFAULT_PROCESSES = tuple(2**i for i in range(15))  # 1 .. 16K
DEFAULT_SEED = 1
THRASH_FACTOR = 3  # a target must keep at least 3 thresholds of work to give any away

TargetChooser = Callable[[int], IntArray]  # count of sources -> their targets


def workload(units: int = DEFAULT_UNITS, seed: int = DEFAULT_SEED) -> FloatArray:
    """``units`` durations ``max(1, floor(|N(0,1)| * 10))``: positive integers, median 6."""
    if units < 1:
        raise ValueError(f"units must be >= 1, not {units}")
    rng = np.random.default_rng(seed)
    # Zeros become 1: redrawing them instead would move the median from 6 to 7.
    return np.maximum(np.floor(np.abs(rng.standard_normal(units)) * 10.0), 1.0)


def target_rng(seed: int, processes: int) -> np.random.Generator:
    """The stream of random targets for one process count: the same for every model
    and threshold (so PM and MD see the same choices), independent of the workload's."""
    return np.random.default_rng([seed, processes])


def draw_targets(rng: np.random.Generator, count: int, processes: int) -> IntArray:
    """``count`` uniformly random targets in ``[0, processes)``."""
    return rng.integers(0, processes, size=count, dtype=np.int64)


def split_count(n: int) -> int:
    """How many of a target's ``n`` queued units go to the source: the first half,
    rounded up (the thesis's ``(1+count py) div 2``)."""
    return (n + 1) // 2


def refuses(target_total: float, threshold: float) -> bool:
    """The thrashing check (FIX 1): no split when the target has less than three
    thresholds of work queued."""
    return target_total < THRASH_FACTOR * threshold


def block_bounds(units: int, processes: int) -> IntArray:
    """Boundaries of the initial contiguous, (nearly) equal blocks."""
    return (np.arange(processes + 1, dtype=np.int64) * units) // processes


@dataclass(frozen=True)
class Outcome:
    """One simulation run: the makespan, the speed-up and how many steps it took."""

    model: str
    processes: int
    threshold: float
    total_work: float
    makespan: float
    steps: int
    splits: int

    @property
    def speedup(self) -> float:
        return self.total_work / self.makespan if self.makespan > 0 else math.inf


class Simulation:
    """The state of one run (see the module docstring for the rules)."""

    def __init__(self, work: FloatArray, processes: int, model: str, threshold: float,
                 latency: float = DEFAULT_LATENCY, *, seed: int = DEFAULT_SEED,
                 chooser: TargetChooser | None = None,
                 bounds: Sequence[int] | IntArray | None = None):
        if model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, not {model!r}")
        if processes < 1:
            raise ValueError(f"processes must be >= 1, not {processes}")
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, not {threshold}")
        if latency < 0:
            raise ValueError(f"latency must be >= 0, not {latency}")
        self.work = np.asarray(work, dtype=np.float64)
        if self.work.size and not (self.work > 0).all():
            raise ValueError("every work unit must take a positive time")
        self.cum = np.concatenate(([0.0], np.cumsum(self.work)))
        self.processes = processes
        self.model = model
        self.threshold = float(threshold)
        self.latency = float(latency)
        if chooser is None:
            rng = target_rng(seed, processes)
            chooser = lambda count: draw_targets(rng, count, processes)  # noqa: E731
        self.chooser = chooser
        edges = (block_bounds(self.work.size, processes) if bounds is None
                 else np.asarray(bounds, dtype=np.int64))
        if edges.shape != (processes + 1,) or edges[0] != 0 or edges[-1] != self.work.size \
                or (np.diff(edges) < 0).any():
            raise ValueError("bounds must be processes+1 nondecreasing edges from 0 to units")
        self.begin: IntArray = edges[:-1].copy()
        self.end: IntArray = edges[1:].copy()
        self.ready: FloatArray = np.zeros(processes)
        self.clock: FloatArray = np.zeros(processes)
        self.pending: dict[int, deque[Range]] = {}
        self.pend_count: IntArray = np.zeros(processes, dtype=np.int64)
        self.pend_total: FloatArray = np.zeros(processes)
        self.steps = 0
        self.splits = 0

    # -- queries ------------------------------------------------------------------------

    def totals(self, ps: IntArray | None = None) -> FloatArray:
        """Queued work of the processes ``ps`` (all by default)."""
        if ps is None:
            return self.cum[self.end] - self.cum[self.begin] + self.pend_total
        return self.cum[self.end[ps]] - self.cum[self.begin[ps]] + self.pend_total[ps]

    def counts(self, ps: IntArray) -> IntArray:
        """Queued units of the processes ``ps``."""
        return self.end[ps] - self.begin[ps] + self.pend_count[ps]

    def busy(self) -> bool:
        """Whether any queue holds work (an empty current range means an empty queue)."""
        return bool((self.begin < self.end).any())

    def queue(self, p: int) -> list[float]:
        """The durations queued at ``p``, in order (for tests and debugging)."""
        return [float(d) for b, e, _ in self._ranges(p) for d in self.work[b:e]]

    def ready_times(self, p: int) -> list[float]:
        """The ready time of each unit queued at ``p``, in order."""
        return [r for b, e, r in self._ranges(p) for _ in range(e - b)]

    # -- the deques -----------------------------------------------------------------------

    def _ranges(self, p: int) -> list[Range]:
        first: list[Range] = []
        if self.begin[p] < self.end[p]:
            first.append((int(self.begin[p]), int(self.end[p]), float(self.ready[p])))
        return first + list(self.pending.get(p, ()))

    def _set_ranges(self, p: int, ranges: list[Range]) -> None:
        ranges = [r for r in ranges if r[0] < r[1]]
        if not ranges:
            self.begin[p] = self.end[p]
            self.pending.pop(p, None)
            self.pend_count[p] = 0
            self.pend_total[p] = 0.0
            return
        self.begin[p], self.end[p], self.ready[p] = ranges[0]
        self._set_pending(p, deque(ranges[1:]))

    def _set_pending(self, p: int, rest: deque[Range]) -> None:
        if rest:
            self.pending[p] = rest
        else:
            self.pending.pop(p, None)
        self.pend_count[p] = sum(e - b for b, e, _ in rest)
        # A sum over whole ranges, never a running balance, so no rounding drift.
        self.pend_total[p] = sum(float(self.cum[e] - self.cum[b]) for b, e, _ in rest)

    def _promote(self, ps: IntArray) -> None:
        """Keep the invariant: a process whose current range ran out starts its next one."""
        for p in ps.tolist():
            rest = self.pending.get(p)
            if rest:
                self.begin[p], self.end[p], self.ready[p] = rest.popleft()
                self._set_pending(p, rest)

    # -- one step -------------------------------------------------------------------------

    def run_units(self) -> None:
        """Phase 1 of a step: every process completes the first unit of its queue."""
        a = np.flatnonzero(self.begin < self.end)
        b = self.begin[a]
        self.clock[a] = np.maximum(self.clock[a], self.ready[a]) + self.work[b]
        self.begin[a] = b + 1
        out = a[self.begin[a] == self.end[a]]
        self._promote(out[self.pend_count[out] > 0])

    def sources(self) -> IntArray:
        """The processes whose queued total is below the threshold."""
        return np.flatnonzero(self.totals() < self.threshold)

    def step(self) -> bool:
        """One step; False when every queue is empty after its units ran (then the
        step ends there: nobody is left to balance)."""
        self.run_units()
        self.steps += 1
        if not self.busy():
            return False
        sources = self.sources()
        if sources.size:
            targets = np.asarray(self.chooser(int(sources.size)), dtype=np.int64)
            keep = sources != targets  # x == y: the balance functions return at once
            self.balance(sources[keep], targets[keep])
        return True

    def quiet_steps(self) -> int:
        """How many next steps surely have no source and complete only units of the
        current ranges: those change nothing but clocks and ``begin``."""
        if not (self.begin < self.end).all():
            return 0  # an empty queue is below any positive threshold: a source
        span = self.end - self.begin
        # After s units p's total is cum[end] - cum[begin+s] + pend_total; it stays at
        # or above the threshold while cum[begin+s] <= cum[end] + pend_total - threshold.
        limit = self.cum[self.end] + self.pend_total - self.threshold
        last = np.searchsorted(self.cum, limit, side="right") - 1
        m = int(np.minimum(last - self.begin, span).min())
        # Confirm with exactly the expression step() uses (float noise in `limit`).
        while m > 0 and (self.cum[self.end] - self.cum[self.begin + m] + self.pend_total
                         < self.threshold).any():
            m -= 1
        return max(m, 0)

    def advance(self, m: int) -> None:
        """Take ``m`` quiet steps at once (see `quiet_steps`)."""
        b = self.begin
        self.clock = np.maximum(self.clock, self.ready) + (self.cum[b + m] - self.cum[b])
        self.begin = b + m
        out = np.flatnonzero((self.begin == self.end) & (self.pend_count > 0))
        self._promote(out)
        self.steps += m

    def run(self) -> Outcome:
        """Steps until every queue is empty."""
        while self.busy():
            m = self.quiet_steps()
            if m > 0:
                self.advance(m)
            if not self.step():
                break
        return Outcome(self.model, self.processes, self.threshold, float(self.cum[-1]),
                       float(self.clock.max()), self.steps, self.splits)

    # -- balancing --------------------------------------------------------------------------

    def balance(self, xs: IntArray, ys: IntArray) -> None:
        """Balance the pairs ``(xs[i], ys[i])`` in order (no ``x == y`` pairs), in rounds
        of pairs that share no process with an earlier remaining pair."""
        while xs.size:
            idx = np.arange(xs.size, dtype=np.int64)
            first = np.full(self.processes, xs.size, dtype=np.int64)
            np.minimum.at(first, xs, idx)
            np.minimum.at(first, ys, idx)
            now = (first[xs] == idx) & (first[ys] == idx)
            self._balance_round(xs[now], ys[now])
            later = ~now
            xs, ys = xs[later], ys[later]

    def _balance_round(self, xs: IntArray, ys: IntArray) -> None:
        """The balance function on pairs that touch disjoint processes."""
        ok = ~(self.totals(ys) < THRASH_FACTOR * self.threshold)  # FIX 1 (see `refuses`)
        xs_ok, ys_ok = xs[ok], ys[ok]
        # FIX 4: when MP's targets handle the requests, from the clocks before latency.
        handled = (self._handle_times(ys_ok, self.clock[xs_ok]) if self.model == "mp"
                   else None)
        if self.model in ("mp", "md"):
            self.clock[xs] += self.latency
            self.clock[ys] += self.latency
        if xs_ok.size:
            when = self.clock[ys_ok]  # the target's clock after the balance function
            if handled is not None:  # MP: never earlier than that (MD's ready time)
                when = np.maximum(when, handled + self.latency)
            self._split(xs_ok, ys_ok, when)

    def _handle_times(self, ys: IntArray, sent: FloatArray) -> FloatArray:
        """FIX 4: when each target ``ys[i]`` handles a request sent at ``sent[i]``: at
        its clock if that is not earlier; otherwise at the end of the unit it is
        running at ``sent[i]`` (the first unit boundary at or after it, along its
        queue, each range starting no earlier than its ready time), or at ``sent[i]``
        itself if it is idle then (waiting for a ready time, or out of work). Reads
        the queues only: no unit is completed, no clock changes."""
        cy = self.clock[ys]
        handled = np.maximum(cy, sent)
        late = np.flatnonzero((cy < sent) & (self.begin[ys] < self.end[ys]))
        if not late.size:
            return handled
        p, limit = ys[late], sent[late]
        b, e = self.begin[p], self.end[p]
        start = np.maximum(cy[late], self.ready[p])  # the current range's first unit
        busy = start < limit  # otherwise idle at `limit`: handled on arrival
        j = np.clip(np.searchsorted(self.cum, limit - start + self.cum[b], side="left"),
                    b + 1, e)
        finish = start + (self.cum[j] - self.cum[b])
        inside = busy & (finish >= limit)
        handled[late[inside]] = finish[inside]
        # The current range ends before `limit`: on along the pending ranges.
        deep = np.flatnonzero(busy & ~inside & (self.pend_count[p] > 0))
        for i, t, lim in zip(late[deep].tolist(), finish[deep].tolist(),
                             limit[deep].tolist(), strict=True):
            handled[i] = self._handle_time_pending(int(ys[i]), t, lim)
        return handled

    def _handle_time_pending(self, y: int, t: float, limit: float) -> float:
        """`_handle_times` along ``y``'s pending ranges, from time ``t < limit`` (the
        end of its current range)."""
        for b, e, r in self.pending[y]:
            start = max(t, r)
            if start >= limit:
                return limit  # idle at `limit`, waiting for this range
            j = int(np.searchsorted(self.cum, limit - start + self.cum[b], side="left"))
            j = min(max(j, b + 1), e)
            t = start + float(self.cum[j] - self.cum[b])
            if t >= limit:
                return t
        return limit  # out of work at `limit`

    def _split(self, xs: IntArray, ys: IntArray, t: FloatArray) -> None:
        """Accepted pairs (disjoint processes): the source gets the first
        ``(n + 1) // 2`` of the target's ``n`` units, ready no earlier than ``t``."""
        self.splits += int(xs.size)
        k = (self.counts(ys) + 1) // 2  # `split_count`, vectorised
        simple = (self.pend_count[ys] == 0) & (self.begin[xs] == self.end[xs])
        sx, sy, sk = xs[simple], ys[simple], k[simple]
        b = self.begin[sy]
        self.begin[sx] = b
        self.end[sx] = b + sk
        self.ready[sx] = np.maximum(self.ready[sy], t[simple])
        self.begin[sy] = b + sk
        rest = ~simple
        for x, y, n, when in zip(xs[rest].tolist(), ys[rest].tolist(), k[rest].tolist(),
                                 t[rest].tolist(), strict=True):
            self._split_one(x, y, n, when)

    def _split_one(self, x: int, y: int, k: int, when: float) -> None:
        portion: list[Range] = []
        kept: list[Range] = []
        need = k
        for b, e, r in self._ranges(y):
            take = min(need, e - b)
            if take:
                portion.append((b, b + take, max(r, when)))  # FIX 3: ready times
            if take < e - b:
                kept.append((b + take, e, r))
            need -= take
        self._set_ranges(y, kept)
        self._set_ranges(x, self._ranges(x) + portion)


def simulate(work: FloatArray, processes: int, model: str, threshold: float,
             latency: float = DEFAULT_LATENCY, seed: int = DEFAULT_SEED) -> Outcome:
    """One run with the default stream of random targets for ``(seed, processes)``."""
    return Simulation(work, processes, model, threshold, latency, seed=seed).run()


__all__ = [
    "DEFAULT_LATENCY", "DEFAULT_PROCESSES", "DEFAULT_SEED", "DEFAULT_THRESHOLDS",
    "DEFAULT_UNITS", "MODELS", "MODEL_NAMES", "Outcome", "Simulation", "block_bounds",
    "draw_targets", "refuses", "simulate", "split_count", "target_rng", "workload",
]
