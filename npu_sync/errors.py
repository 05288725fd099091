"""The exceptions npu_sync raises. Every one derives from :class:`NpuSyncError`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from npu_sync.task import Attempt


class NpuSyncError(Exception):
    """Root of every exception npu_sync raises on purpose."""


class ConfigError(NpuSyncError, ValueError):
    """A configuration is invalid.

    ``errors`` lists every problem found, each naming its key path, e.g.
    ``npu_workers.workers[2].port: must be 1..65535, got 0``.
    """

    def __init__(self, errors: str | Sequence[str], *, source: str | None = None) -> None:
        self.errors: tuple[str, ...] = (errors,) if isinstance(errors, str) else tuple(errors)
        self.source = source
        head = f"invalid configuration in {source}" if source else "invalid configuration"
        super().__init__(head + ":\n  " + "\n  ".join(self.errors))


class InvalidTask(NpuSyncError, ValueError):
    """A task could not be built: its payload, endpoint or options are unusable."""


class TaskRejected(NpuSyncError):
    """The task itself is bad: a worker refused it (4xx other than 408/429), or no
    worker serves the model it names. Never retried, never counted against a worker.
    """

    def __init__(
        self,
        message: str,
        *,
        task_id: str,
        status: int | None = None,
        worker_id: str | None = None,
        body: object = None,
    ) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.status = status
        self.worker_id = worker_id
        self.body = body


class TaskFailed(NpuSyncError):
    """The task could not succeed; its dead-letter record was stored before this was raised.

    ``attempts`` holds every attempt (worker id, error, duration) in order.
    ``dead_letter_id`` is None only when storing the record itself failed; the error
    says so and the whole record is logged at ERROR level.
    """

    def __init__(
        self,
        message: str,
        *,
        task_id: str,
        dead_letter_id: str | None,
        attempts: Sequence[Attempt] = (),
    ) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.dead_letter_id = dead_letter_id
        self.attempts: tuple[Attempt, ...] = tuple(attempts)


class NoWorkerAvailable(TaskFailed):
    """A task failed without a single attempt: no worker could take it before its
    deadline (none in the pool, all disabled, or all busy or down throughout).
    Its dead-letter record was stored, as for any ``TaskFailed``.
    """


class PoolClosed(NpuSyncError):
    """The pool was closed; it accepts no more tasks."""
