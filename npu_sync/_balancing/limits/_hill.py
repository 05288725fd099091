"""Hill climbing: find how many tasks a worker should have in flight from its throughput.

``max_concurrent`` must otherwise be guessed per worker: too low leaves an NPU idle
between tasks, too high queues tasks inside the worker, where the pool can no longer
send them elsewhere and every task waits longer. With a limit, the configured
``max_concurrent`` becomes a ceiling and the worker's capacity is the limit's
:attr:`~HillClimbingLimit.current` value (see :meth:`npu_sync._worker.Worker.set_limit`).

Why this algorithm. The candidates were loss-based AIMD (grow by one per answer, cut
by 10 % on a drop), Vegas (estimate the worker's queue from the smallest RTT seen)
and Netflix's gradient2 (shrink when an answer takes more than 1.5 times a long-term
average RTT). An NPU worker under too much load rarely drops a task, it queues it:
AIMD then grows to the ceiling unless a latency threshold is configured, the guess we
want to remove. Gradient2 was simulated against a worker with 8 parallel slots and
32 callers that keep it busy (the pool's situation): its long-term average follows
the RTT as the queue grows, so the limit never stops growing and reaches the ceiling
within a thousand answers. Vegas needs the no-load RTT, which a busy worker never
shows: it must be probed by draining the worker now and then, and it drifts as models
and inputs change. AIMD and a gradient2-style limit are offered all the same
(:mod:`._aimd`, :mod:`._gradient2`), for workers this heuristic misreads.

What does not drift is the shape of a worker's throughput: it grows with concurrency
until the NPU (or the CPU) is busy, then stays flat while the RTT grows. By Little's
law a worker with ``n`` tasks in flight answering in ``rtt`` seconds completes
``n/rtt`` tasks a second, so every answer measures the throughput at the concurrency
it was sent at (the lease's ``in_flight``), without a clock. The limit hill-climbs
on it, like .NET's thread pool: it measures a *round* (at least 16 answers, and
twice the limit, once the answers to tasks sent before its last move have gone by)
at its current value, moves one step, measures again, and keeps the move if
throughput grew by at least half of what a linear gain would give (``new/old``
times), otherwise steps back. It climbs in steps of a quarter of itself while
throughput keeps scaling, so reaching 64 takes about twenty rounds; when such a
step gains too little it goes on from the last good value one at a time, since the
knee may lie inside the step. If its first step up gains nothing, the knee is below
the start: it steps down until a step loses throughput, then goes back one. What it
settles on is the *knee* (:attr:`~HillClimbingLimit.limit`).

Once settled the worker gets the knee plus a *headroom* of ``ceil(sqrt(knee))``
(11 for a knee of 8), as Envoy's adaptive concurrency filter and Netflix's gradient2
add a queue size on top of the limit they measure. The measure cannot see the gap
between a slot freeing at the worker and the next task reaching it (the answer's
transfer and parsing, waking the caller that waits, sending): at the knee the next
task waits in the pool, not at the worker, and each slot idles for that gap at every
turnover. A few tasks queued at the worker fill it. Measured with
``benchmarks/test_uneven.py`` (3 workers of 8 slots at 20 ms, 32 callers), the bare
knee settled at 8 and reached 0.99 of the throughput of the best fixed
``max_concurrent`` (12 or 16) on a quiet machine, 0.94 on a loaded one; with the
headroom it holds at 11 or 12 and, over interleaved rounds, reaches 0.996 of it with
a p99 0.96 times the best's. On 2 workers of 16 slots with 64 callers, where every
fixed value is reached, it holds at 20-24: 0.993 of the best fixed value's throughput
at 0.99-1.01 times its p99 (run-to-run noise), where the default of 8 gets half the
throughput (``docs/benchmarks.md``). The climb and the descent stay bare, so they
measure the knee and not the queue.

It holds for a few rounds, then probes, up and down in turn. A probe up goes one step
up, headroom included, measured over two rounds; a gain is believed when the next
probe up gains too (noise wins one now and then, and a knee that only moved up would
ratchet toward the ceiling): the worker can do more, maybe past where padded levels
can tell (they fill the slots either way), so it searches bare again from the level
measured; if its first step up gains nothing, the gains proved the probe's knee and no
more, and it holds there (descending from the padded level one at a time would stop
wherever noise first shows a loss, and keep part of the headroom in the knee). A probe
down measures the knee one step down, bare, and tells both ways: a loss under half the
linear one means the knee was past the slots, so it goes on down; a loss over twice
the linear one, twice running, means the knee is below the slots (the headroom did the
work), so it climbs bare. A knee whose step down lost is probed down only on every
eighth turn, since a bare round under the knee costs throughput. It also probes down
at once when the held throughput fell by a tenth (the worker lost capacity, or got
slower), judged on the whole period held, not on one round (rounds of 16 answers are
too noisy on a busy machine); the fallen throughput is the new reference, whatever the
probe finds, and a loss of that first step does not mark the knee as one whose step
down lost (it was judged against a period that still counted answers from before the
fall). A *dropped* attempt (429, 503, a timeout) cuts the limit in force by
``backoff`` (10 %) at once, headroom included, since the worker said plainly it is
overloaded: it holds at the lowest knee whose level with its headroom reaches the cut
(11 becomes 6 + 3), the headroom trimmed to the cut while it holds there; during a
probe up from hold the cut is taken from the level held before the probe, never from
the probe's. Answers sent while the worker had fewer tasks than the knee (the pool had
no more to give it) say nothing about more load, and answers sent above the limit in
force (before a move down or a reset) describe a level left behind: neither is
counted. A ceiling at or under the start (``max_concurrent`` of 4 or less) is measured
down from, like a first step up that gains nothing.

Against a simulated worker of ``C`` parallel slots kept busy by more callers than the
limit (``tests/test_limits.py``) the knee settles at ``C`` or ``C + 1``, from above
and from below, and follows a worker that loses half its slots; when tasks take a
couple of milliseconds to reach the worker, the headroom keeps its throughput within
1 % of a fixed limit of twice its slots, where the bare knee loses 2-3 %. A real pool
also sends answers below the knee, which are not counted, so rounds take longer
there.

A limit of its design: a worker whose capacity swings faster than it measures (slots
going 16 <-> 32 every 200 answers, when a probe up takes twice 64 answers and a hold
four times) is misread, a rise in slots counted as a probe's or a climb's gain, and
its knee ratchets to the ceiling; it follows swings slower than a few of its periods.

How it is built. The answers are counted by a :class:`~._window.RoundWindow` (a
round, and the turnover skipped after each move) apart from the algorithm, which sees
one :class:`~._window.WindowSummary` per round. The algorithm is a few explicit
phases, each a small class with its own fields and a ``next(summary)`` that returns
the phase to go on with: :class:`Starting`, :class:`Climbing` (a bare search up),
:class:`ProbingUp` (one step up from hold, headroom included), :class:`ProbingDown`
(one bare step down) and :class:`Holding`; what outlives a phase (the throughput
settled at, which way the next probe goes, the last probes' verdicts) is a
:class:`Memory`, and a drop's cut a :class:`Cut`.

Events for the pool to emit once it uses a limit: ``worker.limit_changed`` (worker id,
old and new capacity) when :meth:`HillClimbingLimit.on_sample` moves :attr:`current`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from npu_sync._balancing.limits._window import RoundWindow, WindowSummary

_FALL = 0.1  # the share of throughput lost at a held knee that makes it probe down
_RECHECK = 8  # a confirmed knee probes down on every this many turns down


def square_root_headroom(knee: int) -> int:
    """``ceil(sqrt(knee))`` tasks on top of a knee of ``knee`` (0 for a knee below 1):
    3 for 8, 8 for 64; the queue size Envoy's and Netflix's gradient limits add."""
    return math.isqrt(knee - 1) + 1 if knee > 0 else 0


@dataclass(frozen=True, slots=True)
class Cut:
    """A drop's cut: while it holds at ``knee``, the worker gets at most ``level``."""

    knee: int
    level: int


