"""One worker as the pool sees it: its config, its connection pool, its breaker, its load."""

from __future__ import annotations

from typing import Any

from npu_sync.breaker import WorkerBreaker
from npu_sync.config import WorkerConfig
from npu_sync.metrics import WorkerStats
from npu_sync.transport import Transport


class Worker:
    """Runtime state of one worker.

    Not thread-safe on its own: every mutable field (``in_flight``, ``capacity``,
    ``healthy``, ``draining``, ``cooldown_until``, ``stats``, the breaker) is read and
    written under the pool's selection lock. ``transport`` is thread-safe and used
    outside that lock.
    """

    __slots__ = (
        "breaker",
        "capacity",
        "config",
        "cooldown_until",
        "draining",
        "healthy",
        "id",
        "in_flight",
        "priority",
        "removed",
        "stats",
        "transport",
    )

    def __init__(self, config: WorkerConfig, transport: Transport, breaker: WorkerBreaker) -> None:
        self.config = config
        self.id = config.id
        self.priority = config.priority
        self.transport = transport
        self.breaker = breaker
        self.in_flight = 0
        self.capacity = config.max_concurrent
        self.healthy = True
        self.draining = False
        self.removed = False
        self.cooldown_until = 0.0
        self.stats = WorkerStats()

    def eligible(self, now: float) -> bool:
        """Whether a new attempt may start here now (ignoring per-task exclusions)."""
        return (
            self.in_flight < self.capacity
            and self.healthy
            and not self.draining
            and self.config.enabled
            and now >= self.cooldown_until
            and self.breaker.can_admit(now)
        )

    def snapshot(self, now: float) -> dict[str, Any]:
        """A JSON-serialisable view. Call under the pool's lock."""
        stats = self.stats
        p50, p95, p99 = stats.latency.percentiles(50, 95, 99)
        return {
            "id": self.id,
            "url": self.config.url,
            "priority": self.priority,
            "enabled": self.config.enabled,
            "draining": self.draining,
            "healthy": self.healthy,
            "breaker": {
                "state": self.breaker.state,
                "trips": self.breaker.trips,
                "failures": self.breaker.failures,
                "reset_timeout": self.breaker.reset_timeout,
            },
            "in_flight": self.in_flight,
            "capacity": self.capacity,
            "tasks": {
                "attempts": stats.attempts,
                "succeeded": stats.succeeded,
                "failed": stats.failed,
                "rejected": stats.rejected,
                "not_here": stats.not_here,
            },
            "failure_rate": stats.outcomes.failure_rate(now),
            "latency": {
                "ewma_ms": None if stats.latency_ewma is None else stats.latency_ewma * 1000,
                "p50_ms": None if p50 is None else p50 * 1000,
                "p95_ms": None if p95 is None else p95 * 1000,
                "p99_ms": None if p99 is None else p99 * 1000,
            },
            "last_error": stats.last_error,
            "last_error_at": stats.last_error_at,
            "cooldown_remaining": max(0.0, self.cooldown_until - now),
        }
