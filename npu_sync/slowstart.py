"""Slow start: a worker back in service gets its share of tasks gradually.

A worker that recovers (its breaker closes, its health check passes again) or that
was just added is often still warming up: an NPU worker restarted a moment ago loads
its models, fills caches, compiles graphs. Given its full share at once it answers
slowly or fails, and the breaker opens again. Envoy's slow start is the model: over a
window the worker's weight is scaled by

    factor = max(min_factor, (elapsed / window) ** (1 / aggression))

which grows from ``min_factor`` to 1; ``aggression`` 1 is linear, above 1 the share
rises fast early, below 1 it stays small longer. The selector divides the worker's
score by ``weight * factor``: with least connections, a worker at factor 0.25 is
chosen when the others carry four times its load.

Events for the pool to emit once it reports recoveries: ``worker.slow_start`` when a
ramp begins (worker id, until when) and the ramp's end is visible in ``workers()`` as
``slow_start_until``; no event at its end, which is a known time.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_WINDOW = 10.0
"""Seconds: how long a ramp lasts (``balancing.slow_start``)."""


@dataclass(frozen=True, slots=True)
class SlowStart:
    """How a worker's share ramps up over ``window`` seconds. Immutable, so thread-safe.

    ``window`` 0 turns slow start off: :meth:`factor` is always 1.
    """

    window: float = DEFAULT_WINDOW
    aggression: float = 1.0
    min_factor: float = 0.1

    def __post_init__(self) -> None:
        if not self.window >= 0:
            raise ValueError(f"slow start window must be >= 0 seconds, got {self.window!r}")
        if not self.aggression > 0:
            raise ValueError(f"slow start aggression must be > 0, got {self.aggression!r}")
        if not 0 < self.min_factor <= 1:
            raise ValueError(f"slow start min_factor must be in (0, 1], got {self.min_factor!r}")

    @property
    def enabled(self) -> bool:
        return self.window > 0

    def ends(self, started: float) -> float:
        """When a ramp begun at ``started`` is over (monotonic seconds)."""
        return started + self.window

    def factor(self, started: float, now: float) -> float:
        """The share, in (0, 1], of a worker whose ramp began at ``started``."""
        elapsed = now - started
        if elapsed >= self.window:
            return 1.0
        if elapsed <= 0:
            return self.min_factor
        share = (elapsed / self.window) ** (1.0 / self.aggression)
        return share if share > self.min_factor else self.min_factor