class Memory:
    """What outlives a phase. Not thread-safe: its limit's caller serialises.

    ``settled`` is the throughput where the limit holds, measured at ``settled_knee``;
    ``down_next`` says the next probe from hold goes down, ``down_turns`` counts turns
    down, and ``confirmed`` is the knee a step down from which last lost throughput
    (probed down again only every eighth turn). ``gained``: the last probe up from hold
    gained; ``short``: the last probe down lost more than twice the linear loss.
    """

    __slots__ = (
        "confirmed",
        "down_next",
        "down_turns",
        "gained",
        "settled",
        "settled_knee",
        "short",
    )

    def __init__(self) -> None:
        self.settled: float | None = None
        self.settled_knee = 0
        self.down_next = False
        self.down_turns = 0
        self.confirmed = 0
        self.gained = False
        self.short = False


class Phase:
    """What the limit is doing at a knee of :attr:`knee`: one of the classes below."""

    __slots__ = ("knee",)

    mode: ClassVar[str]
    padded: bool = False  # whether the headroom is on top of the knee
    # A round's answers: this many times max(min_round, twice the limit in force).
    round_factor: ClassVar[int] = 1

    def __init__(self, knee: int) -> None:
        self.knee = knee

    @property
    def throughput(self) -> float | None:
        """What this phase compares against (for ``stats()``)."""
        return None

    def next(self, summary: WindowSummary, limit: HillClimbingLimit) -> Phase:
        """The phase to go on with after a round measured ``summary``: ``self`` to stay."""
        raise NotImplementedError

    def clamp(self, ceiling: int) -> None:
        """A new ceiling, under which this phase goes on."""


