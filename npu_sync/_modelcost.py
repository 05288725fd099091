"""How long each worker takes for each model: per-(worker, model) latency estimates.

A worker's own estimate (:mod:`npu_sync._latency`) mixes every model it serves: a
worker fast for a small model and slow for a large one looks middling for both. This
store keeps one peak-EWMA estimate per worker and model, fed by every successful
attempt of a task that names a model, and :meth:`ModelCosts.best` picks, among the
workers a task may go to, the one whose estimate for that model, weighed by its load,
is lowest.

Size. A task may declare its size (``Task(size=...)``: tokens, pixels, bytes). Its
answer time then feeds a second estimate per worker and model, in seconds *per unit*,
so that a worker that happened to get the large tasks is not taken for a slow one.
A sized task is ranked by the per-unit estimates, an unsized one by the per-task
estimates. (The size multiplies every candidate's per-unit estimate alike, so it
does not change which worker is fastest for a task; it keeps the learning fair.)

Only where models mix. While every worker has answered tasks of one model only, its
own estimate is the same information, and it carries what this store does not (a
paused worker's peak relaxed after ``balancing.peak_hold``): unsized tasks are then
left to the usual choice, and the store only learns. It steps in for a model once
some worker has answered two models, or for sized tasks.

Bounded: at most ``max_models`` models per worker (the least recently used is
forgotten), and workers that leave the pool are dropped with :meth:`forget`.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable

from npu_sync._latency import DEFAULT_DECAY, PeakEwma
from npu_sync._worker import Worker

__all__ = ["DEFAULT_MAX_MODELS", "ModelCosts"]

DEFAULT_MAX_MODELS = 32
"""Models whose estimates are kept per worker unless told otherwise."""

UNEVEN = 1.5
"""A model is *uneven* when its slowest worker's estimate is at least this many times
its fastest's (and, per task, at least :data:`UNEVEN_GAP` slower): only then does a
task for it look for the fastest worker. When a model runs alike everywhere the
worker's own estimate says enough, and the task is spared the look."""

UNEVEN_GAP = 0.001
"""Seconds: per-task estimates closer than this are even, whatever their ratio (tens
of microseconds apart is noise, and less than the look itself costs)."""

_RECHECK = 1.0  # seconds between re-judging whether a model is uneven
_MAX_JUDGED = 4096  # models judged at once; beyond, the judgements start afresh


class _Estimates:
    """One worker and model: the per-task and the per-unit estimate (either may be None
    until a task of that kind answers)."""

    __slots__ = ("per_task", "per_unit")

    def __init__(self) -> None:
        self.per_task: PeakEwma | None = None
        self.per_unit: PeakEwma | None = None


