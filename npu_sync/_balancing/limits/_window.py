"""The measurement window: samples collected apart from the algorithm that judges them.

As in Netflix's concurrency-limits (``WindowedLimit``), a limit does not look at each
answer: a window collects them — how many, the tasks in flight and RTT they add up to,
the smallest RTT, the most in flight, the drops — and hands one :class:`WindowSummary`
to the algorithm when it closes. Two ways to close one:

- :class:`RoundWindow` closes after a number of answers the algorithm sets each time
  (the hill climbing's rounds, which measure throughput by Little's law and need no
  clock), and skips a turnover of answers after each move;
- :class:`TimedWindow` closes once it has lasted long enough on an injected clock and
  holds enough answers (AIMD, gradient2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WindowSummary:
    """What one window measured. Immutable, so thread-safe.

    ``sum_in_flight`` and ``sum_rtt`` add up each answer's tasks in flight (at its
    start, itself included) and its duration: by Little's law their ratio is the
    worker's throughput over the window, in tasks a second.
    """

    samples: int
    sum_in_flight: int
    sum_rtt: float
    min_rtt: float
    max_in_flight: int
    drops: int

    @property
    def throughput(self) -> float:
        """Tasks a second (0 for a window without a counted answer)."""
        return self.sum_in_flight / self.sum_rtt if self.sum_rtt > 0 else 0.0

    @property
    def mean_rtt(self) -> float:
        """The answers' mean duration in seconds (``inf`` without one)."""
        return self.sum_rtt / self.samples if self.samples else math.inf


class SampleWindow:
    """Adds up answers until cleared. Not thread-safe: its limit's caller serialises."""

    __slots__ = ("drops", "max_in_flight", "min_rtt", "samples", "sum_in_flight", "sum_rtt")

    def __init__(self) -> None:
        self.samples = 0
        self.sum_in_flight = 0
        self.sum_rtt = 0.0
        self.min_rtt = math.inf
        self.max_in_flight = 0
        self.drops = 0

    def add(self, rtt: float, in_flight: int) -> None:
        """Count one answer that took ``rtt`` seconds, sent with ``in_flight`` in flight."""
        self.samples += 1
        self.sum_in_flight += in_flight
        self.sum_rtt += rtt
        if rtt < self.min_rtt:
            self.min_rtt = rtt
        if in_flight > self.max_in_flight:
            self.max_in_flight = in_flight

    def drop(self) -> None:
        """Count one answer the worker turned away for overload."""
        self.drops += 1

    def summary(self) -> WindowSummary:
        return WindowSummary(
            self.samples,
            self.sum_in_flight,
            self.sum_rtt,
            self.min_rtt,
            self.max_in_flight,
            self.drops,
        )

    def clear(self) -> None:
        self.samples = 0
        self.sum_in_flight = 0
        self.sum_rtt = 0.0
        self.min_rtt = math.inf
        self.max_in_flight = 0
        self.drops = 0


class RoundWindow:
    """A round of answers: closes when it holds as many as its limit asks.

    After a move the worker's queue is not yet what the new limit makes it: answers to
    tasks sent before describe the old level, so :meth:`skip` lets that many go by
    uncounted. Not thread-safe: its limit's caller serialises.
    """

    __slots__ = ("_skip", "_window")

    def __init__(self) -> None:
        self._window = SampleWindow()
        self._skip = 0

    @property
    def samples(self) -> int:
        """Answers counted in the round under way."""
        return self._window.samples

    def skip(self, answers: int) -> None:
        """Start afresh, and leave the next ``answers`` answers uncounted."""
        self._skip = answers
        self._window.clear()

    def clear(self) -> None:
        """Start afresh (the skip under way, if any, goes on)."""
        self._window.clear()

    def offer(self, rtt: float, in_flight: int, needed: int) -> WindowSummary | None:
        """Count one answer; the round's summary once it holds ``needed`` answers (a
        round's size may depend on the limit, which may move between answers)."""
        if self._skip:
            self._skip -= 1
            return None
        window = self._window
        window.add(rtt, in_flight)
        if window.samples < needed:
            return None
        summary = window.summary()
        window.clear()
        return summary


class TimedWindow:
    """A window of time, from its first answer: closes on the first answer once it has
    lasted ``clamp(2 * its smallest RTT, min_time, max_time)`` seconds and holds at least
    ``min_samples`` answers, drops included (as ``WindowedLimit`` sizes its windows):
    a worker that refuses every task still closes windows, ``max_time`` long. Not
    thread-safe: its limit's caller serialises.

    Args:
        clock: monotonic seconds.
        min_time, max_time: the shortest and longest a window lasts, answers allowing.
        min_samples: the fewest answers (drops included) a window holds; it lasts longer
            until it has them.

    Raises:
        ValueError: a bound below zero, ``max_time < min_time``, or ``min_samples < 1``.
    """

    __slots__ = ("_clock", "_started", "_window", "max_time", "min_samples", "min_time")

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        min_time: float = 0.1,
        max_time: float = 1.0,
        min_samples: int = 10,
    ) -> None:
        if not 0 <= min_time <= max_time < math.inf:
            raise ValueError(
                f"window times must satisfy 0 <= min_time <= max_time, got min_time="
                f"{min_time!r}, max_time={max_time!r}"
            )
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples!r}")
        self._clock = clock
        self.min_time = min_time
        self.max_time = max_time
        self.min_samples = min_samples
        self._window = SampleWindow()
        self._started = 0.0

    @property
    def drops(self) -> int:
        """Drops counted in the window under way."""
        return self._window.drops

    def restart(self) -> None:
        """Drop what the window holds: the next answer starts a new one."""
        self._window.clear()

    def offer(self, rtt: float, in_flight: int, dropped: bool) -> WindowSummary | None:
        """Count one answer; the window's summary when this answer closes it."""
        window = self._window
        if not window.samples and not window.drops:
            # A window starts with its first answer: a worker idle (or stalled) since the
            # last one closed says nothing, and would make the next a window of a moment.
            self._started = self._clock()
        if dropped:
            window.drop()
        else:
            window.add(rtt, in_flight)
        if window.samples + window.drops < self.min_samples:
            return None
        now = self._clock()
        length = min(max(2 * window.min_rtt, self.min_time), self.max_time)
        if now - self._started < length:
            return None
        summary = window.summary()
        window.clear()
        return summary
