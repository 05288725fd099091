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
throughput keeps scaling, so reaching 64 takes about twenty rounds. If its first
step up gains nothing, the knee is below the start: it steps down until a step loses
throughput, then goes back one. After settling it holds for a few rounds and probes
one step up, so it sits at the knee or one above it; when the throughput it holds at
falls by a tenth (the worker lost capacity, or got slower), the next probe goes one
step down instead. Probing down costs a round at lower throughput, which is why it
is not done routinely. A *dropped* attempt (429, 503, a timeout) cuts the limit by
``backoff`` (10 %) at once, since the worker said plainly it is overloaded. Answers
sent while the worker had fewer tasks than the limit (the pool had no more to give
it) say nothing about more load and are not counted.

Against a simulated worker of ``C`` parallel slots kept busy by more callers than the
limit (``tests/test_limits.py``) it settles at ``C`` or ``C + 1``, from above and from
below, and follows a worker that loses half its slots. In a simulation of 32 callers
over 60 s (1, 2, 8, 16 and 64 slots, starting from 4) its throughput and p99 matched
those of a fixed limit of ``C`` within 0.1 %; against real workers it is to be
measured with ``benchmarks/test_uneven.py`` once the pool uses it. A real pool also
sends answers below the limit, which are not counted, so rounds take longer there.

Events for the pool to emit once it uses a limit: ``worker.limit_changed`` (worker id,
old and new capacity) when :meth:`HillClimbingLimit.on_sample` moves :attr:`current`.
"""

from __future__ import annotations

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


class HillClimbingLimit:
    """Find the concurrency past which a worker's throughput stops growing.

    Not thread-safe: the pool calls it under its selection lock.

    Args:
        ceiling: the most the limit may reach (the worker's ``max_concurrent``).
        initial: where the limit starts; at most ``ceiling``. From there it first
            climbs, or, if one step up gains nothing, descends.
        hold_rounds: rounds held at a settled value between probes.
        min_round: the fewest answers a measurement takes.
        backoff: the factor applied to the limit on a dropped attempt.
    """

    __slots__ = (
        "_backoff",
        "_first_climb",
        "_held",
        "_hold_rounds",
        "_min_round",
        "_mode",
        "_n",
        "_previous",
        "_settled",
        "_skip",
        "_sum_in_flight",
        "_sum_rtt",
        "_throughput",
        "ceiling",
        "drops",
        "initial",
        "limit",
        "samples",
    )

    _FALL = 0.1  # the share of throughput lost at a held limit that makes it probe down

    def __init__(
        self,
        ceiling: int,
        *,
        initial: int = 4,
        hold_rounds: int = 4,
        min_round: int = 16,
        backoff: float = 0.9,
    ) -> None:
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling!r}")
        if hold_rounds < 1 or min_round < 1:
            raise ValueError("hold_rounds and min_round must be >= 1")
        if not 0 < backoff < 1:
            raise ValueError(f"backoff must be in (0, 1), got {backoff!r}")
        self.ceiling = ceiling
        self.initial = max(1, min(initial, ceiling))
        self._hold_rounds = hold_rounds
        self._min_round = min_round
        self._backoff = backoff
        self.samples = 0
        self.drops = 0
        self.reset()

    @property
    def current(self) -> int:
        return self.limit

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
            self._move(int(self.limit * self._backoff), "hold", None)
            return self.limit
        if in_flight < self.limit or not rtt > 0:
            return self.limit  # app-limited: says nothing about more load
        self.samples += 1
        if self._skip:
            self._skip -= 1
            return self.limit
        self._n += 1
        self._sum_in_flight += in_flight
        self._sum_rtt += rtt
        if self._n >= max(self._min_round, 2 * self.limit):
            self._decide(self._sum_in_flight / self._sum_rtt)
        return self.limit

    def reset(self) -> None:
        """Start again from the initial limit (a worker back in service, a new address)."""
        self.limit = self.initial
        self._mode = "start"
        self._previous = self.initial
        self._throughput: float | None = None
        self._held = 0
        self._settled: float | None = None  # the throughput where it holds
        self._first_climb = False
        self._skip = self.initial  # the worker's queue is not yet what the limit makes it
        self._clear()

    def stats(self) -> dict[str, float | int | str | None]:
        """``{"limit", "ceiling", "mode", "throughput", "samples", "drops"}``: the
        limit, what it is doing (``start``, ``up``, ``down``, ``hold``), the last
        round's throughput in tasks a second, and the running totals."""
        return {
            "limit": self.limit,
            "ceiling": self.ceiling,
            "mode": self._mode,
            "throughput": self._throughput,
            "samples": self.samples,
            "drops": self.drops,
        }

    # -- internals ----------------------------------------------------------------------

    def _decide(self, throughput: float) -> None:
        """A round at ``limit`` measured ``throughput``: keep, move on, or step back."""
        limit, previous, before, mode = self.limit, self._previous, self._throughput, self._mode
        if mode == "start" or before is None:
            self._climb(throughput, first=True)
        elif mode == "up":
            # Linear scaling would multiply throughput by limit / previous: keep the
            # step if at least half that gain showed.
            if throughput >= before * (1 + 0.5 * (limit / previous - 1)):
                self._climb(throughput, first=False)
            elif self._first_climb and previous > 1:
                # The knee is below the start: measure one under it, against it.
                self._move(previous - 1, "down", before, came_from=previous)
            else:
                self._move(previous, "hold", before)
        elif mode == "down":
            if throughput >= before * (1 - 0.5 * (1 - limit / previous)):
                if limit > 1:
                    self._move(limit - 1, "down", throughput)
                else:
                    self._move(limit, "hold", throughput)
            else:
                self._move(previous, "hold", before)
        else:
            settled = self._settled
            if settled is None or throughput > settled:
                self._settled = settled = throughput
            self._held += 1
            if self._held < self._hold_rounds:
                self._throughput = throughput
                self._clear()
                return
            if throughput < settled * (1 - self._FALL) and limit > 1:
                self._move(limit - 1, "down", throughput)
            elif limit < self.ceiling:
                self._first_climb = False
                self._move(limit + 1, "up", throughput)
            else:
                self._move(limit, "hold", throughput)

    def _climb(self, throughput: float, *, first: bool) -> None:
        self._first_climb = first
        limit = self.limit
        if limit >= self.ceiling:
            self._move(limit, "hold", throughput)
        else:
            self._move(limit + max(1, limit // 4), "up", throughput)

    def _move(
        self, limit: int, mode: str, throughput: float | None, came_from: int | None = None
    ) -> None:
        """Go to ``limit``; ``throughput`` is what the level compared against (the one
        ``came_from``, by default the current) measured."""
        self._previous = self.limit if came_from is None else came_from
        # Answers to tasks sent before the move describe the old level: skip a turnover.
        self._skip = max(self.limit, limit)
        self.limit = max(1, min(self.ceiling, limit))
        self._mode = mode
        self._throughput = throughput
        if mode == "hold":
            self._held = 0
            self._settled = None
        self._clear()

    def _clear(self) -> None:
        self._n = 0
        self._sum_in_flight = 0
        self._sum_rtt = 0.0
