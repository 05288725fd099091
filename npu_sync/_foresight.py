"""Deadline-aware admission: refuse at once a task that would wait for nothing.

A task that finds no worker with room waits for one (see :mod:`npu_sync._admission`).
When the fleet is saturated and the queue ahead is long, the wait alone may outlast
the task's deadline: the caller (a web request under gunicorn's 30 s limit) then
learns of the failure only when the time is gone. :class:`DeadlineForesight` is the
step of admission that looks ahead instead: just before a task would join the queue it
forms an expectation of when the task would be answered, and refuses the task at
once when that is confidently past its deadline.

How the expectation is formed. Each worker that could serve the task now (not tried
by it, enabled, not draining, healthy, breaker not open) runs up to ``capacity``
tasks at once, each taking about its mean answer time ``s`` (the EWMA of its
successful attempts' durations, ``WorkerStats.latency_ewma``). Together they free
slots at a rate ``R = sum(capacity / s)``. A task with ``n`` tasks queued ahead of it
gets the ``n + 1``-th slot freed, after about ``(n + 1) / R``; its own attempt then
takes about ``C / R`` (the mean answer time, each worker weighted by the share of
slots it frees; ``C`` the total capacity). The expectation is the sum of the two.

Conservative by construction:

* no expectation, so the task is let in, while any such worker has fewer than
  ``min_samples`` successful answers (a fresh pool, a worker just added) or when no
  worker could serve now (the other refusals of admission speak for that case);
* a worker whose breaker is open or that is unhealthy frees no slot in the sum, as it
  frees none now;
* the task is refused only when the expectation exceeds the time left by the factor
  ``margin`` (``admission.deadline_margin``, 1.25 by default).

How often it is wrong is measured in ``benchmarks/test_foresight.py`` (see
docs/priority.md): tasks refused that would have finished in time, and tasks let in
that timed out, under a saturated fleet of real workers.

Not thread-safe on its own, and need not be: it holds only its settings, and
:meth:`DeadlineForesight.judge` reads the workers under the pool's lock.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable

from npu_sync._breaker import CLOSED
from npu_sync._config_types import AdmissionConfig
from npu_sync._worker import Worker

__all__ = ["DeadlineForesight", "Late", "foresight_for"]


class Late:
    """The expectation that refused a task: it would be answered in ``expected``
    seconds, and has ``left`` seconds (or may wait only ``left``, when ``waiting``)."""

    __slots__ = ("expected", "left", "waiting")

    def __init__(self, expected: float, left: float, waiting: bool = False) -> None:
        self.expected = expected
        self.left = left
        self.waiting = waiting

    @property
    def reason(self) -> str:
        """The refusal in words: ``expected 3.2 s, 1.0 s left``."""
        if self.waiting:
            return (
                f"expected wait for a worker {self.expected:.1f} s, "
                f"pool.max_queue_wait allows {self.left:.1f} s"
            )
        return f"expected {self.expected:.1f} s, {self.left:.1f} s left"

    def __repr__(self) -> str:
        return f"Late({self.reason})"


class DeadlineForesight:
    """Whether a task about to wait for a worker can still be answered by its deadline.

    Immutable, so thread-safe.

    Args:
        margin: refuse only when the expectation exceeds the time left by this factor
            (>= 1).
        min_samples: successful answers every worker must have given before its answer
            time is trusted.
    """

    __slots__ = ("margin", "min_samples")

    def __init__(self, margin: float = 1.25, min_samples: int = 5) -> None:
        if not margin >= 1.0:
            raise ValueError(f"margin must be >= 1, got {margin!r}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples!r}")
        self.margin = margin
        self.min_samples = min_samples

    def expect(
        self, workers: Iterable[Worker], excluded: Collection[str], ahead: int
    ) -> tuple[float, float] | None:
        """When a task with ``ahead`` tasks queued before it would get a worker and when
        it would be answered, in seconds from now; None when no confident expectation
        can be formed. Call under the pool's lock."""
        rate = 0.0
        slots = 0
        min_samples = self.min_samples
        for worker in workers:
            if (
                worker.id in excluded
                or not worker.enabled
                or worker.draining
                or not worker.healthy
                or worker.breaker.state != CLOSED
            ):
                continue
            stats = worker.stats
            mean = stats.latency_ewma
            if mean is None or stats.succeeded < min_samples:
                return None  # not known yet: let the task in
            capacity = worker.capacity
            if capacity <= 0:
                continue
            rate += capacity / max(mean, 1e-6)
            slots += capacity
        if rate <= 0.0:
            return None
        return (ahead + 1) / rate, (ahead + 1 + slots) / rate

    def judge(
        self,
        workers: Iterable[Worker],
        excluded: Collection[str],
        ahead: int,
        now: float,
        wait_until: float,
        deadline: float,
    ) -> Late | None:
        """A :class:`Late` when the task cannot confidently be answered by
        ``deadline`` (or given a worker by ``wait_until``), else None. Call under the
        pool's lock, with no worker free for the task."""
        expected = self.expect(workers, excluded, ahead)
        if expected is None:
            return None
        wait, answered = expected
        left = deadline - now
        if answered > left * self.margin:
            return Late(answered, left)
        allowed = wait_until - now
        if wait_until < deadline and wait > allowed * self.margin:
            # The wait alone must fit in pool.max_queue_wait.
            return Late(wait, allowed, waiting=True)
        return None


@functools.lru_cache(maxsize=8)
def foresight_for(config: AdmissionConfig) -> DeadlineForesight | None:
    """The step for ``config`` (None when ``deadline_aware`` is off), built once per
    configuration."""
    if not config.deadline_aware:
        return None
    return DeadlineForesight(config.deadline_margin, config.min_samples)
