"""What happens in a pool, as frozen event records passed to hooks.

A hook is any callable taking one event. Hooks run synchronously on the thread where
the event happened (a caller's thread, a pool thread, the health or reload thread),
never while the pool holds its lock; an exception raised by a hook is logged and
swallowed, so instrumentation can never fail a task. Each event class has a stable
``name`` (``"task.succeeded"``, ``"breaker.opened"`` …) used in logs and metrics.

The per-task events (:class:`TaskStarted`, :class:`AttemptFinished`,
:class:`TaskSucceeded`) are only built when at least one hook is registered, so a pool
without hooks pays nothing for them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

log = logging.getLogger("npu_sync.events")


__all__ = [
    "AttemptFinished",
    "AttemptHedged",
    "BreakerStateChanged",
    "ConfigReloadFailed",
    "ConfigReloaded",
    "Event",
    "HandoverDone",
    "HandoverOverdue",
    "HandoverStarted",
    "Hook",
    "ModelPlacement",
    "RetryBudgetAvailable",
    "RetryBudgetExhausted",
    "RetryScheduled",
    "TaskCancelled",
    "TaskDeadLettered",
    "TaskFallback",
    "TaskRejectedEvent",
    "TaskStarted",
    "TaskSucceeded",
    "WorkerCredentialsRefused",
    "WorkerHealthChanged",
    "WorkerLimitChanged",
    "WorkerModelsChanged",
    "WorkerSlowStart",
]


@dataclass(frozen=True, slots=True)
class Event:
    """Base of every event. ``at`` is wall-clock epoch seconds."""

    name: ClassVar[str] = "event"
    level: ClassVar[int] = logging.DEBUG

    at: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form, with the event's ``name``."""
        data: dict[str, Any] = {"event": self.name}
        data.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        return data


@dataclass(frozen=True, slots=True)
class TaskStarted(Event):
    """A task was accepted by ``execute``/``submit``/``map``/a decorated function."""

    name: ClassVar[str] = "task.started"
    task_id: str
    endpoint: str


@dataclass(frozen=True, slots=True)
class AttemptFinished(Event):
    """One attempt ended. ``outcome``: success, rejected, not_here, failure, misconfigured
    (the worker refused the credentials) or abandoned."""

    name: ClassVar[str] = "attempt.finished"
    task_id: str
    worker_id: str
    attempt: int
    outcome: str
    status: int | None
    error: str | None
    duration: float


@dataclass(frozen=True, slots=True)
class RetryScheduled(Event):
    """A failed attempt will be followed by another, on another worker, after ``wait``."""

    name: ClassVar[str] = "retry.scheduled"
    level: ClassVar[int] = logging.INFO
    task_id: str
    worker_id: str
    attempt: int
    wait: float
    error: str | None


@dataclass(frozen=True, slots=True)
class TaskSucceeded(Event):
    """A task returned the result of ``worker_id`` after ``attempts`` attempts."""

    name: ClassVar[str] = "task.succeeded"
    task_id: str
    worker_id: str
    attempts: int
    duration: float


@dataclass(frozen=True, slots=True)
class TaskRejectedEvent(Event):
    """A task raised ``TaskRejected``."""

    name: ClassVar[str] = "task.rejected"
    level: ClassVar[int] = logging.INFO
    task_id: str
    worker_id: str | None
    status: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class TaskFallback(Event):
    """Every worker failed the task and its local fallback answered instead."""

    name: ClassVar[str] = "task.fallback"
    level: ClassVar[int] = logging.INFO
    task_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class TaskCancelled(Event):
    """A task was stopped by its caller before it ended (an asyncio task cancelled, a
    ``TaskStop`` stopped): nobody charged, no dead letter, no fallback."""

    name: ClassVar[str] = "task.cancelled"
    task_id: str


@dataclass(frozen=True, slots=True)
class TaskDeadLettered(Event):
    """A task failed; its dead-letter record ``record_id`` was stored (None if storing failed)."""

    name: ClassVar[str] = "task.dead_lettered"
    level: ClassVar[int] = logging.WARNING
    task_id: str
    record_id: str | None
    attempts: int
    reason: str


@dataclass(frozen=True, slots=True)
class BreakerStateChanged(Event):
    """A worker's breaker moved from ``old`` to ``new`` (closed, open, half-open)."""

    name: ClassVar[str] = "breaker.state_changed"
    level: ClassVar[int] = logging.INFO
    worker_id: str
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class WorkerHealthChanged(Event):
    """A worker turned healthy or unhealthy by the health-check thresholds."""

    name: ClassVar[str] = "worker.health_changed"
    level: ClassVar[int] = logging.WARNING
    worker_id: str
    healthy: bool
    error: str | None


@dataclass(frozen=True, slots=True)
class WorkerCredentialsRefused(Event):
    """A worker refused the pool's credentials (HTTP 401 or 403, to a task or a health
    check): a configuration error, the operator's to fix. The worker takes no task
    until ``until`` (wall-clock epoch seconds; None: until a health check or a reload
    says it accepts them). ``error`` says what it answered."""

    name: ClassVar[str] = "worker.credentials_refused"
    level: ClassVar[int] = logging.ERROR
    worker_id: str
    error: str
    until: float | None


