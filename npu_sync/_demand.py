"""When a model's load exceeds what its replicas serve: the rule by which a placement
round adds a replica (:mod:`npu_sync._placement`).

A round looks at what each model's tasks did since the previous round (a
:class:`Window`) and asks :class:`Demand` whether the model needs one more replica.
Three signs, any one of which is enough:

1. **In flight.** Its peak of tasks in flight reached ``models.scale_up`` of its
   replicas' capacity: the slots it has are (nearly) all taken.
2. **Queueing.** Its tasks waited for a worker, on average at least :data:`QUEUED`
   of a task at any moment over the window (``queued task-seconds / window``): its
   replicas had no room for them, whatever else filled them (another model's tasks on
   the same workers, where the in-flight count of this model stays low).
3. **Latency rising.** Its attempts took, on average over the window, at least
   :data:`RISE` times its own normal: the workers holding it answer slower than they
   used to (a worker queueing tasks behind its own few NPU slots, where the pool's
   ``max_concurrent`` lets more in than it serves at once). The normal is the
   model's own mean attempt time, averaged over past windows with a time constant of
   :data:`SETTLE` seconds, so a lasting change of what its tasks cost becomes the new
   normal after a few minutes rather than adding replicas for ever. A window with
   fewer than :data:`MIN_TASKS` attempts is not judged (too few to say).

:class:`QueueMeter` counts the queued task-seconds per model for the dispatcher.
Deciding is apart from measuring: the rule takes the window and the time as
arguments, so tests give it both, with no clock and no sleep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MIN_TASKS", "QUEUED", "RISE", "SETTLE", "Demand", "QueueMeter", "Window"]

RISE = 1.5
"""A model's mean attempt time at least this many times its normal is latency rising."""

SETTLE = 300.0
"""Seconds: the time constant of a model's normal latency (what it learns towards)."""

MIN_TASKS = 5
"""Attempts a window needs before its mean attempt time is judged or learnt."""

QUEUED = 0.5
"""Tasks of a model waiting for a worker on average over a window: at or above, its
replicas do not serve its load."""

_MAX_MODELS = 10_000  # models whose normal latency is remembered at once


@dataclass(frozen=True, slots=True)
class Window:
    """What one model's tasks did between two rounds, in this process."""

    seconds: float
    """The window's length."""
    peak: int = 0
    """The most attempts in flight at once."""
    tasks: int = 0
    """Attempts that ended."""
    busy: float = 0.0
    """Attempt-seconds in flight: the sum of the attempts' times."""
    queued: float = 0.0
    """Task-seconds spent waiting for a worker."""


class Demand:
    """Judges, window by window, whether a model's load exceeds what its replicas
    serve, and keeps each model's normal latency. Not thread-safe: one placement
    round at a time uses it (under the placer's lock).

    Args:
        rise: see :data:`RISE`.
        settle: see :data:`SETTLE`.
        min_tasks: see :data:`MIN_TASKS`.
        queued: see :data:`QUEUED`.
    """

    def __init__(
        self,
        rise: float = RISE,
        settle: float = SETTLE,
        min_tasks: int = MIN_TASKS,
        queued: float = QUEUED,
    ) -> None:
        self.rise = rise
        self.settle = settle
        self.min_tasks = min_tasks
        self.queued = queued
        # Per model: (its normal mean attempt time, when last learnt).
        self._normal: dict[str, tuple[float, float]] = {}

    def normal(self, model: str) -> float | None:
        """The model's normal mean attempt time, in seconds; None until learnt."""
        found = self._normal.get(model)
        return None if found is None else found[0]

    def judge(
        self, model: str, window: Window, capacity: int, scale_up: float, now: float
    ) -> str | None:
        """Why ``model`` needs one more replica after ``window`` (its replicas hold
        ``capacity`` slots in all), or None. Learns the model's normal latency from
        the window as it judges it."""
        reasons: list[str] = []
        if capacity > 0 and window.peak >= scale_up * capacity:
            reasons.append(f"{window.peak} in flight on {capacity} slots")
        if window.seconds > 0 and window.queued / window.seconds >= self.queued:
            waiting = window.queued / window.seconds
            reasons.append(f"{waiting:.1f} tasks waiting for a worker on average")
        rising = self._latency(model, window, now)
        if rising is not None:
            reasons.append(rising)
        return "load: " + "; ".join(reasons) if reasons else None

    def _latency(self, model: str, window: Window, now: float) -> str | None:
        """Whether the window's mean attempt time is rising above the model's normal;
        the normal learns from it either way."""
        if window.tasks < self.min_tasks:
            return None
        mean = window.busy / window.tasks
        found = self._normal.get(model)
        if found is None:
            if len(self._normal) >= _MAX_MODELS:
                self._normal.clear()
            self._normal[model] = (mean, now)
            return None
        normal, since = found
        weight = 1.0 - math.exp(-max(now - since, 0.0) / self.settle)
        self._normal[model] = (normal + weight * (mean - normal), now)
        if normal > 0 and mean >= self.rise * normal:
            return f"latency {mean * 1000:.0f} ms against a normal {normal * 1000:.0f} ms"
        return None

    def forget(self, keep: set[str]) -> None:
        """Drop the normal latency of every model not in ``keep``."""
        for model in [m for m in self._normal if m not in keep]:
            del self._normal[model]


class QueueMeter:
    """Task-seconds spent waiting for a worker, per model the tasks name. Not
    thread-safe: the dispatcher calls it under its lock."""

    __slots__ = ("_area", "_count", "_since")

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._area: dict[str, float] = {}
        self._since: dict[str, float] = {}

    def join(self, model: str, now: float) -> None:
        """A task for ``model`` starts waiting."""
        self._move(model, now, 1)

    def leave(self, model: str, now: float) -> None:
        """A task for ``model`` stops waiting (served, refused, or gone)."""
        self._move(model, now, -1)

    def waiting(self, model: str) -> int:
        """Tasks for ``model`` waiting now."""
        return self._count.get(model, 0)

    def take(self, now: float) -> dict[str, float]:
        """Per model, the task-seconds waited since the last call (the waits under way
        counted up to ``now``); the count starts again."""
        taken: dict[str, float] = {}
        for model in list(self._since):
            self._move(model, now, 0)
            area = self._area.pop(model, 0.0)
            if area > 0:
                taken[model] = area
            if not self._count.get(model):
                self._count.pop(model, None)
                del self._since[model]
        return taken

    def _move(self, model: str, now: float, step: int) -> None:
        count = self._count.get(model, 0)
        since = self._since.get(model, now)
        if count:
            self._area[model] = self._area.get(model, 0.0) + count * max(now - since, 0.0)
        self._since[model] = now
        count += step
        if count > 0:
            self._count[model] = count
        else:
            self._count.pop(model, None)
