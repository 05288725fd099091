"""Time as a dependency: the pool, breakers, backoff and health read it through a Clock."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """What npu_sync needs of time. Implementations must be thread-safe."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""
        ...

    def time(self) -> float:
        """Wall-clock seconds since the epoch (for records people read)."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block the calling thread for ``seconds``."""
        ...

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        """Wait for ``event`` up to ``timeout`` seconds; return whether it is set."""
        ...


class SystemClock:
    """The real clock. Thread-safe and stateless."""

    # The C functions themselves, not wrappers: the pool reads the clock several
    # times per task.
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        return event.wait(timeout)


SYSTEM_CLOCK = SystemClock()
