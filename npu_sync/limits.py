"""Adaptive concurrency: find how many tasks a worker should have in flight from its answers.

``max_concurrent`` must otherwise be guessed per worker: too low leaves an NPU idle
between tasks, too high queues tasks inside the worker, where the pool can no longer
send them elsewhere and every task waits longer. With a limit, the configured
``max_concurrent`` becomes a ceiling and the worker's capacity is the limit's
:attr:`~HillClimbingLimit.current` value (see :meth:`npu_sync.worker.Worker.set_limit`).

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
and inputs change.

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

Events for the pool to emit once it uses a limit: ``worker.limit_changed`` (worker id,
old and new capacity) when :meth:`HillClimbingLimit.on_sample` moves :attr:`current`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol


class ConcurrencyLimit(Protocol):
    """What a worker needs of an adaptive limit."""

    @property
    def current(self) -> int:
        """Tasks the worker may have in flight now: an int in ``[1, ceiling]``."""
        ...

    def on_sample(self, rtt: float, in_flight: int, dropped: bool) -> int:
        """Count one attempt; returns :attr:`current`."""
        ...

    def reset(self) -> None:
        """Start again from the initial limit (a worker back in service)."""
        ...

    def stats(self) -> dict[str, float | int | str | None]:
        """A JSON-serialisable view."""
        ...


def square_root_headroom(knee: int) -> int:
    """``ceil(sqrt(knee))`` tasks on top of a knee of ``knee`` (0 for a knee below 1):
    3 for 8, 8 for 64; the queue size Envoy's and Netflix's gradient limits add."""
    return math.isqrt(knee - 1) + 1 if knee > 0 else 0


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
    """

    __slots__ = (
        "_backoff",
        "_cap",
        "_cap_knee",
        "_confirmed",
        "_down_next",
        "_down_turns",
        "_fall",
        "_fine",
        "_first_climb",
        "_gained",
        "_headroom",
        "_held",
        "_hold_rounds",
        "_min_round",
        "_mode",
        "_n",
        "_padded",
        "_period_in_flight",
        "_period_rtt",
        "_previous",
        "_probe_knee",
        "_settled",
        "_settled_knee",
        "_short",
        "_skip",
        "_start",
        "_sum_in_flight",
        "_sum_rtt",
        "_throughput",
        "ceiling",
        "drops",
        "initial",
        "limit",
        "samples",
    )

    _FALL = 0.1  # the share of throughput lost at a held knee that makes it probe down
    _RECHECK = 8  # a confirmed knee probes down on every this many turns down

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
            raise ValueError("hold_rounds and min_round must be >= 1")
        if not 0 < backoff < 1:
            raise ValueError(f"backoff must be in (0, 1), got {backoff!r}")
        self.ceiling = ceiling
        self._start = initial
        self.initial = max(1, min(initial, ceiling))
        self._hold_rounds = hold_rounds
        self._min_round = min_round
        self._backoff = backoff
        self._headroom = headroom
        self.samples = 0
        self.drops = 0
        self.reset()

    @property
    def current(self) -> int:
        """The worker's capacity: the knee, plus the headroom once settled."""
        level = self._level(self.limit, self._padded)
        if self.limit == self._cap_knee and self._mode == "hold":
            return min(level, self._cap)
        return level

    def on_sample(self, rtt: float, in_flight: int, dropped: bool) -> int:
        """Count one attempt.

        Call for attempts whose duration says something about the worker's load: a
        success (``dropped`` False) and an overload answer or a timeout (``dropped``
        True); not for rejected tasks or attempts the caller cut short.

        Args:
            rtt: the attempt's duration in seconds.
            in_flight: tasks in flight on the worker when the attempt started, itself
                included (:attr:`Lease.in_flight <npu_sync.admission.Lease.in_flight>`).
            dropped: the worker turned the attempt away for overload.

        Returns:
            :attr:`current`.
        """
        if dropped:
            self.drops += 1
            self._cut()
            return self.current
        # Below the knee the worker was app-limited (the pool had no more to give it):
        # that says nothing about more load. The headroom need not be full. Above the
        # limit in force the task was sent before a move down (or a reset): it describes
        # a level left behind. An infinite duration is a clock gone wrong.
        if not self.limit <= in_flight <= self.current or not 0 < rtt < math.inf:
            return self.current
        self.samples += 1
        if self._skip:
            self._skip -= 1
            return self.current
        self._n += 1
        self._sum_in_flight += in_flight
        self._sum_rtt += rtt
        needed = max(self._min_round, 2 * self.current)
        if self._padded and self._mode == "up":
            needed *= 2  # a probe from hold: a round is too noisy to move a settled knee on
        if self._n >= needed:
            self._decide(self._sum_in_flight / self._sum_rtt)
        return self.current

    def reset(self) -> None:
        """Start again from the initial limit (a worker back in service, a new address)."""
        self.limit = self.initial
        self._mode = "start"
        self._cap_knee = 0  # the knee a drop left, whose level stays within ``_cap``
        self._cap = 0
        self._padded = False
        self._previous = self.initial
        self._throughput: float | None = None
        self._held = 0
        self._period_in_flight = 0
        self._period_rtt = 0.0
        self._settled: float | None = None  # the throughput where it holds
        self._settled_knee = 0  # the knee that throughput was measured at
        self._first_climb = False
        self._fine = False
        self._down_next = False  # the next probe from hold goes down, not up
        self._down_turns = 0
        self._confirmed = 0  # the knee a step down from which last lost throughput
        self._fall = False  # the probe down under way was started by a fall in throughput
        self._probe_knee = 0  # the knee of the probe up whose two gains started a climb
        self._gained = False  # the last probe up from hold gained
        self._short = False  # the last probe down lost more than twice the linear loss
        self._skip = self.initial  # the worker's queue is not yet what the limit makes it
        self._clear()

    def set_ceiling(self, ceiling: int) -> None:
        """Apply a new ceiling (a reload changed ``max_concurrent``): the limit, and the
        initial one a :meth:`reset` returns to, stay within it.

        Raises:
            ValueError: ``ceiling`` is below 1.
        """
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling!r}")
        before = self.current
        self.ceiling = ceiling
        self.initial = max(1, min(self._start, ceiling))
        self._previous = min(self._previous, ceiling)
        if self.limit > ceiling:
            # The knee no longer fits: hold at the ceiling (or keep starting from it) and
            # measure it afresh.
            mode = "start" if self._mode == "start" else "hold"
            self._move(ceiling, mode, None, padded=self._padded)
        elif self.current != before:
            # Only the headroom changed: the round under way measured another level.
            self._skip = max(before, self.current)
            self._clear()

    def stats(self) -> dict[str, float | int | str | None]:
        """``{"limit", "knee", "headroom", "ceiling", "mode", "throughput", "samples",
        "drops"}``: the limit in force (:attr:`current`), the knee it found and the
        headroom on top, what it is doing (``start``, ``up``, ``down``, ``hold``), the
        last round's throughput in tasks a second, and the running totals."""
        current = self.current
        return {
            "limit": current,
            "knee": self.limit,
            "headroom": current - self.limit,
            "ceiling": self.ceiling,
            "mode": self._mode,
            "throughput": self._throughput,
            "samples": self.samples,
            "drops": self.drops,
        }

    # -- internals ----------------------------------------------------------------------

    def _level(self, knee: int, padded: bool) -> int:
        if not padded:
            return knee
        return max(1, min(self.ceiling, knee + self._headroom(knee)))

    def _decide(self, throughput: float) -> None:
        """A round at ``limit`` measured ``throughput``: keep, move on, or step back."""
        limit, previous, before, mode = self.limit, self._previous, self._throughput, self._mode
        if mode == "hold":
            self._hold(throughput)
        elif mode == "start" or before is None:
            self._climb(throughput, first=True)
        elif mode == "up":
            # Linear scaling would multiply throughput by limit / previous: keep the
            # step if at least half that gain showed.
            if throughput < before * (1 + 0.5 * (limit / previous - 1)):
                self._gained = False
                if self._probe_knee:
                    # Two padded gains, and a step past the padded level gains nothing:
                    # the gains proved the probe's knee, no more. Descending one at a
                    # time from the padded level would stop wherever noise first shows
                    # a loss, and keep part of the headroom in the knee each time.
                    self._move(self._probe_knee, "hold", before, padded=True)
                elif self._first_climb and previous > 1:
                    # The knee is below the start: measure one under it, against it.
                    self._move(previous - 1, "down", before, came_from=previous)
                elif limit - previous > 1 and not self._padded:
                    # A step of a quarter overshot the knee, which may lie inside it:
                    # go on from the last good level one at a time.
                    self._fine = True
                    self._move(previous + 1, "up", before, came_from=previous)
                else:
                    self._move(previous, "hold", before, padded=True)
            elif self._padded and not self._gained:
                # A probe from hold gained, headroom and all. Noise does that now and
                # then: go back, and believe it when the next probe up gains too.
                self._gained = True
                self._move(previous, "hold", before, padded=True)
            elif self._padded:
                # Twice: the worker can do more, and its knee may now lie past the
                # padded level (slots regained, a ceiling raised). Probes of padded
                # levels would stop once knee plus headroom reach the slots, so search
                # bare from the level measured: climb, or, if a step up gains nothing,
                # hold at the probe's knee.
                self._gained = False
                self.limit, self._padded = self.current, False
                self._climb(throughput, first=True)
                self._probe_knee = limit
            else:
                self._climb(throughput, first=False)
        elif throughput >= before * (1 - 0.5 * (1 - limit / previous)):  # down
            self._gained = False
            if limit > 1:
                self._move(limit - 1, "down", throughput)
            else:
                self._confirmed = limit
                self._move(limit, "hold", throughput, padded=True)
        elif throughput < before * (1 - 2 * (1 - limit / previous)) and self._short:
            # Lost more than twice the linear loss, twice running: the level left
            # (headroom and all, from hold) ran well past what its knee alone reaches,
            # so the knee lies below the worker's slots, where probes of padded levels
            # cannot see it (they fill the slots either way). Climb bare from here.
            self._short = False
            self._climb(throughput, first=False)
        else:
            # Once may be noise: back to hold, and probe down again next time.
            self._short = throughput < before * (1 - 2 * (1 - limit / previous))
            # A probe down a fall started is judged against a period that may still
            # count answers from before the fall: its loss says nothing of the knee.
            self._confirmed = 0 if self._short or self._fall else previous
            self._move(previous, "hold", before, padded=True)

    def _hold(self, throughput: float) -> None:
        """A round held: at the end of ``hold_rounds`` of them, probe down if the whole
        period's throughput fell by a tenth against the settled one, else probe up."""
        self._held += 1
        self._period_in_flight += self._sum_in_flight
        self._period_rtt += self._sum_rtt
        self._throughput = throughput
        if self._held < self._hold_rounds:
            self._clear()
            return
        # One round is 16 answers or so, too few to tell a loss from noise on a busy
        # machine; the period's are several times more.
        period = self._period_in_flight / self._period_rtt
        limit = self.limit
        settled = self._settled if self._settled_knee == limit else None
        if settled is not None and period < settled * (1 - self._FALL) and limit > 1:
            # The fall is the new normal whatever the probe down finds: judged against
            # the old throughput, every later period would fall again, and the limit
            # would alternate hold and probe down for good.
            self._settled = period
            self._move(limit - 1, "down", period)
            self._fall = True
            return
        self._settled = period if settled is None else (settled + period) / 2
        self._settled_knee = limit
        # Probes alternate up and down. Noise keeps a probe up now and then, and a knee
        # that only ever probed up would ratchet toward the ceiling; a bare probe down
        # is kept when it loses less than half the linear loss, so a knee past the
        # slots comes back. A bare round under the knee costs throughput: a knee whose
        # step down lost already is probed down only now and then (its worker may
        # have slowly lost slots).
        down, self._down_next = self._down_next, not self._down_next
        if down:
            self._down_turns += 1
            down = limit != self._confirmed or self._down_turns % self._RECHECK == 0
        if down and limit > 1:
            self._move(limit - 1, "down", period)
        elif not down and (
            self._level(limit + 1, True) > self.current
            or (not self._padded and limit < self.ceiling)
        ):
            self._first_climb = False
            self._move(limit + 1, "up", period, padded=self._padded)
        else:
            self._move(limit, "hold", period, padded=self._padded)

    def _climb(self, throughput: float, *, first: bool) -> None:
        self._first_climb = first
        self._cap_knee = 0  # the worker has room again: a drop's cut no longer holds
        limit = self.limit
        if limit >= self.ceiling:
            if first and limit > 1:
                # Started at the ceiling: the knee may lie below it.
                self._move(limit - 1, "down", throughput)
            else:
                self._move(limit, "hold", throughput, padded=True)
        else:
            self._move(limit + (1 if self._fine else max(1, limit // 4)), "up", throughput)

    def _cut(self) -> None:
        """A dropped attempt: the worker said what it can take. Hold at the smallest knee
        whose level, headroom included, reaches the cut, held to the cut while it holds
        there: padding a bare cut would leave the worker more than before the drop (11
        cut to 9, plus 3). During a probe up from hold the cut is taken from the level
        held before the probe: the probe's extra task is what the worker refused, and 10 %
        off the probe's level can leave more than was held (4 cut to 3 after holding 2)."""
        level = self.current
        if self._mode == "up" and self._padded:
            held = self._level(self._previous, True)
            if self._previous == self._cap_knee:
                held = min(held, self._cap)
            level = min(level, held)
        cut = max(1, int(level * self._backoff))
        knee = cut
        while knee > 1 and self._level(knee - 1, True) >= cut:
            knee -= 1
        self._move(knee, "hold", None, padded=True)
        self._cap, self._cap_knee = cut, knee

    def _move(
        self,
        limit: int,
        mode: str,
        throughput: float | None,
        came_from: int | None = None,
        *,
        padded: bool = False,
    ) -> None:
        """Go to a knee of ``limit`` (plus the headroom when ``padded``); ``throughput``
        is what the level compared against (the one ``came_from``, by default the
        current) measured."""
        before = self.current
        self._previous = self.limit if came_from is None else came_from
        self.limit = max(1, min(self.ceiling, limit))
        self._padded = padded
        # Answers to tasks sent before the move describe the old level: skip a turnover.
        self._skip = max(before, self.current)
        self._mode = mode
        self._throughput = throughput
        self._fall = False
        self._probe_knee = 0
        if mode == "hold":
            self._fine = False
            self._held = 0
            self._period_in_flight = 0
            self._period_rtt = 0.0
        self._clear()

    def _clear(self) -> None:
        self._n = 0
        self._sum_in_flight = 0
        self._sum_rtt = 0.0