class Starting(Phase):
    """At the initial knee, not yet measured: the first round starts a climb."""

    __slots__ = ()
    mode = "start"

    def next(self, summary: WindowSummary, limit: HillClimbingLimit) -> Phase:
        return limit.climb(self.knee, summary.throughput, first=True)


class _Probe(Phase):
    """A knee measured against ``previous``'s throughput ``before``."""

    __slots__ = ("before", "previous")

    def __init__(self, knee: int, previous: int, before: float) -> None:
        super().__init__(knee)
        self.previous = previous
        self.before = before

    @property
    def throughput(self) -> float | None:
        return self.before

    def clamp(self, ceiling: int) -> None:
        self.previous = min(self.previous, ceiling)

    def gained(self, throughput: float) -> bool:
        """At least half what linear scaling (``knee / previous`` times) would give."""
        return throughput >= self.before * (1 + 0.5 * (self.knee / self.previous - 1))


class Climbing(_Probe):
    """A bare search up, a step at a time: a quarter of the knee while throughput scales,
    one (``fine``) once such a step overshot. ``first``: the climb's first step, whose
    loss means the knee lies below where it started; ``probe_knee``: the knee of the
    probe up whose two gains started this climb (0: none)."""

    __slots__ = ("fine", "first", "probe_knee")
    mode = "up"

    def __init__(
        self,
        knee: int,
        previous: int,
        before: float,
        *,
        first: bool,
        fine: bool = False,
        probe_knee: int = 0,
    ) -> None:
        super().__init__(knee, previous, before)
        self.first = first
        self.fine = fine
        self.probe_knee = probe_knee

    def next(self, summary: WindowSummary, limit: HillClimbingLimit) -> Phase:
        throughput, previous, before = summary.throughput, self.previous, self.before
        if self.gained(throughput):
            return limit.climb(self.knee, throughput, first=False, fine=self.fine)
        limit.memory.gained = False
        if self.probe_knee:
            # Two padded gains, and a step past the padded level gains nothing: the
            # gains proved the probe's knee, no more. Descending one at a time from the
            # padded level would stop wherever noise first shows a loss, and keep part
            # of the headroom in the knee each time.
            return limit.hold(self.probe_knee, before)
        if self.first and previous > 1:
            # The knee is below the start: measure one under it, against it.
            return ProbingDown(limit.clamped(previous - 1), previous, before)
        if self.knee - previous > 1:
            # A step of a quarter overshot the knee, which may lie inside it: go on
            # from the last good level one at a time.
            return Climbing(
                limit.clamped(previous + 1), previous, before, first=self.first, fine=True
            )
        return limit.hold(previous, before)