class ModelCosts:
    """Per-(worker, model) latency estimates. Thread-safe: one small lock of its own,
    held for a dictionary update, never across I/O or user code.

    Args:
        decay: the estimates' time constant, in seconds (``balancing.latency_decay``).
        max_models: models remembered per worker; the least recently answered goes.
    """

    def __init__(self, decay: float = DEFAULT_DECAY, max_models: int = DEFAULT_MAX_MODELS) -> None:
        if max_models < 1:
            raise ValueError(f"max_models must be >= 1, got {max_models!r}")
        self.decay = decay
        self.max_models = max_models
        self._lock = threading.Lock()
        self._by_worker: dict[str, OrderedDict[str, _Estimates]] = {}
        # Whether any model is uneven: until one is, no task looks for the fastest.
        self.active = False
        # Per model: (when to judge it again, whether it is uneven).
        self._judged: dict[str, tuple[float, bool]] = {}

    def observe(
        self, worker_id: str, model: str, rtt: float, now: float, size: float | None = None
    ) -> None:
        """A successful attempt of a task for ``model`` took ``rtt`` seconds on
        ``worker_id``, ending at ``now``; ``size`` is the task's declared size."""
        with self._lock:
            models = self._by_worker.get(worker_id)
            if models is None:
                models = self._by_worker[worker_id] = OrderedDict()
            found = models.get(model)
            if found is None:
                found = models[model] = _Estimates()
                if len(models) > self.max_models:
                    models.popitem(last=False)
            else:
                models.move_to_end(model)
            if size is None:
                if found.per_task is None:
                    found.per_task = PeakEwma(self.decay, now=now)
                found.per_task.observe(rtt, now)
            else:
                if found.per_unit is None:
                    found.per_unit = PeakEwma(self.decay, now=now)
                found.per_unit.observe(rtt / size, now)
            judged = self._judged.get(model)
            if judged is None or now >= judged[0]:
                self._judge_locked(model, now)

    def _judge_locked(self, model: str, now: float) -> None:
        """Whether ``model`` is uneven now (see :data:`UNEVEN`). Under ``_lock``."""
        task_costs: list[float] = []
        unit_costs: list[float] = []
        for models in self._by_worker.values():
            found = models.get(model)
            if found is not None:
                if found.per_task is not None:
                    task_costs.append(found.per_task.value(now))
                if found.per_unit is not None:
                    unit_costs.append(found.per_unit.value(now))
        # One model everywhere: the workers' own estimates say the same (see above).
        mixed = any(len(models) > 1 for models in self._by_worker.values())
        uneven = (
            mixed
            and len(task_costs) >= 2
            and max(task_costs) >= UNEVEN * min(task_costs)
            and max(task_costs) - min(task_costs) >= UNEVEN_GAP
        ) or (len(unit_costs) >= 2 and max(unit_costs) >= UNEVEN * min(unit_costs))
        if len(self._judged) >= _MAX_JUDGED:
            self._judged.clear()
        self._judged[model] = (now + _RECHECK, uneven)
        if uneven:
            self.active = True

    def uneven(self, model: str) -> bool:
        """Whether ``model``'s workers differ enough for a task to look for the fastest."""
        judged = self._judged.get(model)
        return judged is not None and judged[1]

    def estimate(
        self, worker_id: str, model: str, now: float, size: float | None = None
    ) -> float | None:
        """The expected seconds for a task of ``model`` (of ``size``) on ``worker_id``,
        or None when no such task has answered there."""
        models = self._by_worker.get(worker_id)
        found = None if models is None else models.get(model)
        if found is None:
            return None
        if size is None:
            return None if found.per_task is None else found.per_task.value(now)
        return None if found.per_unit is None else found.per_unit.value(now) * size

    def best(
        self, candidates: Iterable[Worker], model: str, now: float, size: float | None = None
    ) -> Worker | None:
        """The candidate a task of ``model`` should go to by its per-model estimate,
        weighed by load as the selector weighs its own (``estimate * (1 + (in_flight +
        1) / capacity)``); None unless at least two candidates have an estimate, so
        that one known worker is not preferred over unknown ones it has never been
        compared with. Only the lowest priority tier among the candidates is ranked."""
        workers = list(candidates)
        if len(workers) < 2:
            return None
        tier = min(w.priority for w in workers)
        by_worker = self._by_worker
        best: Worker | None = None
        best_cost = math.inf
        known = 0
        for worker in workers:
            if worker.priority != tier:
                continue
            models = by_worker.get(worker.id)
            found = None if models is None else models.get(model)
            estimator = None
            if found is not None:
                estimator = found.per_task if size is None else found.per_unit
            if estimator is None:
                return None  # never compared with the others: the usual choice tries it
            known += 1
            cost = estimator.value(now) * (1.0 + (worker.in_flight + 1) / max(worker.capacity, 1))
            if cost < best_cost:
                best, best_cost = worker, cost
        return best if known >= 2 else None

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the estimates of every worker not in ``keep`` (the pool's workers)."""
        kept = set(keep)
        with self._lock:
            for worker_id in [w for w in self._by_worker if w not in kept]:
                del self._by_worker[worker_id]

    def stats(self, now: float) -> dict[str, dict[str, float]]:
        """``{worker_id: {model: estimate_ms}}`` of the per-task estimates: for people."""
        with self._lock:
            return {
                wid: {
                    model: e.per_task.value(now) * 1000.0
                    for model, e in models.items()
                    if e.per_task is not None
                }
                for wid, models in self._by_worker.items()
            }
