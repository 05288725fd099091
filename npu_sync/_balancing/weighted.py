"""``weighted`` and ``weighted-random``: tasks in proportion to each worker's share.

A worker's share is its ``weight`` times its slow start factor. ``weighted`` is smooth
weighted round robin (nginx's), whatever the load or latency: a worker of weight 3
gets three tasks for every one of a worker of weight 1, spread out (``aaab``,
interleaved). ``weighted-random`` (AutoBot's name) draws a random worker with room,
each with probability proportional to its share: the same split on average, with
random runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from npu_sync._balancing.index import Index
from npu_sync._balancing.slot import Tier
from npu_sync._balancing.slowstart import Ramps
from npu_sync._balancing.tiered import TierByTier
from npu_sync._worker import Worker


class Weighted(TierByTier):
    """Smooth weighted round robin over a tier's workers with room: each gains its
    share, the richest is picked and pays the total.

    Not thread-safe: under the pool's lock. Each worker's running credit is kept in
    its slot (``wrr``).
    """

    name = "weighted"

    __slots__ = ()

    def pick(self, tier: Tier, excluded: Collection[str], now: float) -> Worker | None:
        """The richest eligible worker of ``tier`` after one round of credit."""
        while True:
            candidates = [s for s in tier.ready if s.id not in excluded]
            if not candidates:
                return None
            total = 0.0
            best = candidates[0]
            for slot in candidates:
                slot.wrr += slot.share
                total += slot.share
                if slot.wrr > best.wrr:
                    best = slot
            if best.worker.eligible(now):
                best.wrr -= total
                return best.worker
            for slot in candidates:
                slot.wrr -= slot.share  # this round did not happen
            self._index.classify(best, now)  # leaves the ready list


class WeightedRandom(Weighted):
    """A random worker with room, drawn in proportion to its share.

    Not thread-safe: under the pool's lock.
    """

    name = "weighted-random"

    __slots__ = ("_random",)

    def __init__(self, index: Index, ramps: Ramps, random: Callable[[], float]) -> None:
        super().__init__(index, ramps)
        self._random = random

    def pick(self, tier: Tier, excluded: Collection[str], now: float) -> Worker | None:
        """A worker of ``tier`` drawn by share, eligible."""
        while True:
            candidates = [s for s in tier.ready if s.id not in excluded]
            if not candidates:
                return None
            point = self._random() * sum(s.share for s in candidates)
            chosen = candidates[-1]
            for slot in candidates:
                point -= slot.share
                if point < 0:
                    chosen = slot
                    break
            if chosen.worker.eligible(now):
                return chosen.worker
            self._index.classify(chosen, now)  # leaves the ready list