class ProbingUp(_Probe):
    """One step up from a padded hold, headroom included, over rounds twice as long (a
    round is too noisy to move a settled knee on). A gain is believed when the next
    probe up gains too: noise wins one now and then, and a knee that only moved up
    would ratchet toward the ceiling."""

    __slots__ = ()
    mode = "up"
    padded = True
    round_factor = 2

    def next(self, summary: WindowSummary, limit: HillClimbingLimit) -> Phase:
        memory = limit.memory
        if not self.gained(summary.throughput):
            memory.gained = False
            return limit.hold(self.previous, self.before)
        if not memory.gained:
            # Noise does that now and then: go back, and believe it when the next probe
            # up gains too.
            memory.gained = True
            return limit.hold(self.previous, self.before)
        # Twice: the worker can do more, and its knee may now lie past the padded level
        # (slots regained, a ceiling raised). Probes of padded levels would stop once
        # knee plus headroom reach the slots, so search bare from the level measured:
        # climb, or, if a step up gains nothing, hold at the probe's knee.
        memory.gained = False
        phase = limit.climb(limit.current, summary.throughput, first=True)
        if isinstance(phase, Climbing):
            phase.probe_knee = self.knee
        return phase


class ProbingDown(_Probe):
    """One bare step down. A loss under half the linear one means the knee was past
    the worker's slots: go on down. A loss over twice the linear one, twice running,
    means the knee is below them (the headroom did the work): climb bare. ``fall``:
    started by a fall in held throughput, whose loss says nothing of the knee."""

    __slots__ = ("fall",)
    mode = "down"

    def __init__(self, knee: int, previous: int, before: float, *, fall: bool = False) -> None:
        super().__init__(knee, previous, before)
        self.fall = fall

    def next(self, summary: WindowSummary, limit: HillClimbingLimit) -> Phase:
        memory = limit.memory
        throughput, knee, previous, before = (
            summary.throughput,
            self.knee,
            self.previous,
            self.before,
        )
        share = knee / previous
        if throughput >= before * (1 - 0.5 * (1 - share)):
            memory.gained = False
            if knee > 1:
                return ProbingDown(limit.clamped(knee - 1), knee, throughput)
            memory.confirmed = knee
            return limit.hold(knee, throughput)
        heavy = throughput < before * (1 - 2 * (1 - share))
        if heavy and memory.short:
            # Lost more than twice the linear loss, twice running: the level left
            # (headroom and all, from hold) ran well past what its knee alone reaches,
            # so the knee lies below the worker's slots, where probes of padded levels
            # cannot see it (they fill the slots either way). Climb bare from here.
            memory.short = False
            return limit.climb(knee, throughput, first=False)
        # Once may be noise: back to hold, and probe down again next time.
        memory.short = heavy
        # A probe down a fall started is judged against a period that may still count
        # answers from before the fall: its loss says nothing of the knee.
        memory.confirmed = 0 if heavy or self.fall else previous
        return limit.hold(previous, before)


