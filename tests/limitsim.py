"""A simulated worker for the tests of the time-windowed limits (AIMD, gradient2).

Like the simulation of the hill-climbing attacks in ``tests/test_limits.py``, with the
time the limit's windows are read on: the worker has ``slots(i)`` parallel slots after
``i`` answers, a task started then takes ``duration(rng, i)`` seconds in its slot, and
more callers than the limit keep it full. With ``refuse_above``, the worker has
admission of its own: a task that arrives when that many are already in it is answered
429 at once (a drop).
The limit is built on :meth:`Sim.clock`, which reads the simulation's time.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from typing import Any

Duration = Callable[[random.Random, int], float]


def steady(rng: random.Random, i: int) -> float:
    """A task time of 20 ms, within 5 %."""
    return 0.02 * rng.uniform(0.95, 1.05)


class Sim:
    """The simulation's time and randomness; run a limit against a worker with :meth:`run`."""

    def __init__(self, seed: int = 1) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self.answers = 0  # over every run
        self.drops = 0

    def clock(self) -> float:
        return self.now

    def run(
        self,
        limit: Any,
        answers: int,
        *,
        slots: Callable[[int], int] = lambda i: 8,
        duration: Duration = steady,
        refuse_above: Callable[[int], int | None] = lambda i: None,
        watch: Callable[[Any], None] | None = None,
    ) -> float:
        """Feed ``limit`` answers until ``answers`` were not drops (drops come back in a
        millisecond, and a worker refusing most tasks must not end the run in a blink of
        simulated time); returns the worker's throughput over the second half of those
        answers, in tasks a second."""
        rng = self.rng
        free_at = [self.now] * slots(0)
        seq = itertools.count()
        # (ends, seq, started, in flight at the start, dropped)
        in_flight: list[tuple[float, int, float, int, bool]] = []

        def start(i: int) -> None:
            nonlocal free_at
            wanted = slots(i)
            if wanted != len(free_at):
                # Slots lost take no new task; slots gained are free from now on.
                free_at = sorted(free_at)[:wanted] + [self.now] * max(0, wanted - len(free_at))
            level = len(in_flight) + 1
            cap = refuse_above(i)
            if cap is not None and len(in_flight) >= cap:
                heapq.heappush(in_flight, (self.now + 0.001, next(seq), self.now, level, True))
                return
            slot = min(range(len(free_at)), key=free_at.__getitem__)
            begins = max(self.now, free_at[slot])
            free_at[slot] = begins + duration(rng, i)
            heapq.heappush(in_flight, (free_at[slot], next(seq), self.now, level, False))

        for _ in range(limit.current):
            start(0)
        half_at, done_half = self.now, 0
        i = 0
        while i < answers:
            ends, _, started, level, dropped = heapq.heappop(in_flight)
            self.now = ends
            self.answers += 1
            self.drops += dropped
            if not dropped:
                if i == answers // 2:
                    half_at, done_half = self.now, 0
                elif i > answers // 2:
                    done_half += 1
                i += 1
            limit.on_sample(ends - started, level, dropped)
            if watch is not None:
                watch(limit)
            while len(in_flight) < limit.current:
                start(i)
        return done_half / (self.now - half_at) if self.now > half_at else 0.0


def within_bounds(limit: Any) -> None:
    """A ``watch`` asserting the contract on every answer: an int in [1, ceiling] that
    stats() agrees with."""
    current = limit.current
    assert isinstance(current, int) and 1 <= current <= limit.ceiling
    assert limit.stats()["limit"] == current


class Fixed:
    """A fixed limit, for comparison."""

    def __init__(self, current: int) -> None:
        self.current = current

    def on_sample(self, rtt: float, in_flight: int, dropped: bool) -> int:
        return self.current
