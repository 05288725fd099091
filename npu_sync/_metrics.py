"""Counters and bounded samples behind ``stats()`` and ``workers()``.

Recording costs the hot path a few integer additions and one ``deque.append``
(samples are bounded); percentiles are computed only when somebody asks.
Not thread-safe on their own: the pool updates them under its selection lock,
which it holds anyway to release a worker.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of already sorted values, nearest-rank."""
    if not sorted_values:
        return None
    rank = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


class Window:
    """The last ``size`` observations, with percentiles on demand."""

    __slots__ = ("_values",)

    def __init__(self, size: int = 1024) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._values.append(value)

    def __len__(self) -> int:
        return len(self._values)

    def percentiles(self, *qs: float) -> list[float | None]:
        ordered = sorted(self._values)
        return [percentile(ordered, q) for q in qs]

    def copy(self) -> Window:
        """A snapshot: copying is a C-level deque copy, cheap enough under a lock."""
        clone = Window.__new__(Window)
        clone._values = self._values.copy()
        return clone


class TimedWindow:
    """Outcomes (ok / failed) over the last ``span`` seconds, for a failure rate."""

    __slots__ = ("_events", "span")

    def __init__(self, span: float = 60.0, maxlen: int = 4096) -> None:
        self.span = span
        self._events: deque[tuple[float, bool]] = deque(maxlen=maxlen)

    def add(self, now: float, failed: bool) -> None:
        self._events.append((now, failed))

    def failure_rate(self, now: float) -> float | None:
        horizon = now - self.span
        events = [failed for at, failed in list(self._events) if at >= horizon]
        if not events:
            return None
        return sum(events) / len(events)

    def copy(self) -> TimedWindow:
        clone = TimedWindow.__new__(TimedWindow)
        clone.span = self.span
        clone._events = self._events.copy()
        return clone


@dataclass
class WorkerStats:
    """What one worker has done, since it joined the pool."""

    attempts: int = 0
    succeeded: int = 0
    failed: int = 0
    rejected: int = 0
    not_here: int = 0
    abandoned: int = 0  # cut short by the caller's deadline or a closed connection
    last_error: str | None = None
    last_error_at: float | None = None
    latency_ewma: float | None = None
    latency: Window = field(default_factory=Window)
    outcomes: TimedWindow = field(default_factory=TimedWindow)

    _ALPHA = 0.2

    def copy(self) -> WorkerStats:
        """A snapshot to compute percentiles from outside the pool's lock."""
        clone = dataclasses.replace(self)
        clone.latency = self.latency.copy()
        clone.outcomes = self.outcomes.copy()
        return clone

    def observe(self, now: float, duration: float, ok: bool) -> None:
        self.latency.add(duration)
        self.latency_ewma = (
            duration
            if self.latency_ewma is None
            else self.latency_ewma + self._ALPHA * (duration - self.latency_ewma)
        )
        self.outcomes.add(now, not ok)


@dataclass
class PoolStats:
    """Pool-wide counters."""

    submitted: int = 0
    succeeded: int = 0
    rejected: int = 0
    failed: int = 0
    retries: int = 0
    fallbacks: int = 0
    cancelled: int = 0
    dead_lettered: int = 0
    waited: int = 0