class Holding(Phase):
    """At a settled knee (``padded``: headroom on top) for ``hold_rounds`` rounds, the
    period's answers added up; then a probe, down and up in turn, or down at once
    when the period's throughput fell by a tenth against the settled one."""

    __slots__ = ("_throughput", "held", "padded", "period_in_flight", "period_rtt")
    mode = "hold"

    def __init__(self, knee: int, throughput: float | None, *, padded: bool = True) -> None:
        super().__init__(knee)
        self.padded = padded
        self._throughput = throughput
        self.held = 0
        self.period_in_flight = 0
        self.period_rtt = 0.0

    @property
    def throughput(self) -> float | None:
        return self._throughput

    def next(self, summary: WindowSummary, limit: HillClimbingLimit) -> Phase:
        self.held += 1
        self.period_in_flight += summary.sum_in_flight
        self.period_rtt += summary.sum_rtt
        self._throughput = summary.throughput
        if self.held < limit.hold_rounds:
            return self
        # One round is 16 answers or so, too few to tell a loss from noise on a busy
        # machine; the period's are several times more.
        period = self.period_in_flight / self.period_rtt
        memory, knee = limit.memory, self.knee
        settled = memory.settled if memory.settled_knee == knee else None
        if settled is not None and period < settled * (1 - _FALL) and knee > 1:
            # The fall is the new normal whatever the probe down finds: judged against
            # the old throughput, every later period would fall again, and the limit
            # would alternate hold and probe down for good.
            memory.settled = period
            return ProbingDown(limit.clamped(knee - 1), knee, period, fall=True)
        memory.settled = period if settled is None else (settled + period) / 2
        memory.settled_knee = knee
        # Probes alternate up and down. Noise keeps a probe up now and then, and a knee
        # that only ever probed up would ratchet toward the ceiling; a bare probe down
        # is kept when it loses less than half the linear loss, so a knee past the
        # slots comes back. A bare round under the knee costs throughput: a knee whose
        # step down lost already is probed down only now and then (its worker may
        # have slowly lost slots).
        down = memory.down_next
        memory.down_next = not down
        if down:
            memory.down_turns += 1
            down = knee != memory.confirmed or memory.down_turns % _RECHECK == 0
        if down and knee > 1:
            return ProbingDown(limit.clamped(knee - 1), knee, period)
        if not down and (
            limit.level(knee + 1, True) > limit.current
            or (not self.padded and knee < limit.ceiling)
        ):
            up = limit.clamped(knee + 1)
            if self.padded:
                return ProbingUp(up, knee, period)
            return Climbing(up, knee, period, first=False)
        return limit.hold(knee, period, padded=self.padded)


