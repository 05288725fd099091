"""The per-model view: which workers hold each model, how busy it is, and how many
replicas it has against its targets — ``stats()["models"]["per_model"]``, which the
status page shows.

Model-aware routing knows who holds what from the workers' model lists whether or not
placement rounds run (``models.balance``), so the rows are there either way. A model's
load comes from two places:

- the workers' own counts: AutoBot's ``GET /models`` gives each loaded model's
  ``inference_count`` (every process's tasks, since the worker loaded it), and two
  lists in a row give a rate (:class:`~npu_sync._holdings.Holdings`);
- with ``models.balance``, this process's tasks in flight per model and the learnt
  load times (``Placer.rows()``).
"""

from __future__ import annotations

from collections.abc import Iterable

from npu_sync._outage import down_reason
from npu_sync._stats_types import ModelRowDict, ModelViewDict
from npu_sync._worker import Worker
from npu_sync.config import ModelsConfig

__all__ = ["model_rows"]


def model_rows(
    workers: Iterable[Worker],
    models: ModelsConfig,
    now: float,
    placed: Iterable[ModelRowDict] | None = None,
) -> list[ModelViewDict]:
    """One row per model some worker holds or ``models.catalog`` names, by model id.

    Args:
        workers: the pool's workers (read under the pool's lock, or as one list each).
        models: the ``models`` section in force, for the replica targets.
        now: the pool's monotonic clock, to tell live holders from down ones.
        placed: placement's rows (with ``models.balance``), for tasks in flight and
            load times; None without placement rounds.

    Returns:
        JSON-serialisable rows.
    """
    # One pass over what each worker holds (a big fleet has thousands of pairs):
    # per model, its holders, live replicas, and the counts and rates summed.
    found: dict[str, _Model] = {}
    for worker in sorted(workers, key=lambda w: w.id):
        holdings = worker.held
        listed = holdings.models
        if not listed:
            continue
        gone = holdings.not_loaded
        if gone:
            listed = frozenset(m for m in listed if m not in gone)
        counts, rates, wid = holdings.inferences, holdings.rates, worker.id
        live = down_reason(worker, now) is None
        for model in listed:
            entry = found.get(model)
            if entry is None:
                entry = found[model] = _Model()
            entry.workers.append(wid)
            if counts:
                count = counts.get(model)
                if count is not None:
                    entry.inferences = count + (entry.inferences or 0)
            if live:
                entry.replicas += 1
                if rates:
                    rate = rates.get(model)
                    if rate is not None:
                        entry.rate = rate + (entry.rate or 0.0)
    by_model = {row["model"]: row for row in placed} if placed is not None else None
    none = _Model()
    rows: list[ModelViewDict] = []
    for model in sorted(set(found) | set(models.catalog)):
        policy = models.policy(model)
        entry = found.get(model, none)
        row = None if by_model is None else by_model.get(model)
        in_flight: int | None = None  # not counted without placement rounds
        if by_model is not None:
            in_flight = 0 if row is None else row["in_flight"]
        rows.append(
            {
                "model": model,
                "workers": list(entry.workers),
                "replicas": entry.replicas,
                "min": policy.min_replicas,
                "max": policy.max_replicas,
                "in_flight": in_flight,
                "inferences": entry.inferences,
                "rate": entry.rate,
                "load_seconds": None if row is None else row["load_seconds"],
            }
        )
    return rows


class _Model:
    """One model's sums while the rows are built."""

    __slots__ = ("inferences", "rate", "replicas", "workers")

    def __init__(self) -> None:
        self.workers: list[str] = []
        self.replicas = 0
        self.inferences: int | None = None
        self.rate: float | None = None
