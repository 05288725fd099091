"""The record of one attempt at running a task: which worker, what went wrong, how long.

A module of its own, importing nothing from the package, so that both the task
(``task.py``) and the exceptions that carry attempts (``errors.py``) can name it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Attempt:
    """What happened on one attempt: which worker, the outcome, how long it took."""

    worker_id: str | None
    error: str | None
    duration: float
    status: int | None = None
    started_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "error": self.error,
            "duration": self.duration,
            "status": self.status,
            "started_at": self.started_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attempt:
        return cls(
            worker_id=data.get("worker_id"),
            error=data.get("error"),
            duration=float(data.get("duration", 0.0)),
            status=data.get("status"),
            started_at=float(data.get("started_at", 0.0)),
        )