@dataclass(frozen=True, slots=True)
class WorkerModelsChanged(Event):
    """What the pool knows of a worker's models changed: a health round read a new
    list, a "not loaded" answer corrected it, or placement loaded a model there.

    ``reason`` is ``health``, ``not_loaded`` or ``placed``; ``added`` and ``removed``
    are sorted model ids; ``models`` is the whole list now, None when unknown.
    """

    name: ClassVar[str] = "worker.models_changed"
    level: ClassVar[int] = logging.INFO
    worker_id: str
    reason: str
    added: tuple[str, ...]
    removed: tuple[str, ...]
    models: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class ModelPlacement(Event):
    """Placement acted on a model (see docs/placement.md).

    ``action`` is ``load`` (a replica added), ``unload`` (a replica removed: the model
    went cold, or above its ``max``), ``evict`` (unloaded to make room on a full
    worker) or ``failed`` (a load or unload the worker refused or did not answer);
    ``reason`` says why in a few words; ``seconds`` is how long the request took.
    """

    name: ClassVar[str] = "model.placement"
    level: ClassVar[int] = logging.INFO
    worker_id: str
    model: str
    action: str
    reason: str
    seconds: float


@dataclass(frozen=True, slots=True)
class ConfigReloaded(Event):
    """A new configuration was applied; ``changes`` is ``ReloadResult.to_dict()``."""

    name: ClassVar[str] = "config.reloaded"
    level: ClassVar[int] = logging.INFO
    source: str | None
    changes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ConfigReloadFailed(Event):
    """A new configuration was rejected; the running one was kept."""

    name: ClassVar[str] = "config.reload_failed"
    level: ClassVar[int] = logging.ERROR
    source: str | None
    error: str


@dataclass(frozen=True, slots=True)
class HandoverStarted(Event):
    """A reload replaced workers: the ``retiring`` ones keep taking tasks until the
    ``awaited`` ones pass a health check (make before break)."""

    name: ClassVar[str] = "reload.handover_started"
    level: ClassVar[int] = logging.INFO
    retiring: tuple[str, ...]
    awaited: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HandoverDone(Event):
    """The workers that replace the ``retired`` ones answer (``joined``): the retired
    ones take no new task and drain. ``unanswered``: added workers that had not passed
    a health check when the bound passed."""

    name: ClassVar[str] = "reload.handover_done"
    level: ClassVar[int] = logging.INFO
    retired: tuple[str, ...]
    joined: tuple[str, ...]
    unanswered: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HandoverOverdue(Event):
    """None of the workers a reload added has passed a health check within
    ``reload.handover_timeout``: the ``retiring`` ones keep serving until one does."""

    name: ClassVar[str] = "reload.handover_overdue"
    level: ClassVar[int] = logging.WARNING
    retiring: tuple[str, ...]
    awaited: tuple[str, ...]
    waited: float


@dataclass(frozen=True, slots=True)
class WorkerSlowStart(Event):
    """A worker back in service (``reason``: ``recovered``, ``healthy``, ``moved``,
    ``added``) ramps up its share of tasks over the next ``window`` seconds."""

    name: ClassVar[str] = "worker.slow_start"
    level: ClassVar[int] = logging.INFO
    worker_id: str
    window: float
    reason: str


@dataclass(frozen=True, slots=True)
class WorkerLimitChanged(Event):
    """A worker's adaptive concurrency limit moved from ``old`` to ``new`` tasks."""

    name: ClassVar[str] = "worker.limit_changed"
    worker_id: str
    old: int
    new: int


@dataclass(frozen=True, slots=True)
class RetryBudgetExhausted(Event):
    """The pool-wide retry budget refused a retry (or hedge): retries stop until
    enough new tasks earn more."""

    name: ClassVar[str] = "retry_budget.exhausted"
    level: ClassVar[int] = logging.WARNING


@dataclass(frozen=True, slots=True)
class RetryBudgetAvailable(Event):
    """The retry budget allows retries again after refusing some."""

    name: ClassVar[str] = "retry_budget.available"
    level: ClassVar[int] = logging.INFO


@dataclass(frozen=True, slots=True)
class AttemptHedged(Event):
    """Task ``task_id``, slow on ``worker_id`` for ``delay`` seconds, was sent to
    ``hedge_worker_id`` as well; the first answer wins."""

    name: ClassVar[str] = "attempt.hedged"
    task_id: str
    worker_id: str
    hedge_worker_id: str
    delay: float


Hook = Callable[[Event], object]
"""Anything that takes an event; its return value is ignored."""


def log_event(event: Event) -> None:
    """The pool's own logging: one line per notable event, under its stable name.

    Records carry ``extra={"npu_event": event.to_dict()}`` for structured handlers.
    """
    if not log.isEnabledFor(event.level):
        return
    fields = " ".join(
        f"{f.name}={getattr(event, f.name)!r}" for f in dataclasses.fields(event) if f.name != "at"
    )
    log.log(event.level, "%s %s", event.name, fields, extra={"npu_event": event.to_dict()})


def emit(hooks: tuple[Hook, ...], event: Event) -> None:
    """Call every hook; a failing hook is logged and skipped."""
    for hook in hooks:
        try:
            hook(event)
        except Exception:
            log.exception("hook %r failed on %s", hook, event.name)
