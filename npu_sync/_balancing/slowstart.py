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
chosen when the others carry four times its load. :class:`Ramps` keeps the workers
ramping and gives each its share as the ramp goes.

Events for the pool to emit once it reports recoveries: ``worker.slow_start`` when a
ramp begins (worker id, until when) and the ramp's end is visible in ``workers()`` as
``slow_start_until``; no event at its end, which is a known time.
"""

from __future__ import annotations

from dataclasses import dataclass

from npu_sync._balancing.index import Index
from npu_sync._balancing.scores import Scores
from npu_sync._balancing.slot import NEVER, Slot

DEFAULT_WINDOW = 10.0
"""Seconds: how long a ramp lasts (``balancing.slow_start``)."""

RAMP_STEPS = 100
"""How many times a ramp's factor is refreshed over its window."""


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


class Ramps:
    """The workers ramping up, and each one's share as its ramp goes.

    Not thread-safe: under the pool's lock.

    Args:
        slow_start: how a worker back in service ramps up.
        index: whose members may ramp.
        scores: rekeys a worker whose share moved; told whether scores count.
    """

    __slots__ = ("_index", "_scores", "due", "ramping", "slow_start")

    def __init__(self, slow_start: SlowStart, index: Index, scores: Scores) -> None:
        self.slow_start = slow_start
        self._index = index
        self._scores = scores
        self.ramping: list[Slot] = []
        self.due = NEVER
        """When the shares must be refreshed: one comparison per selection."""

    def start(self, slot: Slot, now: float) -> None:
        """``slot``'s worker is back in service at ``now``: ramp it from the floor."""
        slow_start = self.slow_start
        if slow_start.enabled:
            slot.ramp_from = now
            slot.ramp_until = slow_start.ends(now)
            if slot not in self.ramping:
                self.ramping.append(slot)
        else:
            self._scores.rekey(slot, now)

    def restart(self, now: float) -> None:
        """Take the ramps under way from the members (a new candidate set)."""
        self.ramping = [s for s in self._scores.members if s.ramp_until > -NEVER]
        self.refresh(now, everyone=True)

    def refresh(self, now: float, everyone: bool = False) -> None:
        """Give every ramping worker its share at ``now`` and forget finished ramps;
        with ``everyone``, recompute every member's share and score (new weights, new
        settings, a new candidate set)."""
        slow_start = self.slow_start
        scores = self._scores
        members = self._index.slots
        # Slow start turned off (a reload): the ramps under way end now.
        enabled = slow_start.enabled
        still: list[Slot] = []
        for slot in self.ramping:
            weight = slot.worker.weight
            if enabled and slot.ramp_until > now and members.get(slot.worker) is slot:
                slot.share = weight * slow_start.factor(slot.ramp_from, now)
                still.append(slot)
            else:
                slot.share = float(weight)
                slot.ramp_until = -NEVER
            if not everyone:
                scores.rekey(slot, now)
        self.ramping = still
        if everyone:
            for slot in scores.members:
                if slot.ramp_until <= now:
                    slot.share = float(slot.worker.weight)
                scores.rekey(slot, now)
        self.due = now + max(slow_start.window / RAMP_STEPS, 1e-3) if still else NEVER
        scores.scored = (
            scores.latency_aware or bool(still) or any(s.worker.weight != 1 for s in scores.members)
        )
