"""Which worker gets the next attempt: priority tier first, then least connections.

Selection runs under the pool's lock on every attempt, so it is a plain scan with no
allocation on small pools. Within a tier the worker with the fewest tasks in flight
wins; ties rotate so equal workers share the load evenly. Large tiers use
power-of-two-choices, which keeps selection O(1) at the cost of exactness.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Sequence
from itertools import groupby

from npu_sync.worker import Worker

P2C_THRESHOLD = 64
"""Tiers with more workers than this are sampled rather than scanned."""

_P2C_SAMPLES = 8


class Selector:
    """Picks a worker for an attempt.

    Not thread-safe: the pool calls it under its selection lock.
    """

    def __init__(self, workers: Iterable[Worker] = (), *, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._turn = 0
        self.tiers: tuple[tuple[Worker, ...], ...] = ()
        self.workers: tuple[Worker, ...] = ()
        self.set_workers(workers)

    def set_workers(self, workers: Iterable[Worker]) -> None:
        """Replace the candidate set; lower ``priority`` numbers form earlier tiers."""
        ordered = sorted(workers, key=lambda w: w.priority)
        self.workers = tuple(ordered)
        self.tiers = tuple(tuple(tier) for _, tier in groupby(ordered, key=lambda w: w.priority))

    def select(self, excluded: Collection[str], now: float) -> Worker | None:
        """The best eligible worker not in ``excluded``, or None.

        A lower tier is used only when no worker of a higher tier is eligible.
        """
        for tier in self.tiers:
            chosen = (
                self._sample(tier, excluded, now)
                if len(tier) > P2C_THRESHOLD
                else self._scan(tier, excluded, now)
            )
            if chosen is not None:
                return chosen
        return None

    def _scan(self, tier: Sequence[Worker], excluded: Collection[str], now: float) -> Worker | None:
        n = len(tier)
        start = self._turn % n
        self._turn += 1
        best: Worker | None = None
        best_load = 0
        for i in range(start, start + n):
            worker = tier[i % n]
            if (
                (best is None or worker.in_flight < best_load)
                and worker.id not in excluded
                and worker.eligible(now)
            ):
                best = worker
                best_load = worker.in_flight
                if best_load == 0:
                    break
        return best

    def _sample(
        self, tier: Sequence[Worker], excluded: Collection[str], now: float
    ) -> Worker | None:
        pick = self._rng.randrange
        n = len(tier)
        found: list[Worker] = []
        for _ in range(_P2C_SAMPLES):
            worker = tier[pick(n)]
            if worker.id not in excluded and worker.eligible(now) and worker not in found:
                found.append(worker)
                if len(found) == 2:
                    a, b = found
                    return a if a.in_flight <= b.in_flight else b
        if found:
            return found[0]
        # Sampling missed (most of the tier is busy, open or excluded): scan so that a
        # free worker is never overlooked.
        return self._scan(tier, excluded, now)
