"""Helpers for testing code that uses npu_sync: a fake clock, a fake transport,
and local reference workers. Public and used by npu_sync's own tests.
"""

from __future__ import annotations

import threading


class FakeClock:
    """A clock that moves only when told to. Thread-safe.

    ``sleep`` advances the clock instead of blocking, so backoff and breaker
    timeouts can be driven without waiting; ``sleeps`` records every sleep asked for.
    """

    def __init__(self, start: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._lock = threading.Lock()
        self._now = start
        self._wall_offset = wall - start
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def time(self) -> float:
        with self._lock:
            return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            if seconds > 0:
                self._now += seconds

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        if event.is_set():
            return True
        if timeout is not None:
            self.advance(timeout)
        return event.is_set()