class HillClimbingLimit:
    """Find the concurrency past which a worker's throughput stops growing.

    :attr:`limit` is that knee as measured; :attr:`current`, what the worker may have
    in flight, adds the headroom once the knee is settled. Not thread-safe: the pool
    calls it under its selection lock.

    Args:
        ceiling: the most the limit may reach (the worker's ``max_concurrent``).
        initial: where the limit starts; at most ``ceiling``. From there it first
            climbs, or, if one step up gains nothing, descends.
        hold_rounds: rounds held at a settled value between probes.
        min_round: the fewest answers a measurement takes.
        backoff: the factor applied to the limit on a dropped attempt.
        headroom: tasks allowed on top of the knee once settled, given the knee;
            ``lambda knee: 0`` keeps a worker at its knee.

    Raises:
        ValueError: a ceiling, ``hold_rounds`` or ``min_round`` below 1, or a
            ``backoff`` outside (0, 1).
    """

    __slots__ = (
        "_current_value",
        "_cut",
        "_headroom",
        "_phase",
        "_start",
        "_window",
        "backoff",
        "ceiling",
        "drops",
        "hold_rounds",
        "initial",
        "memory",
        "min_round",
        "samples",
    )

    algorithm: ClassVar[str] = "hill-climbing"

    def __init__(
        self,
        ceiling: int,
        *,
        initial: int = 4,
        hold_rounds: int = 4,
        min_round: int = 16,
        backoff: float = 0.9,
        headroom: Callable[[int], int] = square_root_headroom,
    ) -> None:
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling!r}")
        if hold_rounds < 1 or min_round < 1:
            raise ValueError(
                f"hold_rounds and min_round must be >= 1, got hold_rounds={hold_rounds!r}, "
                f"min_round={min_round!r}"
            )
        if not 0 < backoff < 1:
            raise ValueError(f"backoff must be in (0, 1), got {backoff!r}")
        self.ceiling = ceiling
        self._start = initial
        self.initial = max(1, min(initial, ceiling))
        self.hold_rounds = hold_rounds
        self.min_round = min_round
        self.backoff = backoff
        self._headroom = headroom
        self._window = RoundWindow()
        self.samples = 0
        self.drops = 0
        self.reset()

    @property
    def limit(self) -> int:
        """The knee as measured (without the headroom)."""
        return self._phase.knee

    @property
    def phase(self) -> Phase:
        """What the limit is doing now."""
        return self._phase

    @property
    def current(self) -> int:
        """The worker's capacity: the knee, plus the headroom once settled."""
        return self._current_value

    def on_sample(self, rtt: float, in_flight: int, dropped: bool) -> int:
        """Count one attempt.

        Call for attempts whose duration says something about the worker's load: a
        success (``dropped`` False) and an overload answer or a timeout (``dropped``
        True); not for rejected tasks or attempts the caller cut short.

        Args:
            rtt: the attempt's duration in seconds.
            in_flight: tasks in flight on the worker when the attempt started, itself
                included (:attr:`Lease.in_flight <npu_sync._admission.Lease.in_flight>`).
            dropped: the worker turned the attempt away for overload.

        Returns:
            :attr:`current`.
        """
        if dropped:
            self.drops += 1
            self._drop()
            return self.current
        # Below the knee the worker was app-limited (the pool had no more to give it):
        # that says nothing about more load. The headroom need not be full. Above the
        # limit in force the task was sent before a move down (or a reset): it describes
        # a level left behind. An infinite duration is a clock gone wrong.
        phase, current = self._phase, self._current_value
        if not phase.knee <= in_flight <= current or not 0 < rtt < math.inf:
            return current
        self.samples += 1
        needed = max(self.min_round, 2 * current) * phase.round_factor
        summary = self._window.offer(rtt, in_flight, needed)
        if summary is None:
            return current
        self._go(phase.next(summary, self))
        return self._current_value

    def reset(self) -> None:
        """Start again from the initial limit (a worker back in service, a new address)."""
        self._phase: Phase = Starting(self.initial)
        self._cut: Cut | None = None
        self._current_value = self.initial
        self.memory = Memory()
        # The worker's queue is not yet what the limit makes it.
        self._window.skip(self.initial)

    def set_ceiling(self, ceiling: int) -> None:
        """Apply a new ceiling (a reload changed ``max_concurrent``): the limit, and the
        initial one a :meth:`reset` returns to, stay within it.

        Raises:
            ValueError: ``ceiling`` is below 1.
        """
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling!r}")
        phase = self._phase
        before = self.current
        self.ceiling = ceiling
        self.initial = max(1, min(self._start, ceiling))
        self._current_value = self._current(phase)
        phase.clamp(ceiling)
        if phase.knee > ceiling:
            # The knee no longer fits: hold at the ceiling (or keep starting from it) and
            # measure it afresh.
            if isinstance(phase, Starting):
                self._go(Starting(ceiling))
            else:
                self._go(Holding(ceiling, None, padded=phase.padded))
        elif self.current != before:
            # Only the headroom changed: the round under way measured another level.
            self._window.skip(max(before, self.current))

    def stats(self) -> dict[str, float | int | str | None]:
        """``{"algorithm", "limit", "knee", "headroom", "ceiling", "mode", "throughput",
        "samples", "drops"}``: ``hill-climbing``, the limit in force (:attr:`current`),
        the knee it found and the headroom on top, what it is doing (``start``, ``up``,
        ``down``, ``hold``), the last round's throughput in tasks a second, and the
        running totals."""
        current = self.current
        phase = self._phase
        return {
            "algorithm": self.algorithm,
            "limit": current,
            "knee": phase.knee,
            "headroom": current - phase.knee,
            "ceiling": self.ceiling,
            "mode": phase.mode,
            "throughput": phase.throughput,
            "samples": self.samples,
            "drops": self.drops,
        }

    # -- what the phases ask of the limit ----------------------------------------------

    def level(self, knee: int, padded: bool) -> int:
        """What a knee of ``knee`` gives the worker (with the headroom when ``padded``)."""
        if not padded:
            return knee
        return max(1, min(self.ceiling, knee + self._headroom(knee)))

    def clamped(self, knee: int) -> int:
        """``knee`` within ``[1, ceiling]``."""
        return max(1, min(self.ceiling, knee))

    def climb(self, knee: int, throughput: float, *, first: bool, fine: bool = False) -> Phase:
        """A bare step up from ``knee``, measured at ``throughput``; at the ceiling, a
        step down when it is the climb's ``first`` (the knee may lie below), else hold."""
        self._cut = None  # the worker has room again: a drop's cut no longer holds
        if knee >= self.ceiling:
            if first and knee > 1:
                return ProbingDown(self.clamped(knee - 1), knee, throughput)
            return self.hold(knee, throughput)
        step = 1 if fine else max(1, knee // 4)
        return Climbing(self.clamped(knee + step), knee, throughput, first=first, fine=fine)

    def hold(self, knee: int, throughput: float | None, *, padded: bool = True) -> Holding:
        """Hold at ``knee`` (headroom on top when ``padded``)."""
        return Holding(self.clamped(knee), throughput, padded=padded)

    # -- internals ----------------------------------------------------------------------

    def _current(self, phase: Phase, *, holding: bool | None = None) -> int:
        """What ``phase`` gives the worker; a drop's cut bounds it while it holds at the
        cut's knee (``holding``: whether to count it as holding, by default its own)."""
        level = self.level(phase.knee, phase.padded)
        cut = self._cut
        if holding is None:
            holding = isinstance(phase, Holding)
        if cut is not None and holding and phase.knee == cut.knee:
            return min(level, cut.level)
        return level

    def _go(self, phase: Phase) -> None:
        """Go on with ``phase``; a new one skips a turnover of answers, whose tasks were
        sent at the old level."""
        old = self._phase
        if phase is old:
            return
        # The new level as the old phase's cut rule saw it.
        skip = max(self._current(old), self._current(phase, holding=isinstance(old, Holding)))
        self._phase = phase
        self._current_value = self._current(phase)
        self._window.skip(skip)

    def _drop(self) -> None:
        """A dropped attempt: the worker said what it can take. Hold at the smallest knee
        whose level, headroom included, reaches the cut, held to the cut while it holds
        there: padding a bare cut would leave the worker more than before the drop (11
        cut to 9, plus 3). During a probe up from hold the cut is taken from the level
        held before the probe: the probe's extra task is what the worker refused, and 10 %
        off the probe's level can leave more than was held (4 cut to 3 after holding 2)."""
        phase = self._phase
        level = self.current
        if isinstance(phase, ProbingUp):
            held = self.level(phase.previous, True)
            cut = self._cut
            if cut is not None and phase.previous == cut.knee:
                held = min(held, cut.level)
            level = min(level, held)
        cut_level = max(1, int(level * self.backoff))
        knee = cut_level
        while knee > 1 and self.level(knee - 1, True) >= cut_level:
            knee -= 1
        self._go(self.hold(knee, None))
        self._cut = Cut(self._phase.knee, cut_level)
        self._current_value = self._current(self._phase)
